//! CPU-only tests of the CUDA layer: library search, NVRTC compilation to cubins for each
//! architecture (with the real NVRTC wheel when installed; otherwise each such test prints
//! "skipped: NVRTC not installed" and returns), the cache key, and typed errors for broken
//! input.

use std::path::Path;

use super::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn real_nvrtc() -> Option<Nvrtc> {
    match Nvrtc::load(&LibrarySearch::from_env()) {
        Ok(n) => Some(n),
        Err(e) => {
            println!("skipped: NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12): {e}");
            None
        }
    }
}

fn touch(p: &Path) {
    std::fs::write(p, b"x").unwrap_or_else(|e| panic!("{}: {e}", p.display()));
}

#[test]
fn search_finds_the_first_directory_and_names_other_major_versions() {
    let (a, b) = (tmp(), tmp());
    touch(&b.path().join("libnvrtc.so.12"));
    let s = LibrarySearch::only(vec![a.path().into(), b.path().into()]);
    assert_eq!(
        s.find("libnvrtc.so.12").map(|f| f.path),
        Ok(b.path().join("libnvrtc.so.12"))
    );

    let c = tmp();
    touch(&c.path().join("libnvrtc.so.13"));
    touch(&c.path().join("libnvrtc.so.12.9.86")); // same major: not a mismatch
    touch(&c.path().join("libnvrtc-builtins.so.13.0"));
    let s = LibrarySearch::only(vec![c.path().into()]);
    match s.find("libnvrtc.so.12") {
        Err(LibraryError::NotFound {
            other_majors,
            searched,
            ..
        }) => {
            assert_eq!(other_majors, vec![c.path().join("libnvrtc.so.13")]);
            assert_eq!(searched, vec![c.path().to_path_buf()]);
        }
        other => panic!("expected NotFound, found {other:?}"),
    }
}

#[test]
fn a_missing_or_broken_nvrtc_is_a_typed_error_not_a_panic() {
    let d = tmp();
    let e = Nvrtc::load(&LibrarySearch::only(vec![d.path().into()]))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("libnvrtc.so.12 not found") && e.contains("nvidia-cuda-nvrtc-cu12"),
        "{e}"
    );
    std::fs::write(d.path().join("libnvrtc.so.12"), b"\x7fELF garbage")
        .unwrap_or_else(|e| panic!("{e}"));
    let e = Nvrtc::load(&LibrarySearch::only(vec![d.path().into()]))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("could not be loaded"), "{e}");
    let e = driver::probe(&LibrarySearch::only(vec![d.path().into()]))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("libcuda.so.1 not found"), "{e}");
}

#[test]
fn arch_support_is_read_from_the_list_and_names_the_release_that_adds_it() {
    let old = [50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90];
    assert!(nvrtc::check_arch(12, 4, &old, 90).is_ok());
    let e = nvrtc::check_arch(12, 4, &old, 103)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.starts_with("NVRTC 12.4 cannot target sm_103") && e.contains("needs NVRTC >= 12.9"),
        "{e}"
    );
    let e = nvrtc::check_arch(12, 4, &old, 120)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("needs NVRTC >= 12.8"), "{e}");
}

#[test]
fn every_kernel_file_compiles_for_two_architectures_with_a_matching_cubin() {
    let Some(nv) = real_nvrtc() else { return };
    // One ABI-7 (sm_86) and one ABI-8 (sm_120) layout; `cargo xtask kernels` does all seven.
    for arch in [86, 120] {
        for f in &FILES {
            let r = compile_one(&nv, f, arch);
            let stats = r
                .result
                .unwrap_or_else(|e| panic!("{} sm_{arch}: {e}", f.name));
            assert!(!stats.is_empty(), "{}: no entry points", f.name);
            assert!(
                stats
                    .iter()
                    .all(|s| s.spill_stores == 0 && s.spill_loads == 0),
                "{}: spills {stats:?}",
                f.name
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_returns_the_compiler_log() {
    let Some(nv) = real_nvrtc() else { return };
    let f = KernelFile::custom(
        "broken.cu",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_thing; }\n",
    );
    match nv.compile(f.name, &f.program(), 90) {
        Err(CudaError::Compile { kernel, arch, log }) => {
            assert_eq!((kernel.as_str(), arch), ("broken.cu", 90));
            assert!(log.contains("undefined_thing"), "{log}");
        }
        other => panic!(
            "expected a compile error, found {:?}",
            other.map(|c| c.cubin.len())
        ),
    }
    let e = nv
        .compile("x.cu", "", 77)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("cannot target sm_77"), "{e}");
}

#[test]
fn the_cache_is_keyed_by_source_arch_and_nvrtc_version_and_rejects_a_corrupt_file() {
    let Some(nv) = real_nvrtc() else { return };
    let d = tmp();
    let cache = KernelCache::new(d.path());
    let f = FILES[0];
    let (a, o) = cache.get(&nv, &f, 89).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o, Origin::Compiled);
    assert_eq!(cubin_arch(&a), Ok(89));
    let (_, o) = cache.get(&nv, &f, 89).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o, Origin::Cached);
    let p89 = cache.path_for(&f, 89, nv.version());
    assert_ne!(p89, cache.path_for(&f, 90, nv.version()));
    assert_ne!(p89, cache.path_for(&f, 89, (12, 8)));
    assert_ne!(p89, cache.path_for(&FILES[1], 89, nv.version()));
    // A truncated cache file is recompiled, not loaded.
    std::fs::write(&p89, b"\x7fELF").unwrap_or_else(|e| panic!("{e}"));
    let (_, o) = cache.get(&nv, &f, 89).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o, Origin::Compiled);
}

#[test]
fn opening_the_backend_without_a_driver_is_an_error_naming_the_library() {
    let d = tmp();
    let e = CudaBackend::new(
        0,
        &LibrarySearch::only(vec![d.path().into()]),
        &KernelCache::new(d.path()),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("libcuda.so.1 not found"), "{e}");
}
