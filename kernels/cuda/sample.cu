// Argmax and sampling on the device, so that decoding downloads one id instead of the logits.

// (value, index) order of engine::sampling::argmax: NaN never wins, the larger value wins, ties
// go to the lower index.
__device__ __forceinline__ bool beats(float v, u32 i, float bv, u32 bi) {
    if (isnan(v)) return false;
    if (isnan(bv)) return true;
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index) over `x[0..n]`, skipping indices listed in `skip[0..n_skip]`.
// blockDim 256. Thread 0's result is returned to every thread through shared memory.
__device__ void block_best(const float* __restrict__ x, u32 n, const u32* skip, u32 n_skip,
                           float* bv_out, u32* bi_out) {
    __shared__ float sv[256];
    __shared__ u32 si[256];
    float bv = __int_as_float(0x7fc00000);
    u32 bi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        bool skipped = false;
        for (u32 s = 0; s < n_skip; s++) skipped |= (skip[s] == i);
        if (!skipped && beats(x[i], i, bv, bi)) {
            bv = x[i];
            bi = i;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (u32 o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o && beats(sv[threadIdx.x + o], si[threadIdx.x + o], sv[threadIdx.x],
                                     si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + o];
            si[threadIdx.x] = si[threadIdx.x + o];
        }
        __syncthreads();
    }
    *bv_out = sv[0];
    *bi_out = si[0];
    __syncthreads();
}

// Twin: engine::sampling::argmax, one block (256 threads) per row of `width`; all-NaN rows give 0.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, u32 width,
                                       u32* __restrict__ out) {
    float bv;
    u32 bi;
    block_best(x + (u64)blockIdx.x * width, width, 0, 0, &bv, &bi);
    if (threadIdx.x == 0) out[blockIdx.x] = (bi == 0xffffffffu) ? 0 : bi;
}

// Twin: engine::sampling::Sampler::sample with top_k ∈ 1..=64, top_p = 1, min_p = 0, no
// repetition penalty: the k best logits (ties to the lower id), softmax at `temperature` in f64
// (the best logit contributes exactly 1, as the CPU's softmax), then the first candidate whose
// cumulative probability exceeds `u` (the host's Rng::next_f64 draw, so both sides can use one
// random stream). One block of 256 threads; writes the id to out[0].
extern "C" __global__ void sample_top_k(const float* __restrict__ logits, u32 n, u32 top_k,
                                        float temperature, double u, u32* __restrict__ out) {
    __shared__ u32 cand[64];
    __shared__ float cval[64];
    u32 k = top_k < n ? top_k : n;
    if (k > 64) k = 64;
    u32 found = 0;
    for (u32 s = 0; s < k; s++) {
        float bv;
        u32 bi;
        block_best(logits, n, cand, s, &bv, &bi);
        if (bi == 0xffffffffu) break;  // only NaN left
        if (threadIdx.x == 0) {
            cand[s] = bi;
            cval[s] = bv;
        }
        __syncthreads();
        found = s + 1;
    }
    if (threadIdx.x != 0) return;
    if (found == 0) {
        out[0] = 0;
        return;
    }
    double mx = (double)cval[0], t = (double)temperature, sum = 0.0;
    double e[64];
    for (u32 s = 0; s < found; s++) {
        double l = (double)cval[s];
        e[s] = (mx == -1.0 / 0.0) ? 1.0 : ((l == mx) ? 1.0 : exp((l - mx) / t));
        sum += e[s];
    }
    double acc = 0.0;
    for (u32 s = 0; s < found; s++) {
        acc += e[s] / sum;
        if (u < acc) {
            out[0] = cand[s];
            return;
        }
    }
    out[0] = cand[found - 1];
}
