// plumbline CUDA emulator: registration of host-compiled entry points.
//
// `PLUMBLINE_EMU_ENTRY(ns, name)` makes a KernelEntry for the kernel `ns::name`: its parameter
// sizes come from the function's type, and its trampoline reads the driver's parameter array
// as cuLaunchKernel defines it (params[i] points at the i-th argument, of the i-th parameter's
// size).
#pragma once

#include <cstring>
#include <utility>

#include "emu.h"

namespace plumbline_emu {

template <auto F>
struct Trampoline;

template <typename... A, void (*F)(A...)>
struct Trampoline<F> {
    static constexpr unsigned sizes[sizeof...(A) + 1] = {(unsigned)sizeof(A)..., 0};
    static constexpr unsigned count = sizeof...(A);

    template <typename T>
    static T load(void* p) {
        T v;
        std::memcpy(&v, p, sizeof(T));
        return v;
    }

    template <size_t... I>
    static void call(void** params, std::index_sequence<I...>) {
        F(load<A>(params[I])...);
        (void)params;
    }

    static void run(void** params) { call(params, std::index_sequence_for<A...>{}); }
};

struct Registrar {
    Registrar(const KernelEntry* e, size_t n) { plumblineEmuRegisterKernels(e, n); }
};

}  // namespace plumbline_emu

#define PLUMBLINE_EMU_ENTRY(ns, name)                                                  \
    plumbline_emu::KernelEntry {                                                       \
        #name, &plumbline_emu::Trampoline<&ns::name>::run,                             \
            plumbline_emu::Trampoline<&ns::name>::count,                               \
            plumbline_emu::Trampoline<&ns::name>::sizes                                \
    }
