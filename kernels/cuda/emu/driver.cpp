// plumbline CUDA emulator: the driver API (`libcuda.so.1`) on the CPU.
//
// Every call the engine makes, directly (engine/src/runtime/cuda/driver.rs) or through cudarc
// 0.19 (context, streams, memory, copies, modules, launches, error strings). Device memory is
// host memory: a device pointer is a host address, so kernels dereference it directly. Streams
// run in call order, synchronously.
//
// The checks (stricter than a GPU):
// - each allocation is its own mapping between inaccessible guard pages, its end against the
//   upper guard (aligned only to the largest power of two ≤ 256 dividing its size), so that an
//   access past the end faults at once; the bytes before its start hold a canary checked when
//   it is freed; new memory reads as 0xFF bytes (f32 NaN) until written;
// - freed memory is made inaccessible and its addresses are not reused for a long while;
// - copies and memsets must lie inside one live allocation;
// - a module must be a cubin (ELF, EM_CUDA) for the architecture the emulator reports; its
//   entry points are read from the symbol table, their parameter sizes from EIATTR_KPARAM_INFO
//   and their static shared memory from `.nv.shared.<name>`, and the host-compiled kernel of
//   the same name must have the same parameters;
// - launches are checked against the hardware limits of that architecture.
//
// A failure is returned by the call, printed to stderr, and kept: `cuGetErrorString` of that
// code and `plumblineEmuLastError()` give the message (kernel name, reason).

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "emu.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;

enum : int {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_IMAGE = 200,
    E_INVALID_CONTEXT = 201,
    E_NO_BINARY_FOR_GPU = 209,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_ILLEGAL_ADDRESS = 700,
    E_ASSERT = 710,
    E_LAUNCH_FAILED = 719,
    E_NOT_SUPPORTED = 801,
};

