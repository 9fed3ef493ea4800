// Kernels that check the emulation prelude against independent expectations (selftest.cpp):
// shuffles, votes, barriers, shared memory, thread/block indexing, atomics, f16 conversion.

// out[t] for every variant of shuffle, lane l = threadIdx.x % 32 of a 64-thread block:
// [0] xor 5, [1] down 3 (width 16), [2] up 2 (width 8), [3] idx 7-l (width 32), [4] ballot of
// odd lanes, [5] any(l == 9), [6] all(l < 32), [7] all(l < 31).
extern "C" __global__ void shuffles(u32* out) {
    u32 t = threadIdx.x, l = t % 32;
    u32 v = 100 * t;
    u32* o = out + 8 * t;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    o[1] = __shfl_down_sync(0xffffffffu, v, 3, 16);
    o[2] = __shfl_up_sync(0xffffffffu, v, 2, 8);
    o[3] = __shfl_sync(0xffffffffu, v, 7 - (int)l);
    o[4] = __ballot_sync(0xffffffffu, l & 1);
    o[5] = __any_sync(0xffffffffu, l == 9);
    o[6] = __all_sync(0xffffffffu, l < 32);
    o[7] = __all_sync(0xffffffffu, l < 31);
}

// A double and a float warp sum (common.cuh's warp_sum_d, warp_sum).
extern "C" __global__ void warp_sums(double* d, float* f) {
    d[threadIdx.x] = warp_sum_d((double)threadIdx.x + 0.5);
    f[threadIdx.x] = warp_sum((float)threadIdx.x);
}

// Shared memory and barriers over a 3-D block: each thread writes its linear index, then reads
// its mirror's after the barrier; then a tree reduction; thread 0 writes the sum.
extern "C" __global__ void block_mirror(u32* out, u32* sum) {
    __shared__ u32 s[1024];
    u32 n = blockDim.x * blockDim.y * blockDim.z;
    u32 t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    s[t] = t + 1000 * blockIdx.x;
    __syncthreads();
    out[blockIdx.x * n + t] = s[n - 1 - t];
    __syncthreads();
    for (u32 o = 512; o > 0; o >>= 1) {
        if (t < o && t + o < n) s[t] += s[t + o];
        __syncthreads();
    }
    if (t == 0) sum[blockIdx.x] = s[0];
}

// Every (block, thread) index once: out[linear block][linear thread] = packed indices.
extern "C" __global__ void indices(u32* out) {
    u32 b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    u32 n = blockDim.x * blockDim.y * blockDim.z;
    u32 t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    out[b * n + t] = (threadIdx.x) | (threadIdx.y << 8) | (threadIdx.z << 16) | (blockIdx.x << 24);
}

// Atomics across blocks running on several OS threads.
extern "C" __global__ void atomic_count(u32* counter, float* fsum) {
    atomicAdd(counter, 1u);
    atomicAdd(fsum, 1.0f);
}

// common.cuh's f16 conversions over arrays.
extern "C" __global__ void f16_to_f32_all(const u16* h, float* f, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) f[i] = f16_to_f32(h[i]);
}
extern "C" __global__ void f32_to_f16_all(const float* f, u16* h, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = f32_to_f16(f[i]);
}

// Parameters of every width the engine passes (u8 pointer, u64, u32, f32, f64).
extern "C" __global__ void param_widths(u64* out, u64 a, u32 b, float c, double d, u32 e) {
    out[0] = a;
    out[1] = b;
    out[2] = (u64)__float_as_uint(c);
    out[3] = (u64)__double_as_longlong(d);
    out[4] = e;
}
