// Elementwise ops and data movement. One thread per element (grid-stride loops), n < 2^32.
// Twins: the CpuBackend ops of the same names in engine/src/runtime/cpu.rs.

#define GRID_LOOP(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                             i += (u64)gridDim.x * blockDim.x)

// Twin: engine::runtime::cpu::silu (x / (1 + e^-x)), CpuBackend::gated_act(Silu).
extern "C" __global__ void gated_silu(float* __restrict__ gate, const float* __restrict__ up,
                                      u64 n) {
    GRID_LOOP(i, n) {
        float g = gate[i];
        gate[i] = (g / (1.0f + expf(-g))) * up[i];
    }
}

// Twin: engine::runtime::cpu::gelu_tanh (ggml_gelu's tanh form), CpuBackend::gated_act(GeluTanh).
extern "C" __global__ void gated_gelu_tanh(float* __restrict__ gate, const float* __restrict__ up,
                                           u64 n) {
    const float SQRT_2_OVER_PI = 0.7978846f, GELU_COEF_A = 0.044715f;
    GRID_LOOP(i, n) {
        float x = gate[i];
        float g = 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x)));
        gate[i] = g * up[i];
    }
}

// Twin: CpuBackend::softcap: x = cap · tanh(x · (1/cap)).
extern "C" __global__ void softcap(float* __restrict__ x, u64 n, float cap) {
    float inv = 1.0f / cap;
    GRID_LOOP(i, n) x[i] = tanhf(x[i] * inv) * cap;
}

// Twin: CpuBackend::add.
extern "C" __global__ void add(float* __restrict__ x, const float* __restrict__ y, u64 n) {
    GRID_LOOP(i, n) x[i] += y[i];
}

// Twin: CpuBackend::add_row: x[t, :] += row.
extern "C" __global__ void add_row(float* __restrict__ x, const float* __restrict__ row, u64 n,
                                   u32 width) {
    GRID_LOOP(i, n) x[i] += row[i % width];
}

// Twin: CpuBackend::scale.
extern "C" __global__ void scale(float* __restrict__ x, u64 n, float s) {
    GRID_LOOP(i, n) x[i] *= s;
}

// Twin: CpuBackend::fill.
extern "C" __global__ void fill(float* __restrict__ x, u64 n, float value) {
    GRID_LOOP(i, n) x[i] = value;
}

// Twin: CpuBackend::copy_strided: for row < n_rows, group < n_groups, j < len:
// dst[row·drs + group·dgs + doff + j] = src[row·srs + group·sgs + soff + j].
extern "C" __global__ void copy_strided(const float* __restrict__ src, u64 srs, u64 sgs, u64 soff,
                                        float* __restrict__ dst, u64 drs, u64 dgs, u64 doff,
                                        u32 n_rows, u32 n_groups, u32 len) {
    u64 n = (u64)n_rows * n_groups * len;
    GRID_LOOP(i, n) {
        u64 j = i % len, g = (i / len) % n_groups, r = i / ((u64)len * n_groups);
        dst[r * drs + g * dgs + doff + j] = src[r * srs + g * sgs + soff + j];
    }
}

// Twin: CpuBackend::gather_rows: out[i, :] = x[rows[i], :].
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows,
                                       float* __restrict__ out, u32 n_out, u32 width) {
    u64 n = (u64)n_out * width;
    GRID_LOOP(i, n) out[i] = x[(u64)rows[i / width] * width + i % width];
}

// Twin: CpuBackend::kv_write into f32 storage: row i of src to cell cells[i].
extern "C" __global__ void kv_write_f32(float* __restrict__ kv, const u32* __restrict__ cells,
                                        const float* __restrict__ src, u32 n_rows, u32 width) {
    u64 n = (u64)n_rows * width;
    GRID_LOOP(i, n) kv[(u64)cells[i / width] * width + i % width] = src[i];
}

// Twin: CpuBackend::kv_write into f16 storage (KvStore::write: half::f16::from_f32, round to
// nearest even).
extern "C" __global__ void kv_write_f16(u16* __restrict__ kv, const u32* __restrict__ cells,
                                        const float* __restrict__ src, u32 n_rows, u32 width) {
    u64 n = (u64)n_rows * width;
    GRID_LOOP(i, n) kv[(u64)cells[i / width] * width + i % width] = f32_to_f16(src[i]);
}

// Rows of 16-bit words (an f32 row is two words per value): dst[dst_idx[i]] = src[src_idx[i]],
// a null index meaning i itself. CpuBackend::kv_move runs as two of these: gather every source
// into scratch, then scatter, so that every source is read before any destination is written.
extern "C" __global__ void copy_rows_u16(const u16* __restrict__ src,
                                         const u32* __restrict__ src_idx, u16* __restrict__ dst,
                                         const u32* __restrict__ dst_idx, u32 n_rows, u32 words) {
    u64 n = (u64)n_rows * words;
    GRID_LOOP(i, n) {
        u64 r = i / words, w = i % words;
        u64 s = src_idx ? src_idx[r] : r, d = dst_idx ? dst_idx[r] : r;
        dst[d * words + w] = src[s * words + w];
    }
}

// Twin: KvStore::read_at for f16 storage (CpuBackend::kv_read_k): exact widening.
extern "C" __global__ void f16_to_f32_rows(const u16* __restrict__ src, float* __restrict__ dst,
                                           u64 n) {
    GRID_LOOP(i, n) dst[i] = f16_to_f32(src[i]);
}
