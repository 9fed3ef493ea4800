// Matrix-vector products straight from the quantized blocks, one kernel per weight type.
//
// Twin: kernels::cpu::CpuKernels::matmul (and its scalar row dots, kernels/src/cpu/scalar.rs):
// out[o, r] = Σ_k W[mat(o)][r, k] · x[row(o), k]. The CPU quantizes activations to the weight
// type's vec_dot_type (Q8_0 / Q8_K); here every quantized type reads q8_1 activations (one
// quantization per product, as ggml-cuda's mmvq does), so the two agree to within one
// activation rounding, not bit for bit. Float weights (F32, F16, BF16) read f32 activations.
//
// Layout: blockDim (32, ROWS): one warp per weight row; lane l takes chunks l, l+32, ... of 32
// values, dequantizes them (quant.cuh) and multiplies with the matching activation block; the
// warp sums. gridDim.x covers the rows, gridDim.y strides over the output rows `o`.
//
// Dense products: ids == null, mat(o) = 0, row(o) = o. Grouped expert products
// (Backend::matmul_experts): mat(o) = ids[o], row(o) = x_per_slot ? o : o / k_slots. An expert
// id ≥ n_mats (impossible after `route`, which only writes ids < n_expert) yields NaN, so that a
// bad id is visible in the output instead of reading out of bounds.

#define MMV_ROWS 4

// Q4_1 and Q5_1 (blocks of MIN_BLOCK bytes with the min `m` at byte 2): ggml's dot with q8_1
// activations is d_w·d_x·Σ q_w·q_x + m_w·s_x, with s_x = f16(d_x·Σ q_x) stored in the block
// (CPU twin: vec_dot_q4_1_q8_1). The dequantized product here gives m_w·d_x·Σ q_x instead; the
// difference m_w·(s_x − d_x·Σ q_x) is added so that both backends compute the same value
// (without it they differ by the f16 rounding of s_x: NMSE ~1e-6, as large as a wrong scale in
// one block of a long row).
template <void (*DEQ)(const u8*, int, float*), bool FLOAT_ACT, int MIN_BLOCK>
__device__ __forceinline__ void mmv_impl(const u8* __restrict__ w, u64 row_bytes, u64 mat_bytes,
                                         u32 n_mats, const void* __restrict__ x, u32 k_dim,
                                         u32 n_rows, u32 n_out, const u32* __restrict__ ids,
                                         u32 k_slots, u32 x_per_slot, float* __restrict__ out) {
    u32 r = blockIdx.x * MMV_ROWS + threadIdx.y;
    if (r >= n_rows) return;
    int lane = threadIdx.x;
    u32 n_chunks = k_dim / 32;
    for (u32 o = blockIdx.y; o < n_out; o += gridDim.y) {
        u32 mat = 0, xrow = o;
        if (ids) {
            mat = ids[o];
            xrow = x_per_slot ? o : o / k_slots;
        }
        if (mat >= n_mats) {
            if (lane == 0) out[(u64)o * n_rows + r] = __int_as_float(0x7fc00000);
            continue;
        }
        const u8* row = w + (u64)mat * mat_bytes + (u64)r * row_bytes;
        float acc = 0.0f;
        for (u32 c = lane; c < n_chunks; c += WARP) {
            float y[32];
            DEQ(row, (int)c, y);
            if (FLOAT_ACT) {
                const float* xa = (const float*)x + (u64)xrow * k_dim + 32 * c;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; i++) s += y[i] * xa[i];
                acc += s;
            } else {
                const block_q8_1* xb = (const block_q8_1*)x + (u64)xrow * n_chunks + c;
                float s = 0.0f;
                int sq = 0;
#pragma unroll
                for (int i = 0; i < 32; i++) {
                    s += y[i] * (float)xb->qs[i];
                    sq += xb->qs[i];
                }
                float dx = f16_to_f32(xb->d);
                acc += s * dx;
                if (MIN_BLOCK) {
                    float m = ld_f16(row + (u64)MIN_BLOCK * c + 2);
                    acc += m * (f16_to_f32(xb->s) - dx * (float)sq);
                }
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) out[(u64)o * n_rows + r] = acc;
    }
}

#define IS_FLOAT_f32 true
#define IS_FLOAT_f16 true
#define IS_FLOAT_bf16 true
#define IS_FLOAT_q4_0 false
#define IS_FLOAT_q4_1 false
#define IS_FLOAT_q5_0 false
#define IS_FLOAT_q5_1 false
#define IS_FLOAT_q8_0 false
#define IS_FLOAT_q8_1 false
#define IS_FLOAT_q2_k false
#define IS_FLOAT_q3_k false
#define IS_FLOAT_q4_k false
#define IS_FLOAT_q5_k false
#define IS_FLOAT_q6_k false
#define IS_FLOAT_q8_k false
#define IS_FLOAT_iq4_nl false
#define IS_FLOAT_iq4_xs false
#define IS_FLOAT_mxfp4 false

#define MIN_BLOCK_f32 0
#define MIN_BLOCK_f16 0
#define MIN_BLOCK_bf16 0
#define MIN_BLOCK_q4_0 0
#define MIN_BLOCK_q4_1 20
#define MIN_BLOCK_q5_0 0
#define MIN_BLOCK_q5_1 24
#define MIN_BLOCK_q8_0 0
#define MIN_BLOCK_q8_1 0
#define MIN_BLOCK_q2_k 0
#define MIN_BLOCK_q3_k 0
#define MIN_BLOCK_q4_k 0
#define MIN_BLOCK_q5_k 0
#define MIN_BLOCK_q6_k 0
#define MIN_BLOCK_q8_k 0
#define MIN_BLOCK_iq4_nl 0
#define MIN_BLOCK_iq4_xs 0
#define MIN_BLOCK_mxfp4 0

#define MMV_KERNEL(T, ID)                                                                        \
    extern "C" __global__ void mmv_##T(const u8* __restrict__ w, u64 row_bytes, u64 mat_bytes,   \
                                       u32 n_mats, const void* __restrict__ x, u32 k_dim,        \
                                       u32 n_rows, u32 n_out, const u32* __restrict__ ids,       \
                                       u32 k_slots, u32 x_per_slot, float* __restrict__ out) {   \
        mmv_impl<deq_##T, IS_FLOAT_##T, MIN_BLOCK_##T>(w, row_bytes, mat_bytes, n_mats, x,       \
                                                       k_dim, n_rows, n_out, ids, k_slots,       \
                                                       x_per_slot, out);                         \
    }

FOR_EACH_TYPE(MMV_KERNEL)

// mmvf_<type>: the same product on f32 activations already rounded to the weight type's
// vec_dot_type (round_act in quantize.cu): the types whose CPU dot product reads Q8_K or
// 16-bit-float activations, which q8_1 cannot hold exactly.
#define MMVF_KERNEL(T, ID)                                                                       \
    extern "C" __global__ void mmvf_##T(const u8* __restrict__ w, u64 row_bytes, u64 mat_bytes,  \
                                        u32 n_mats, const float* __restrict__ x, u32 k_dim,      \
                                        u32 n_rows, u32 n_out, const u32* __restrict__ ids,      \
                                        u32 k_slots, u32 x_per_slot, float* __restrict__ out) {  \
        mmv_impl<deq_##T, true, 0>(w, row_bytes, mat_bytes, n_mats, x, k_dim, n_rows, n_out,    \
                                   ids, k_slots, x_per_slot, out);                               \
    }

FOR_EACH_TYPE(MMVF_KERNEL)
