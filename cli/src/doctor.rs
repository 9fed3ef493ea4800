//! `plumbline doctor [--model FILE] [--require-gpu] [--arch N]... [--json]`: a preflight of the
//! whole stack, one row per layer, each with a verdict and, on failure, the root cause (which
//! library, where it was looked for, which version, which architecture) rather than the wrapper
//! a service start would report ("worker initialization failed").
//!
//! Rows: the CPU (instruction sets, threads); the CUDA driver (found where, the CUDA version it
//! supports); NVRTC (found where, version, the architectures it targets); the driver against the
//! kernels' CUDA version; each device (name, sm_XX, memory, whether NVRTC and the driver support
//! its architecture); the kernels compiled for each device architecture (and each `--arch`);
//! each device loading them and running them once against a known answer; the model (read and
//! validated, every tensor type has a kernel, it fits in memory).
//!
//! Without a GPU the CUDA rows are "skip" with the reason, unless `--require-gpu`.

use std::path::PathBuf;

use anyhow::Result;
use engine::gguf::Gguf;
use engine::runtime::cuda::{
    self, arch, driver, CudaError, DriverInfo, KernelCache, KernelFile, LibrarySearch, Nvrtc,
};
use kernels::cpu::{CpuKernels, Isa};
use kernels::quant::GgmlType;
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Also check this model: it reads and validates, every tensor type has a kernel, it fits
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Fail (instead of skip) when there is no usable GPU
    #[arg(long)]
    pub require_gpu: bool,
    /// Also compile the kernels for this architecture (e.g. 103), as for a device of it
    #[arg(long)]
    pub arch: Vec<u32>,
    /// The device whose driver to examine: cuda (the NVIDIA driver, default) or cuda-emu (the
    /// CUDA emulator in target/cuda-emu or $PLUMBLINE_CUDA_EMU)
    #[arg(long, default_value = "cuda")]
    pub device: engine::exec::Device,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

/// A row's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Warn,
    Skip,
    Fail,
}