namespace plumbline_emu {

// ---- errors -------------------------------------------------------------------------------

static std::mutex err_mu;
static std::string last_error;  // the last failure's message
static int last_error_code = 0;
static std::map<int, const char*> detailed;  // code → "description: last message of that code"

static const char* describe_code(int code) {
    switch (code) {
        case 0: return "no error";
        case 1: return "invalid argument";
        case 2: return "out of memory";
        case 3: return "initialization error";
        case 100: return "no CUDA-capable device is detected";
        case 101: return "invalid device ordinal";
        case 200: return "device kernel image is invalid";
        case 201: return "invalid device context";
        case 209: return "no kernel image is available for execution on the device";
        case 300: return "device kernel image is invalid";
        case 400: return "invalid resource handle";
        case 500: return "named symbol not found";
        case 600: return "device not ready";
        case 700: return "an illegal memory access was encountered";
        case 701: return "too many resources requested for launch";
        case 710: return "device-side assert triggered";
        case 719: return "unspecified launch failure";
        case 801: return "operation not supported";
        case 999: return "unknown error";
        default: return nullptr;
    }
}

static const char* name_code(int code) {
    switch (code) {
        case 0: return "CUDA_SUCCESS";
        case 1: return "CUDA_ERROR_INVALID_VALUE";
        case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
        case 3: return "CUDA_ERROR_NOT_INITIALIZED";
        case 100: return "CUDA_ERROR_NO_DEVICE";
        case 101: return "CUDA_ERROR_INVALID_DEVICE";
        case 200: return "CUDA_ERROR_INVALID_IMAGE";
        case 201: return "CUDA_ERROR_INVALID_CONTEXT";
        case 209: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
        case 300: return "CUDA_ERROR_INVALID_SOURCE";
        case 400: return "CUDA_ERROR_INVALID_HANDLE";
        case 500: return "CUDA_ERROR_NOT_FOUND";
        case 600: return "CUDA_ERROR_NOT_READY";
        case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS";
        case 701: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
        case 710: return "CUDA_ERROR_ASSERT";
        case 719: return "CUDA_ERROR_LAUNCH_FAILED";
        case 801: return "CUDA_ERROR_NOT_SUPPORTED";
        case 999: return "CUDA_ERROR_UNKNOWN";
        default: return nullptr;
    }
}

static CUresult fail(int code, const char* f, ...) __attribute__((format(printf, 2, 3)));
static CUresult fail(int code, const char* f, ...) {
    char buf[4096];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    std::lock_guard<std::mutex> g(err_mu);
    last_error = buf;
    last_error_code = code;
    const char* d = describe_code(code);
    std::string full = std::string(d ? d : "error") + ": " + buf;
    // The strings handed out stay valid for the life of the process (a caller may keep them);
    // at most one is kept per code and message, so this grows only with distinct failures.
    static std::unordered_map<std::string, const char*> interned;
    auto it = interned.find(full);
    if (it == interned.end()) it = interned.emplace(full, strdup(full.c_str())).first;
    detailed[code] = it->second;
    if (!getenv("PLUMBLINE_CUDA_EMU_QUIET"))
        fprintf(stderr, "plumbline CUDA emulator: %s: %s\n", name_code(code) ? name_code(code) : "error", buf);
    return code;
}

// ---- the device ---------------------------------------------------------------------------

static int arch() {
    static const int a = [] {
        long v = env_long("PLUMBLINE_CUDA_EMU_ARCH", 90);
        switch (v) {
            case 80: case 86: case 87: case 89: case 90: case 100: case 103: case 110: case 120:
            case 121:
                return (int)v;
            default:
                fprintf(stderr,
                        "plumbline CUDA emulator: PLUMBLINE_CUDA_EMU_ARCH=%ld is not an "
                        "architecture it models; using 90\n",
                        v);
                return 90;
        }
    }();
    return a;
}

// Shared memory a block may use with the opt-in attribute (the per-block hardware maximum).
static unsigned smem_optin_max() {
    switch (arch()) {
        case 80: case 87: return 166912;                // 163 KiB
        case 86: case 89: case 120: case 121: return 101376;  // 99 KiB
        default: return 232448;                         // 227 KiB (sm_90, sm_100, sm_103, sm_110)
    }
}
static unsigned smem_per_sm() {
    switch (arch()) {
        case 80: case 87: return 167936;
        case 86: case 89: case 120: case 121: return 102400;
        default: return 233472;
    }
}
static const unsigned SMEM_DEFAULT = 48 * 1024;

static size_t memory_budget() {
    static const size_t b = [] {
        const char* v = getenv("PLUMBLINE_CUDA_EMU_MEMORY");
        if (v && *v) {
            char* end = nullptr;
            double x = strtod(v, &end);
            if (end != v && x > 0) {
                double mul = 1;
                if (*end == 'G' || *end == 'g') mul = 1024.0 * 1024 * 1024;
                if (*end == 'M' || *end == 'm') mul = 1024.0 * 1024;
                if (*end == 'K' || *end == 'k') mul = 1024.0;
                return (size_t)(x * mul);
            }
        }
        long pages = sysconf(_SC_PHYS_PAGES), ps = sysconf(_SC_PAGESIZE);
        return pages > 0 && ps > 0 ? (size_t)pages * (size_t)ps : (size_t)16 << 30;
    }();
    return b;
}

static bool initialized = false;
static int primary_refs = 0;
static thread_local CUcontext current_ctx = nullptr;
static char the_context;  // the primary context's handle is its address

// ---- memory -------------------------------------------------------------------------------

struct Alloc {
    uint64_t id;
    uintptr_t ptr;
    size_t size;
    char* map;        // the whole mapping (guard, data pages, guard)
    size_t map_size;
    bool freed;
};

static std::mutex mem_mu;
static std::map<uintptr_t, Alloc> allocs;        // live and recently freed, by start address
static std::deque<uintptr_t> quarantine;         // freed, oldest first
static size_t live_bytes = 0;
static size_t peak_bytes = 0;  // the high-water mark of live_bytes (plumblineEmuMemoryPeak)
static uint64_t next_id = 1;
static const size_t PAGE = 4096;
static const unsigned char CANARY = 0xA5;

static void describe_locked(uintptr_t addr, char* out, size_t n);

[[maybe_unused]] static size_t natural_alignment(size_t size) {
    size_t a = size & (~size + 1);  // lowest set bit
    return std::min<size_t>(a ? a : 256, 256);
}

static CUresult mem_alloc(CUdeviceptr* out, size_t size) {
    if (!out) return fail(E_INVALID_VALUE, "cuMemAlloc: null result pointer");
    if (size == 0) return fail(E_INVALID_VALUE, "cuMemAlloc: zero bytes requested");
    std::lock_guard<std::mutex> g(mem_mu);
    if (live_bytes + size > memory_budget()) {
        return fail(E_OUT_OF_MEMORY,
                    "cuMemAlloc of %zu bytes: %zu of the emulated device's %zu bytes are in use "
                    "(PLUMBLINE_CUDA_EMU_MEMORY sets the budget)",
                    size, live_bytes, memory_budget());
    }
#ifdef __SANITIZE_ADDRESS__
    // Under AddressSanitizer its redzones and quarantine check every access exactly.
    void* p = nullptr;  // exactly `size` bytes: ASan's redzone starts right after them
    if (posix_memalign(&p, 256, size) != 0) p = nullptr;
    if (!p) return fail(E_OUT_OF_MEMORY, "cuMemAlloc of %zu bytes: host allocation failed", size);
    memset(p, 0xff, size);
    Alloc a{next_id++, (uintptr_t)p, size, (char*)p, 0, false};
#else
    size_t align = natural_alignment(size);
    size_t span = (size + align - 1) / align * align;
    size_t data_pages = (span + PAGE - 1) / PAGE;
    size_t map_size = (data_pages + 2) * PAGE;
    void* m = mmap(nullptr, map_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return fail(E_OUT_OF_MEMORY, "cuMemAlloc of %zu bytes: mmap failed", size);
    char* data = (char*)m + PAGE;
    if (mprotect(data, data_pages * PAGE, PROT_READ | PROT_WRITE) != 0) {
        munmap(m, map_size);
        return fail(E_OUT_OF_MEMORY, "cuMemAlloc of %zu bytes: mprotect failed", size);
    }
    uintptr_t p = (uintptr_t)(data + data_pages * PAGE - span);
    memset(data, CANARY, p - (uintptr_t)data);
    memset((void*)p, 0xff, span);
    Alloc a{next_id++, p, size, (char*)m, map_size, false};
#endif
    allocs[a.ptr] = a;
    live_bytes += size;
    peak_bytes = std::max(peak_bytes, live_bytes);
    *out = a.ptr;
    return OK;
}

// The live allocation holding [p, p + n), or nullptr. Caller holds mem_mu.
static Alloc* find_live(uintptr_t p, size_t n) {
    auto it = allocs.upper_bound(p);
    if (it == allocs.begin()) return nullptr;
    --it;
    Alloc& a = it->second;
    if (a.freed || p < a.ptr || p + n > a.ptr + a.size || p + n < p) return nullptr;
    return &a;
}

// Caller holds mem_mu.
static std::string range_problem(uintptr_t p, size_t n) {
    char buf[512];
    describe_locked(p, buf, sizeof buf);
    char out[700];
    snprintf(out, sizeof out, "[%#lx, +%zu bytes) is not inside one live allocation (%s)",
             (unsigned long)p, n, buf);
    return out;
}

static CUresult mem_free(CUdeviceptr dptr) {
    std::lock_guard<std::mutex> g(mem_mu);
    auto it = allocs.find((uintptr_t)dptr);
    if (it == allocs.end() || it->second.freed) {
        char buf[512];
        describe_locked((uintptr_t)dptr, buf, sizeof buf);
        return fail(E_INVALID_VALUE, "cuMemFree of %#llx, which is not a live allocation (%s)",
                    dptr, buf);
    }
    Alloc& a = it->second;
    a.freed = true;
    live_bytes -= a.size;
#ifdef __SANITIZE_ADDRESS__
    free(a.map);
    return OK;
#else
    // An underflow write lands in the bytes below the start: they must still be the canary.
    char* data = a.map + PAGE;
    size_t below = a.ptr - (uintptr_t)data;
    size_t bad = below;
    for (size_t i = 0; i < below; i++)
        if ((unsigned char)data[i] != CANARY) {
            bad = i;
            break;
        }
    mprotect(a.map, a.map_size, PROT_NONE);
    madvise(a.map, a.map_size, MADV_DONTNEED);
    quarantine.push_back(a.ptr);
    while (quarantine.size() > 4096) {
        auto q = allocs.find(quarantine.front());
        quarantine.pop_front();
        if (q != allocs.end()) {
            munmap(q->second.map, q->second.map_size);
            allocs.erase(q);
        }
    }
    if (bad != below) {
        return fail(E_ILLEGAL_ADDRESS,
                    "allocation #%llu (%#lx, %zu bytes) was written %zu bytes before its start "
                    "(found when it was freed): an out-of-bounds write by an earlier kernel",
                    (unsigned long long)a.id, (unsigned long)a.ptr, a.size, below - bad);
    }
    return OK;
#endif
}

// Caller holds mem_mu.
static void describe_locked(uintptr_t addr, char* out, size_t n) {
    // The allocation whose mapping (guard pages included) holds the address, else the nearest.
    for (auto& kv : allocs) {
        const Alloc& a = kv.second;
        if (a.map_size && addr >= (uintptr_t)a.map && addr < (uintptr_t)a.map + a.map_size) {
            const char* st = a.freed ? "freed " : "";
            if (addr >= a.ptr && addr < a.ptr + a.size)
                snprintf(out, n, "%zu bytes into %sallocation #%llu (%#lx, %zu bytes)%s",
                         (size_t)(addr - a.ptr), st, (unsigned long long)a.id, (unsigned long)a.ptr,
                         a.size, a.freed ? ": use after free" : "");
            else if (addr < a.ptr)
                snprintf(out, n, "%zu bytes before %sallocation #%llu (%#lx, %zu bytes)",
                         (size_t)(a.ptr - addr), st, (unsigned long long)a.id, (unsigned long)a.ptr,
                         a.size);
            else
                snprintf(out, n, "%zu bytes past the end of %sallocation #%llu (%#lx, %zu bytes)",
                         (size_t)(addr - a.ptr - a.size), st, (unsigned long long)a.id,
                         (unsigned long)a.ptr, a.size);
            return;
        }
    }
    const Alloc* best = nullptr;
    uintptr_t best_d = ~(uintptr_t)0;
    for (auto& kv : allocs) {
        const Alloc& a = kv.second;
        uintptr_t d = addr < a.ptr ? a.ptr - addr : addr >= a.ptr + a.size ? addr - (a.ptr + a.size) + 1 : 0;
        if (d < best_d || (d == best_d && best && best->freed && !a.freed)) {
            best = &a;
            best_d = d;
        }
    }
    if (addr < 65536) {
        snprintf(out, n, "a null pointer (plus %zu)", (size_t)addr);
        return;
    }
    if (!best) {
        snprintf(out, n, "no device allocation exists");
        return;
    }
    if (best_d > ((uintptr_t)1 << 20)) {
        snprintf(out, n, "not near any device allocation (the nearest, #%llu, is %zu MiB away)",
                 (unsigned long long)best->id, (size_t)(best_d >> 20));
        return;
    }
    const char* st = best->freed ? "freed " : "";
    if (best_d == 0) {
        snprintf(out, n, "%zu bytes into %sallocation #%llu (%#lx, %zu bytes)%s",
                 (size_t)(addr - best->ptr), st, (unsigned long long)best->id,
                 (unsigned long)best->ptr, best->size, best->freed ? ": use after free" : "");
    } else if (addr < best->ptr) {
        snprintf(out, n, "%zu bytes before %sallocation #%llu (%#lx, %zu bytes)", (size_t)best_d, st,
                 (unsigned long long)best->id, (unsigned long)best->ptr, best->size);
    } else {
        snprintf(out, n, "%zu bytes past the end of %sallocation #%llu (%#lx, %zu bytes)",
                 (size_t)best_d - 1, st, (unsigned long long)best->id, (unsigned long)best->ptr,
                 best->size);
    }
}

void describe_address(uintptr_t addr, char* out, size_t n) {
    // Called from the fault handler too: best effort if the lock is held.
    std::unique_lock<std::mutex> g(mem_mu, std::try_to_lock);
    if (!g.owns_lock()) {
        snprintf(out, n, "allocation registry busy");
        return;
    }
    describe_locked(addr, out, n);
}

static CUresult check_range(const char* op, CUdeviceptr p, size_t n) {
    if (n == 0) return OK;
    std::lock_guard<std::mutex> g(mem_mu);
    if (!find_live((uintptr_t)p, n))
        return fail(E_INVALID_VALUE, "%s: %s", op, range_problem((uintptr_t)p, n).c_str());
    return OK;
}

// ---- modules ------------------------------------------------------------------------------

struct Function {
    std::string name;
    const KernelEntry* entry;
    std::vector<unsigned> cubin_params;  // from EIATTR_KPARAM_INFO, in ordinal order
    bool cubin_params_known;
    unsigned static_shared;
    unsigned max_dynamic_shared;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
};

struct Module {
    std::map<std::string, std::unique_ptr<Function>> functions;
};

static std::mutex reg_mu;
static std::map<std::string, const KernelEntry*>& registry() {
    static auto* r = new std::map<std::string, const KernelEntry*>();
    return *r;
}

static std::mutex mod_mu;
static std::map<Module*, std::unique_ptr<Module>> modules;

struct ElfView {
    const unsigned char* b;
    size_t n;
    template <typename T>
    bool rd(size_t off, T* v) const {
        if (off + sizeof(T) > n || off + sizeof(T) < off) return false;
        memcpy(v, b + off, sizeof(T));
        return true;
    }
};

// Parses a cubin: its architecture, entry points, parameter sizes and static shared memory.
static CUresult parse_cubin(const void* image, Module* m) {
    const unsigned char* b = (const unsigned char*)image;
    if (!b) return fail(E_INVALID_VALUE, "cuModuleLoadData: null image");
    if (memcmp(b, "\x7f" "ELF", 4) != 0) {
        if (memcmp(b, "//", 2) == 0 || memcmp(b, ".version", 8) == 0)
            return fail(E_INVALID_IMAGE,
                        "cuModuleLoadData: the image is PTX text; the emulator loads cubins "
                        "(the engine compiles kernels to cubins with NVRTC)");
        return fail(E_INVALID_IMAGE, "cuModuleLoadData: the image is not an ELF cubin");
    }
    // The ELF header holds the section table's place; its size is the end of that table.
    uint64_t shoff;
    uint16_t shentsize, shnum, shstrndx, machine;
    memcpy(&shoff, b + 0x28, 8);
    memcpy(&shentsize, b + 0x3a, 2);
    memcpy(&shnum, b + 0x3c, 2);
    memcpy(&shstrndx, b + 0x3e, 2);
    memcpy(&machine, b + 18, 2);
    if (b[4] != 2 || b[5] != 1)
        return fail(E_INVALID_IMAGE, "cuModuleLoadData: not a 64-bit little-endian ELF");
    if (machine != 190)
        return fail(E_INVALID_IMAGE,
                    "cuModuleLoadData: ELF e_machine %u, expected 190 (EM_CUDA): not a cubin",
                    machine);
    uint32_t flags;
    memcpy(&flags, b + 48, 4);
    int cubin_arch = b[8] == 7 ? (int)(flags & 0xff) : b[8] == 8 ? (int)((flags >> 8) & 0xff) : -1;
    if (cubin_arch < 0)
        return fail(E_INVALID_IMAGE, "cuModuleLoadData: unknown CUDA ELF ABI version %u", b[8]);
    if (cubin_arch != arch())
        return fail(E_NO_BINARY_FOR_GPU,
                    "cuModuleLoadData: the cubin is for sm_%d, the emulated device is sm_%d "
                    "(PLUMBLINE_CUDA_EMU_ARCH)",
                    cubin_arch, arch());
    if (shentsize != 64) return fail(E_INVALID_IMAGE, "cuModuleLoadData: section headers of %u bytes", shentsize);
    ElfView v{b, (size_t)(shoff + (uint64_t)shnum * 64)};
    struct Sec {
        uint32_t name, type;
        uint64_t off, size;
        uint32_t link, info;
    };
    std::vector<Sec> secs(shnum);
    for (unsigned i = 0; i < shnum; i++) {
        size_t h = shoff + (size_t)i * 64;
        Sec& s = secs[i];
        if (!v.rd(h, &s.name) || !v.rd(h + 4, &s.type) || !v.rd(h + 24, &s.off) ||
            !v.rd(h + 32, &s.size) || !v.rd(h + 40, &s.link) || !v.rd(h + 44, &s.info))
            return fail(E_INVALID_IMAGE, "cuModuleLoadData: truncated section table");
    }
    if (shstrndx >= shnum) return fail(E_INVALID_IMAGE, "cuModuleLoadData: bad e_shstrndx");
    // Section contents precede the section table (as NVRTC writes them): bound reads by it.
    size_t limit = shoff;
    auto str = [&](const Sec& tab, uint32_t off) -> std::string {
        if (tab.off + off >= limit) return "";
        const char* s = (const char*)b + tab.off + off;
        size_t maxn = limit - (tab.off + off);
        return std::string(s, strnlen(s, maxn));
    };
    const Sec& shs = secs[shstrndx];
    std::map<std::string, unsigned> shared_size;
    std::map<std::string, std::vector<std::pair<unsigned, unsigned>>> kparams;  // ordinal, size
    std::map<std::string, bool> has_info;
    bool has_reserved_smem = false;
    std::vector<std::string> entries;
    for (unsigned i = 0; i < shnum; i++) {
        const Sec& s = secs[i];
        std::string nm = str(shs, s.name);
        if (nm == ".nv.shared.reserved.0") has_reserved_smem = true;
        if (nm.rfind(".nv.shared.", 0) == 0 && nm != ".nv.shared.reserved.0")
            shared_size[nm.substr(11)] = (unsigned)s.size;
        if (nm.rfind(".nv.info.", 0) == 0) {
            std::string fn = nm.substr(9);
            has_info[fn] = true;
            auto& ps = kparams[fn];
            if (s.off + s.size > limit) return fail(E_INVALID_IMAGE, "cuModuleLoadData: truncated %s", nm.c_str());
            size_t p = s.off, end = s.off + s.size;
            while (p + 2 <= end) {
                unsigned fmt = b[p], attr = b[p + 1];
                if (fmt == 4) {  // EIFMT_SVAL: u16 size, then the value
                    uint16_t sz;
                    if (!v.rd(p + 2, &sz) || p + 4 + sz > end) break;
                    if (attr == 0x17 && sz >= 12) {  // EIATTR_KPARAM_INFO
                        uint16_t ordinal = 0;
                        uint32_t word = 0;
                        v.rd(p + 8, &ordinal);
                        v.rd(p + 12, &word);
                        ps.push_back({ordinal, (word >> 18) & 0x3fff});
                    }
                    p += 4 + sz;
                } else if (fmt == 3 || fmt == 2) {  // EIFMT_HVAL, EIFMT_BVAL: a 2-byte value
                    p += 4;
                } else {  // EIFMT_NVAL
                    p += 2;
                }
            }
        }
        if (s.type == 2) {  // SHT_SYMTAB
            if (s.link >= shnum) return fail(E_INVALID_IMAGE, "cuModuleLoadData: bad symtab link");
            const Sec& strtab = secs[s.link];
            for (uint64_t o = 0; o + 24 <= s.size; o += 24) {
                uint32_t st_name;
                uint8_t st_info;
                uint16_t shndx;
                if (!v.rd(s.off + o, &st_name) || !v.rd(s.off + o + 4, &st_info) ||
                    !v.rd(s.off + o + 6, &shndx))
                    return fail(E_INVALID_IMAGE, "cuModuleLoadData: truncated symbol table");
                // Global functions defined in a `.text.<name>` section are the entry points.
                if ((st_info & 0xf) == 2 && (st_info >> 4) == 1 && shndx < shnum) {
                    std::string sym = str(strtab, st_name);
                    if (str(shs, secs[shndx].name) == ".text." + sym) entries.push_back(sym);
                }
            }
        }
    }
    if (entries.empty()) return fail(E_INVALID_IMAGE, "cuModuleLoadData: the cubin has no entry points");
    std::lock_guard<std::mutex> g(reg_mu);
    for (const std::string& e : entries) {
        auto f = std::make_unique<Function>();
        f->name = e;
        auto r = registry().find(e);
        f->entry = r == registry().end() ? nullptr : r->second;
        auto& ps = kparams[e];
        std::sort(ps.begin(), ps.end());
        f->cubin_params_known = has_info.count(e) > 0;
        for (size_t k = 0; k < ps.size(); k++) {
            if (ps[k].first != k) f->cubin_params_known = false;
            f->cubin_params.push_back(ps[k].second);
        }
        unsigned sh = shared_size.count(e) ? shared_size[e] : 0;
        // From sm_90 on, `.nv.shared.<kernel>` also covers the 1 KiB the system reserves.
        if (has_reserved_smem) sh = sh >= 1024 ? sh - 1024 : 0;
        f->static_shared = sh;
        f->max_dynamic_shared = sh < SMEM_DEFAULT ? SMEM_DEFAULT - sh : 0;
        m->functions[e] = std::move(f);
    }
    return OK;
}

static std::string sizes_text(const unsigned* s, size_t n) {
    std::string out = "(";
    for (size_t i = 0; i < n; i++) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + ")";
}

}  // namespace plumbline_emu

using namespace plumbline_emu;

EXPORT void plumblineEmuRegisterKernels(const KernelEntry* entries, size_t n) {
    std::lock_guard<std::mutex> g(reg_mu);
    for (size_t i = 0; i < n; i++) registry()[entries[i].name] = &entries[i];
}

EXPORT const char* plumblineEmuLastError(void) {
    std::lock_guard<std::mutex> g(err_mu);
    static thread_local std::string copy;
    copy = last_error;
    return copy.c_str();
}

// The most device memory in use at once (bytes) since the last reset; `reset` starts a new mark at
// the bytes in use now. Tests bound what an operation allocates with it.
EXPORT size_t plumblineEmuMemoryPeak(int reset) {
    std::lock_guard<std::mutex> g(mem_mu);
    if (reset) peak_bytes = live_bytes;
    return peak_bytes;
}

EXPORT int plumblineEmuLastErrorCode(void) {
    std::lock_guard<std::mutex> g(err_mu);
    return last_error_code;
}

// ---- initialization and devices ----------------------------------------------------------

EXPORT CUresult cuDriverGetVersion(int* v) {
    if (!v) return fail(E_INVALID_VALUE, "cuDriverGetVersion: null pointer");
    *v = 12090;
    return OK;
}

EXPORT CUresult cuInit(unsigned flags) {
    if (flags != 0) return fail(E_INVALID_VALUE, "cuInit: flags must be 0, found %u", flags);
    install_fault_handlers();
    initialized = true;
    return OK;
}

#define NEED_INIT(fn)                                                        \
    do {                                                                     \
        if (!initialized) return fail(E_NOT_INITIALIZED, fn ": cuInit was not called"); \
    } while (0)

EXPORT CUresult cuDeviceGetCount(int* n) {
    NEED_INIT("cuDeviceGetCount");
    if (!n) return fail(E_INVALID_VALUE, "cuDeviceGetCount: null pointer");
    *n = 1;
    return OK;
}

EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    NEED_INIT("cuDeviceGet");
    if (!d) return fail(E_INVALID_VALUE, "cuDeviceGet: null pointer");
    if (ordinal != 0) return fail(E_INVALID_DEVICE, "cuDeviceGet: ordinal %d (the emulator has one device, 0)", ordinal);
    *d = 0;
    return OK;
}

EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    NEED_INIT("cuDeviceGetName");
    if (!name || len <= 0) return fail(E_INVALID_VALUE, "cuDeviceGetName: bad buffer");
    if (d != 0) return fail(E_INVALID_DEVICE, "cuDeviceGetName: device %d", d);
    snprintf(name, (size_t)len, "plumbline CUDA emulator (CPU, sm_%d)", arch());
    return OK;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    NEED_INIT("cuDeviceTotalMem");
    if (!bytes) return fail(E_INVALID_VALUE, "cuDeviceTotalMem: null pointer");
    if (d != 0) return fail(E_INVALID_DEVICE, "cuDeviceTotalMem: device %d", d);
    *bytes = memory_budget();
    return OK;
}

EXPORT CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice d) {
    NEED_INIT("cuDeviceGetUuid");
    if (!uuid || d != 0) return fail(E_INVALID_VALUE, "cuDeviceGetUuid: bad argument");
    memcpy(uuid, "plumbline-emu-00", 16);
    return OK;
}

EXPORT CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

EXPORT CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    NEED_INIT("cuDeviceGetAttribute");
    if (!v) return fail(E_INVALID_VALUE, "cuDeviceGetAttribute: null pointer");
    if (d != 0) return fail(E_INVALID_DEVICE, "cuDeviceGetAttribute: device %d", d);
    int cores = (int)std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
    switch (attr) {
        case 1: *v = 1024; break;                  // MAX_THREADS_PER_BLOCK
        case 2: *v = 1024; break;                  // MAX_BLOCK_DIM_X
        case 3: *v = 1024; break;                  // MAX_BLOCK_DIM_Y
        case 4: *v = 64; break;                    // MAX_BLOCK_DIM_Z
        case 5: *v = 2147483647; break;            // MAX_GRID_DIM_X
        case 6: *v = 65535; break;                 // MAX_GRID_DIM_Y
        case 7: *v = 65535; break;                 // MAX_GRID_DIM_Z
        case 8: *v = (int)SMEM_DEFAULT; break;     // MAX_SHARED_MEMORY_PER_BLOCK
        case 9: *v = 65536; break;                 // TOTAL_CONSTANT_MEMORY
        case 10: *v = 32; break;                   // WARP_SIZE
        case 12: *v = 65536; break;                // MAX_REGISTERS_PER_BLOCK
        case 16: *v = cores; break;                // MULTIPROCESSOR_COUNT
        case 39: *v = 2048; break;                 // MAX_THREADS_PER_MULTIPROCESSOR
        case 41: *v = 1; break;                    // UNIFIED_ADDRESSING
        case 75: *v = arch() / 10; break;          // COMPUTE_CAPABILITY_MAJOR
        case 76: *v = arch() % 10; break;          // COMPUTE_CAPABILITY_MINOR
        case 81: *v = (int)smem_per_sm(); break;   // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        case 82: *v = 65536; break;                // MAX_REGISTERS_PER_MULTIPROCESSOR
        case 97: *v = (int)smem_optin_max(); break;  // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        case 115: *v = 1; break;                   // MEMORY_POOLS_SUPPORTED
        default: *v = 0; break;                    // features the emulator does not model
    }
    return OK;
}

