// plumbline CUDA kernels: GGML block formats, dequantized 32 values at a time.
//
// `deq_<type>(row, c, y)` writes the 32 values of chunk `c` (elements 32c .. 32c+31) of a row
// stored in that type. Each is the twin of the dequantize function beside the block struct in
// kernels/src/quant (named on each), and every layout offset is the one that struct asserts.
// The matrix-vector kernels (mmv.cu), the dequantize-to-f16 prefill path (dequant.cu) and the
// embedding gather all read weights through these, so one definition per format serves all.

// Twin: kernels::quant::float (f32 rows; chunk = 32 consecutive floats).
__device__ __forceinline__ void deq_f32(const u8* row, int c, float* y) {
    const float* p = (const float*)(row) + 32 * c;  // rows of f32 are 4-byte aligned
#pragma unroll
    for (int i = 0; i < 32; i++) y[i] = p[i];
}

// Twin: kernels::quant::float, f16.
__device__ __forceinline__ void deq_f16(const u8* row, int c, float* y) {
    const u16* p = (const u16*)(row) + 32 * c;
#pragma unroll
    for (int i = 0; i < 32; i++) y[i] = f16_to_f32(p[i]);
}

// Twin: kernels::quant::float, bf16.
__device__ __forceinline__ void deq_bf16(const u8* row, int c, float* y) {
    const u16* p = (const u16*)(row) + 32 * c;
#pragma unroll
    for (int i = 0; i < 32; i++) y[i] = bf16_to_f32(p[i]);
}

// Twin: kernels::quant::legacy::dequantize_q4_0 (BlockQ4_0, 18 bytes: d f16, qs[16]).
__device__ __forceinline__ void deq_q4_0(const u8* row, int c, float* y) {
    const u8* b = row + 18 * c;
    float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        y[j] = d * (float)((int)(q & 0xF) - 8);
        y[j + 16] = d * (float)((int)(q >> 4) - 8);
    }
}

// Twin: kernels::quant::legacy::dequantize_q4_1 (BlockQ4_1, 20 bytes: d, m f16, qs[16]).
__device__ __forceinline__ void deq_q4_1(const u8* row, int c, float* y) {
    const u8* b = row + 20 * c;
    float d = ld_f16(b), m = ld_f16(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[4 + j];
        y[j] = d * (float)(q & 0xF) + m;
        y[j + 16] = d * (float)(q >> 4) + m;
    }
}

// Twin: kernels::quant::legacy::dequantize_q5_0 (BlockQ5_0, 22 bytes: d f16, qh[4], qs[16]).
__device__ __forceinline__ void deq_q5_0(const u8* row, int c, float* y) {
    const u8* b = row + 22 * c;
    float d = ld_f16(b);
    u32 qh = ld_u32(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[6 + j];
        int h0 = ((qh >> j) << 4) & 0x10;
        int h1 = (qh >> (j + 12)) & 0x10;
        y[j] = d * (float)(((q & 0xF) | h0) - 16);
        y[j + 16] = d * (float)(((q >> 4) | h1) - 16);
    }
}

// Twin: kernels::quant::legacy::dequantize_q5_1 (BlockQ5_1, 24 bytes: d, m f16, qh[4], qs[16]).
__device__ __forceinline__ void deq_q5_1(const u8* row, int c, float* y) {
    const u8* b = row + 24 * c;
    float d = ld_f16(b), m = ld_f16(b + 2);
    u32 qh = ld_u32(b + 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[8 + j];
        int h0 = ((qh >> j) << 4) & 0x10;
        int h1 = (qh >> (j + 12)) & 0x10;
        y[j] = d * (float)((q & 0xF) | h0) + m;
        y[j + 16] = d * (float)((q >> 4) | h1) + m;
    }
}

// Twin: kernels::quant::legacy::dequantize_q8_0 (BlockQ8_0, 34 bytes: d f16, qs[32] i8).
__device__ __forceinline__ void deq_q8_0(const u8* row, int c, float* y) {
    const u8* b = row + 34 * c;
    float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 32; j++) y[j] = d * (float)(i8)b[2 + j];
}