impl Verdict {
    fn name(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Skip => "skip",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One layer of the stack.
#[derive(Clone, Debug)]
pub struct Row {
    pub layer: String,
    pub verdict: Verdict,
    pub detail: String,
    /// The root cause of a failure, skip or warning, with its fix.
    pub cause: Option<String>,
}

fn row(layer: impl Into<String>, verdict: Verdict, detail: impl Into<String>) -> Row {
    Row {
        layer: layer.into(),
        verdict,
        detail: detail.into(),
        cause: None,
    }
}

impl Row {
    fn because(mut self, cause: impl ToString) -> Row {
        self.cause = Some(cause.to_string());
        self
    }
}

/// What the doctor examines: values, so tests construct each failure.
pub struct Probe {
    pub search: LibrarySearch,
    pub require_gpu: bool,
    pub archs: Vec<u32>,
    pub files: Vec<KernelFile>,
    pub cache: KernelCache,
    pub model: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let search = match &args.device {
        engine::exec::Device::CudaEmu { .. } => engine::exec::cuda_search(&args.device)?,
        _ => LibrarySearch::from_env(),
    };
    let probe = Probe {
        search,
        require_gpu: args.require_gpu,
        archs: args.arch,
        files: cuda::FILES.to_vec(),
        cache: KernelCache::new(KernelCache::default_dir()),
        model: args.model,
    };
    let rows = diagnose(&probe);
    if args.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| json!({"layer": r.layer, "verdict": r.verdict.name(), "detail": r.detail, "cause": r.cause}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", format_rows(&rows));
    }
    let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
    if failed > 0 {
        anyhow::bail!("doctor: {failed} failed checks");
    }
    Ok(())
}

pub fn format_rows(rows: &[Row]) -> String {
    let w = rows.iter().map(|r| r.layer.len()).max().unwrap_or(5).max(5);
    let mut s = format!("{:<w$}  {:<7} detail\n", "layer", "verdict");
    for r in rows {
        s.push_str(&format!(
            "{:<w$}  {:<7} {}\n",
            r.layer,
            r.verdict.name(),
            r.detail
        ));
        if let Some(c) = &r.cause {
            for (i, line) in c.lines().enumerate() {
                let head = if i == 0 { "cause: " } else { "       " };
                s.push_str(&format!("{:<w$}  {:<7} {head}{line}\n", "", ""));
            }
        }
    }
    let n = |v| rows.iter().filter(|r| r.verdict == v).count();
    s.push_str(&format!(
        "{} ok, {} warnings, {} skipped, {} failed\n",
        n(Verdict::Ok),
        n(Verdict::Warn),
        n(Verdict::Skip),
        n(Verdict::Fail)
    ));
    s
}

/// Every check, in stack order.
pub fn diagnose(p: &Probe) -> Vec<Row> {
    let mut rows = vec![cpu_row()];
    // Without a GPU requirement, a missing CUDA layer is a skip, not a failure.
    let absent = if p.require_gpu {
        Verdict::Fail
    } else {
        Verdict::Skip
    };

    let drv = driver::probe(&p.search);
    let devices: Vec<cuda::DeviceInfo> = match &drv {
        Ok(d) => d.devices.clone().unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    rows.push(match &drv {
        Ok(d) => driver_row(d, absent),
        Err(e) => row("cuda driver", absent, "not usable").because(e),
    });

    let nv = Nvrtc::load(&p.search);
    // NVRTC matters as soon as there is something to compile for.
    let needed = p.require_gpu || !devices.is_empty() || !p.archs.is_empty();
    rows.push(match &nv {
        Ok(n) => {
            let (ma, mi) = n.version();
            let archs = n.archs();
            row(
                "nvrtc",
                Verdict::Ok,
                format!(
                    "{} (NVRTC {ma}.{mi}), targets sm_{} … sm_{} ({} architectures)",
                    n.path().display(),
                    archs.first().unwrap_or(&0),
                    archs.last().unwrap_or(&0),
                    archs.len()
                ),
            )
        }
        Err(e) => row(
            "nvrtc",
            if needed { Verdict::Fail } else { absent },
            "not usable",
        )
        .because(e),
    });

    if let (Ok(d), Ok(n)) = (&drv, &nv) {
        rows.push(compat_row(d, n));
    }

    for dev in &devices {
        rows.push(device_row(dev, drv.as_ref().ok(), nv.as_ref().ok()));
    }
    if drv.is_ok() && devices.is_empty() {
        let why = match drv.as_ref().map(|d| &d.devices) {
            Ok(Err(e)) => e.clone(),
            _ => "the driver reports no device".into(),
        };
        rows.push(row("devices", absent, "none").because(why));
    }

    let mut archs: Vec<u32> = devices
        .iter()
        .map(|d| d.arch)
        .chain(p.archs.iter().copied())
        .collect();
    archs.sort();
    archs.dedup();
    for &a in &archs {
        rows.push(match &nv {
            Ok(n) => kernels_row(n, &p.files, &p.cache, a),
            Err(_) => row(format!("kernels sm_{a}"), Verdict::Fail, "not compiled")
                .because("NVRTC is not usable (see the nvrtc row)"),
        });
    }
    if archs.is_empty() {
        rows.push(
            row("kernels", absent, "not compiled")
                .because("no device and no --arch to compile for (cargo xtask kernels compiles every architecture)"),
        );
    }

    for dev in &devices {
        rows.push(selftest_row(dev, p));
    }

    if let Some(m) = &p.model {
        rows.extend(model_rows(m, &devices));
    }
    rows
}

fn cpu_row() -> Row {
    let isas: Vec<&str> = Isa::available().iter().rev().map(|i| i.name()).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    row(
        "cpu",
        Verdict::Ok,
        format!(
            "{} ({threads} threads); backend cpu-{}",
            isas.join(" "),
            Isa::detect().name()
        ),
    )
}

fn driver_row(d: &DriverInfo, absent: Verdict) -> Row {
    let mut detail = format!(
        "{} (supports CUDA {})",
        d.path.display(),
        d.version_string()
    );
    if d.emulated {
        // Named as what it is: the kernels run on the CPU, checked stricter than a GPU; no
        // GPU's memory model, timing or cubin machine code is proven by it.
        detail.push_str(
            ": the plumbline CUDA emulator (kernels run on the CPU), not an NVIDIA driver",
        );
        if absent == Verdict::Fail {
            return row("cuda driver", Verdict::Fail, detail)
                .because("--require-gpu: the driver found is the CUDA emulator, not a GPU's");
        }
    }
    if d.version / 1000 < arch::CUDA_MAJOR {
        return row("cuda driver", Verdict::Fail, detail).because(CudaError::DriverTooOld {
            driver_major: d.version / 1000,
            driver_minor: d.version % 1000 / 10,
            cubin_major: arch::CUDA_MAJOR,
            cubin_minor: 0,
        });
    }
    match &d.devices {
        Ok(_) => row("cuda driver", Verdict::Ok, detail),
        Err(e) => row("cuda driver", absent, detail).because(e),
    }
}

/// The driver against the cubins NVRTC makes: same major version or newer, else they never
/// load; an older minor version loads cubins (CUDA minor-version compatibility) but would
/// reject PTX, which plumbline never ships.
fn compat_row(d: &DriverInfo, n: &Nvrtc) -> Row {
    let (ma, mi) = n.version();
    let (dma, dmi) = (d.version / 1000, d.version % 1000 / 10);
    let detail = format!("driver CUDA {dma}.{dmi}, kernels built by NVRTC {ma}.{mi}");
    if dma < ma {
        row("driver vs kernels", Verdict::Fail, detail).because(CudaError::DriverTooOld {
            driver_major: dma,
            driver_minor: dmi,
            cubin_major: ma,
            cubin_minor: mi,
        })
    } else if dma == ma && dmi < mi {
        row(
            "driver vs kernels",
            Verdict::Ok,
            format!("{detail}; cubins load by minor-version compatibility (PTX would not)"),
        )
    } else {
        row("driver vs kernels", Verdict::Ok, detail)
    }
}

fn device_row(dev: &cuda::DeviceInfo, drv: Option<&DriverInfo>, nv: Option<&Nvrtc>) -> Row {
    let layer = format!("device {}", dev.ordinal);
    let detail = format!(
        "{}, sm_{}, {:.1} GiB",
        dev.name,
        dev.arch,
        dev.memory_bytes as f64 / (1u64 << 30) as f64
    );
    if let Some(n) = nv {
        if let Err(e) = n.check_arch(dev.arch) {
            return row(layer, Verdict::Fail, detail).because(e);
        }
    }
    if let Some(d) = drv {
        let need = arch::min_driver_for(dev.arch);
        if d.version < need {
            return row(layer, Verdict::Fail, detail).because(format!(
                "the driver supports CUDA {}, but sm_{} needs a driver of CUDA {}.{} or newer: update the NVIDIA driver",
                d.version_string(),
                dev.arch,
                need / 1000,
                need % 1000 / 10
            ));
        }
    }
    row(layer, Verdict::Ok, detail)
}

fn kernels_row(n: &Nvrtc, files: &[KernelFile], cache: &KernelCache, a: u32) -> Row {
    let layer = format!("kernels sm_{a}");
    let t = std::time::Instant::now();
    let mut compiled = 0;
    let mut cached = 0;
    for f in files {
        match cache.get(n, f, a) {
            Ok((_, cuda::Origin::Compiled)) => compiled += 1,
            Ok((_, cuda::Origin::Cached)) => cached += 1,
            Err(e) => {
                return row(layer, Verdict::Fail, format!("{} does not compile", f.name)).because(e)
            }
        }
    }
    row(
        layer,
        Verdict::Ok,
        format!(
            "{} files: {compiled} compiled, {cached} from the cache {} ({:.1} s)",
            files.len(),
            cache.dir().display(),
            t.elapsed().as_secs_f64()
        ),
    )
}

/// Load every kernel on the device and run the known-answer checks.
fn selftest_row(dev: &cuda::DeviceInfo, p: &Probe) -> Row {
    let layer = format!("kernels on device {}", dev.ordinal);
    match cuda::backend::self_test(dev.ordinal, &p.search, &p.cache) {
        Ok(report) => row(layer, Verdict::Ok, report),
        Err(e) => row(layer, Verdict::Fail, "load or known-answer run failed").because(e),
    }
}

fn model_rows(path: &std::path::Path, devices: &[cuda::DeviceInfo]) -> Vec<Row> {
    let g = match Gguf::open(path) {
        Ok(g) => g,
        Err(e) => {
            return vec![row(
                "model",
                Verdict::Fail,
                format!("{} does not read", path.display()),
            )
            .because(e)]
        }
    };
    let mut rows = vec![row(
        "model",
        Verdict::Ok,
        format!(
            "{}: {} tensors, {}",
            path.display(),
            g.tensors().len(),
            g.architecture().unwrap_or("?")
        ),
    )];
    let cpu = CpuKernels::detect();
    let mut missing: Vec<(String, GgmlType)> = Vec::new();
    for t in g.tensors() {
        let on_cpu = cpu.supports(t.ggml_type);
        let on_cuda = devices.is_empty() || cuda::backend::CUDA_TYPES.contains(&t.ggml_type);
        if !on_cpu || !on_cuda {
            missing.push((t.name.clone(), t.ggml_type));
        }
    }
    rows.push(if missing.is_empty() {
        row("model types", Verdict::Ok, "every tensor's type has a kernel on the chosen backend")
    } else {
        let names: Vec<String> = missing.iter().take(8).map(|(n, t)| format!("{n} ({})", t.name())).collect();
        row("model types", Verdict::Fail, format!("{} tensors have no kernel", missing.len())).because(format!(
            "no kernel for {}{}: these tensors would need dequantizing (requantize the model, e.g. llama-quantize --allow-requantize)",
            names.join(", "),
            if missing.len() > 8 { ", …" } else { "" }
        ))
    });
    let bytes: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match mem_available() {
        Some(avail) if bytes > avail => rows.push(
            row(
                "model memory",
                Verdict::Fail,
                format!("{:.2} GiB of weights", gib(bytes)),
            )
            .because(format!(
                "only {:.2} GiB of host memory available",
                gib(avail)
            )),
        ),
        Some(avail) => rows.push(row(
            "model memory",
            Verdict::Ok,
            format!(
                "{:.2} GiB of weights, {:.2} GiB host memory available",
                gib(bytes),
                gib(avail)
            ),
        )),
        None => rows.push(
            row(
                "model memory",
                Verdict::Warn,
                format!("{:.2} GiB of weights", gib(bytes)),
            )
            .because("/proc/meminfo unreadable"),
        ),
    }
    for d in devices {
        if bytes > d.memory_bytes {
            rows.push(
                row(
                    format!("model on device {}", d.ordinal),
                    Verdict::Fail,
                    format!("{:.2} GiB of weights", gib(bytes)),
                )
                .because(format!("the device has {:.2} GiB", gib(d.memory_bytes))),
            );
        }
    }
    rows
}

/// `MemAvailable` of /proc/meminfo, bytes.
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    //! Each failure is constructed: a library search pointed at a temporary directory holding
    //! nothing, garbage, or a fake library built with the system C compiler that reports the
    //! version and devices a broken machine would.

    use std::path::Path;

    use super::*;
    use engine::gguf::GgufWriter;

    /// A shared library built from C source (no soname, so the loader never mistakes it for
    /// the real one by name).
    fn build_fake(dir: &Path, file: &str, c_src: &str) {
        let src = dir.join(format!("{file}.c"));
        std::fs::write(&src, c_src).unwrap_or_else(|e| panic!("writing {}: {e}", src.display()));
        let out = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join(file))
            .arg(&src)
            .output()
            .unwrap_or_else(|e| {
                panic!("these tests build fake CUDA libraries and need a C compiler (cc): {e}")
            });
        assert!(
            out.status.success(),
            "cc: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A fake `libcuda.so.1`: the CUDA version the driver reports, one device of `arch` (or
    /// none for 0).
    fn fake_driver(dir: &Path, version: u32, arch: u32) {
        let n = u32::from(arch != 0);
        build_fake(
            dir,
            "libcuda.so.1",
            &format!(
                r#"#include <string.h>
#include <stddef.h>
int cuDriverGetVersion(int* v) {{ *v = {version}; return 0; }}
int cuInit(unsigned f) {{ return 0; }}
int cuDeviceGetCount(int* n) {{ *n = {n}; return 0; }}
int cuDeviceGet(int* d, int i) {{ *d = i; return 0; }}
int cuDeviceGetName(char* b, int n, int d) {{ strncpy(b, "Fake GPU", n); return 0; }}
int cuDeviceGetAttribute(int* v, int a, int d) {{ *v = a == 75 ? {ma} : {mi}; return 0; }}
int cuDeviceTotalMem_v2(size_t* b, int d) {{ *b = (size_t)80 << 30; return 0; }}
int cuGetErrorName(int r, const char** s) {{ *s = "CUDA_ERROR_FAKE"; return 0; }}
"#,
                ma = arch / 10,
                mi = arch % 10
            ),
        );
    }

    /// A fake NVRTC of `major.minor` that lists `archs` and compiles nothing.
    fn fake_nvrtc(dir: &Path, file: &str, major: u32, minor: u32, archs: &[u32]) {
        let list: Vec<String> = archs.iter().map(|a| a.to_string()).collect();
        build_fake(
            dir,
            file,
            &format!(
                r#"#include <stddef.h>
static const int A[] = {{ {list} }};
int nvrtcVersion(int* ma, int* mi) {{ *ma = {major}; *mi = {minor}; return 0; }}
int nvrtcGetNumSupportedArchs(int* n) {{ *n = {n}; return 0; }}
int nvrtcGetSupportedArchs(int* a) {{ for (int i = 0; i < {n}; i++) a[i] = A[i]; return 0; }}
int nvrtcCreateProgram(void** p, const char* s, const char* n, int k, const char** h, const char** i) {{ return 5; }}
int nvrtcCompileProgram(void* p, int n, const char** o) {{ return 6; }}
int nvrtcGetProgramLogSize(void* p, size_t* n) {{ *n = 1; return 0; }}
int nvrtcGetProgramLog(void* p, char* l) {{ l[0] = 0; return 0; }}
int nvrtcGetCUBINSize(void* p, size_t* n) {{ *n = 0; return 0; }}
int nvrtcGetCUBIN(void* p, char* c) {{ return 0; }}
int nvrtcDestroyProgram(void** p) {{ return 0; }}
const char* nvrtcGetErrorString(int r) {{ return "NVRTC_ERROR_FAKE"; }}
"#,
                list = list.join(", "),
                n = archs.len()
            ),
        );
    }

    fn probe(dir: &Path, require_gpu: bool, archs: Vec<u32>) -> Probe {
        Probe {
            search: LibrarySearch::only(vec![dir.to_path_buf()]),
            require_gpu,
            archs,
            files: cuda::FILES.to_vec(),
            cache: KernelCache::new(dir.join("cache")),
            model: None,
        }
    }

    fn find<'a>(rows: &'a [Row], layer: &str) -> &'a Row {
        rows.iter()
            .find(|r| r.layer == layer)
            .unwrap_or_else(|| panic!("no row {layer} in\n{}", format_rows(rows)))
    }

    /// `layer` has `verdict` and its cause contains every one of `needles`.
    fn check(rows: &[Row], layer: &str, verdict: Verdict, needles: &[&str]) {
        let r = find(rows, layer);
        let text = format_rows(rows);
        assert_eq!(r.verdict, verdict, "{layer}:\n{text}");
        let cause = r.cause.clone().unwrap_or_default();
        for n in needles {
            assert!(cause.contains(n), "{layer}: cause lacks {n:?}:\n{text}");
        }
    }

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
    }

