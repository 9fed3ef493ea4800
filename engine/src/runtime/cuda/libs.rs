//! Finding and loading the CUDA libraries at run time.
//!
//! Nothing CUDA is linked at build time. A [`LibrarySearch`] is a value: the directories to look
//! in, in order, and whether to fall back to the system loader's own search (`ld.so.cache`).
//! [`LibrarySearch::from_env`] builds the default one; tests build their own pointing at a
//! temporary directory, so a missing, broken or wrong-version library is constructed, not
//! imagined.
//!
//! A library found here is opened by its full path and kept open for the life of the process;
//! cudarc, which opens libraries by name, then gets the same one (the loader matches an already
//! loaded library by its soname), so cudarc never reaches its panicking "not found" path.

use std::path::{Path, PathBuf};

use super::error::LibraryError;

/// The NVIDIA driver library (its soname does not change with the CUDA version).
pub const DRIVER_SONAME: &str = "libcuda.so.1";
/// The NVRTC library of the CUDA major version the backend targets.
pub const NVRTC_SONAME: &str = "libnvrtc.so.12";
/// A folder holding the CUDA emulator's `libcuda.so.1` (kernels/cuda/emu/build.sh): when set,
/// [`LibrarySearch::from_env`] finds the driver there before anywhere else.
pub const EMULATOR_ENV: &str = "PLUMBLINE_CUDA_EMU";

/// Where to look for the CUDA libraries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibrarySearch {
    pub dirs: Vec<PathBuf>,
    /// After `dirs`, ask the system loader by soname (finds the driver in `ld.so.cache`).
    pub system: bool,
}

/// A library file found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// Found by the system loader rather than in one of the directories.
    pub via_system: bool,
}

impl LibrarySearch {
    /// Only these directories (no system fallback): what tests use.
    pub fn only(dirs: Vec<PathBuf>) -> Self {
        LibrarySearch {
            dirs,
            system: false,
        }
    }

    /// The default search with the CUDA emulator's folder first (the folder
    /// kernels/cuda/emu/build.sh wrote `libcuda.so.1` to): the driver is the emulator, NVRTC
    /// is found as usual. The emulator is used only when asked for, by this or by
    /// `$PLUMBLINE_CUDA_EMU`, never in place of a real driver otherwise.
    pub fn emulator(dir: PathBuf) -> Self {
        let mut s = Self::from_env();
        s.dirs.retain(|d| d != &dir);
        s.dirs.insert(0, dir);
        s
    }

    /// The default search: `$PLUMBLINE_CUDA_EMU` (the emulator, only when set),
    /// `$PLUMBLINE_CUDA_LIB_PATH` (colon-separated), `$LD_LIBRARY_PATH`, the PyPI wheels'
    /// `nvidia/*/lib` folders of every Python found in the usual places, `$CUDA_HOME/lib64`,
    /// `/usr/local/cuda/lib64`, the distribution's library folders, then the system loader.
    pub fn from_env() -> Self {
        let mut dirs = Vec::new();
        if let Some(v) = std::env::var_os(EMULATOR_ENV).filter(|v| !v.is_empty()) {
            dirs.push(PathBuf::from(v));
        }
        for var in ["PLUMBLINE_CUDA_LIB_PATH", "LD_LIBRARY_PATH"] {
            if let Some(v) = std::env::var_os(var) {
                dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
            }
        }
        dirs.extend(python_wheel_dirs());
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(v) = std::env::var_os(var) {
                dirs.push(PathBuf::from(v).join("lib64"));
            }
        }
        for d in [
            "/usr/local/cuda/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/lib/wsl/lib",
        ] {
            dirs.push(PathBuf::from(d));
        }
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|d| seen.insert(d.clone()));
        LibrarySearch { dirs, system: true }
    }

    /// The first `soname` in the directories, or (with `system`) whatever the loader finds.
    pub fn find(&self, soname: &str) -> Result<Found, LibraryError> {
        for d in &self.dirs {
            let p = d.join(soname);
            if p.is_file() {
                return Ok(Found {
                    path: p,
                    via_system: false,
                });
            }
        }
        if self.system {
            if let Some(p) = system_lookup(soname) {
                return Ok(Found {
                    path: p,
                    via_system: true,
                });
            }
        }
        Err(LibraryError::NotFound {
            soname: soname.to_string(),
            searched: self.dirs.clone(),
            other_majors: self.other_majors(soname),
        })
    }

    /// Files of the same library with another major version (`libnvrtc.so.13`, `libnvrtc.so`
    /// pointing at one) in the search directories.
    pub fn other_majors(&self, soname: &str) -> Vec<PathBuf> {
        let Some((stem, _)) = soname.rsplit_once(".so.") else {
            return Vec::new();
        };
        let prefix = format!("{stem}.so");
        let mut out = Vec::new();
        for d in &self.dirs {
            let Ok(rd) = std::fs::read_dir(d) else {
                continue;
            };
            let mut names: Vec<String> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                // `libnvrtc.so.13`, `libnvrtc.so` (a link to some version); not `libnvrtc.so.12.9`,
                // which is the wanted major version.
                .filter(|n| {
                    n.starts_with(&prefix)
                        && n.as_str() != soname
                        && !n.starts_with(&format!("{soname}."))
                })
                .collect();
            names.sort();
            out.extend(names.into_iter().map(|n| d.join(n)));
        }
        out
    }
}

