// Dequantization kernels: the batched (prefill) path and the embedding gather.
//
// - dequant_<type>_f16: a whole weight matrix to f16 rows (`[n_rows, k_dim]`), which the
//   prefill GEMM below multiplies. Twin: kernels::quant::dequantize (then f16 rounding, as
//   half::f16::from_f32).
// - embed_<type>: rows `tokens[t]` of an embedding table dequantized to f32. Twin:
//   engine::runtime::CpuBackend::embed (dequantizes the same rows with kernels::quant).
//
// One thread per 32-value chunk.

#define DEQ_KERNELS(T, ID)                                                                        \
    extern "C" __global__ void dequant_##T##_f16(const u8* __restrict__ w, u64 row_bytes,        \
                                                 u32 k_dim, u32 n_rows, u16* __restrict__ out) {  \
        u32 n_chunks = k_dim / 32;                                                                \
        u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= (u64)n_rows * n_chunks) return;                                                  \
        u64 r = i / n_chunks;                                                                     \
        u32 c = (u32)(i % n_chunks);                                                              \
        float y[32];                                                                              \
        deq_##T(w + r * row_bytes, (int)c, y);                                                    \
        u16* o = out + r * k_dim + 32 * c;                                                        \
        for (int j = 0; j < 32; j++) o[j] = f32_to_f16(y[j]);                                     \
    }                                                                                             \
    extern "C" __global__ void embed_##T(const u8* __restrict__ w, u64 row_bytes, u32 k_dim,      \
                                         u32 n_vocab, const u32* __restrict__ tokens,             \
                                         u32 n_tokens, float* __restrict__ out) {                 \
        u32 n_chunks = k_dim / 32;                                                                \
        u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= (u64)n_tokens * n_chunks) return;                                                \
        u64 t = i / n_chunks;                                                                     \
        u32 c = (u32)(i % n_chunks);                                                              \
        u32 tok = tokens[t];                                                                      \
        float* o = out + t * k_dim + 32 * c;                                                      \
        if (tok >= n_vocab) {                                                                     \
            for (int j = 0; j < 32; j++) o[j] = __int_as_float(0x7fc00000);                       \
            return;                                                                               \
        }                                                                                         \
        float y[32];                                                                              \
        deq_##T(w + (u64)tok * row_bytes, (int)c, y);                                             \
        for (int j = 0; j < 32; j++) o[j] = y[j];                                                 \
    }

FOR_EACH_TYPE(DEQ_KERNELS)

// Prefill product on dequantized weights: out[t, r] = Σ_k W[r, k] · x[t, k], W f16 [n_rows,
// k_dim], x f32 [n_tok, k_dim], f32 accumulation. 32×32 output tiles, blockDim (32, 8), each
// thread four outputs; k in steps of 32 through shared memory. Grid x covers the row tiles, grid
// y (at most 65535) strides over the token tiles, so any token count fits. Twin:
// kernels::cpu::CpuKernels::matmul on F16 weights (which rounds the activations to f16 too;
// here they are rounded on the device first, round_act).
#define GT 32
extern "C" __global__ void gemm_f16_f32(const u16* __restrict__ w, const float* __restrict__ x,
                                        float* __restrict__ out, u32 n_rows, u32 k_dim,
                                        u32 n_tok) {
    __shared__ float ws[GT][GT + 1];
    __shared__ float xs[GT][GT + 1];
    u32 r0 = blockIdx.x * GT;
    int tx = threadIdx.x, ty = threadIdx.y;
    for (u64 t0 = (u64)blockIdx.y * GT; t0 < n_tok; t0 += (u64)gridDim.y * GT) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 k0 = 0; k0 < k_dim; k0 += GT) {
            for (int i = ty; i < GT; i += 8) {
                u64 r = r0 + i, t = t0 + i;
                u32 k = k0 + tx;
                ws[i][tx] = (r < n_rows && k < k_dim) ? f16_to_f32(w[r * k_dim + k]) : 0.0f;
                xs[i][tx] = (t < n_tok && k < k_dim) ? x[t * k_dim + k] : 0.0f;
            }
#ifndef PLUMBLINE_FAULT_CUDA_GEMM_MISSING_BARRIER
            __syncthreads();  // the whole tile is loaded before any thread reads it
#endif
            // Fault (engine/src/faults.rs): without the barrier above, a thread reads tile
            // entries other threads have not stored yet (the previous tile's, or stale ones).
#pragma unroll 8
            for (int k = 0; k < GT; k++) {
                float wv = ws[tx][k];
#pragma unroll
                for (int j = 0; j < 4; j++) acc[j] += wv * xs[ty + 8 * j][k];
            }
            __syncthreads();  // every thread is done with the tile before the next is loaded
        }
        u32 r = r0 + tx;
        if (r < n_rows) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                u64 t = t0 + ty + 8 * j;
                if (t < n_tok) out[t * n_rows + r] = acc[j];
            }
        }
    }
}