    /// The real NVRTC's directory, or `None` (then the test says it is skipped).
    fn real_nvrtc_dir() -> Option<PathBuf> {
        let f = LibrarySearch::from_env()
            .find(cuda::libs::NVRTC_SONAME)
            .ok()?;
        f.path.parent().map(Path::to_path_buf)
    }

    #[test]
    fn nothing_installed_is_skipped_without_require_gpu_and_fails_with_it() {
        let d = tmp();
        let rows = diagnose(&probe(d.path(), false, vec![]));
        check(
            &rows,
            "cuda driver",
            Verdict::Skip,
            &[
                "libcuda.so.1 not found",
                &d.path().display().to_string(),
                "install the NVIDIA driver",
            ],
        );
        check(
            &rows,
            "nvrtc",
            Verdict::Skip,
            &["libnvrtc.so.12 not found", "nvidia-cuda-nvrtc-cu12"],
        );
        assert_eq!(find(&rows, "cpu").verdict, Verdict::Ok);
        let rows = diagnose(&probe(d.path(), true, vec![]));
        check(
            &rows,
            "cuda driver",
            Verdict::Fail,
            &["libcuda.so.1 not found"],
        );
        check(&rows, "nvrtc", Verdict::Fail, &["libnvrtc.so.12 not found"]);
        check(&rows, "kernels", Verdict::Fail, &["no device"]);
    }