// ---- contexts -----------------------------------------------------------------------------

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    NEED_INIT("cuDevicePrimaryCtxRetain");
    if (!ctx) return fail(E_INVALID_VALUE, "cuDevicePrimaryCtxRetain: null pointer");
    if (d != 0) return fail(E_INVALID_DEVICE, "cuDevicePrimaryCtxRetain: device %d", d);
    primary_refs++;
    *ctx = &the_context;
    return OK;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d != 0) return fail(E_INVALID_DEVICE, "cuDevicePrimaryCtxRelease: device %d", d);
    if (primary_refs <= 0) return fail(E_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease: not retained");
    primary_refs--;
    return OK;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
    NEED_INIT("cuCtxGetCurrent");
    if (!ctx) return fail(E_INVALID_VALUE, "cuCtxGetCurrent: null pointer");
    *ctx = current_ctx;
    return OK;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED_INIT("cuCtxSetCurrent");
    if (ctx && ctx != &the_context) return fail(E_INVALID_CONTEXT, "cuCtxSetCurrent: unknown context %p", ctx);
    current_ctx = ctx;
    return OK;
}

EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
    if (!d) return fail(E_INVALID_VALUE, "cuCtxGetDevice: null pointer");
    if (!current_ctx) return fail(E_INVALID_CONTEXT, "cuCtxGetDevice: no current context");
    *d = 0;
    return OK;
}