// Twin: kernels::quant::legacy::dequantize_q8_1 (BlockQ8_1, 36 bytes: d, s f16, qs[32]).
__device__ __forceinline__ void deq_q8_1(const u8* row, int c, float* y) {
    const u8* b = row + 36 * c;
    float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 32; j++) y[j] = d * (float)(i8)b[4 + j];
}

// Twin: kernels::quant::k_quants::dequantize_q2k (BlockQ2K, 84 bytes: scales[16], qs[64],
// d, dmin f16). Chunk c of a super-block: half n = c/4 (128 values), shift 2·(c%4).
__device__ __forceinline__ void deq_q2_k(const u8* row, int c, float* y) {
    const u8* b = row + 84 * (c / 8);
    int s = c % 8, n = s / 4, j = s % 4;
    float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
    const u8* q = b + 16 + 32 * n;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        u8 sc = b[n * 8 + j * 2 + half];
        float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
#pragma unroll
        for (int l = 0; l < 16; l++)
            y[half * 16 + l] = dl * (float)((q[half * 16 + l] >> (2 * j)) & 3) - ml;
    }
}

// Twin: kernels::quant::k_quants::dequantize_q3k (BlockQ3K, 110 bytes: hmask[32], qs[64],
// scales[12] (16 six-bit scales), d f16).
__device__ __forceinline__ void deq_q3_k(const u8* row, int c, float* y) {
    const u8* b = row + 110 * (c / 8);
    int s = c % 8, n = s / 4, j = s % 4;
    const u8* hm = b;
    const u8* q = b + 32 + 32 * n;
    const u8* sc = b + 96;
    float d = ld_f16(b + 108);
    u8 bit = (u8)(1 << (n * 4 + j));
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int is = n * 8 + j * 2 + half;
        int lo = (is < 8) ? (sc[is] & 0xF) : (sc[is - 8] >> 4);
        int hi = (sc[8 + is % 4] >> (2 * (is / 4))) & 3;
        float dl = d * (float)((lo | (hi << 4)) - 32);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            int k = half * 16 + l;
            int v = (int)((q[k] >> (2 * j)) & 3) - ((hm[k] & bit) ? 0 : 4);
            y[k] = dl * (float)v;
        }
    }
}

// ggml's get_scale_min_k4: the 6-bit scale and min `j` of a Q4_K/Q5_K super-block.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* d, int* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Twin: kernels::quant::k_quants::dequantize_q4k (BlockQ4K, 144 bytes: d, dmin f16,
// scales[12], qs[128]). Chunk c: 64-value group c/2, low (c even) or high nibbles.
__device__ __forceinline__ void deq_q4_k(const u8* row, int c, float* y) {
    const u8* b = row + 144 * (c / 8);
    int s = c % 8;
    float d = ld_f16(b), dmin = ld_f16(b + 2);
    int sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float dl = d * (float)sc, ml = dmin * (float)m;
    const u8* q = b + 16 + 32 * (s / 2);
    int shift = 4 * (s % 2);
#pragma unroll
    for (int l = 0; l < 32; l++) y[l] = dl * (float)((q[l] >> shift) & 0xF) - ml;
}

// Twin: kernels::quant::k_quants::dequantize_q5k (BlockQ5K, 176 bytes: d, dmin f16,
// scales[12], qh[32], qs[128]).
__device__ __forceinline__ void deq_q5_k(const u8* row, int c, float* y) {
    const u8* b = row + 176 * (c / 8);
    int s = c % 8;
    float d = ld_f16(b), dmin = ld_f16(b + 2);
    int sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    float dl = d * (float)sc, ml = dmin * (float)m;
    const u8* qh = b + 16;
    const u8* q = b + 48 + 32 * (s / 2);
    int shift = 4 * (s % 2);
    u8 bit = (u8)(1 << s);
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int v = ((q[l] >> shift) & 0xF) + ((qh[l] & bit) ? 16 : 0);
        y[l] = dl * (float)v - ml;
    }
}