    #[test]
    fn a_file_that_is_not_a_library_is_named_with_the_loader_error() {
        let d = tmp();
        std::fs::write(d.path().join("libnvrtc.so.12"), b"not an ELF file")
            .unwrap_or_else(|e| panic!("{e}"));
        let rows = diagnose(&probe(d.path(), false, vec![90]));
        check(
            &rows,
            "nvrtc",
            Verdict::Fail,
            &["libnvrtc.so.12 could not be loaded"],
        );
        check(
            &rows,
            "kernels sm_90",
            Verdict::Fail,
            &["NVRTC is not usable"],
        );
    }

    #[test]
    fn nvrtc_13_beside_a_cuda_12_driver_is_a_major_version_mismatch() {
        let d = tmp();
        fake_driver(d.path(), 12090, 90);
        fake_nvrtc(
            d.path(),
            "libnvrtc.so.13",
            13,
            0,
            &[75, 80, 86, 89, 90, 100, 103, 120],
        );
        let rows = diagnose(&probe(d.path(), false, vec![]));
        check(
            &rows,
            "nvrtc",
            Verdict::Fail,
            &[
                "libnvrtc.so.12 not found",
                "libnvrtc.so.13",
                "major-version mismatch",
            ],
        );
        // The same library renamed to the CUDA 12 name is caught by the version it reports.
        let d2 = tmp();
        fake_driver(d2.path(), 12090, 90);
        fake_nvrtc(
            d2.path(),
            "libnvrtc.so.12",
            13,
            0,
            &[75, 80, 86, 89, 90, 100, 103, 120],
        );
        let rows = diagnose(&probe(d2.path(), false, vec![]));
        check(
            &rows,
            "nvrtc",
            Verdict::Fail,
            &["is NVRTC 13.0, but the backend targets CUDA 12"],
        );
    }