#define NEED_CTX(fn)                                                                          \
    do {                                                                                      \
        if (!initialized) return fail(E_NOT_INITIALIZED, fn ": cuInit was not called");       \
        if (!current_ctx) return fail(E_INVALID_CONTEXT, fn ": no current context on this thread"); \
    } while (0)

EXPORT CUresult cuCtxSynchronize(void) {
    NEED_CTX("cuCtxSynchronize");
    return OK;  // every operation completed before its call returned
}

// ---- streams and events (the default stream is all the engine uses; all run in order) ----

static char stream_tag, event_tag;

EXPORT CUresult cuStreamCreate(CUstream* s, unsigned) {
    NEED_CTX("cuStreamCreate");
    if (!s) return fail(E_INVALID_VALUE, "cuStreamCreate: null pointer");
    *s = &stream_tag;
    return OK;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream) { return OK; }
EXPORT CUresult cuStreamSynchronize(CUstream) {
    NEED_CTX("cuStreamSynchronize");
    return OK;
}
EXPORT CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned) { return OK; }
EXPORT CUresult cuEventCreate(CUevent* e, unsigned) {
    NEED_CTX("cuEventCreate");
    if (!e) return fail(E_INVALID_VALUE, "cuEventCreate: null pointer");
    *e = &event_tag;
    return OK;
}
EXPORT CUresult cuEventDestroy_v2(CUevent) { return OK; }
EXPORT CUresult cuEventRecord(CUevent, CUstream) { return OK; }
EXPORT CUresult cuEventSynchronize(CUevent) { return OK; }
EXPORT CUresult cuEventQuery(CUevent) { return OK; }
EXPORT CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) {
    if (!ms) return fail(E_INVALID_VALUE, "cuEventElapsedTime: null pointer");
    *ms = 0.0f;  // no timing model
    return OK;
}

