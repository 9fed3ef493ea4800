// Softmax attention under the core's mask values, over an f32 or f16 KV cache.
//
// Twin: engine::runtime::cpu (CpuBackend::attention → attend → attend_one) and the mask rule
// engine::runtime::Mask::visible: a cell is visible when it belongs to the query's sequence (and
// is not free), and — as configured — its position is at most the query's (causal), the
// position distance is below the window, and for a tree mask a cell written by this batch is
// the query or one of its ancestors (bit `batch` of the query's ancestor words).
//
// grid (n_head, n_tok), blockDim 128. The query head is staged in shared memory (dynamic,
// head_dim_k floats). Scores go to `scores` ([n_tok, n_head, n_cells] f32, global scratch), so
// any number of cells fits. Softmax as the CPU: max, exp(s − max), sum in f64, weights scaled by
// 1/sum, then the weighted sum of values in cell order. No visible cell gives zeros.

#define CELL_FREE 0xffffffffu
#define CELL_COMMITTED 0xffffffffu

__device__ __forceinline__ bool visible(u32 q_pos, u32 q_seq, u32 c_pos, u32 c_seq, u32 c_batch,
                                        u32 causal, u32 window, u32 tree,
                                        const u64* __restrict__ anc, u32 anc_words) {
    if (c_seq != q_seq || c_seq == CELL_FREE) return false;
    if (causal && c_pos > q_pos) return false;
    if (window) {
        u32 dist = q_pos > c_pos ? q_pos - c_pos : c_pos - q_pos;
        if (dist >= window) return false;
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
    u64 v_stride, float* __restrict__ out, u32 n_head, u32 n_head_kv, u32 dk, u32 dv, float scale,
    u32 causal, u32 window, u32 tree, const u32* __restrict__ q_pos, const u32* __restrict__ q_seq,
    const u32* __restrict__ c_pos, const u32* __restrict__ c_seq, const u32* __restrict__ c_batch,
    u32 n_cells, const u64* __restrict__ anc, u32 anc_words, float* __restrict__ scores) {
    DYNAMIC_SHARED(float, sq);
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    u32 h = blockIdx.x, t = blockIdx.y, n_tok = gridDim.y;
    u32 kvh = h / (n_head / n_head_kv);
    const float* qh = q + ((u64)t * n_head + h) * dk;
    for (u32 i = threadIdx.x; i < dk; i += blockDim.x) sq[i] = qh[i];
    __syncthreads();
    float* sc = scores + ((u64)t * n_head + h) * n_cells;
    const u64* my_anc = anc ? anc + (u64)t * anc_words : anc;
    u32 qp = q_pos[t], qs = q_seq[t];
    float mx = NEG_INF;
    for (u32 j = threadIdx.x; j < n_cells; j += blockDim.x) {
        float s = NEG_INF;
        if (visible(qp, qs, c_pos[j], c_seq[j], c_batch[j], causal, window, tree, my_anc,
                    anc_words)) {
            const KV* kr = k + (u64)j * k_stride + (u64)kvh * dk;
            float d = 0.0f;
            for (u32 i = 0; i < dk; i++) d += sq[i] * kv_load(kr, i);
            s = d * scale;
            mx = fmaxf(mx, s);
        }
        sc[j] = s;
    }
    mx = block_max(mx, fscratch);
    float* oh = out + ((u64)t * n_head + h) * dv;
    if (mx == NEG_INF) {
        for (u32 i = threadIdx.x; i < dv; i += blockDim.x) oh[i] = 0.0f;
        return;
    }
    double sum = 0.0;
    for (u32 j = threadIdx.x; j < n_cells; j += blockDim.x) {
        float s = sc[j];
        float e = (s == NEG_INF) ? 0.0f : expf(s - mx);
        sc[j] = e;
        sum += (double)e;
    }
    sum = block_sum_d(sum, dscratch);
    float inv = (float)(1.0 / sum);
    __syncthreads();  // every score written before any thread reads them all
    for (u32 i = threadIdx.x; i < dv; i += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j < n_cells; j++) {
            float e = sc[j];
            if (e != 0.0f) acc += (e * inv) * kv_load(v + (u64)j * v_stride + (u64)kvh * dv, i);
        }
        oh[i] = acc;
    }
    (void)n_tok;
}

#define ATTN_ARGS                                                                               \
    const float *__restrict__ q, const KVT *__restrict__ k, const KVT *__restrict__ v,          \
        u64 k_stride, u64 v_stride, float *__restrict__ out, u32 n_head, u32 n_head_kv, u32 dk, \
        u32 dv, float scale, u32 causal, u32 window, u32 tree, const u32 *__restrict__ q_pos,   \
        const u32 *__restrict__ q_seq, const u32 *__restrict__ c_pos,                           \
        const u32 *__restrict__ c_seq, const u32 *__restrict__ c_batch, u32 n_cells,            \
        const u64 *__restrict__ anc, u32 anc_words, float *__restrict__ scores
#define ATTN_PASS                                                                                \
    q, k, v, k_stride, v_stride, out, n_head, n_head_kv, dk, dv, scale, causal, window, tree,     \
        q_pos, q_seq, c_pos, c_seq, c_batch, n_cells, anc, anc_words, scores

#define KVT float
extern "C" __global__ void attention_f32(ATTN_ARGS) { attention_impl<float>(ATTN_PASS); }
#undef KVT
#define KVT u16
extern "C" __global__ void attention_f16(ATTN_ARGS) { attention_impl<u16>(ATTN_PASS); }
#undef KVT
