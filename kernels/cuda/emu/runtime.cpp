// plumbline CUDA emulator: the execution model.
//
// A launch is a grid of blocks spread over a pool of OS threads (`PLUMBLINE_CUDA_EMU_THREADS`,
// default: the available cores; the calling thread is one of them). A block runs on one OS
// thread with each of its threads as a fiber on its own stack. A fiber runs until it reaches a
// scheduling point (`__syncthreads`, a warp shuffle or vote) it cannot pass yet, then switches
// straight to the next fiber that can run; the fiber that completes a barrier or warp operation
// goes on without a switch, so a block costs one switch per fiber per point it waits at.
//
// The runtime is a checker: a barrier that some threads of the block never reach (they exited,
// or wait at another barrier or warp operation), a warp operation whose mask names exited or
// absent lanes or lanes that never arrive, and a fault in kernel code (an access outside every
// live allocation hits a guard page; see driver.cpp) fail the launch with the kernel, block,
// thread and reason.
//
// Context switches: a hand-written x86-64 switch (callee-saved registers and the stack
// pointer; no system call) by default on x86-64, glibc's ucontext (which saves the signal mask
// with a system call per switch) elsewhere or with `PLUMBLINE_CUDA_EMU_SWITCH=ucontext`.
// README.md has the measurements behind that choice.

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace plumbline_emu {

long env_long(const char* name, long fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    long x = strtol(v, &end, 10);
    if (end == v || x < 0) return fallback;
    return x;
}

// ---- context switching --------------------------------------------------------------------

#if defined(__x86_64__)
#define PLUMBLINE_EMU_HAVE_ASM_SWITCH 1
extern "C" void plumbline_emu_swap(void** save_sp, void* new_sp);
extern "C" void plumbline_emu_fiber_start();
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp,
// loads new_sp and pops the other context's registers. A new context's frame (see
// Fiber::reset_asm) "returns" into plumbline_emu_fiber_start, which calls r13(r12).
asm(R"(
    .text
    .globl plumbline_emu_swap
    .hidden plumbline_emu_swap
    .type plumbline_emu_swap,@function
plumbline_emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size plumbline_emu_swap, .-plumbline_emu_swap

    .globl plumbline_emu_fiber_start
    .hidden plumbline_emu_fiber_start
    .type plumbline_emu_fiber_start,@function
plumbline_emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size plumbline_emu_fiber_start, .-plumbline_emu_fiber_start
)");
#else
#define PLUMBLINE_EMU_HAVE_ASM_SWITCH 0
#endif

static bool read_switch_choice() {
    const char* v = getenv("PLUMBLINE_CUDA_EMU_SWITCH");
    if (!PLUMBLINE_EMU_HAVE_ASM_SWITCH) return true;
    return v && std::string(v) == "ucontext";
}
static const bool g_ucontext = read_switch_choice();
static inline bool use_ucontext() { return g_ucontext; }

enum State : uint8_t { READY, WAIT_BAR, WAIT_WARP, DONE };

struct Worker;

// Fiber stacks: every stack of every worker is one power-of-two slot of a single reserved arena,
// a guard page at the bottom of each, so that kernel code finds its fiber from the stack
// pointer alone (slot = (sp - arena) / slot size; no thread-local lookup on the hot path). The
// top of each stack is offset by a per-fiber amount: stacks aligned alike would put every
// fiber's saved registers in the same cache sets.
static size_t stack_bytes() {
    static const size_t s = [] {
        size_t want = (size_t)env_long("PLUMBLINE_CUDA_EMU_STACK_KB", 128) * 1024;
#ifdef __SANITIZE_ADDRESS__
        want *= 4;
#endif
        size_t p = 64 * 1024;
        while (p < want) p <<= 1;
        return p;
    }();
    return s;
}
static const size_t GUARD = 4096;
static const unsigned MAX_THREADS = 1024;
static const unsigned MAX_WORKERS = 256;

struct Fiber {
    ThreadInfo info{};
    Worker* worker = nullptr;
    void* sp = nullptr;         // asm switch: saved stack pointer
    ucontext_t* uc = nullptr;   // ucontext switch
    char* base = nullptr;       // the stack slot (guard page first)
    size_t color = 0;           // bytes left free at the top of the slot
    State state = READY;
    bool dirty = true;  // context must be (re)built before the next resume
    void* asan_fake = nullptr;  // AddressSanitizer's fake stack of this fiber while it is away
};

static char* g_arena = nullptr;
static Fiber** g_fiber_of_slot = nullptr;
static unsigned g_slot_shift = 0;
static std::atomic<unsigned> g_workers{0};

static void reserve_arena() {
    static std::once_flag once;
    std::call_once(once, [] {
        size_t s = stack_bytes();
        size_t slots = (size_t)MAX_WORKERS * MAX_THREADS;
        void* a = mmap(nullptr, slots * s + s, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        void* t = mmap(nullptr, slots * sizeof(Fiber*), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (a == MAP_FAILED || t == MAP_FAILED) {
            fprintf(stderr, "plumbline CUDA emulator: cannot reserve the fiber stack arena\n");
            abort();
        }
        g_arena = (char*)(((uintptr_t)a + s - 1) & ~(uintptr_t)(s - 1));
        g_fiber_of_slot = (Fiber**)t;
        while (((size_t)1 << g_slot_shift) < s) g_slot_shift++;
    });
}

static inline Fiber* fiber_of_stack() {
    uintptr_t sp;
#if defined(__x86_64__)
    asm volatile("movq %%rsp, %0" : "=r"(sp));
#else
    sp = (uintptr_t)__builtin_frame_address(0);
#endif
    return g_fiber_of_slot[(sp - (uintptr_t)g_arena) >> g_slot_shift];
}

struct WarpState {
    unsigned pending = 0;  // lanes arrived at the pending operation
    unsigned mask = 0;     // its mask (0: none pending)
    int op = -1;
    int width = 32;
    void* site = nullptr;
    unsigned done = 0;    // lanes that exited
    unsigned exists = 0;  // lanes that exist (a partial last warp has fewer)
    int arg[32];
    uint64_t value[32];
    uint64_t result[32];
};

struct LaunchState {
    const LaunchSpec* spec;
    uint64_t n_blocks;
    unsigned n_threads;
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string error;
    void fail(const std::string& e) {
        std::lock_guard<std::mutex> g(mu);
        if (error.empty()) error = e;
        failed.store(true);
    }
};

static void fiber_entry(Fiber* f);

struct Worker {
    Fiber fibers[MAX_THREADS];
    unsigned n_stacks = 0;  // fibers[0 .. n_stacks) have a stack
    BlockInfo block{};
    LaunchState* launch = nullptr;
    unsigned n = 0;  // threads in the block
    unsigned n_done = 0;
    unsigned bar_arrived = 0;
    void* bar_site = nullptr;
    std::vector<WarpState> warps;
    Fiber* cur = nullptr;
    void* main_sp = nullptr;
    ucontext_t main_uc{};
    std::string error;  // set by a failing fiber before it switches to the main context
    std::vector<char> dyn_shared;
    // Fault recovery.
    sigjmp_buf jb;
    volatile sig_atomic_t in_kernel = 0;
    char fault_msg[1024];
    uint64_t rng = 0;  // nonzero: randomized fiber order
    char* altstack = nullptr;
#ifdef __SANITIZE_ADDRESS__
    void* fake_stack = nullptr;
    const void* main_stack_bottom = nullptr;
    size_t main_stack_size = 0;
#endif

    unsigned index;

    Worker() {
        long seed = env_long("PLUMBLINE_CUDA_EMU_SHUFFLE", 0);
        if (seed) rng = (uint64_t)seed * 0x9E3779B97F4A7C15ull | 1;
        for (auto& f : fibers) f.worker = this;
        reserve_arena();
        index = g_workers.fetch_add(1);
        if (index >= MAX_WORKERS) {
            fprintf(stderr, "plumbline CUDA emulator: more than %u threads launched kernels\n", MAX_WORKERS);
            abort();
        }
    }

    // Stacks for fibers [0, n).
    void ensure_stacks(unsigned n) {
        size_t s = stack_bytes();
        while (n_stacks < n) {
            Fiber& f = fibers[n_stacks];
            size_t slot = (size_t)index * MAX_THREADS + n_stacks;
            char* b = g_arena + slot * s;
            if (mprotect(b + GUARD, s - GUARD, PROT_READ | PROT_WRITE) != 0) {
                fprintf(stderr, "plumbline CUDA emulator: cannot map a fiber stack\n");
                abort();
            }
            g_fiber_of_slot[slot] = &f;
            f.base = b;
            f.color = 64 + (n_stacks % 64) * 64 + ((n_stacks / 64) % 4) * 4096;
            f.dirty = true;
            n_stacks++;
        }
    }

    char* stack_lo(const Fiber* f) const { return f->base + GUARD; }
    size_t stack_len(const Fiber* f) const { return stack_bytes() - GUARD - f->color; }
};

static thread_local Worker* tls_worker = nullptr;

// Workers of threads that ended, kept for the next thread that launches (a worker owns stack
// slots of the arena, of which there are MAX_WORKERS).
static std::mutex spare_mu;
static std::vector<Worker*> spare_workers;

struct WorkerRelease {
    ~WorkerRelease() {
        if (!tls_worker) return;
        std::lock_guard<std::mutex> g(spare_mu);
        spare_workers.push_back(tls_worker);
        tls_worker = nullptr;
    }
};
static thread_local WorkerRelease tls_release;

static Worker* this_worker() {
    if (!tls_worker) {
        {
            std::lock_guard<std::mutex> g(spare_mu);
            if (!spare_workers.empty()) {
                tls_worker = spare_workers.back();
                spare_workers.pop_back();
            }
        }
        if (!tls_worker) tls_worker = new Worker();
        (void)&tls_release;  // constructed with the thread's first launch: releases at its end
    }
    return tls_worker;
}

static void reset_context(Worker* w, Fiber* f) {
#ifdef __SANITIZE_ADDRESS__
    // A fiber abandoned mid-kernel (a failed block) left its frames' redzones poisoned.
    __asan_unpoison_memory_region(w->stack_lo(f), w->stack_len(f));
#endif
    if (use_ucontext()) {
        if (!f->uc) f->uc = new ucontext_t();
        getcontext(f->uc);
        f->uc->uc_stack.ss_sp = w->stack_lo(f);
        f->uc->uc_stack.ss_size = w->stack_len(f);
        f->uc->uc_link = nullptr;
        uintptr_t p = (uintptr_t)f;
        makecontext(f->uc, (void (*)())(void*)+[](unsigned lo, unsigned hi) {
            fiber_entry((Fiber*)(((uintptr_t)hi << 32) | lo));
        }, 2, (unsigned)(p & 0xffffffffu), (unsigned)(p >> 32));
    } else {
#if PLUMBLINE_EMU_HAVE_ASM_SWITCH
        uintptr_t top = ((uintptr_t)f->base + stack_bytes() - f->color) & ~(uintptr_t)15;
        void** sp = (void**)(top - 72);
        sp[0] = nullptr;                      // r15
        sp[1] = nullptr;                      // r14
        sp[2] = (void*)&fiber_entry;          // r13: the function
        sp[3] = (void*)f;                     // r12: its argument
        sp[4] = nullptr;                      // rbx
        sp[5] = nullptr;                      // rbp
        sp[6] = (void*)&plumbline_emu_fiber_start;
        sp[7] = nullptr;
        sp[8] = nullptr;
        f->sp = (void*)sp;
#endif
    }
    f->dirty = false;
}

// Switch from `from` (nullptr: the worker's own context) to `to` (nullptr: the worker's own).
static inline void switch_to(Worker* w, Fiber* from, Fiber* to) {
    w->cur = to;
#ifdef __SANITIZE_ADDRESS__
    void** fake = from ? &from->asan_fake : &w->fake_stack;
    if (to)
        __sanitizer_start_switch_fiber(fake, w->stack_lo(to), w->stack_len(to));
    else
        __sanitizer_start_switch_fiber(fake, w->main_stack_bottom, w->main_stack_size);
#endif
    if (use_ucontext()) {
        swapcontext(from ? from->uc : &w->main_uc, to ? to->uc : &w->main_uc);
    } else {
#if PLUMBLINE_EMU_HAVE_ASM_SWITCH
        plumbline_emu_swap(from ? &from->sp : &w->main_sp, to ? to->sp : w->main_sp);
#endif
    }
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(from ? from->asan_fake : w->fake_stack, nullptr, nullptr);
#endif
}

static std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char* f, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

static std::string where(const Worker* w, const Fiber* f) {
    const BlockInfo& b = w->block;
    return fmt("block (%u,%u,%u) thread (%u,%u,%u)", b.block_idx.x, b.block_idx.y, b.block_idx.z,
               f->info.tid.x, f->info.tid.y, f->info.tid.z);
}

static std::string lanes_text(unsigned m) {
    std::string s;
    for (int i = 0; i < 32; i++) {
        if (!((m >> i) & 1u)) continue;
        int j = i;
        while (j + 1 < 32 && ((m >> (j + 1)) & 1u)) j++;
        if (!s.empty()) s += ",";
        s += (i == j) ? std::to_string(i) : std::to_string(i) + "-" + std::to_string(j);
        i = j;
    }
    return s.empty() ? "none" : s;
}

// Fails the block: the message is kept and the worker's own context resumes; the fibers of the
// block are abandoned mid-kernel (their contexts are rebuilt before they run again).
[[noreturn]] static void fail_block(Worker* w, Fiber* f, const std::string& msg) {
    w->error = msg;
    for (unsigned i = 0; i < w->n; i++)
        if (w->fibers[i].state != DONE) w->fibers[i].dirty = true;
    f->dirty = true;
    switch_to(w, f, nullptr);
    __builtin_unreachable();
}

static std::string describe_waiters(Worker* w) {
    std::string s;
    unsigned at_bar = 0, done = 0;
    for (unsigned i = 0; i < w->n; i++) {
        State st = w->fibers[i].state;
        if (st == WAIT_BAR) at_bar++;
        if (st == DONE) done++;
    }
    s = fmt("%u of %u threads wait at __syncthreads, %u exited", at_bar, w->n, done);
    for (size_t k = 0; k < w->warps.size(); k++) {
        const WarpState& ws = w->warps[k];
        if (ws.mask)
            s += fmt("; warp %zu: lanes %s wait at a warp operation with mask 0x%08x", k,
                     lanes_text(ws.pending).c_str(), ws.mask);
    }
    return s;
}

// The next fiber that can run after `from` (cyclically; random order under
// PLUMBLINE_CUDA_EMU_SHUFFLE), or nullptr.
static Fiber* pick_next(Worker* w, unsigned from) {
    unsigned n = w->n;
    unsigned start = from + 1;
    if (w->rng) {
        w->rng ^= w->rng << 13;
        w->rng ^= w->rng >> 7;
        w->rng ^= w->rng << 17;
        start = (unsigned)(w->rng % n);
    }
    for (unsigned k = 0; k < n; k++) {
        unsigned i = start + k;
        if (i >= n) i -= n;
        if (i >= n) i %= n;
        Fiber* f = &w->fibers[i];
        if (f->state == READY) return f;
    }
    return nullptr;
}

// The running fiber `f` waits (its state is already set): run another one.
static inline void block_on(Worker* w, Fiber* f, const char* what) {
    unsigned i = f->info.linear + 1;
    Fiber* next = (!w->rng && i < w->n && w->fibers[i].state == READY) ? &w->fibers[i]
                                                                       : pick_next(w, f->info.linear);
    if (!next) {
        fail_block(w, f,
                   fmt("deadlock: %s reached %s and no thread of the block can go on (%s): a "
                       "barrier or warp operation that some threads never reach (divergent code)",
                       where(w, f).c_str(), what, describe_waiters(w).c_str()));
    }
    if (next->dirty) reset_context(w, next);
    switch_to(w, f, next);
}

static const char* warp_op_name(int op);

static void fiber_entry(Fiber* f) {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);  // a fresh fiber's first run
#endif
    for (;;) {
        Worker* w = f->worker;
        w->launch->spec->kernel->run(w->launch->spec->params);
        // The thread exits.
        f->state = DONE;
        w->n_done++;
        WarpState& ws = w->warps[f->info.warp];
        unsigned bit = 1u << f->info.lane;
        ws.done |= bit;
        if (w->bar_arrived > 0) {
            fail_block(w, f,
                       fmt("%s exited while %u threads of the block wait at __syncthreads: a "
                           "barrier that some threads never reach",
                           where(w, f).c_str(), w->bar_arrived));
        }
        if (ws.mask & bit) {
            fail_block(w, f,
                       fmt("%s (lane %u) exited while lanes %s wait for it at %s with mask "
                           "0x%08x: an inactive lane in a warp operation",
                           where(w, f).c_str(), f->info.lane, lanes_text(ws.pending).c_str(),
                           warp_op_name(ws.op), ws.mask));
        }
        Fiber* next = (w->n_done == w->n) ? nullptr : pick_next(w, f->info.linear);
        if (!next && w->n_done != w->n) {
            fail_block(w, f,
                       fmt("deadlock after %s exited: no thread of the block can go on (%s)",
                           where(w, f).c_str(), describe_waiters(w).c_str()));
        }
        if (next && next->dirty) reset_context(w, next);
        switch_to(w, f, next);
    }
}

}  // namespace plumbline_emu

using namespace plumbline_emu;

namespace plumbline_emu {
static const char* warp_op_name(int op);
}

extern "C" __attribute__((visibility("default"))) const ThreadInfo* plumblineEmuSelf(void) {
    return &fiber_of_stack()->info;
}

extern "C" __attribute__((visibility("default"))) const BlockInfo* plumblineEmuBlock(void) {
    return &fiber_of_stack()->worker->block;
}

extern "C" __attribute__((visibility("default"), noreturn)) void plumblineEmuTrap(const char* msg) {
    Fiber* f = fiber_of_stack();
    Worker* w = f->worker;
    fail_block(w, f, fmt("%s: %s", where(w, f).c_str(), msg));
}

extern "C" __attribute__((visibility("default"), noinline)) void plumblineEmuSyncthreads(void) {
    void* site = __builtin_return_address(0);
    Fiber* f = fiber_of_stack();
    Worker* w = f->worker;
    if (w->n_done > 0) {
        fail_block(w, f,
                   fmt("%s reached __syncthreads after %u threads of the block exited: a barrier "
                       "that some threads never reach",
                       where(w, f).c_str(), w->n_done));
    }
    if (w->warps[f->info.warp].mask) {
        const WarpState& ws = w->warps[f->info.warp];
        fail_block(w, f,
                   fmt("%s reached __syncthreads while lanes %s of its warp wait at a warp "
                       "operation (mask 0x%08x): divergent code",
                       where(w, f).c_str(), lanes_text(ws.pending).c_str(), ws.mask));
    }
    if (w->bar_arrived == 0) {
        w->bar_site = site;
    } else if (site != w->bar_site) {
        fail_block(w, f,
                   fmt("divergent __syncthreads: %s reached a different __syncthreads (code "
                       "address %p) than the %u threads waiting (at %p)",
                       where(w, f).c_str(), site, w->bar_arrived, w->bar_site));
    }
    if (++w->bar_arrived == w->n) {
        w->bar_arrived = 0;
        for (unsigned i = 0; i < w->n; i++) {
            Fiber* o = &w->fibers[i];
            if (o->state == WAIT_BAR) o->state = READY;
        }
        return;  // the last thread goes on
    }
    f->state = WAIT_BAR;
    block_on(w, f, "__syncthreads");
}

namespace plumbline_emu {
static const char* warp_op_name(int op) {
    switch (op) {
        case WARP_SHFL_IDX: return "__shfl_sync";
        case WARP_SHFL_UP: return "__shfl_up_sync";
        case WARP_SHFL_DOWN: return "__shfl_down_sync";
        case WARP_SHFL_XOR: return "__shfl_xor_sync";
        case WARP_BALLOT: return "__ballot_sync";
        case WARP_ANY: return "__any_sync";
        case WARP_ALL: return "__all_sync";
        default: return "__syncwarp";
    }
}
}  // namespace plumbline_emu

// The lane whose value lane `l` receives.
static int shfl_src(int op, int l, int arg, int width) {
    int base = l & ~(width - 1), off = l & (width - 1);
    switch (op) {
        case WARP_SHFL_IDX: return base + (arg & (width - 1));
        case WARP_SHFL_UP: return off >= arg ? l - arg : l;
        case WARP_SHFL_DOWN: return off + arg < width ? l + arg : l;
        case WARP_SHFL_XOR: {
            int s = l ^ arg;
            return (s & ~(width - 1)) == base && s < 32 ? s : l;
        }
        default: return l;
    }
}

extern "C" __attribute__((visibility("default"), noinline)) uint64_t plumblineEmuWarp(
    int op, unsigned mask, uint64_t value, int arg, int width) {
    void* site = __builtin_return_address(0);
    Fiber* f = fiber_of_stack();
    Worker* w = f->worker;
    WarpState& ws = w->warps[f->info.warp];
    unsigned bit = 1u << f->info.lane;
    const char* name = warp_op_name(op);
    if (!(mask & bit)) {
        fail_block(w, f,
                   fmt("%s: %s with mask 0x%08x called by lane %u, which the mask leaves out",
                       where(w, f).c_str(), name, mask, f->info.lane));
    }
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        fail_block(w, f, fmt("%s: %s with width %d (a power of two ≤ 32 is required)",
                             where(w, f).c_str(), name, width));
    }
    if (mask & ~ws.exists) {
        fail_block(w, f,
                   fmt("%s: %s with mask 0x%08x names lanes %s that do not exist (the block "
                       "has %u threads)",
                       where(w, f).c_str(), name, mask, lanes_text(mask & ~ws.exists).c_str(),
                       w->n));
    }
    if (mask & ws.done) {
        fail_block(w, f,
                   fmt("%s: %s with mask 0x%08x but lanes %s of the warp exited: inactive lanes "
                       "in a full-mask warp operation",
                       where(w, f).c_str(), name, mask, lanes_text(mask & ws.done).c_str()));
    }
    if (ws.mask == 0) {
        ws.mask = mask;
        ws.op = op;
        ws.width = width;
        ws.site = site;
        ws.pending = 0;
    } else if (ws.mask != mask || ws.op != op || ws.site != site || ws.width != width) {
        fail_block(w, f,
                   fmt("%s: divergent warp operation: lane %u reached %s (mask 0x%08x, code "
                       "address %p) while lanes %s wait at %s (mask 0x%08x, code address %p)",
                       where(w, f).c_str(), f->info.lane, name, mask, site,
                       lanes_text(ws.pending).c_str(), warp_op_name(ws.op), ws.mask, ws.site));
    }
    unsigned l = f->info.lane;
    ws.value[l] = value;
    ws.arg[l] = arg;
    ws.pending |= bit;
    if (ws.pending != ws.mask) {
        f->state = WAIT_WARP;
        block_on(w, f, name);
        return ws.result[l];
    }
    // The last lane: compute every lane's result, release them, go on.
    Fiber* lanes = &w->fibers[f->info.warp * 32];
    if (op >= WARP_BALLOT) {
        uint64_t ballot = 0;
        for (unsigned k = 0; k < 32; k++)
            if (((mask >> k) & 1u) && ws.value[k]) ballot |= 1ull << k;
        uint64_t r = op == WARP_BALLOT ? ballot : op == WARP_ANY ? ballot != 0 : op == WARP_ALL ? ballot == mask : 0;
        for (unsigned k = 0; k < 32; k++) ws.result[k] = r;
    } else {
        // The common case (warp reductions): every lane, one xor distance.
        bool uniform_xor = mask == 0xffffffffu && op == WARP_SHFL_XOR && width == 32 && arg > 0 && arg < 32;
        for (unsigned k = 0; uniform_xor && k < 32; k++) uniform_xor = ws.arg[k] == arg;
        if (uniform_xor) {
            for (unsigned k = 0; k < 32; k++) ws.result[k] = ws.value[k ^ (unsigned)arg];
        } else {
            for (unsigned k = 0; k < 32; k++) {
                if (!((mask >> k) & 1u)) continue;
                int s = shfl_src(op, (int)k, ws.arg[k], width);
                if (!((mask >> s) & 1u)) {
                    fail_block(w, f,
                               fmt("%s: %s: lane %u reads lane %d, which is not in the mask "
                                   "0x%08x",
                                   where(w, f).c_str(), name, k, s, mask));
                }
                ws.result[k] = ws.value[s];
            }
        }
    }
    for (unsigned k = 0; k < 32; k++)
        if ((mask >> k) & 1u) lanes[k].state = READY;
    ws.mask = 0;
    ws.pending = 0;
    return ws.result[l];
}

