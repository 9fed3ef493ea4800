// Softmax attention under the core's mask values, over an f32 or f16 KV cache.
//
// Twin: engine::runtime::cpu (CpuBackend::attention → attend → attend_group) and the mask rule
// engine::runtime::Mask::visible: a cell is visible when it belongs to the query's sequence (and
// is not free), and — as configured — its position is at most the query's (causal), the
// position distance is below the window (`window` is the window itself; WINDOW_NONE for none,
// so a window of 0 sees nothing, as on the CPU), and for a tree mask a cell written by this
// batch is the query or one of its ancestors (bit `batch` of the query's ancestor words).
//
// One block of ATTN_THREADS threads per (query token, head) pair: pair p = t·n_head + h, the
// blocks striding over the pairs (grid x ≤ 2^31 − 1, so any token count fits; nothing in grid
// y). The query head is staged in shared memory (dynamic: dk floats, then ATTN_THREADS floats
// of tile weights). Cells are taken ATTN_THREADS at a time (one per thread) with an online
// softmax, as flash attention does: the running maximum m, the running sum l (f64, as the CPU
// sums) and the output rescaled by exp(m_old − m_new) whenever a tile raises the maximum. So
// the memory is the output and the per-call metadata, whatever the number of cells: no
// [tokens × heads × cells] scores buffer. The output row of the pair is the accumulator (each
// thread owns dims i ≡ threadIdx.x mod ATTN_THREADS). No visible cell gives zeros.
//
// The CPU computes exp(s − max) with the final maximum and multiplies weights by 1/sum before
// the weighted sum; here the rescaling and the final division round differently, by a few ulp.

#define CELL_FREE 0xffffffffu
#define CELL_COMMITTED 0xffffffffu
#define WINDOW_NONE 0xffffffffffffffffull
#define ATTN_THREADS 128

__device__ __forceinline__ bool visible(u32 q_pos, u32 q_seq, u32 c_pos, u32 c_seq, u32 c_batch,
                                        u32 causal, u64 window, u32 tree,
                                        const u64* __restrict__ anc, u32 anc_words) {
    if (c_seq != q_seq || c_seq == CELL_FREE) return false;
#ifdef PLUMBLINE_FAULT_CUDA_CAUSAL_MASK_OFF_BY_ONE
    // Fault (engine/src/faults.rs): the causal test compares against the next position, so a
    // query also sees the cell one position ahead of it.
    if (causal && c_pos > q_pos + 1) return false;
#else
    if (causal && c_pos > q_pos) return false;
#endif
    if (window != WINDOW_NONE) {
        u32 dist = q_pos > c_pos ? q_pos - c_pos : c_pos - q_pos;
        if ((u64)dist >= window) return false;
    }
    if (tree && c_batch != CELL_COMMITTED) {
        u32 w = c_batch / 64;
        if (w >= anc_words) return false;
        return (anc[w] >> (c_batch % 64)) & 1ull;
    }
    return true;
}

__device__ __forceinline__ float kv_load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, u64 i) { return f16_to_f32(p[i]); }

