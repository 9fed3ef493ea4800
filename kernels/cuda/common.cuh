// plumbline CUDA kernels: shared definitions.
//
// Prepended to every .cu file by the compile layer (engine/src/runtime/cuda/compile.rs), so the
// sources need no include path and no CUDA toolkit headers: NVRTC from the PyPI wheel compiles
// them as they are. Half and bfloat16 values travel as their 16-bit patterns (`u16`) and are
// converted with PTX `cvt` instructions, which every architecture from sm_80 on has.
//
// Block layouts are those of kernels/src/quant (the one definition in the workspace); the byte
// offsets below are the ones its `#[repr(C)]` structs assert. Blocks are read byte by byte
// (`ld_u16`, `ld_u32`), because ggml's block sizes (18, 22, 17, 110 ... bytes) leave most blocks
// misaligned for wider loads.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

// Dynamic shared memory of a kernel (`extern __shared__`); the CPU emulator
// (kernels/cuda/emu/prelude.h) defines its own.
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
#else
    return plumbline_emu_f16_to_f32(h);  // the host build: kernels/cuda/emu/prelude.h
#endif
}

// Round to nearest even, as `half::f16::from_f32` does (the CPU cache's conversion).
__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
#else
    return plumbline_emu_f32_to_f16(f);
#endif
}

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return (u16)(p[0] | (p[1] << 8));
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ float ld_f16(const u8* p) { return f16_to_f32(ld_u16(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread gets the result.
// `scratch` holds at least 32 values.
__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) scratch[wid] = v;
    __syncthreads();
    int nw = (blockDim.x + WARP - 1) / WARP;
    v = (lane < nw) ? scratch[lane] : 0.0;
    return warp_sum_d(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[wid] = v;
    __syncthreads();
    int nw = (blockDim.x + WARP - 1) / WARP;
    v = (lane < nw) ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// ---- q8_1 activations ----------------------------------------------------------------------
// kernels::quant::legacy::BlockQ8_1: d (f16), s (f16) = d·Σq, qs[32] (i8); 36 bytes.
struct __align__(4) block_q8_1 {
    u16 d;
    u16 s;
    i8 qs[32];
};