namespace plumbline_emu {

// ---- fault handling -----------------------------------------------------------------------

static struct sigaction old_segv, old_bus, old_fpe;

static void fault_handler(int sig, siginfo_t* si, void* uctx) {
    Worker* w = tls_worker;
    if (w && w->in_kernel && w->launch) {
        char near[512];
        uintptr_t a = (uintptr_t)si->si_addr;
        describe_address(a, near, sizeof near);
        for (unsigned i = 0; i < w->n_stacks; i++)
            if (a >= (uintptr_t)w->fibers[i].base && a < (uintptr_t)w->fibers[i].base + GUARD)
                snprintf(near, sizeof near,
                         "the guard page below a thread's stack: stack overflow (%zu KiB per "
                         "thread; PLUMBLINE_CUDA_EMU_STACK_KB sets it)",
                         stack_bytes() / 1024);
        const Fiber* f = w->cur;
        const BlockInfo& b = w->block;
        const char* kind = sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                           : sig == SIGBUS ? "bus error"
                                           : "invalid memory access";
        if (f) {
            snprintf(w->fault_msg, sizeof w->fault_msg,
                     "%s at address %p in block (%u,%u,%u) thread (%u,%u,%u): %s", kind,
                     si->si_addr, b.block_idx.x, b.block_idx.y, b.block_idx.z, f->info.tid.x,
                     f->info.tid.y, f->info.tid.z, sig == SIGFPE ? "" : near);
        } else {
            snprintf(w->fault_msg, sizeof w->fault_msg, "%s at address %p: %s", kind,
                     si->si_addr, near);
        }
        siglongjmp(w->jb, 1);
    }
    // Not ours: hand it to whoever handled it before.
    struct sigaction* old = sig == SIGSEGV ? &old_segv : sig == SIGBUS ? &old_bus : &old_fpe;
    if (old->sa_flags & SA_SIGINFO) {
        old->sa_sigaction(sig, si, uctx);
    } else if (old->sa_handler != SIG_IGN && old->sa_handler != SIG_DFL) {
        old->sa_handler(sig);
    } else {
        sigaction(sig, old, nullptr);  // the fault repeats under the old disposition
    }
}

void install_fault_handlers() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa {};
        sa.sa_sigaction = fault_handler;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
        sigaction(SIGBUS, &sa, &old_bus);
        sigaction(SIGFPE, &sa, &old_fpe);
    });
}