template <typename KV>
__device__ __forceinline__ void attention_impl(
    const float* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v, u64 k_stride,
    u64 v_stride, float* __restrict__ out, u32 n_tok, u32 n_head, u32 n_head_kv, u32 dk, u32 dv,
    float scale, u32 causal, u64 window, u32 tree, const u32* __restrict__ q_pos,
    const u32* __restrict__ q_seq, const u32* __restrict__ c_pos, const u32* __restrict__ c_seq,
    const u32* __restrict__ c_batch, u32 n_cells, const u64* __restrict__ anc, u32 anc_words) {
    DYNAMIC_SHARED(float, smem);
    float* sq = smem;        // the query head, dk floats
    float* sp = smem + dk;   // the tile's weights exp(s − m), ATTN_THREADS floats
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    u32 group = n_head / n_head_kv;
    u64 n_pairs = (u64)n_tok * n_head;
    for (u64 pair = blockIdx.x; pair < n_pairs; pair += gridDim.x) {
        u32 t = (u32)(pair / n_head), h = (u32)(pair % n_head);
        u32 kvh = h / group;
        const float* qh = q + pair * dk;
        float* oh = out + pair * dv;
        // Every thread is done with the previous pair's query and weights before they change.
        __syncthreads();
        for (u32 i = threadIdx.x; i < dk; i += blockDim.x) sq[i] = qh[i];
        for (u32 i = threadIdx.x; i < dv; i += blockDim.x) oh[i] = 0.0f;
        __syncthreads();
        const u64* my_anc = anc ? anc + (u64)t * anc_words : anc;
        u32 qp = q_pos[t], qs = q_seq[t];
        float m = NEG_INF;
        double l = 0.0;
        for (u32 j0 = 0; j0 < n_cells; j0 += blockDim.x) {
            u32 j = j0 + threadIdx.x;
            float s = NEG_INF;
            if (j < n_cells && visible(qp, qs, c_pos[j], c_seq[j], c_batch[j], causal, window,
                                       tree, my_anc, anc_words)) {
                const KV* kr = k + (u64)j * k_stride + (u64)kvh * dk;
                float d = 0.0f;
                for (u32 i = 0; i < dk; i++) d += sq[i] * kv_load(kr, i);
                s = d * scale;
            }
            // The same value in every thread: the branch below is uniform. The reduction's
            // barriers also order the previous tile's reads of sp before this tile's writes.
            float tmax = block_max(s, fscratch);
            if (tmax == NEG_INF) continue;  // nothing visible in this tile
            float m_new = fmaxf(m, tmax);
            float corr = (m == NEG_INF) ? 0.0f : expf(m - m_new);
            float e = (s == NEG_INF) ? 0.0f : expf(s - m_new);
            sp[threadIdx.x] = e;
            // Its barriers make every weight of the tile visible to every thread.
            double tsum = block_sum_d((double)e, dscratch);
            l = l * (double)corr + tsum;
            m = m_new;
            u32 nt = min(n_cells - j0, (u32)blockDim.x);
            for (u32 i = threadIdx.x; i < dv; i += blockDim.x) {
                float acc = oh[i] * corr;
                for (u32 jj = 0; jj < nt; jj++) {
                    float w = sp[jj];
                    if (w != 0.0f)
                        acc += w * kv_load(v + (u64)(j0 + jj) * v_stride + (u64)kvh * dv, i);
                }
                oh[i] = acc;
            }
        }
        if (m != NEG_INF) {
            float inv = (float)(1.0 / l);
            for (u32 i = threadIdx.x; i < dv; i += blockDim.x) oh[i] *= inv;
        }
    }
}

#define ATTN_ARGS                                                                                \
    const float *__restrict__ q, const KVT *__restrict__ k, const KVT *__restrict__ v,           \
        u64 k_stride, u64 v_stride, float *__restrict__ out, u32 n_tok, u32 n_head,              \
        u32 n_head_kv, u32 dk, u32 dv, float scale, u32 causal, u64 window, u32 tree,            \
        const u32 *__restrict__ q_pos, const u32 *__restrict__ q_seq,                            \
        const u32 *__restrict__ c_pos, const u32 *__restrict__ c_seq,                            \
        const u32 *__restrict__ c_batch, u32 n_cells, const u64 *__restrict__ anc, u32 anc_words
#define ATTN_PASS                                                                                 \
    q, k, v, k_stride, v_stride, out, n_tok, n_head, n_head_kv, dk, dv, scale, causal, window,     \
        tree, q_pos, q_seq, c_pos, c_seq, c_batch, n_cells, anc, anc_words

#define KVT float
extern "C" __global__ void attention_f32(ATTN_ARGS) { attention_impl<float>(ATTN_PASS); }
#undef KVT
#define KVT u16
extern "C" __global__ void attention_f16(ATTN_ARGS) { attention_impl<u16>(ATTN_PASS); }
#undef KVT