/// `nvidia/<pkg>/lib` of the Python installs in the usual places (user site, virtualenv,
/// pyenv, conda, the distribution's dist-packages).
fn python_wheel_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    if let Some(v) = std::env::var_os("CONDA_PREFIX") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        roots.push(home.join(".local/lib"));
        if let Ok(rd) = std::fs::read_dir(home.join(".pyenv/versions")) {
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("lib"))
                .collect();
            v.sort();
            roots.extend(v);
        }
    }
    for r in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        roots.push(PathBuf::from(r));
    }
    let mut out = Vec::new();
    for root in roots {
        let Ok(rd) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pys.sort();
        for py in pys {
            for site in ["site-packages", "dist-packages"] {
                for pkg in ["cuda_nvrtc", "cuda_runtime", "cublas"] {
                    let d = py.join(site).join("nvidia").join(pkg).join("lib");
                    if d.is_dir() {
                        out.push(d);
                    }
                }
            }
        }
    }
    out
}

/// Ask the system loader for `soname` and report the file it opened (from
/// `/proc/self/maps`), or `None`.
fn system_lookup(soname: &str) -> Option<PathBuf> {
    // SAFETY: opening a CUDA library runs its initializers, which have no preconditions; the
    // handle is dropped again (the library stays loaded if anything else holds it).
    let lib = unsafe { libloading::Library::new(soname) }.ok()?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with(soname))
        })
        .map(PathBuf::from);
    drop(lib);
    path.or_else(|| Some(PathBuf::from(soname)))
}

/// Open `path` and keep it open for the life of the process (see the module docs).
pub fn open(path: &Path) -> Result<&'static libloading::Library, LibraryError> {
    // SAFETY: as in `system_lookup`: the CUDA libraries' initializers have no preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| LibraryError::Load {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(Box::leak(Box::new(lib)))
}

/// The symbol `name` of `lib` (opened by [`open`] from `path`), as a `T`; `library` names the
/// library in the error ("NVRTC", "CUDA driver").
///
/// # Safety
///
/// `T` must be the C signature of `name` in that library's header. The pointer never dangles:
/// [`open`] never unloads a library.
pub unsafe fn symbol<T: Copy>(
    lib: &'static libloading::Library,
    path: &Path,
    library: &'static str,
    name: &'static str,
) -> Result<T, LibraryError> {
    // SAFETY: the caller's contract above.
    unsafe {
        lib.get::<T>(name.as_bytes())
            .map(|s| *s)
            .map_err(|e| LibraryError::Symbol {
                path: path.to_path_buf(),
                library,
                symbol: name,
                reason: e.to_string(),
            })
    }
}
