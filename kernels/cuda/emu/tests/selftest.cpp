// The emulator's self-test: each case (emu_selftest CASE) drives the driver API the way the
// engine does (dlopen'd libcuda.so.1 by path, a cubin loaded, kernelParams of 8-byte values)
// and checks either a result against an independent expectation or that a violation of the
// CUDA execution model fails with the kernel and the reason named. kernels/tests/cuda_emu.rs
// runs every case under `cargo nextest`; `emu_selftest list` names them, `emu_selftest all`
// runs them in one process.
#include <dlfcn.h>
#include <immintrin.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cubin_writer.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define FNS(X)                                                                                  \
    X(cuInit, CUresult (*)(unsigned))                                                           \
    X(cuDeviceGet, CUresult (*)(int*, int))                                                     \
    X(cuDeviceGetAttribute, CUresult (*)(int*, int, int))                                       \
    X(cuDevicePrimaryCtxRetain, CUresult (*)(void**, int))                                      \
    X(cuCtxSetCurrent, CUresult (*)(void*))                                                     \
    X(cuMemAlloc_v2, CUresult (*)(CUdeviceptr*, size_t))                                        \
    X(cuMemFree_v2, CUresult (*)(CUdeviceptr))                                                  \
    X(cuMemsetD8_v2, CUresult (*)(CUdeviceptr, unsigned char, size_t))                          \
    X(cuMemcpyHtoD_v2, CUresult (*)(CUdeviceptr, const void*, size_t))                          \
    X(cuMemcpyDtoH_v2, CUresult (*)(void*, CUdeviceptr, size_t))                                \
    X(cuModuleLoadData, CUresult (*)(void**, const void*))                                      \
    X(cuModuleGetFunction, CUresult (*)(void**, void*, const char*))                            \
    X(cuFuncSetAttribute, CUresult (*)(void*, int, int))                                        \
    X(cuFuncGetParamInfo, CUresult (*)(void*, size_t, size_t*, size_t*))                        \
    X(cuLaunchKernel, CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,    \
                                   unsigned, unsigned, void*, void**, void**))                 \
    X(cuGetErrorString, CUresult (*)(int, const char**))                                        \
    X(plumblineEmuLastError, const char* (*)(void))

#define DECL(n, t) static decltype((t)nullptr) n;
FNS(DECL)

static int g_arch = 90;
static std::string g_dir;

static void die(const char* what) {
    fprintf(stderr, "emu_selftest: %s\n", what);
    exit(2);
}