// ---- memory -------------------------------------------------------------------------------

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    NEED_CTX("cuMemAlloc");
    return mem_alloc(p, n);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) {
    NEED_CTX("cuMemAllocAsync");
    return mem_alloc(p, n);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    NEED_CTX("cuMemFree");
    return mem_free(p);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) {
    NEED_CTX("cuMemFreeAsync");
    return mem_free(p);
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total) {
    NEED_CTX("cuMemGetInfo");
    std::lock_guard<std::mutex> g(mem_mu);
    if (free_b) *free_b = memory_budget() - live_bytes;
    if (total) *total = memory_budget();
    return OK;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    NEED_CTX("cuMemsetD8");
    CUresult r = check_range("cuMemsetD8", p, n);
    if (r) return r;
    memset((void*)p, v, n);
    return OK;
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream) {
    return cuMemsetD8_v2(p, v, n);
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    NEED_CTX("cuMemcpyHtoD");
    CUresult r = check_range("cuMemcpyHtoD (destination)", dst, n);
    if (r) return r;
    if (n && !src) return fail(E_INVALID_VALUE, "cuMemcpyHtoD: null source");
    if (n) memcpy((void*)dst, src, n);
    return OK;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    NEED_CTX("cuMemcpyDtoH");
    CUresult r = check_range("cuMemcpyDtoH (source)", src, n);
    if (r) return r;
    if (n && !dst) return fail(E_INVALID_VALUE, "cuMemcpyDtoH: null destination");
    if (n) memcpy(dst, (const void*)src, n);
    return OK;
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX("cuMemcpyDtoD");
    CUresult r = check_range("cuMemcpyDtoD (source)", src, n);
    if (r) return r;
    r = check_range("cuMemcpyDtoD (destination)", dst, n);
    if (r) return r;
    if (n) memmove((void*)dst, (const void*)src, n);
    return OK;
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoD_v2(dst, src, n);
}

