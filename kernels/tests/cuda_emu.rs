//! The CUDA emulator (`kernels/cuda/emu`): built with its test kernels, then every case of its
//! self-test run — each checker violation constructed by a kernel and seen named in the error,
//! and the prelude's shuffles, barriers, shared memory, atomics, parameter passing and f16
//! conversions checked against independent expectations. The same cases run under
//! AddressSanitizer, and ASan must name the kernel of an out-of-bounds read.
//!
//! Needs g++ (C++20) and bash; no GPU and no CUDA install.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn emu_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/emu")
}

/// Builds the emulator and its tests into the test target folder (incremental) and returns
/// the folder.
fn build(asan: bool) -> &'static Path {
    static PLAIN: OnceLock<PathBuf> = OnceLock::new();
    static ASAN: OnceLock<PathBuf> = OnceLock::new();
    let cell = if asan { &ASAN } else { &PLAIN };
    cell.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(if asan {
            "cuda-emu-asan"
        } else {
            "cuda-emu"
        });
        let mut cmd = Command::new("bash");
        cmd.arg(emu_src().join("build.sh")).arg(&out).arg("--tests");
        if asan {
            cmd.arg("--asan");
        }
        let o = cmd
            .output()
            .expect("running bash kernels/cuda/emu/build.sh");
        assert!(
            o.status.success(),
            "kernels/cuda/emu/build.sh {} failed:\n{}",
            out.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        out
    })
}

fn selftest(asan: bool, args: &[&str]) -> Output {
    selftest_env(asan, args, &[])
}

fn selftest_env(asan: bool, args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = build(asan);
    let mut cmd = Command::new(dir.join("emu_selftest"));
    cmd.args(args);
    cmd.envs(env.iter().copied());
    // Leaks of device memory by the test program are not what these runs look for.
    cmd.env("ASAN_OPTIONS", "detect_leaks=0");
    cmd.output().expect("running emu_selftest")
}

fn check(case: &str) {
    let o = selftest(false, &[case]);
    check_output(case, o);
}

fn check_output(case: &str, o: Output) {
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains(&format!("ok {case}")),
        "emu_selftest {case}:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        const CASES: &[&str] = &[$(stringify!($name)),*];
        $(#[test] fn $name() { check(stringify!($name)); })*
    };
}

cases! {
    // Checker: each violation fails the launch (or call) and names the kernel and the reason.
    barrier_exit,
    barrier_after_exit,
    barrier_divergent,
    shfl_exited_lane,
    shfl_vs_barrier,
    shfl_divergent,
    shfl_partial_warp,
    launch_limits,
    shared_limits,
    param_mismatch,
    module_checks,
    oob_read_past_end,
    oob_write_before_start,
    oob_far,
    use_after_free,
    null_pointer,
    never_written_reads_nan,
    copy_bounds,
    trap,
    division_by_zero,
    stack_overflow,
    // The prelude against independent expectations.
    dynamic_shared_values,
    shuffles,
    warp_sums,
    block_mirror,
    indices,
    atomics,
    param_widths,
    f16_to_f32_exhaustive,
    f32_to_f16_edges,
}

/// A case added to emu_selftest without a test here would never run.
#[test]
fn every_selftest_case_has_a_test() {
    let o = selftest(false, &["list"]);
    assert!(o.status.success());
    let mut listed: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let mut here: Vec<String> = CASES.iter().map(|s| s.to_string()).collect();
    here.push("shuffled_order_reveals_a_race".into());
    listed.sort();
    here.sort();
    assert_eq!(listed, here);
}

/// `PLUMBLINE_CUDA_EMU_SHUFFLE` runs threads in a random order between scheduling points: a
/// missing barrier that the default order hides shows up as stale reads.
#[test]
fn shuffled_order_reveals_a_race() {
    let case = "shuffled_order_reveals_a_race";
    let o = selftest_env(false, &[case], &[("PLUMBLINE_CUDA_EMU_SHUFFLE", "7")]);
    check_output(case, o);
}