    #[test]
    fn nvrtc_12_4_cannot_target_an_sm_103_device() {
        let d = tmp();
        fake_driver(d.path(), 12090, 103);
        fake_nvrtc(
            d.path(),
            "libnvrtc.so.12",
            12,
            4,
            &[50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90],
        );
        let rows = diagnose(&probe(d.path(), false, vec![]));
        assert_eq!(
            find(&rows, "cuda driver").verdict,
            Verdict::Ok,
            "{}",
            format_rows(&rows)
        );
        check(
            &rows,
            "device 0",
            Verdict::Fail,
            &["NVRTC 12.4 cannot target sm_103", "needs NVRTC >= 12.9"],
        );
        check(
            &rows,
            "kernels sm_103",
            Verdict::Fail,
            &["NVRTC 12.4 cannot target sm_103"],
        );
    }

    #[test]
    fn a_driver_older_than_the_kernels_cuda_version_is_named() {
        let d = tmp();
        fake_driver(d.path(), 11080, 90);
        fake_nvrtc(
            d.path(),
            "libnvrtc.so.12",
            12,
            9,
            &[80, 86, 89, 90, 100, 103, 120],
        );
        let rows = diagnose(&probe(d.path(), false, vec![]));
        check(
            &rows,
            "cuda driver",
            Verdict::Fail,
            &[
                "supports CUDA 11.8, older than the kernels' CUDA 12",
                "update the NVIDIA driver",
            ],
        );
        check(
            &rows,
            "driver vs kernels",
            Verdict::Fail,
            &[
                "CUDA 11.8, older than the kernels' CUDA 12.9",
                "never loads",
            ],
        );
        // A CUDA 12.8 driver cannot run an sm_103 device (first supported by 12.9).
        let d2 = tmp();
        fake_driver(d2.path(), 12080, 103);
        fake_nvrtc(
            d2.path(),
            "libnvrtc.so.12",
            12,
            9,
            &[80, 86, 89, 90, 100, 103, 120],
        );
        let rows = diagnose(&probe(d2.path(), false, vec![]));
        check(
            &rows,
            "device 0",
            Verdict::Fail,
            &["sm_103 needs a driver of CUDA 12.9"],
        );
        assert_eq!(find(&rows, "driver vs kernels").verdict, Verdict::Ok);
    }