// ---- modules and functions ----------------------------------------------------------------

EXPORT CUresult cuModuleLoadData(CUmodule* out, const void* image) {
    NEED_CTX("cuModuleLoadData");
    if (!out) return fail(E_INVALID_VALUE, "cuModuleLoadData: null result pointer");
    auto m = std::make_unique<Module>();
    CUresult r = parse_cubin(image, m.get());
    if (r) return r;
    Module* raw = m.get();
    std::lock_guard<std::mutex> g(mod_mu);
    modules[raw] = std::move(m);
    *out = raw;
    return OK;
}

EXPORT CUresult cuModuleUnload(CUmodule mod) {
    std::lock_guard<std::mutex> g(mod_mu);
    auto it = modules.find((Module*)mod);
    if (it == modules.end()) return fail(E_INVALID_HANDLE, "cuModuleUnload: unknown module %p", mod);
    // Functions of an unloaded module must not be launched; keep them (rarely many) so that a
    // stale handle is reported rather than dereferenced freed memory.
    static std::vector<std::unique_ptr<Module>> unloaded;
    unloaded.push_back(std::move(it->second));
    modules.erase(it);
    return OK;
}

EXPORT CUresult cuModuleGetFunction(CUfunction* out, CUmodule mod, const char* name) {
    NEED_CTX("cuModuleGetFunction");
    if (!out || !name) return fail(E_INVALID_VALUE, "cuModuleGetFunction: null argument");
    std::lock_guard<std::mutex> g(mod_mu);
    auto it = modules.find((Module*)mod);
    if (it == modules.end()) return fail(E_INVALID_HANDLE, "cuModuleGetFunction(%s): unknown module %p", name, mod);
    auto f = it->second->functions.find(name);
    if (f == it->second->functions.end())
        return fail(E_NOT_FOUND, "cuModuleGetFunction: the cubin has no entry point named %s", name);
    Function* fn = f->second.get();
    if (!fn->entry) {
        std::lock_guard<std::mutex> g2(reg_mu);
        auto r = registry().find(name);
        if (r != registry().end()) fn->entry = r->second;
    }
    if (!fn->entry)
        return fail(E_NOT_FOUND,
                    "cuModuleGetFunction: %s is in the cubin but no host-compiled kernel of that "
                    "name is registered with the emulator (is its .cu file in the emulator build?)",
                    name);
    const KernelEntry* e = fn->entry;
    if (fn->cubin_params_known &&
        (fn->cubin_params.size() != e->n_params ||
         !std::equal(fn->cubin_params.begin(), fn->cubin_params.end(), e->param_sizes))) {
        return fail(E_INVALID_IMAGE,
                    "cuModuleGetFunction(%s): the cubin's parameters %s (EIATTR_KPARAM_INFO) "
                    "differ from the host-compiled kernel's %s: the two builds disagree on the "
                    "signature",
                    name, sizes_text(fn->cubin_params.data(), fn->cubin_params.size()).c_str(),
                    sizes_text(e->param_sizes, e->n_params).c_str());
    }
    *out = fn;
    return OK;
}

static Function* live_function(CUfunction f) {
    std::lock_guard<std::mutex> g(mod_mu);
    for (auto& m : modules)
        for (auto& kv : m.second->functions)
            if (kv.second.get() == f) return kv.second.get();
    return nullptr;
}

EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attr, int value) {
    Function* fn = live_function(f);
    if (!fn) return fail(E_INVALID_HANDLE, "cuFuncSetAttribute: unknown function %p", f);
    if (attr == 8) {  // MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (value < 0 || (unsigned)value + fn->static_shared > smem_optin_max())
            return fail(E_INVALID_VALUE,
                        "cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES, %d): with %u "
                        "bytes of static shared memory the sm_%d limit is %u",
                        fn->name.c_str(), value, fn->static_shared, arch(),
                        smem_optin_max() - fn->static_shared);
        fn->max_dynamic_shared = (unsigned)value;
        return OK;
    }
    return OK;  // carveout and cluster preferences change nothing here
}

