// Mixture-of-experts routing and combination.

// Twin: engine::runtime::cpu::route_one (Backend::route): gating (0 softmax with the sum in f64,
// 1 sigmoid), selection score = gate + bias, top-k in descending score, NaN last, ties to the
// lower id; the chosen gates normalized when `norm` (sum clamped at 6.1035156e-5, the smallest
// normal f16, as llama.cpp) and scaled. One thread per token (k ≤ 64 selection passes over at
// most 256 experts; the host checks both). `probs` is [n_tok, n_expert] scratch.
extern "C" __global__ void route(const float* __restrict__ logits, const float* __restrict__ bias,
                                 u32 n_tok, u32 n_expert, u32 k, u32 gating, u32 norm,
                                 float weights_scale, float* __restrict__ probs,
                                 u32* __restrict__ ids, float* __restrict__ weights) {
    u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok) return;
    const float* l = logits + (u64)t * n_expert;
    float* p = probs + (u64)t * n_expert;
    if (gating == 0) {
        float mx = NEG_INF;
        for (u32 e = 0; e < n_expert; e++) mx = fmaxf(mx, l[e]);
        double sum = 0.0;
        for (u32 e = 0; e < n_expert; e++) {
            p[e] = expf(l[e] - mx);
            sum += (double)p[e];
        }
        float inv = (float)(1.0 / sum);
        for (u32 e = 0; e < n_expert; e++) p[e] *= inv;
    } else {
        for (u32 e = 0; e < n_expert; e++) p[e] = 1.0f / (1.0f + expf(-l[e]));
    }
    u64 taken[4] = {0, 0, 0, 0};
    float wsum = 0.0f;
    for (u32 s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
        for (u32 e = 0; e < n_expert; e++) {
            if ((taken[e / 64] >> (e % 64)) & 1ull) continue;
            float v = p[e] + (bias ? bias[e] : 0.0f);
            bool better;
            if (best < 0) better = true;
            else if (isnan(bv)) better = !isnan(v);  // NaN last
            else better = !isnan(v) && v > bv;       // strict: ties keep the lower id
            if (better) {
                best = (int)e;
                bv = v;
            }
        }
        taken[best / 64] |= 1ull << (best % 64);
        ids[(u64)t * k + s] = (u32)best;
        weights[(u64)t * k + s] = p[best];
        wsum += p[best];
    }
    float* w = weights + (u64)t * k;
    if (norm) {
        float d = fmaxf(wsum, 6.1035156e-5f);
        for (u32 s = 0; s < k; s++) w[s] /= d;
    }
    for (u32 s = 0; s < k; s++) w[s] *= weights_scale;
}

// Twin: CpuBackend::moe_combine: out[t, :] = Σ_s weights[t·k + s] · y[t·k + s, :], in slot order.
extern "C" __global__ void moe_combine(const float* __restrict__ y,
                                       const float* __restrict__ weights, float* __restrict__ out,
                                       u32 n_tok, u32 k, u32 width) {
    u64 n = (u64)n_tok * width;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / width, d = i % width;
        float acc = 0.0f;
        for (u32 s = 0; s < k; s++) acc += weights[t * k + s] * y[(t * k + s) * width + d];
        out[i] = acc;
    }
}
