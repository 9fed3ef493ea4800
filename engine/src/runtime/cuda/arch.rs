//! The architecture matrix: which GPU architectures plumbline compiles its kernels for, and
//! which NVRTC release first reaches each.

/// Every architecture the kernels are compiled for in CI, as `major × 10 + minor`:
/// Ampere (A100 sm_80, consumer sm_86), Ada (sm_89), Hopper (H100/H200 sm_90),
/// Blackwell (B200 sm_100, B300 sm_103, consumer sm_120).
pub const TARGET_ARCHS: [u32; 7] = [80, 86, 89, 90, 100, 103, 120];

/// The CUDA major version the backend targets: it loads `libnvrtc.so.12` and compiles with
/// NVRTC 12. Why 12 and not 13: a CUDA 12 cubin loads on every driver from 525 (CUDA 12.0) up,
/// including CUDA 13 drivers (the lent H200 runs driver 580 = CUDA 13.0), while a CUDA 13 cubin
/// needs a CUDA 13 driver; and NVRTC 12.9 already reaches every target (sm_80 … sm_120,
/// sm_103 included). CUDA 13 also drops offline compilation for sm_50…sm_72, which we do not
/// need, and adds nothing the kernels use.
pub const CUDA_MAJOR: u32 = 12;

/// The NVRTC (CUDA toolkit) release that first compiles for `arch`, from NVIDIA's release
/// notes: sm_90 since 11.8, sm_100/sm_101/sm_120 since 12.8, sm_103/sm_121 since 12.9.
pub fn min_nvrtc_for(arch: u32) -> Option<(u32, u32)> {
    Some(match arch {
        80 => (11, 0),
        86 => (11, 1),
        87 => (11, 4),
        89 | 90 => (11, 8),
        100 | 101 | 120 => (12, 8),
        103 | 121 => (12, 9),
        _ => return None,
    })
}

/// The oldest driver (as the CUDA version it reports, `major × 1000 + minor × 10`) that runs a
/// cubin for `arch`: a device of an architecture newer than the driver is not supported by it.
pub fn min_driver_for(arch: u32) -> u32 {
    match arch {
        100 | 101 | 120 => 12080,
        103 | 121 => 12090,
        _ => 12000,
    }
}

/// `sm_90` for 90.
pub fn sm(arch: u32) -> String {
    format!("sm_{arch}")
}