EXPORT CUresult cuFuncGetAttribute(int* v, int attr, CUfunction f) {
    Function* fn = live_function(f);
    if (!fn || !v) return fail(E_INVALID_HANDLE, "cuFuncGetAttribute: unknown function %p", f);
    switch (attr) {
        case 0: *v = 1024; break;
        case 1: *v = (int)fn->static_shared; break;
        case 8: *v = (int)fn->max_dynamic_shared; break;
        default: *v = 0;
    }
    return OK;
}

EXPORT CUresult cuFuncGetParamInfo(CUfunction f, size_t index, size_t* offset, size_t* size) {
    Function* fn = live_function(f);
    if (!fn) return fail(E_INVALID_HANDLE, "cuFuncGetParamInfo: unknown function %p", f);
    const KernelEntry* e = fn->entry;
    if (!e || index >= e->n_params) return E_INVALID_VALUE;  // the documented end-of-list answer
    size_t off = 0;  // each parameter at the next multiple of its size, as the ABI places them
    for (size_t i = 0;; i++) {
        size_t sz = e->param_sizes[i];
        off = (off + sz - 1) / sz * sz;
        if (i == index) break;
        off += sz;
    }
    if (offset) *offset = off;
    if (size) *size = e->param_sizes[index];
    return OK;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shared, CUstream,
                               void** params, void** extra) {
    NEED_CTX("cuLaunchKernel");
    Function* fn = live_function(f);
    if (!fn) return fail(E_INVALID_HANDLE, "cuLaunchKernel: unknown function %p", f);
    const char* k = fn->name.c_str();
    if (extra) return fail(E_NOT_SUPPORTED, "%s: launch with `extra` (only kernelParams is supported)", k);
    if (!gx || !gy || !gz || !bx || !by || !bz)
        return fail(E_INVALID_VALUE, "%s: empty launch: grid (%u,%u,%u), block (%u,%u,%u)", k, gx, gy,
                    gz, bx, by, bz);
    uint64_t threads = (uint64_t)bx * by * bz;
    if (threads > 1024 || bx > 1024 || by > 1024 || bz > 64)
        return fail(E_INVALID_VALUE,
                    "%s: block (%u,%u,%u) = %llu threads is over the limits (1024 threads, "
                    "1024×1024×64)",
                    k, bx, by, bz, (unsigned long long)threads);
    if (gx > 2147483647u || gy > 65535 || gz > 65535)
        return fail(E_INVALID_VALUE, "%s: grid (%u,%u,%u) is over the limits (2^31-1, 65535, 65535)", k,
                    gx, gy, gz);
    if (shared > fn->max_dynamic_shared) {
        if (fn->max_dynamic_shared + fn->static_shared <= SMEM_DEFAULT &&
            shared + fn->static_shared <= smem_optin_max())
            return fail(E_INVALID_VALUE,
                        "%s: %u bytes of dynamic shared memory (+ %u static) are over the 48 KiB "
                        "a block gets without opting in (cuFuncSetAttribute "
                        "MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                        k, shared, fn->static_shared);
        return fail(E_INVALID_VALUE,
                    "%s: %u bytes of dynamic shared memory (+ %u static) are over the kernel's "
                    "limit of %u dynamic bytes (sm_%d allows %u per block)",
                    k, shared, fn->static_shared, fn->max_dynamic_shared, arch(), smem_optin_max());
    }
    const KernelEntry* e = fn->entry;
    if (e->n_params && !params)
        return fail(E_INVALID_VALUE, "%s: kernelParams is null but the kernel takes %u parameters", k,
                    e->n_params);
    for (unsigned i = 0; i < e->n_params; i++)
        if (!params[i])
            return fail(E_INVALID_VALUE, "%s: kernelParams[%u] is null", k, i);
    LaunchSpec spec{e, params, {gx, gy, gz}, {bx, by, bz}, shared};
    std::string err = run_launch(spec);
    if (!err.empty()) {
        int code = err.find("invalid memory access") != std::string::npos ? E_ILLEGAL_ADDRESS
                   : err.find("__trap") != std::string::npos            ? E_ASSERT
                                                                         : E_LAUNCH_FAILED;
        return fail(code, "kernel %s, grid (%u,%u,%u), block (%u,%u,%u): %s", k, gx, gy, gz, bx, by,
                    bz, err.c_str());
    }
    return OK;
}

// NVRTC opens the driver when one is loaded (by the soname libcuda.so.1, which finds the
// emulator) and asks it for private interfaces by UUID. The emulator has none: it says so, and
// NVRTC goes on without them (without this entry point it crashes).
EXPORT CUresult cuGetExportTable(const void** table, const void* /*uuid*/) {
    if (table) *table = nullptr;
    return E_NOT_SUPPORTED;
}

// ---- error strings ------------------------------------------------------------------------

EXPORT CUresult cuGetErrorName(int code, const char** out) {
    if (!out) return E_INVALID_VALUE;
    const char* n = name_code(code);
    if (!n) {
        *out = nullptr;
        return E_INVALID_VALUE;
    }
    *out = n;
    return OK;
}

EXPORT CUresult cuGetErrorString(int code, const char** out) {
    if (!out) return E_INVALID_VALUE;
    {
        std::lock_guard<std::mutex> g(err_mu);
        auto it = detailed.find(code);
        if (it != detailed.end()) {
            *out = it->second;
            return OK;
        }
    }
    const char* d = describe_code(code);
    if (!d) {
        *out = nullptr;
        return E_INVALID_VALUE;
    }
    *out = d;
    return OK;
}