    #[test]
    fn a_kernel_that_does_not_compile_is_named_with_the_compiler_log() {
        let Some(real) = real_nvrtc_dir() else {
            eprintln!("skipped: NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12)");
            return;
        };
        let d = tmp();
        let mut p = probe(&real, false, vec![90]);
        p.cache = KernelCache::new(d.path());
        p.files = vec![KernelFile::custom(
            "broken.cu",
            "extern \"C\" __global__ void broken(float* x) { x[0] = no_such_value; }\n",
        )];
        let rows = diagnose(&p);
        assert_eq!(find(&rows, "nvrtc").verdict, Verdict::Ok);
        check(
            &rows,
            "kernels sm_90",
            Verdict::Fail,
            &["compiling broken.cu for sm_90 failed", "no_such_value"],
        );
    }

    #[test]
    fn the_real_kernels_compile_for_an_architecture_and_come_from_the_cache_the_second_time() {
        let Some(real) = real_nvrtc_dir() else {
            eprintln!("skipped: NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12)");
            return;
        };
        let d = tmp();
        let mut p = probe(&real, false, vec![86]);
        p.cache = KernelCache::new(d.path());
        p.files = vec![cuda::FILES[0], cuda::FILES[3]];
        let rows = diagnose(&p);
        let r = find(&rows, "kernels sm_86");
        assert_eq!(r.verdict, Verdict::Ok, "{}", format_rows(&rows));
        assert!(
            r.detail.contains("2 compiled, 0 from the cache"),
            "{}",
            r.detail
        );
        let rows = diagnose(&p);
        assert!(find(&rows, "kernels sm_86")
            .detail
            .contains("0 compiled, 2 from the cache"));
    }

    #[test]
    fn a_model_with_a_type_without_kernel_names_the_tensor() {
        let d = tmp();
        let path = d.path().join("iq2.gguf");
        let mut w = GgufWriter::new();
        w.add_metadata(
            "general.architecture",
            engine::gguf::MetadataValue::String("llama".into()),
        );
        let ty = GgmlType::Iq2Xxs;
        w.add_tensor(
            "blk.0.ffn_up.weight",
            ty,
            &[256, 2],
            vec![0u8; 2 * ty.type_size()],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        w.add_tensor(
            "blk.0.attn_norm.weight",
            GgmlType::F32,
            &[256],
            vec![0u8; 1024],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        w.write(&path).unwrap_or_else(|e| panic!("{e}"));
        let rows = model_rows(&path, &[]);
        check(
            &rows,
            "model types",
            Verdict::Fail,
            &["blk.0.ffn_up.weight (iq2_xxs)", "dequantizing"],
        );
        assert_eq!(find(&rows, "model").verdict, Verdict::Ok);
        let rows = model_rows(&d.path().join("missing.gguf"), &[]);
        check(&rows, "model", Verdict::Fail, &["missing.gguf"]);
    }
}
