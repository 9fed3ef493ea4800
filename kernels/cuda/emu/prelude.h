// plumbline CUDA emulator: the kernel-side prelude.
//
// Included (by the generated translation unit, see build.sh) before `common.cuh`, `quant.cuh`
// and one `.cu` file, so that g++ compiles the same kernel sources NVRTC compiles. It maps the
// CUDA execution model onto the emulator runtime (runtime.cpp):
//
// - every thread of a block is a fiber; all fibers of a block run on one OS thread, so
//   `__shared__` is `thread_local` (block-shared, as HIP-CPU does) and `threadIdx` is the running
//   fiber's index (`plumblineEmuSelf()` is `const`: a kernel body always runs on one fiber);
// - `__syncthreads`, the warp shuffles and votes are scheduling points of the runtime, which
//   checks them (divergent barriers, inactive lanes) and fails the launch with the reason;
// - dynamic shared memory is `DYNAMIC_SHARED(T, name)` (common.cuh defines it as
//   `extern __shared__ T name[]` for NVRTC);
// - f16 conversions: common.cuh calls `plumbline_emu_f32_to_f16` / `plumbline_emu_f16_to_f32`
//   when `__CUDA_ARCH__` is not defined (round to nearest even, bit-exact with
//   `half::f16::from_f32`, subnormals, infinities and NaN included).
#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>

#define PLUMBLINE_CUDA_EMU 1

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

namespace plumbline_emu {

// What a fiber (one CUDA thread) knows about itself.
struct ThreadInfo {
    uint3 tid;
    unsigned linear;  // x + y·bx + z·bx·by
    unsigned lane;    // linear % 32
    unsigned warp;    // linear / 32
};

// What every thread of the running block shares.
struct BlockInfo {
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    void* dyn_shared;
    unsigned dyn_shared_bytes;
};

// Warp operations (plumblineEmuWarp's `op`).
enum WarpOp : int {
    WARP_SHFL_IDX = 0,
    WARP_SHFL_UP = 1,
    WARP_SHFL_DOWN = 2,
    WARP_SHFL_XOR = 3,
    WARP_BALLOT = 4,
    WARP_ANY = 5,
    WARP_ALL = 6,
    WARP_SYNC = 7,
};

}  // namespace plumbline_emu

extern "C" {
// The running fiber and block; constant for the whole life of a kernel body on its fiber.
const plumbline_emu::ThreadInfo* plumblineEmuSelf(void) __attribute__((const));
const plumbline_emu::BlockInfo* plumblineEmuBlock(void) __attribute__((const));
void plumblineEmuSyncthreads(void);
// A warp operation of the calling lane: `value` is its operand (a shuffled value's bits or a
// predicate), `arg` the lane argument (source lane, delta or xor mask); returns the result.
uint64_t plumblineEmuWarp(int op, unsigned mask, uint64_t value, int arg, int width);
// Fails the running launch with `msg` (a kernel-side assertion).
[[noreturn]] void plumblineEmuTrap(const char* msg);
}

#define threadIdx (plumblineEmuSelf()->tid)
#define blockIdx (plumblineEmuBlock()->block_idx)
#define blockDim (plumblineEmuBlock()->block_dim)
#define gridDim (plumblineEmuBlock()->grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __constant__ static
#define __shared__ thread_local
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(plumblineEmuBlock()->dyn_shared)

inline void __syncthreads() { plumblineEmuSyncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    plumblineEmuWarp(plumbline_emu::WARP_SYNC, mask, 0, 0, 32);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { plumblineEmuTrap("__trap() called"); }

// ---- warp shuffles and votes --------------------------------------------------------------

namespace plumbline_emu {
template <typename T>
inline T shfl(int op, unsigned mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = plumblineEmuWarp(op, mask, bits, arg, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace plumbline_emu

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return plumbline_emu::shfl(plumbline_emu::WARP_SHFL_IDX, mask, v, src, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return plumbline_emu::shfl(plumbline_emu::WARP_SHFL_UP, mask, v, (int)d, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return plumbline_emu::shfl(plumbline_emu::WARP_SHFL_DOWN, mask, v, (int)d, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return plumbline_emu::shfl(plumbline_emu::WARP_SHFL_XOR, mask, v, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)plumblineEmuWarp(plumbline_emu::WARP_BALLOT, mask, pred != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int pred) {
    return (int)plumblineEmuWarp(plumbline_emu::WARP_ANY, mask, pred != 0, 0, 32);
}
inline int __all_sync(unsigned mask, int pred) {
    return (int)plumblineEmuWarp(plumbline_emu::WARP_ALL, mask, pred != 0, 0, 32);
}

// ---- atomics (blocks run concurrently on OS threads: these are real atomics) --------------

template <typename T>
inline T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
template <typename T>
inline T atomicSub(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_sub(v, std::memory_order_relaxed);
}
template <typename T>
inline T atomicExch(T* p, T v) {
    return std::atomic_ref<T>(*p).exchange(v, std::memory_order_relaxed);
}
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v, std::memory_order_relaxed);
    return cmp;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load(std::memory_order_relaxed);
    while (old < v && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load(std::memory_order_relaxed);
    while (v < old && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
}
template <typename T>
inline T atomicOr(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_or(v, std::memory_order_relaxed);
}
template <typename T>
inline T atomicAnd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_and(v, std::memory_order_relaxed);
}

// ---- intrinsics and math ------------------------------------------------------------------

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(1.0f, fmaxf(0.0f, x)); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
using std::isinf;
using std::isnan;

// ---- f16 conversions (the host side of common.cuh's PTX `cvt`) ----------------------------

// f16 bits → f32, exact (every f16 value is an f32 value), bit-exact with half::f16::to_f32.
inline float plumbline_emu_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0x1f) {
        // inf; NaN keeps its payload and is quieted (as half::f16::to_f32 and F16C do)
        bits = sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0u);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;  // ±0
    } else {
        // Subnormal: m · 2^-24, normalized.
        int shift = __builtin_clz(m) - 21;  // leading zeros within the 10-bit field, plus one
        m = (m << shift) & 0x3ffu;
        bits = sign | ((uint32_t)(113 - shift) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// f32 → f16 bits, round to nearest, ties to even; overflow to ±inf; NaN stays NaN with its top
// payload bits and the quiet bit set (as half::f16::from_f32).
inline uint16_t plumbline_emu_f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? (0x200u | (m >> 13)) : 0u));
    int he = (int)e - 127 + 15;
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he <= 0) {
        if (he < -10) return (uint16_t)sign;  // below half the smallest subnormal
        m |= 0x800000u;
        int shift = 14 - he;  // 14 ..= 24
        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1u))) hm++;  // may carry into the exponent
        return (uint16_t)(sign | hm);
    }
    uint32_t r = ((uint32_t)he << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;  // may carry up to inf
    return (uint16_t)(sign | r);
}