/// Every case passes with threads run in a random order (their results must not depend on it).
#[test]
fn every_case_in_a_random_order() {
    let o = selftest_env(false, CASES, &[("PLUMBLINE_CUDA_EMU_SHUFFLE", "99")]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The ucontext switch (the fallback off x86-64) passes every case too.
#[test]
fn every_case_with_the_ucontext_switch() {
    let o = selftest_env(false, CASES, &[("PLUMBLINE_CUDA_EMU_SWITCH", "ucontext")]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn read_file(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn read_u32s(path: &Path) -> Vec<u32> {
    read_file(path)
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_u16s(path: &Path) -> Vec<u16> {
    read_file(path)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// common.cuh's f16 conversions as the emulator runs them (the prelude's, in place of PTX
/// `cvt`) are bit-exact with the half crate, the conversion of the CPU backend's f16 KV cache
/// and dequantization: all 65536 f16 values to f32, and f32 → f16 around every f16 value (the
/// value, both neighbours of the rounding midpoint, the midpoint, one below) and over a
/// strided sweep of all bit patterns.
#[test]
fn f16_conversions_are_bit_exact_with_the_half_crate() {
    let dir = tempfile_dir();
    let o = selftest(false, &["dump-f16", dir.to_str().unwrap_or_default()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let wide = read_u32s(&dir.join("f16_to_f32.bin"));
    assert_eq!(wide.len(), 65536);
    for (i, &w) in wide.iter().enumerate() {
        let want = half::f16::from_bits(i as u16).to_f32().to_bits();
        assert_eq!(w, want, "f16 {i:#06x}: {w:#010x}, half says {want:#010x}");
    }
    let input = read_u32s(&dir.join("f32_in.bin"));
    let narrow = read_u16s(&dir.join("f32_to_f16.bin"));
    assert_eq!(input.len(), narrow.len());
    for (&x, &h) in input.iter().zip(&narrow) {
        let want = half::f16::from_f32(f32::from_bits(x)).to_bits();
        assert_eq!(h, want, "f32 {x:#010x}: {h:#06x}, half says {want:#06x}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh folder under the test target folder.
fn tempfile_dir() -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda-emu-f16-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

/// A real kernel of kernels/cuda (mmv.cu's Q8_0 matrix-vector product) over a 1000-row
/// matrix with a partial last block of rows; emu_selftest checks every output.
#[test]
fn mmv_q8_0_through_the_emulator() {
    let o = selftest(false, &["bench-mmv", "1001", "640", "1"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every case that does not access memory out of bounds on purpose runs clean under
/// AddressSanitizer (the fiber runtime, the prelude and the kernels included).
#[test]
fn asan_runs_clean() {
    let clean: Vec<&str> = CASES
        .iter()
        .copied()
        .filter(|c| !c.starts_with("oob_") && *c != "use_after_free")
        .collect();
    let o = selftest(true, &clean);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Under AddressSanitizer an out-of-bounds read by a kernel is reported with the kernel's
/// name and source line (ASan's redzones replace the guard pages there).
#[test]
fn asan_names_the_kernel_of_an_overflow() {
    let o = selftest(true, &["oob_read_past_end"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the overflow went unnoticed:\n{err}");
    assert!(
        err.contains("AddressSanitizer: heap-buffer-overflow") && err.contains("in read_at"),
        "{err}"
    );
}

/// A misaligned 4-byte load (a GPU faults; x86 does not) is named by the --asan build's UBSan
/// alignment check, with the kernel.
#[test]
fn asan_build_names_a_misaligned_load() {
    let o = selftest(true, &["ubsan-misaligned"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the misaligned load went unnoticed:\n{err}"
    );
    assert!(
        err.contains("misaligned address") && err.contains("checks.cu"),
        "{err}"
    );
}

/// A __shared__ array written past its end is named by the --asan build's UBSan bounds check.
#[test]
fn asan_build_names_a_shared_memory_overflow() {
    let o = selftest(true, &["ubsan-shared-overflow"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the overflow went unnoticed:\n{err}");
    assert!(
        err.contains("index 32 out of bounds for type 'float [32]'") && err.contains("checks.cu"),
        "{err}"
    );
}
