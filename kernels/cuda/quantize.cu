// Activation quantization to q8_1, once per matrix product (as ggml-cuda's quantize_q8_1 and
// candle's quantized CUDA path do): every quantized weight type's matrix-vector kernel reads it.
//
// Twin: kernels::quant::legacy::quantize_q8_1 (quantize_row_q8_1_ref): d = amax / 127,
// q = round(x / d) (ties away from zero, roundf), s = d · Σq; d and s stored as f16.

// One warp per 32-value block; blockDim (32, 8). `x` is [n_rows, k_dim] f32, k_dim a multiple
// of 32; `y` is [n_rows, k_dim / 32] blocks.
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, block_q8_1* __restrict__ y,
                                         u32 n_blocks) {
    u32 ib = blockIdx.x * blockDim.y + threadIdx.y;
    if (ib >= n_blocks) return;
    int lane = threadIdx.x;
    float v = x[(u64)ib * 32 + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = (d != 0.0f) ? 1.0f / d : 0.0f;
    int q = (int)roundf(v * id);
    float sum = warp_sum((float)q);  // |Σq| ≤ 32·127: exact in f32
    y[ib].qs[lane] = (i8)q;
    if (lane == 0) {
        y[ib].d = f32_to_f16(d);
        y[ib].s = f32_to_f16(sum * d);
    }
}

// Activation rounding in place, to the form ggml's CPU dot product for a weight type reads (its
// vec_dot_type), so that every CUDA product computes what the CPU backend and the
// exact-numerics reference compute, up to f32 summation order, whatever the path (q8_1
// matrix-vector, f32-activation matrix-vector, f16 GEMM).
//
// Twin: reference::numerics::ActQuant::apply (and the CPU kernels' quantize_row_q8_0 /
// quantize_row_q8_K / f16 / bf16 conversions). `mode`:
//   1 Q8_0 (also Q8_1's values): blocks of 32, d = amax/127, value f16(d)·roundf(x/d);
//   2 Q8_K: blocks of 256, max = the first value of largest magnitude, iscale = −127/max,
//     value (1/iscale)·min(127, rint(iscale·x)) (ties to even), the scale kept in f32;
//   3 F16 and 4 BF16: each value rounded to nearest even.
// Blocks: one thread per block (modes 1, 2) or per value (modes 3, 4); `n` values in all, a
// whole number of blocks.
__device__ __forceinline__ float round_bf16(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

extern "C" __global__ void round_act(float* __restrict__ x, u64 n, u32 mode) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 3 || mode == 4) {
        if (i < n) x[i] = (mode == 3) ? f16_to_f32(f32_to_f16(x[i])) : round_bf16(x[i]);
        return;
    }
    u32 bs = (mode == 1) ? 32 : 256;
    if (mode != 1 && mode != 2) return;
    if (i >= n / bs) return;
    float* b = x + i * bs;
    if (mode == 1) {
        float amax = 0.0f;
        for (u32 j = 0; j < bs; j++) amax = fmaxf(amax, fabsf(b[j]));
        float d = amax / 127.0f;
        float id = (d != 0.0f) ? 1.0f / d : 0.0f;
        float dh = f16_to_f32(f32_to_f16(d));
        for (u32 j = 0; j < bs; j++) b[j] = dh * roundf(b[j] * id);
        return;
    }
    float amax = 0.0f, max = 0.0f;
    for (u32 j = 0; j < bs; j++) {
        float a = fabsf(b[j]);
        if (a > amax) {
            amax = a;
            max = b[j];
        }
    }
    if (amax == 0.0f) {
        for (u32 j = 0; j < bs; j++) b[j] = 0.0f;
        return;
    }
    float iscale = -127.0f / max;
    float d = 1.0f / iscale;
    for (u32 j = 0; j < bs; j++) b[j] = d * fminf(127.0f, rintf(iscale * b[j]));
}