static void load() {
    char exe[4096];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k <= 0) die("cannot read /proc/self/exe");
    exe[k] = 0;
    g_dir = exe;
    g_dir = g_dir.substr(0, g_dir.rfind('/'));
    void* lib = dlopen((g_dir + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!lib) die(dlerror());
#define LOAD(n, t)                                 \
    n = (t)dlsym(lib, #n);                         \
    if (!n) die("missing symbol " #n);
    FNS(LOAD)
    if (!dlopen((g_dir + "/libplumbline_emu_tests.so").c_str(), RTLD_NOW)) die(dlerror());
    const char* a = getenv("PLUMBLINE_CUDA_EMU_ARCH");
    if (a) g_arch = atoi(a);
    void* ctx;
    int dev;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
        die("cannot set up a context");
}

// ---- helpers ------------------------------------------------------------------------------

struct Failure {
    std::string msg;
};
#define CHECK(c, ...)                                                             \
    do {                                                                          \
        if (!(c)) {                                                               \
            char b_[1024];                                                        \
            snprintf(b_, sizeof b_, __VA_ARGS__);                                 \
            throw Failure{std::string(#c) + " failed at line " + std::to_string(__LINE__) + ": " + b_}; \
        }                                                                         \
    } while (0)

static void* module_of(const std::vector<TestKernel>& ks, int arch = -1) {
    auto img = make_cubin(arch < 0 ? g_arch : arch, ks);
    void* m = nullptr;
    CUresult r = cuModuleLoadData(&m, img.data());
    CHECK(r == 0, "cuModuleLoadData: %d %s", r, plumblineEmuLastError());
    return m;
}

static void* fn(const char* name, std::vector<unsigned> params = {}, bool with_params = false,
                unsigned shared = 0) {
    TestKernel k{name, with_params, params, shared};
    void* m = module_of({k});
    void* f = nullptr;
    CUresult r = cuModuleGetFunction(&f, m, name);
    CHECK(r == 0, "cuModuleGetFunction(%s): %d %s", name, r, plumblineEmuLastError());
    return f;
}

// Arguments as the engine passes them: each an 8-byte little-endian value.
struct Args {
    std::vector<uint64_t> v;
    std::vector<void*> p;
    Args& ptr(CUdeviceptr x) { v.push_back(x); return *this; }
    Args& u(uint64_t x) { v.push_back(x); return *this; }
    Args& f(float x) { uint32_t b; memcpy(&b, &x, 4); v.push_back(b); return *this; }
    Args& d(double x) { uint64_t b; memcpy(&b, &x, 8); v.push_back(b); return *this; }
    void** get() {
        p.clear();
        for (auto& x : v) p.push_back(&x);
        return p.data();
    }
};

static CUresult launch(void* f, unsigned gx, unsigned bx, Args& a, unsigned shared = 0,
                       unsigned gy = 1, unsigned gz = 1, unsigned by = 1, unsigned bz = 1) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, nullptr, a.get(), nullptr);
}

static CUdeviceptr alloc(size_t n) {
    CUdeviceptr p = 0;
    CHECK(cuMemAlloc_v2(&p, n) == 0, "cuMemAlloc(%zu): %s", n, plumblineEmuLastError());
    return p;
}

template <typename T>
static CUdeviceptr upload(const std::vector<T>& v) {
    CUdeviceptr p = alloc(v.size() * sizeof(T));
    CHECK(cuMemcpyHtoD_v2(p, v.data(), v.size() * sizeof(T)) == 0, "upload");
    return p;
}

template <typename T>
static std::vector<T> download(CUdeviceptr p, size_t n) {
    std::vector<T> v(n);
    CHECK(cuMemcpyDtoH_v2(v.data(), p, n * sizeof(T)) == 0, "download: %s", plumblineEmuLastError());
    return v;
}

// The launch (or call) failed with `code`, and the message names every needle.
static void expect_error(CUresult r, int code, std::vector<std::string> needles) {
    std::string msg = plumblineEmuLastError();
    CHECK(r == code, "expected CUresult %d, got %d (last error: %s)", code, r, msg.c_str());
    const char* s = nullptr;
    CHECK(cuGetErrorString(r, &s) == 0 && s, "cuGetErrorString(%d)", r);
    for (auto& n : needles) {
        CHECK(msg.find(n) != std::string::npos, "message lacks \"%s\": %s", n.c_str(), msg.c_str());
        CHECK(std::string(s).find(n) != std::string::npos, "cuGetErrorString lacks \"%s\": %s",
              n.c_str(), s);
    }
}

enum { INVALID_VALUE = 1, INVALID_IMAGE = 200, NO_BINARY = 209, NOT_FOUND = 500,
       ILLEGAL_ADDRESS = 700, ASSERT = 710, LAUNCH_FAILED = 719 };

// ---- checker cases ------------------------------------------------------------------------

static void one_float_out_case(const char* kernel, unsigned threads, std::vector<std::string> needles) {
    void* f = fn(kernel);
    CUdeviceptr out = alloc(64 * 4);
    Args a;
    a.ptr(out);
    expect_error(launch(f, 1, threads, a), LAUNCH_FAILED, needles);
    cuMemFree_v2(out);
}

static std::map<std::string, std::function<void()>> cases() {
    std::map<std::string, std::function<void()>> c;
    c["barrier_exit"] = [] {
        one_float_out_case("bad_barrier_exit", 32,
                           {"bad_barrier_exit", "exited while", "threads of the block wait at __syncthreads"});
    };
    c["barrier_after_exit"] = [] {
        one_float_out_case("bad_barrier_after_exit", 32,
                           {"bad_barrier_after_exit", "reached __syncthreads after", "threads of the block exited"});
    };
    c["barrier_divergent"] = [] {
        one_float_out_case("bad_barrier_divergent", 64, {"bad_barrier_divergent", "divergent __syncthreads"});
    };
    c["shfl_exited_lane"] = [] {
        one_float_out_case("bad_shfl_exited_lane", 32, {"bad_shfl_exited_lane", "lane 31", "__shfl_xor_sync"});
    };
    c["shfl_vs_barrier"] = [] {
        one_float_out_case("bad_shfl_vs_barrier", 32, {"bad_shfl_vs_barrier", "divergent"});
    };
    c["shfl_divergent"] = [] {
        one_float_out_case("bad_shfl_divergent", 32,
                           {"bad_shfl_divergent", "divergent warp operation", "__shfl_down_sync", "__shfl_xor_sync"});
    };
    c["shfl_partial_warp"] = [] {
        one_float_out_case("bad_shfl_partial_warp", 16,
                           {"bad_shfl_partial_warp", "lanes 16-31 that do not exist"});
    };
    c["launch_limits"] = [] {
        void* f = fn("copy_u32");
        CUdeviceptr x = alloc(4), y = alloc(4);
        Args a;
        a.ptr(x).ptr(y).u(0);
        expect_error(launch(f, 1, 1025, a), INVALID_VALUE, {"copy_u32", "1025 threads"});
        expect_error(launch(f, 1, 1, a, 0, 1, 1, 1, 65), INVALID_VALUE, {"copy_u32", "block (1,1,65)"});
        expect_error(launch(f, 1, 1, a, 0, 65536), INVALID_VALUE, {"copy_u32", "grid (1,65536,1)"});
        expect_error(launch(f, 1, 1, a, 0, 1, 65536), INVALID_VALUE, {"copy_u32", "grid (1,1,65536)"});
        expect_error(launch(f, 2147483648u, 1, a), INVALID_VALUE, {"copy_u32", "grid (2147483648,1,1)"});
        expect_error(launch(f, 0, 32, a), INVALID_VALUE, {"copy_u32", "empty launch"});
        expect_error(launch(f, 1, 0, a), INVALID_VALUE, {"copy_u32", "empty launch"});
    };
    c["shared_limits"] = [] {
        // 1 KiB static + dynamic: 47 KiB fits the default 48 KiB, 47 KiB + 1 does not.
        void* f = fn("dyn_shared_sum", {}, false, 1024);
        CUdeviceptr out = alloc(4);
        Args a;
        a.ptr(out).u(16);
        CHECK(launch(f, 1, 32, a, 47 * 1024) == 0, "47 KiB: %s", plumblineEmuLastError());
        expect_error(launch(f, 1, 32, a, 47 * 1024 + 4), INVALID_VALUE,
                     {"dyn_shared_sum", "over the 48 KiB", "without opting in"});
        // Opting in raises the limit up to the architecture's per-block maximum.
        CHECK(cuFuncSetAttribute(f, 8, 64 * 1024) == 0, "opt in: %s", plumblineEmuLastError());
        CHECK(launch(f, 1, 32, a, 64 * 1024) == 0, "64 KiB after opting in: %s", plumblineEmuLastError());
        expect_error(launch(f, 1, 32, a, 64 * 1024 + 4), INVALID_VALUE, {"dyn_shared_sum", "limit of 65536"});
        int optin = 0;
        cuDeviceGetAttribute(&optin, 97, 0);
        expect_error(cuFuncSetAttribute(f, 8, optin), INVALID_VALUE,
                     {"dyn_shared_sum", "MAX_DYNAMIC_SHARED_SIZE_BYTES"});
        CHECK(cuFuncSetAttribute(f, 8, optin - 1024) == 0, "the maximum: %s", plumblineEmuLastError());
    };
    c["dynamic_shared_values"] = [] {
        void* f = fn("dyn_shared_sum", {}, false, 1024);
        CUdeviceptr out = alloc(3 * 4);
        Args a;
        a.ptr(out).u(1000);
        CHECK(launch(f, 3, 64, a, 1000 * 4) == 0, "%s", plumblineEmuLastError());
        auto v = download<float>(out, 3);
        for (float x : v) CHECK(x == 499500.0f, "sum %f", x);  // Σ 0..999
    };
    c["param_mismatch"] = [] {
        // copy_u32 is (const u32*, u32*, u32) = (8, 8, 4) on the host; cubins that record
        // (8, 4, 4) or (8, 8) disagree and must be refused, one that records (8, 8, 4) is taken.
        TestKernel k{"copy_u32", true, {8, 4, 4}, 0};
        void* m = module_of({k});
        void* f = nullptr;
        expect_error(cuModuleGetFunction(&f, m, "copy_u32"), INVALID_IMAGE,
                     {"copy_u32", "(8, 4, 4)", "(8, 8, 4)"});
        TestKernel k2{"copy_u32", true, {8, 8}, 0};
        expect_error(cuModuleGetFunction(&f, module_of({k2}), "copy_u32"), INVALID_IMAGE,
                     {"copy_u32", "(8, 8)", "(8, 8, 4)"});
        TestKernel ok{"copy_u32", true, {8, 8, 4}, 0};
        CHECK(cuModuleGetFunction(&f, module_of({ok}), "copy_u32") == 0, "%s", plumblineEmuLastError());
        size_t off = 0, sz = 0;
        CHECK(cuFuncGetParamInfo(f, 2, &off, &sz) == 0 && off == 16 && sz == 4, "param 2: %zu %zu", off, sz);
        CHECK(cuFuncGetParamInfo(f, 3, &off, &sz) == INVALID_VALUE, "past the last parameter");
    };
    c["module_checks"] = [] {
        auto other = make_cubin(g_arch == 80 ? 90 : 80, {TestKernel{"copy_u32", false, {}, 0}});
        void* m = nullptr;
        expect_error(cuModuleLoadData(&m, other.data()), NO_BINARY, {"the cubin is for sm_"});
        std::vector<unsigned char> not_elf(256, 'x');
        expect_error(cuModuleLoadData(&m, not_elf.data()), INVALID_IMAGE, {"not an ELF cubin"});
        auto host = make_cubin(g_arch, {TestKernel{"copy_u32", false, {}, 0}});
        host[18] = 62;  // EM_X86_64
        expect_error(cuModuleLoadData(&m, host.data()), INVALID_IMAGE, {"e_machine 62"});
        void* good = module_of({TestKernel{"copy_u32", false, {}, 0}, TestKernel{"not_compiled_anywhere", false, {}, 0}});
        void* f = nullptr;
        expect_error(cuModuleGetFunction(&f, good, "trap_if"), NOT_FOUND, {"no entry point named trap_if"});
        expect_error(cuModuleGetFunction(&f, good, "not_compiled_anywhere"), NOT_FOUND,
                     {"not_compiled_anywhere", "no host-compiled kernel"});
    };
    c["oob_read_past_end"] = [] {
        void* f = fn("read_at");
        CUdeviceptr x = upload(std::vector<float>(100, 1.0f)), out = alloc(101 * 4);
        Args ok;
        ok.ptr(x).u(0).u(100).ptr(out);
        CHECK(launch(f, 1, 128, ok) == 0, "in bounds: %s", plumblineEmuLastError());
        Args a;
        a.ptr(x).u(0).u(101).ptr(out);  // one float past the end
        expect_error(launch(f, 1, 128, a), ILLEGAL_ADDRESS,
                     {"read_at", "invalid memory access", "0 bytes past the end of allocation", "400 bytes"});
    };
    c["oob_write_before_start"] = [] {
        void* f = fn("write_at");
        CUdeviceptr x = alloc(100 * 4);
        Args a;
        a.ptr(x).u((uint64_t)-1).u(1);
        CHECK(launch(f, 1, 32, a) == 0, "a write in the same page cannot fault: %s", plumblineEmuLastError());
        expect_error(cuMemFree_v2(x), ILLEGAL_ADDRESS, {"written 4 bytes before its start"});
    };
    c["oob_far"] = [] {
        void* f = fn("read_at");
        // 4096 bytes start on a page: the float before the start is in the guard page.
        CUdeviceptr x = upload(std::vector<float>(1024, 1.0f)), out = alloc(4);
        Args a;
        a.ptr(x).u((uint64_t)-1).u(1).ptr(out);
        expect_error(launch(f, 1, 1, a), ILLEGAL_ADDRESS,
                     {"read_at", "4 bytes before allocation", "block (0,0,0) thread (0,0,0)"});
    };
    c["use_after_free"] = [] {
        void* f = fn("read_at");
        CUdeviceptr x = upload(std::vector<float>(64, 1.0f)), out = alloc(64 * 4);
        CHECK(cuMemFree_v2(x) == 0, "free");
        Args a;
        a.ptr(x).u(0).u(64).ptr(out);
        expect_error(launch(f, 1, 64, a), ILLEGAL_ADDRESS, {"read_at", "freed allocation", "use after free"});
        CUdeviceptr y = alloc(64 * 4);
        CHECK(y != x, "a freed address is not handed out again at once");
        expect_error(cuMemFree_v2(x), INVALID_VALUE, {"not a live allocation"});
    };
    c["null_pointer"] = [] {
        void* f = fn("write_at");
        Args a;
        a.ptr(0).u(0).u(1);
        expect_error(launch(f, 1, 1, a), ILLEGAL_ADDRESS, {"write_at", "invalid memory access at address"});
    };
    c["never_written_reads_nan"] = [] {
        void* f = fn("copy_u32");
        CUdeviceptr x = alloc(32 * 4), out = alloc(32 * 4);
        Args a;
        a.ptr(x).ptr(out).u(32);
        CHECK(launch(f, 1, 32, a) == 0, "%s", plumblineEmuLastError());
        for (uint32_t v : download<uint32_t>(out, 32)) CHECK(v == 0xffffffffu, "read %#x", v);
        float nan_check;
        uint32_t b = 0xffffffffu;
        memcpy(&nan_check, &b, 4);
        CHECK(std::isnan(nan_check), "the fill pattern is an f32 NaN");
        CHECK(cuMemsetD8_v2(x, 0, 32 * 4) == 0, "memset");
        CHECK(launch(f, 1, 32, a) == 0, "%s", plumblineEmuLastError());
        for (uint32_t v : download<uint32_t>(out, 32)) CHECK(v == 0, "after memset %#x", v);
    };
    c["copy_bounds"] = [] {
        CUdeviceptr x = alloc(16);
        std::vector<char> h(32);
        expect_error(cuMemcpyHtoD_v2(x, h.data(), 17), INVALID_VALUE, {"cuMemcpyHtoD", "not inside one live allocation"});
        expect_error(cuMemcpyDtoH_v2(h.data(), x + 8, 9), INVALID_VALUE, {"cuMemcpyDtoH", "not inside one live allocation"});
        expect_error(cuMemsetD8_v2(x - 1, 0, 2), INVALID_VALUE, {"cuMemsetD8"});
    };
    c["trap"] = [] {
        void* f = fn("trap_if");
        Args a;
        a.u(1);
        expect_error(launch(f, 2, 32, a), ASSERT, {"trap_if", "__trap", "thread (3,0,0)"});
        Args b;
        b.u(0);
        CHECK(launch(f, 2, 32, b) == 0, "no trap: %s", plumblineEmuLastError());
    };
    c["division_by_zero"] = [] {
        void* f = fn("int_div");
        CUdeviceptr out = alloc(4 * 4);
        Args a;
        a.ptr(out).u(0);
        expect_error(launch(f, 1, 4, a), LAUNCH_FAILED, {"int_div", "integer division by zero"});
    };
    c["stack_overflow"] = [] {
        void* f = fn("stack_overflow");
        CUdeviceptr out = alloc(4);
        Args a;
        a.ptr(out);
        expect_error(launch(f, 1, 1, a), ILLEGAL_ADDRESS, {"stack_overflow", "invalid memory access", "stack overflow"});
        // The emulator goes on working after a fault.
        void* g = fn("copy_u32");
        CUdeviceptr y = alloc(4);
        Args b;
        b.ptr(out).ptr(y).u(1);
        CHECK(launch(g, 1, 32, b) == 0, "after the fault: %s", plumblineEmuLastError());
    };

    c["shuffled_order_reveals_a_race"] = [] {
        // Needs PLUMBLINE_CUDA_EMU_SHUFFLE (the Rust test and `emu_selftest all` set it).
        CHECK(getenv("PLUMBLINE_CUDA_EMU_SHUFFLE"), "run with PLUMBLINE_CUDA_EMU_SHUFFLE=SEED");
        void* f = fn("racy_left_neighbour");
        CUdeviceptr out = alloc(256 * 4);
        unsigned stale_racy = 0, stale_synced = 0;
        for (uint32_t tag = 1; tag <= 8; tag++) {
            for (uint32_t sync = 0; sync < 2; sync++) {
                Args a;
                a.ptr(out).u(tag).u(sync);
                CHECK(launch(f, 1, 256, a) == 0, "%s", plumblineEmuLastError());
                for (uint32_t v : download<uint32_t>(out, 256))
                    if (v != tag) (sync ? stale_synced : stale_racy)++;
            }
        }
        CHECK(stale_synced == 0, "with the barrier every read is fresh: %u stale", stale_synced);
        CHECK(stale_racy > 0, "a random order shows the missing barrier");
    };

    // ---- correctness of the prelude ----------------------------------------------------------
    c["shuffles"] = [] {
        void* f = fn("shuffles");
        CUdeviceptr out = alloc(64 * 8 * 4);
        Args a;
        a.ptr(out);
        CHECK(launch(f, 1, 64, a) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint32_t>(out, 64 * 8);
        for (uint32_t t = 0; t < 64; t++) {
            uint32_t l = t % 32, w = t - l;
            auto val = [&](uint32_t lane) { return 100 * (w + lane); };
            uint32_t* o = &v[8 * t];
            CHECK(o[0] == val(l ^ 5), "xor t=%u: %u", t, o[0]);
            CHECK(o[1] == (l % 16 + 3 < 16 ? val(l + 3) : val(l)), "down t=%u: %u", t, o[1]);
            CHECK(o[2] == (l % 8 >= 2 ? val(l - 2) : val(l)), "up t=%u: %u", t, o[2]);
            CHECK(o[3] == val((7 - (int)l) & 31), "idx t=%u: %u", t, o[3]);
            CHECK(o[4] == 0xaaaaaaaau, "ballot t=%u: %#x", t, o[4]);
            CHECK(o[5] == 1 && o[6] == 1 && o[7] == 0, "votes t=%u: %u %u %u", t, o[5], o[6], o[7]);
        }
    };
    c["warp_sums"] = [] {
        void* f = fn("warp_sums");
        CUdeviceptr d = alloc(64 * 8), fl = alloc(64 * 4);
        Args a;
        a.ptr(d).ptr(fl);
        CHECK(launch(f, 1, 64, a) == 0, "%s", plumblineEmuLastError());
        auto dv = download<double>(d, 64);
        auto fv = download<float>(fl, 64);
        for (int t = 0; t < 64; t++) {
            double e = t < 32 ? 496.0 + 16.0 : 1520.0 + 16.0;  // Σ lanes (+0.5 each)
            CHECK(dv[t] == e, "double sum t=%d: %f", t, dv[t]);
            CHECK(fv[t] == (float)(t < 32 ? 496 : 1520), "float sum t=%d: %f", t, fv[t]);
        }
    };
    c["block_mirror"] = [] {
        void* f = fn("block_mirror");
        const unsigned bx = 16, by = 8, bz = 8, n = bx * by * bz, blocks = 5;
        CUdeviceptr out = alloc(blocks * n * 4), sum = alloc(blocks * 4);
        Args a;
        a.ptr(out).ptr(sum);
        CHECK(launch(f, blocks, bx, a, 0, 1, 1, by, bz) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint32_t>(out, blocks * n);
        auto s = download<uint32_t>(sum, blocks);
        for (unsigned b = 0; b < blocks; b++) {
            for (unsigned t = 0; t < n; t++)
                CHECK(v[b * n + t] == n - 1 - t + 1000 * b, "block %u thread %u: %u", b, t, v[b * n + t]);
            CHECK(s[b] == n * (n - 1) / 2 + 1000 * b * n, "sum of block %u: %u", b, s[b]);
        }
    };
    c["indices"] = [] {
        void* f = fn("indices");
        const unsigned gx = 3, gy = 2, gz = 2, bx = 5, by = 3, bz = 2, n = bx * by * bz;
        CUdeviceptr out = alloc(gx * gy * gz * n * 4);
        Args a;
        a.ptr(out);
        CHECK(launch(f, gx, bx, a, 0, gy, gz, by, bz) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint32_t>(out, gx * gy * gz * n);
        for (unsigned b = 0; b < gx * gy * gz; b++)
            for (unsigned t = 0; t < n; t++) {
                uint32_t e = (t % bx) | ((t / bx % by) << 8) | ((t / (bx * by)) << 16) | ((b % gx) << 24);
                CHECK(v[b * n + t] == e, "block %u thread %u: %#x, expected %#x", b, t, v[b * n + t], e);
            }
    };
    c["atomics"] = [] {
        void* f = fn("atomic_count");
        CUdeviceptr cnt = alloc(4), fs = alloc(4);
        cuMemsetD8_v2(cnt, 0, 4);
        cuMemsetD8_v2(fs, 0, 4);
        Args a;
        a.ptr(cnt).ptr(fs);
        CHECK(launch(f, 1000, 64, a) == 0, "%s", plumblineEmuLastError());
        CHECK(download<uint32_t>(cnt, 1)[0] == 64000, "count");
        CHECK(download<float>(fs, 1)[0] == 64000.0f, "float sum (exact below 2^24)");
    };
    c["param_widths"] = [] {
        void* f = fn("param_widths");
        CUdeviceptr out = alloc(5 * 8);
        Args a;
        a.ptr(out).u(0x0123456789abcdefull).u(0xfedcba98u).f(-1.5f).d(3.25).u(0xffffffff00000007ull);
        CHECK(launch(f, 1, 1, a) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint64_t>(out, 5);
        double d = 3.25;
        uint64_t db;
        memcpy(&db, &d, 8);
        float fl = -1.5f;
        uint32_t fb;
        memcpy(&fb, &fl, 4);
        CHECK(v[0] == 0x0123456789abcdefull && v[1] == 0xfedcba98u && v[2] == fb && v[3] == db,
              "values %llx %llx %llx %llx", (unsigned long long)v[0], (unsigned long long)v[1],
              (unsigned long long)v[2], (unsigned long long)v[3]);
        // A 4-byte parameter reads the low half of the engine's 8-byte value.
        CHECK(v[4] == 7, "a u32 from an 8-byte value: %llx", (unsigned long long)v[4]);
    };
    c["f16_to_f32_exhaustive"] = [] {
        // Reference: the CPU's F16C conversion (hardware, independent of the prelude's code).
        // Two values written down as well: a signalling NaN is quieted, a subnormal exact.
        CHECK(__builtin_cpu_supports("f16c"), "this test needs F16C");
        std::vector<uint16_t> h(65536);
        for (unsigned i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        void* f = fn("f16_to_f32_all");
        CUdeviceptr hd = upload(h), fd = alloc(65536 * 4);
        Args a;
        a.ptr(hd).ptr(fd).u(65536);
        CHECK(launch(f, 256, 256, a) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint32_t>(fd, 65536);
        CHECK(v[0x7c01] == 0x7fc02000u, "sNaN 0x7c01: %#010x", v[0x7c01]);
        CHECK(v[0x8001] == 0xb3800000u, "-2^-24: %#010x", v[0x8001]);
        for (unsigned i = 0; i < 65536; i++) {
            float e = _cvtsh_ss((unsigned short)i);
            uint32_t eb;
            memcpy(&eb, &e, 4);
            // Bit for bit, NaNs included (quieted, payload kept: F16C and half::f16::to_f32 agree).
            CHECK(v[i] == eb, "f16 %#06x: %#010x, expected %#010x", i, v[i], eb);
        }
    };
    c["f32_to_f16_edges"] = [] {
        CHECK(__builtin_cpu_supports("f16c"), "this test needs F16C");
        // Values with known answers (IEEE 754 binary16, round to nearest even), then a sweep.
        struct E { uint32_t f; uint16_t h; };
        std::vector<E> known = {
            {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3f800000, 0x3c00}, {0xbf800000, 0xbc00},
            {0x477fe000, 0x7bff},  // 65504, the largest f16
            {0x477fefff, 0x7bff},  // just below the midpoint to 65536: 65504
            {0x477ff000, 0x7c00},  // 65520 = midpoint, ties to even: inf
            {0x7f800000, 0x7c00}, {0xff800000, 0xfc00},
            {0x7fc00000, 0x7e00}, {0xffc00000, 0xfe00}, {0x7f800001, 0x7e00},  // NaN stays NaN, quiet
            {0x7fa00000, 0x7f00},  // NaN payload: top bits kept
            {0x33800000, 0x0001},  // 2^-24, the smallest subnormal
            {0x33000000, 0x0000},  // 2^-25: tie between 0 and 2^-24, to even (0)
            {0x33000001, 0x0001},  // just above the tie
            {0x33c00000, 0x0002},  // 1.5·2^-24: tie between 1 and 2 ulps, to even (2)
            {0x38800000, 0x0400},  // 2^-14, the smallest normal
            {0x387fc000, 0x03ff},  // the largest subnormal
            {0x387fe000, 0x0400},  // tie between the largest subnormal and 2^-14: even (0x400)
            {0x3f801000, 0x3c00},  // 1 + 2^-11: tie, to even (1.0)
            {0x3f803000, 0x3c02},  // 1 + 3·2^-11: tie, to even (1 + 2^-9)
            {0x00000001, 0x0000},  // an f32 subnormal
        };
        std::vector<float> in;
        for (auto& k : known) {
            float x;
            memcpy(&x, &k.f, 4);
            in.push_back(x);
        }
        // Around every f16 value: each boundary and its f32 neighbours.
        for (uint32_t h = 0; h < 0x7c00; h++) {
            float x = _cvtsh_ss((unsigned short)h);
            uint32_t b;
            memcpy(&b, &x, 4);
            for (uint32_t d : {0x0u, 0xfffu, 0x1000u, 0x1001u}) {
                uint32_t y = b + d;
                float z;
                memcpy(&z, &y, 4);
                in.push_back(z);
                in.push_back(-z);
            }
        }
        for (uint32_t i = 0; i < (1u << 20); i++) {  // a strided sweep of all bit patterns
            uint32_t y = i * 4099u;
            float z;
            memcpy(&z, &y, 4);
            in.push_back(z);
        }
        void* f = fn("f32_to_f16_all");
        uint32_t n = (uint32_t)in.size();
        CUdeviceptr fd = upload(in), hd = alloc(n * 2);
        Args a;
        a.ptr(fd).ptr(hd).u(n);
        CHECK(launch(f, (n + 255) / 256, 256, a) == 0, "%s", plumblineEmuLastError());
        auto v = download<uint16_t>(hd, n);
        for (size_t i = 0; i < known.size(); i++)
            CHECK(v[i] == known[i].h, "f32 %#010x: %#06x, expected %#06x", known[i].f, v[i], known[i].h);
        for (uint32_t i = 0; i < n; i++) {
            uint16_t e = _cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT);
            CHECK(v[i] == e, "f32 %a: %#06x, F16C says %#06x", in[i], v[i], e);
        }
    };
    return c;
}

// ---- benchmark ----------------------------------------------------------------------------

// The matrix-vector kernel of mmv.cu over a rows × k Q8_0 matrix (all blocks scale 1/64,
// values i % 7 - 3), activations q8_1 of ones; checks every output, prints seconds per launch.
static int bench_mmv(unsigned rows, unsigned k, int reps) {
    unsigned chunks = k / 32;
    size_t row_bytes = (size_t)chunks * 34;
    std::vector<unsigned char> w(rows * row_bytes);
    uint16_t d16 = _cvtss_sh(1.0f / 64, 0);
    for (size_t r = 0; r < rows; r++)
        for (unsigned c = 0; c < chunks; c++) {
            unsigned char* b = &w[r * row_bytes + c * 34];
            memcpy(b, &d16, 2);
            for (int i = 0; i < 32; i++) b[2 + i] = (unsigned char)(int8_t)(i % 7 - 3);
        }
    std::vector<unsigned char> x(chunks * 36);
    uint16_t one = _cvtss_sh(1.0f, 0), s = _cvtss_sh(32.0f, 0);
    for (unsigned c = 0; c < chunks; c++) {
        memcpy(&x[c * 36], &one, 2);
        memcpy(&x[c * 36 + 2], &s, 2);
        memset(&x[c * 36 + 4], 1, 32);
    }
    void* f = fn("mmv_q8_0");
    CUdeviceptr wd = upload(w), xd = upload(x), out = alloc(rows * 4);
    Args a;
    a.ptr(wd).u(row_bytes).u(0).u(1).ptr(xd).u(k).u(rows).u(1).ptr(0).u(1).u(0).ptr(out);
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        auto t0 = std::chrono::steady_clock::now();
        CUresult r = cuLaunchKernel(f, (rows + 3) / 4, 1, 1, 32, 4, 1, 0, nullptr, a.get(), nullptr);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r) {
            fprintf(stderr, "launch failed: %s\n", plumblineEmuLastError());
            return 1;
        }
        best = std::min(best, dt);
    }
    auto v = download<float>(out, rows);
    // Each row: Σ over its blocks of (1/64) · Σ_{i<32} (i % 7 − 3) · 1 (activations all 1, scale 1).
    double per_block = 0;
    for (int i = 0; i < 32; i++) per_block += (i % 7 - 3);
    float e = (float)(per_block / 64.0 * chunks);
    for (unsigned r = 0; r < rows; r++)
        if (std::fabs(v[r] - e) > 1e-3f) {
            fprintf(stderr, "row %u: %f, expected %f\n", r, v[r], e);
            return 1;
        }
    const char* sw = getenv("PLUMBLINE_CUDA_EMU_SWITCH");
    printf("mmv_q8_0 %u x %u: %.4f s per launch (best of %d; switch %s)\n", rows, k, best, reps,
           sw ? sw : "default");
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: emu_selftest list | all | CASE... | bench-mmv ROWS K REPS\n");
        return 2;
    }
    std::string cmd = argv[1];
    // `all` runs every case in a random thread order (results must not depend on it).
    if (cmd == "all" && !getenv("PLUMBLINE_CUDA_EMU_SHUFFLE")) setenv("PLUMBLINE_CUDA_EMU_SHUFFLE", "12345", 1);
    auto cs = cases();
    if (cmd == "list") {
        for (auto& kv : cs) printf("%s\n", kv.first.c_str());
        return 0;
    }
    load();
    // Violations only the --asan build (UBSan) sees: the process is expected to abort.
    if (cmd == "ubsan-misaligned") {
        void* f = fn("misaligned_load");
        CUdeviceptr p = alloc(256), out = alloc(32 * 4);
        cuMemsetD8_v2(p, 0, 256);
        Args a;
        a.ptr(p).ptr(out);
        CUresult r = launch(f, 1, 32, a);
        printf("launch returned %d\n", r);
        return 0;
    }
    if (cmd == "ubsan-shared-overflow") {
        void* f = fn("shared_overflow");
        CUdeviceptr out = alloc(64 * 4);
        Args a;
        a.ptr(out);
        CUresult r = launch(f, 1, 64, a);
        printf("launch returned %d\n", r);
        return 0;
    }
    // The prelude's f16 conversions through the kernels, written out for a comparison with the
    // half crate (kernels/tests/cuda_emu.rs): DIR/f16_to_f32.bin (the f32 bits of all 65536
    // f16 values), DIR/f32_in.bin and DIR/f32_to_f16.bin (f32 bit patterns and their f16).
    if (cmd == "dump-f16") {
        if (argc < 3) return 2;
        std::string dir = argv[2];
        std::vector<uint16_t> h(65536);
        for (unsigned i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        void* f = fn("f16_to_f32_all");
        CUdeviceptr hd = upload(h), fd = alloc(65536 * 4);
        Args a;
        a.ptr(hd).ptr(fd).u(65536);
        if (launch(f, 256, 256, a)) return 1;
        auto wide = download<uint32_t>(fd, 65536);
        std::vector<uint32_t> in;
        for (uint32_t i = 0; i < 65536; i++) {  // every f16 value and the f32s around it
            uint32_t b = wide[i];
            for (uint32_t d : {0x0u, 0xfffu, 0x1000u, 0x1001u, 0xffffffffu}) in.push_back(b + d);
        }
        for (uint32_t i = 0; i < (1u << 20); i++) in.push_back(i * 4099u);
        void* g = fn("f32_to_f16_all");
        uint32_t n = (uint32_t)in.size();
        CUdeviceptr id = upload(in), od = alloc(n * 2);
        Args b;
        b.ptr(id).ptr(od).u(n);
        if (launch(g, (n + 255) / 256, 256, b)) return 1;
        auto narrow = download<uint16_t>(od, n);
        auto write = [&](const char* name, const void* p, size_t bytes) {
            FILE* fp = fopen((dir + "/" + name).c_str(), "wb");
            if (!fp || fwrite(p, 1, bytes, fp) != bytes) die("cannot write the dump");
            fclose(fp);
        };
        write("f16_to_f32.bin", wide.data(), wide.size() * 4);
        write("f32_in.bin", in.data(), in.size() * 4);
        write("f32_to_f16.bin", narrow.data(), narrow.size() * 2);
        return 0;
    }
    if (cmd == "bench-mmv") {
        if (argc < 5) return 2;
        return bench_mmv((unsigned)atoi(argv[2]), (unsigned)atoi(argv[3]), atoi(argv[4]));
    }
    std::vector<std::string> run;
    if (cmd == "all")
        for (auto& kv : cs) run.push_back(kv.first);
    else
        for (int i = 1; i < argc; i++) run.push_back(argv[i]);
    int failed = 0;
    for (auto& name : run) {
        auto it = cs.find(name);
        if (it == cs.end()) {
            printf("FAIL %s: no such case\n", name.c_str());
            failed++;
            continue;
        }
        try {
            it->second();
            printf("ok %s\n", name.c_str());
        } catch (const Failure& f) {
            printf("FAIL %s: %s\n", name.c_str(), f.msg.c_str());
            failed++;
        }
        fflush(stdout);
    }
    return failed ? 1 : 0;
}
