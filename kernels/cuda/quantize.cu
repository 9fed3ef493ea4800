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
