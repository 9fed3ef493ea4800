//! The peer: llama.cpp's `llama-bench`, built from the llama.cpp source vendored in the PyPI
//! sdist of `llama-cpp-python`, cached under
//! `~/.cache/plumbline/peers/llama.cpp-<version>-native-noamx` (built for this machine, AMX off:
//! [`BUILT_FOR`]).
//! Nothing of it is committed; the first `cargo xtask bench` builds it (about 20 minutes on two
//! cores), later runs reuse the cached binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The `llama-cpp-python` release whose vendored llama.cpp is the peer (it runs Gemma 3).
pub const VERSION: &str = "0.3.16";

/// How the peer is compiled: for this machine's ISA (`GGML_NATIVE`, `-march=native`) but never
/// with AMX. Intel VMs advertise AMX in CPUID without the OS granting the tile state, and a
/// native build then dies with SIGILL on `tilezero` in ggml's AMX kernels; plumbline has no AMX
/// kernels either, so the comparison is AVX-512 (or AVX2) against AVX-512 (or AVX2) on every
/// machine. GCC honours an explicit `-mno-…` over what `-march=native` implies, in any order.
pub const BUILT_FOR: &str = "-march=native without AMX";

/// The cache folder's suffix for [`BUILT_FOR`]: a peer cached by an older build (with AMX where
/// the CPU advertised it) is not reused.
const BUILD_TAG: &str = "native-noamx";

/// `$PLUMBLINE_PEERS`, else `~/.cache/plumbline/peers`.
fn peers_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PLUMBLINE_PEERS") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither PLUMBLINE_PEERS nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/plumbline/peers"))
}

fn run_checked(cmd: &mut Command, what: &str, log: &Path) -> Result<()> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out
        .try_clone()
        .with_context(|| format!("opening {}", log.display()))?;
    let status = cmd
        .stdout(out)
        .stderr(err)
        .status()
        .with_context(|| format!("starting {what} ({cmd:?})"))?;
    if !status.success() {
        bail!(
            "{what} failed ({status}); its output is in {}",
            log.display()
        );
    }
    Ok(())
}

fn has_cmake() -> bool {
    Command::new("cmake")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The cached `llama-bench`, building it first when it is missing.
pub fn llama_bench() -> Result<PathBuf> {
    let dir = peers_dir()?.join(format!("llama.cpp-{VERSION}-{BUILD_TAG}"));
    let bin = dir.join("build/bin/llama-bench");
    if bin.is_file() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Before the download: pip reads the sdist's metadata through scikit-build-core, which
    // refuses to run without a CMake >= 3.21 on the PATH.
    if !has_cmake() {
        run_checked(
            Command::new("python3").args(["-m", "pip", "install", "cmake"]),
            "pip install cmake",
            &dir.join("pip-cmake.log"),
        )?;
    }
    let src_root = dir.join(format!("llama_cpp_python-{VERSION}"));
    let src = src_root.join("vendor/llama.cpp");
    if !src.join("CMakeLists.txt").is_file() {
        let sdist = dir.join(format!("llama_cpp_python-{VERSION}.tar.gz"));
        if !sdist.is_file() {
            eprintln!("bench: downloading the llama-cpp-python {VERSION} sdist from PyPI");
            // `--no-build-isolation`: pip reads the sdist's metadata with the scikit-build-core
            // already installed instead of building cmake from source in an isolated env.
            run_checked(
                Command::new("python3").args(["-m", "pip", "install", "scikit-build-core"]),
                "pip install scikit-build-core",
                &dir.join("pip-install.log"),
            )?;
            run_checked(
                Command::new("python3")
                    .args(["-m", "pip", "download", "--no-deps", "--no-build-isolation"])
                    .args(["--no-binary", "llama-cpp-python"])
                    .arg(format!("llama-cpp-python=={VERSION}"))
                    .arg("-d")
                    .arg(&dir),
                "pip download llama-cpp-python",
                &dir.join("pip-download.log"),
            )?;
        }
        run_checked(
            Command::new("tar")
                .arg("xzf")
                .arg(&sdist)
                .arg("-C")
                .arg(&dir),
            "extracting the sdist",
            &dir.join("tar.log"),
        )?;
        if !src.join("CMakeLists.txt").is_file() {
            bail!(
                "expected the vendored llama.cpp at {}, found no CMakeLists.txt there",
                src.display()
            );
        }
    }
    let build = dir.join("build");
    eprintln!(
        "bench: building llama-bench from {} (about 20 minutes on two cores; log in {})",
        src.display(),
        dir.join("build.log").display()
    );
    run_checked(
        Command::new("nice")
            .args(["-n", "19", "cmake", "-S"])
            .arg(&src)
            .arg("-B")
            .arg(&build)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF",
                "-DLLAMA_CURL=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ])
            .args(no_amx_flags()),
        "configuring llama.cpp",
        &dir.join("configure.log"),
    )?;
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    run_checked(
        Command::new("nice")
            .args(["-n", "19", "cmake", "--build"])
            .arg(&build)
            .args(["--target", "llama-bench", "-j"])
            .arg(jobs.to_string()),
        "building llama-bench",
        &dir.join("build.log"),
    )?;
    if !bin.is_file() {
        bail!("the build finished but {} is not there", bin.display());
    }
    Ok(bin)
}

/// The compiler flags that keep AMX out of a native build (x86-64 only; elsewhere none).
fn no_amx_flags() -> Vec<String> {
    if !cfg!(target_arch = "x86_64") {
        return Vec::new();
    }
    let off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";
    vec![
        format!("-DCMAKE_C_FLAGS={off}"),
        format!("-DCMAKE_CXX_FLAGS={off}"),
    ]
}

/// Which llama-bench test to run.
#[derive(Clone, Copy, Debug)]
pub enum Test {
    /// `-p n -n 0`
    Prompt(usize),
    /// `-p 0 -n n`
    Gen(usize),
}

/// One llama-bench repetition (after its own warm-up) of `test` on `threads` threads, in
/// tokens/s.
pub fn run_once(bin: &Path, model: &Path, test: Test, threads: usize) -> Result<f64> {
    let (p, n) = match test {
        Test::Prompt(p) => (p, 0),
        Test::Gen(n) => (0, n),
    };
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &p.to_string(), "-n", &n.to_string()])
        .args(["-t", &threads.to_string(), "-r", "1", "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    parse_ts(&String::from_utf8_lossy(&out.stdout))
}

/// The `avg_ts` of the one test in llama-bench's JSON output.
fn parse_ts(json: &str) -> Result<f64> {
    let v: serde_json::Value =
        serde_json::from_str(json).context("parsing llama-bench's JSON output")?;
    let tests = v
        .as_array()
        .context("expected a JSON array of tests from llama-bench")?;
    match tests.as_slice() {
        [t] => t["avg_ts"]
            .as_f64()
            .context("expected a numeric avg_ts in llama-bench's output"),
        _ => bail!(
            "expected exactly one test in llama-bench's output, found {}",
            tests.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ts;

    #[test]
    fn reads_avg_ts_of_the_single_test() {
        let ts =
            parse_ts(r#"[{"n_prompt": 512, "n_gen": 0, "avg_ts": 331.5, "samples_ts": [331.5]}]"#);
        assert_eq!(ts.ok(), Some(331.5));
        assert!(parse_ts("[]").is_err());
        assert!(parse_ts(r#"[{"avg_ts": "x"}]"#).is_err());
        assert!(parse_ts("not json").is_err());
    }
}
