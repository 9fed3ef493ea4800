// RMSNorm and RoPE.

// RMSNorm of each row of `width` values, times `weight`: one block (256 threads) per row; the
// mean of squares summed in f64, as the CPU does. Twin: engine::runtime::cpu::rms_norm_row
// (ggml's rms_norm: x · 1/√(mean + eps), then the separate multiply by the weight). In place
// when out == x, so x is not __restrict__ (each thread reads an element before writing it).
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ weight,
                                    float* out, u32 width, float eps) {
    __shared__ double scratch[32];
    const float* xr = x + (u64)blockIdx.x * width;
    float* orow = out + (u64)blockIdx.x * width;
    double s = 0.0;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) s += (double)xr[i] * (double)xr[i];
    s = block_sum_d(s, scratch);
    float mean = (float)(s / (double)width);
    float scale = 1.0f / sqrtf(mean + eps);
    __syncthreads();
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) orow[i] = (xr[i] * scale) * weight[i];
}

// RoPE of the first n_rot dimensions of every head of `x` ([n_tok, n_heads × head_dim]), token t
// at positions[t]. Styles: 0 normal (pairs 2i, 2i+1), 1 NeoX (pairs i, i + n_rot/2). YaRN when
// ext_factor ≠ 0, with corr0/corr1 from ggml_rope_yarn_corr_dims (computed on the host once per
// call) and mscale the attention factor (times 1 + 0.1·ln(1/freq_scale) under YaRN, folded in on
// the host). Twin: engine::runtime::cpu::rope_cache + rope_head (ggml_rope_cache_init,
// rope_yarn). The CPU steps θ by repeated multiplication by theta_scale; here θ = pos ·
// theta_scale^i with powf, so the two angles differ by a few ulp.
//
// One block per (token, head) pair p = t·n_heads + h, the blocks striding over the pairs (grid x
// only, so any token count fits), one thread per rotated pair of dimensions.
extern "C" __global__ void rope(float* __restrict__ x, const u32* __restrict__ positions,
                                u32 n_tok, u32 n_heads, u32 head_dim, u32 n_rot, u32 style,
                                float freq_base, float freq_scale, float ext_factor, float mscale,
                                float corr0, float corr1) {
    float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
    u64 n_pairs = (u64)n_tok * n_heads;
    for (u64 pair = blockIdx.x; pair < n_pairs; pair += gridDim.x) {
        u32 t = (u32)(pair / n_heads);
        float* head = x + pair * head_dim;
        float pos = (float)positions[t];
        for (u32 i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
            float theta_extrap = pos * powf(theta_scale, (float)i);
            float theta_interp = freq_scale * theta_extrap;
            float theta = theta_interp;
            if (ext_factor != 0.0f) {
                float y = ((float)i - corr0) / fmaxf(0.001f, corr1 - corr0);
                float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
                float mix = ramp * ext_factor;
                theta = theta_interp * (1.0f - mix) + theta_extrap * mix;
            }
            float c = cosf(theta) * mscale, s = sinf(theta) * mscale;
            u32 a = (style == 0) ? 2 * i : i;
            u32 b = (style == 0) ? 2 * i + 1 : i + n_rot / 2;
            float x0 = head[a], x1 = head[b];
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}