// ---- blocks and launches ------------------------------------------------------------------

static void run_block(Worker* w, uint64_t linear_block) {
    const LaunchSpec& s = *w->launch->spec;
    uint64_t gx = s.grid.x, gy = s.grid.y;
    w->block.block_idx = {(unsigned)(linear_block % gx), (unsigned)(linear_block / gx % gy),
                          (unsigned)(linear_block / (gx * gy))};
    unsigned n = w->n;
    w->n_done = 0;
    w->bar_arrived = 0;
    w->bar_site = nullptr;
    for (auto& ws : w->warps) {
        ws.mask = 0;
        ws.pending = 0;
        ws.done = 0;
    }
    for (unsigned i = 0; i < n; i++) {
        Fiber* f = &w->fibers[i];
        f->state = READY;
    }
    if (s.dyn_shared) std::fill(w->dyn_shared.begin(), w->dyn_shared.end(), (char)0xff);
    Fiber* first = &w->fibers[0];
    if (first->dirty) reset_context(w, first);
    w->error.clear();
    switch_to(w, nullptr, first);
    if (!w->error.empty()) w->launch->fail(w->error);
}

static void prepare_worker(Worker* w, LaunchState* L) {
    const LaunchSpec& s = *L->spec;
    w->launch = L;
    w->n = L->n_threads;
    w->block.block_dim = s.block;
    w->block.grid_dim = s.grid;
    w->dyn_shared.assign(std::max(1u, s.dyn_shared), (char)0xff);
    w->block.dyn_shared = s.dyn_shared ? w->dyn_shared.data() : nullptr;
    w->block.dyn_shared_bytes = s.dyn_shared;
    w->ensure_stacks(w->n);
    unsigned bx = s.block.x, by = s.block.y;
    for (unsigned i = 0; i < w->n; i++) {
        Fiber* f = &w->fibers[i];
        f->info.tid = {i % bx, i / bx % by, i / (bx * by)};
        f->info.linear = i;
        f->info.lane = i % 32;
        f->info.warp = i / 32;
    }
    unsigned n_warps = (w->n + 31) / 32;
    w->warps.assign(n_warps, WarpState{});
    for (unsigned k = 0; k < n_warps; k++) {
        unsigned lanes = std::min(32u, w->n - 32 * k);
        w->warps[k].exists = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
    }
}

