// Kernels that break the CUDA execution model's rules on purpose: each must make the emulator
// fail the launch and name the reason (selftest.cpp, kernels/tests/cuda_emu.rs). Compiled only
// into the emulator's test library; NVRTC never sees them.

// Threads 16.. exit while 0..15 wait at the barrier.
extern "C" __global__ void bad_barrier_exit(float* out) {
    if (threadIdx.x >= 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Threads 0..15 exit before the others reach the barrier.
extern "C" __global__ void bad_barrier_after_exit(float* out) {
    if (threadIdx.x < 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Odd and even threads wait at two different barriers.
extern "C" __global__ void bad_barrier_divergent(float* out) {
    __shared__ float s[64];
    unsigned t = threadIdx.x;
    if (t % 2) {
        s[t] = 1.0f;
        __syncthreads();
        out[t] = s[t ^ 1];
    } else {
        s[t] = 2.0f;
        __syncthreads();
        out[t] = s[t ^ 1] * 3.0f;
    }
}

// Lane 31 skips a full-mask shuffle (it exits).
extern "C" __global__ void bad_shfl_exited_lane(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 31) return;
    v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// Lanes 0..15 shuffle while 16..31 wait at a barrier.
extern "C" __global__ void bad_shfl_vs_barrier(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    else
        __syncthreads();
    out[threadIdx.x] = v;
}

// Two halves of the warp at different shuffles.
extern "C" __global__ void bad_shfl_divergent(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    else
        v = __shfl_down_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// A full-mask warp sum in a block of 16 threads: lanes 16..31 do not exist.
extern "C" __global__ void bad_shfl_partial_warp(float* out) {
    out[threadIdx.x] = warp_sum((float)threadIdx.x);
}

// Reads `n` floats of `x` starting at `first` (negative: before the start).
extern "C" __global__ void read_at(const float* x, long long first, u32 n, float* out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[first + (long long)i];
}

// Writes `n` floats of `x` starting at `first`.
extern "C" __global__ void write_at(float* x, long long first, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[first + (long long)i] = 7.0f;
}

// Copies n words (the reads-of-never-written-memory test reads them back).
extern "C" __global__ void copy_u32(const u32* x, u32* out, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i];
}

extern "C" __global__ void trap_if(u32 flag) {
    if (flag && threadIdx.x == 3) __trap();
}

// Integer division by `d` (zero: the CPU faults where a GPU returns garbage).
extern "C" __global__ void int_div(u32* out, u32 d) { out[threadIdx.x] = 1000u / d; }

// Uses dynamic shared memory of `n` floats and 1 KiB of static shared memory.
extern "C" __global__ void dyn_shared_sum(float* out, u32 n) {
    DYNAMIC_SHARED(float, buf);
    __shared__ float fixed[256];
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (float)i;
    fixed[threadIdx.x % 256] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = fixed[0];
        for (u32 i = 0; i < n; i++) s += buf[i];
        out[blockIdx.x] = s;
    }
}

// Recursion (practically) without end: overflows the fiber's stack.
__device__ __noinline__ u32 deep(volatile u32* p, u32 d) {
    volatile u32 pad[64];
    pad[d % 64] = d;
    if (d == 0xffffffffu) return 0;  // never: the stack runs out long before
    return deep(p, d + 1) + pad[(d + 1) % 64] + p[0];
}
extern "C" __global__ void stack_overflow(u32* out) { out[0] = deep(out, 0); }

// A missing barrier: each thread writes its slot, then reads its left neighbour's without a
// __syncthreads in between. In the default order (each thread runs to its next scheduling point
// in index order) the neighbour has always written already and the race hides;
// PLUMBLINE_CUDA_EMU_SHUFFLE runs the threads in a random order, so that the stale value of the
// previous launch shows up. With `sync` set the barrier is there and every read is fresh.
extern "C" __global__ void racy_left_neighbour(u32* out, u32 tag, u32 sync) {
    __shared__ u32 s[256];
    u32 t = threadIdx.x;
    s[t] = tag;
    if (sync) __syncthreads();
    out[t] = s[(t + blockDim.x - 1) % blockDim.x];
}

// A 4-byte load from an address that is not a multiple of 4: a GPU faults
// (CUDA_ERROR_MISALIGNED_ADDRESS); x86 does not, so only the --asan build (UBSan's alignment
// check) names it.
extern "C" __global__ void misaligned_load(const u8* p, float* out) {
    out[threadIdx.x] = *(const float*)(p + 1 + 4 * threadIdx.x);
}

// 64 threads write a 32-float __shared__ array: on the CPU the overflow lands in whatever
// thread-local storage follows; the --asan build (UBSan's bounds check) names it.
extern "C" __global__ void shared_overflow(float* out) {
    __shared__ float s[32];
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x % 32];
}