// Twin: kernels::quant::k_quants::dequantize_q6k (BlockQ6K, 210 bytes: ql[128], qh[64],
// scales[16] i8, d f16). Chunk c: half n = c/4, quarter c%4.
__device__ __forceinline__ void deq_q6_k(const u8* row, int c, float* y) {
    const u8* b = row + 210 * (c / 8);
    int s = c % 8, n = s / 4, quarter = s % 4;
    const u8* ql = b + 64 * n + 32 * (quarter & 1);
#ifdef PLUMBLINE_FAULT_CUDA_Q6K_HIGH_BITS_HALF
    // Fault (engine/src/faults.rs): the second half's high bits read from the first half's.
    const u8* qh = b + 128;
#else
    const u8* qh = b + 128 + 32 * n;
#endif
    const i8* sc = (const i8*)(b + 192) + 8 * n + 2 * quarter;
    float d = ld_f16(b + 208);
    int shift = (quarter >= 2) ? 4 : 0;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int v = (((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
        y[l] = d * (float)sc[l / 16] * (float)v;
    }
}

// Twin: kernels::quant::k_quants::dequantize_q8k (BlockQ8K, 292 bytes: d f32, qs[256] i8,
// bsums[16] i16).
__device__ __forceinline__ void deq_q8_k(const u8* row, int c, float* y) {
    const u8* b = row + 292 * (c / 8);
    float d = __uint_as_float(ld_u32(b));
    const i8* q = (const i8*)(b + 4) + 32 * (c % 8);
#pragma unroll
    for (int l = 0; l < 32; l++) y[l] = d * (float)q[l];
}

// ggml's kvalues_iq4nl (kernels::quant::iq::KVALUES_IQ4NL).
__device__ __constant__ i8 KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};

// Twin: kernels::quant::iq::dequantize_iq4_nl (BlockIq4Nl, 18 bytes: d f16, qs[16]).
__device__ __forceinline__ void deq_iq4_nl(const u8* row, int c, float* y) {
    const u8* b = row + 18 * c;
    float d = ld_f16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        y[j] = d * (float)KV_IQ4NL[q & 0xF];
        y[j + 16] = d * (float)KV_IQ4NL[q >> 4];
    }
}

// Twin: kernels::quant::iq::dequantize_iq4_xs (BlockIq4Xs, 136 bytes: d f16, scales_h u16,
// scales_l[4], qs[128]).
__device__ __forceinline__ void deq_iq4_xs(const u8* row, int c, float* y) {
    const u8* b = row + 136 * (c / 8);
    int ib = c % 8;
    float d = ld_f16(b);
    u16 sh = ld_u16(b + 2);
    int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
    float dl = d * (float)(ls - 32);
    const u8* q = b + 8 + 16 * ib;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        y[j] = dl * (float)KV_IQ4NL[q[j] & 0xF];
        y[j + 16] = dl * (float)KV_IQ4NL[q[j] >> 4];
    }
}

// ggml's kvalues_mxfp4 (E2M1 values, doubled), kernels::quant::mxfp4.
__device__ __constant__ i8 KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml_e8m0_to_fp32_half: 2^(e - 128), as the float bit pattern (subnormal for e < 2).
__device__ __forceinline__ float e8m0_half(u8 e) {
    u32 bits = (e < 2) ? (0x00200000u << e) : ((u32)(e - 1) << 23);
    return __uint_as_float(bits);
}

// Twin: kernels::quant::mxfp4::dequantize_mxfp4 (BlockMxfp4, 17 bytes: e (E8M0), qs[16]).
__device__ __forceinline__ void deq_mxfp4(const u8* row, int c, float* y) {
    const u8* b = row + 17 * c;
    float d = e8m0_half(b[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[1 + j];
        y[j] = d * (float)KV_MXFP4[q & 0xF];
        y[j + 16] = d * (float)KV_MXFP4[q >> 4];
    }
}

// X-macro of every weight type with a kernel: (suffix, GGUF type id).
#define FOR_EACH_TYPE(X) \
    X(f32, 0)            \
    X(f16, 1)            \
    X(q4_0, 2)           \
    X(q4_1, 3)           \
    X(q5_0, 6)           \
    X(q5_1, 7)           \
    X(q8_0, 8)           \
    X(q8_1, 9)           \
    X(q2_k, 10)          \
    X(q3_k, 11)          \
    X(q4_k, 12)          \
    X(q5_k, 13)          \
    X(q6_k, 14)          \
    X(q8_k, 15)          \
    X(iq4_nl, 20)        \
    X(iq4_xs, 23)        \
    X(bf16, 30)          \
    X(mxfp4, 39)