// Runs blocks of `L` until none is left (or the launch failed).
static void work(LaunchState* L) {
    Worker* w = this_worker();
    prepare_worker(w, L);
    // An alternate signal stack, so that a fiber's stack overflow is reported too.
    if (!w->altstack) {
        w->altstack = (char*)mmap(nullptr, SIGSTKSZ * 4, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    stack_t ss{}, old_ss{};
    ss.ss_sp = w->altstack;
    ss.ss_size = SIGSTKSZ * 4;
    sigaltstack(&ss, &old_ss);
#ifdef __SANITIZE_ADDRESS__
    pthread_attr_t attr;
    void* stack_addr = nullptr;
    size_t stack_sz = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        pthread_attr_getstack(&attr, &stack_addr, &stack_sz);
        pthread_attr_destroy(&attr);
    }
    w->main_stack_bottom = stack_addr;
    w->main_stack_size = stack_sz;
#endif
    if (sigsetjmp(w->jb, 1) != 0) {
        w->in_kernel = 0;
        for (unsigned i = 0; i < w->n; i++) w->fibers[i].dirty = true;
        L->fail(w->fault_msg);
    } else {
        for (;;) {
            if (L->failed.load(std::memory_order_relaxed)) break;
            uint64_t b = L->next.fetch_add(1, std::memory_order_relaxed);
            if (b >= L->n_blocks) break;
            w->in_kernel = 1;
            run_block(w, b);
            w->in_kernel = 0;
        }
    }
    sigaltstack(&old_ss, nullptr);
    w->launch = nullptr;
}

// The pool: threads that wait for a launch, run blocks of it, and report done.
struct Pool {
    std::mutex mu;
    std::condition_variable cv, done_cv;
    LaunchState* current = nullptr;
    uint64_t generation = 0;
    unsigned busy = 0;
    std::vector<std::thread> threads;

    explicit Pool(unsigned n) {
        for (unsigned i = 0; i < n; i++) {
            threads.emplace_back([this] { loop(); });
            threads.back().detach();
        }
    }

    void loop() {
        uint64_t seen = 0;
        for (;;) {
            LaunchState* L;
            {
                std::unique_lock<std::mutex> g(mu);
                cv.wait(g, [&] { return generation != seen; });
                seen = generation;
                L = current;
            }
            work(L);
            {
                std::lock_guard<std::mutex> g(mu);
                if (--busy == 0) done_cv.notify_all();
            }
        }
    }

    void run(LaunchState* L) {
        {
            std::lock_guard<std::mutex> g(mu);
            current = L;
            busy = (unsigned)threads.size();
            generation++;
        }
        cv.notify_all();
        work(L);
        std::unique_lock<std::mutex> g(mu);
        done_cv.wait(g, [&] { return busy == 0; });
    }
};

static unsigned n_threads_wanted() {
    long t = env_long("PLUMBLINE_CUDA_EMU_THREADS", 0);
    if (t > 0) return (unsigned)std::min(t, 1024L);
    unsigned hc = std::thread::hardware_concurrency();
    return hc ? hc : 1;
}

std::string run_launch(const LaunchSpec& spec) {
    install_fault_handlers();
    LaunchState L;
    L.spec = &spec;
    L.n_blocks = (uint64_t)spec.grid.x * spec.grid.y * spec.grid.z;
    L.n_threads = spec.block.x * spec.block.y * spec.block.z;
    static std::mutex launch_mu;  // one launch at a time (streams are in order anyway)
    std::lock_guard<std::mutex> g(launch_mu);
    static unsigned want = n_threads_wanted();
    if (L.n_blocks == 1 || want == 1) {
        work(&L);
    } else {
        static Pool* pool = new Pool(want - 1);  // never destroyed: its threads are detached
        pool->run(&L);
    }
    return L.error;
}

}  // namespace plumbline_emu
