// plumbline CUDA emulator: what the runtime (runtime.cpp: fibers, blocks, launches) and the
// driver (driver.cpp: the cu* entry points, memory, modules) share. Not seen by kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "prelude.h"

namespace plumbline_emu {

// One emulated entry point, registered by the generated translation units (build.sh).
struct KernelEntry {
    const char* name;
    void (*run)(void** params);  // unpacks the driver's parameter array and calls the kernel
    unsigned n_params;
    const unsigned* param_sizes;
};

// What cuLaunchKernel hands the runtime.
struct LaunchSpec {
    const KernelEntry* kernel;
    void** params;
    dim3 grid;
    dim3 block;
    unsigned dyn_shared;
};

// Runs a launch to completion on the worker pool; returns "" or the reason it failed (the
// kernel is named by the caller).
std::string run_launch(const LaunchSpec& spec);

// The allocation nearest `addr` in words ("42 bytes past the end of allocation #7 (0x… ,
// 1024 bytes)"), for fault reports; safe to call from the fault handler.
void describe_address(uintptr_t addr, char* out, size_t n);

// Installs the fault handlers (SIGSEGV, SIGBUS, SIGFPE) once.
void install_fault_handlers();

// Environment helpers.
long env_long(const char* name, long fallback);

}  // namespace plumbline_emu

// Registration of a list of entry points (the generated translation units call it from a
// static initializer; a test kernel library calls it when it is loaded).
extern "C" void plumblineEmuRegisterKernels(const plumbline_emu::KernelEntry* entries, size_t n);
