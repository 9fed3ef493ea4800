//! NVRTC, loaded at run time: its version, the architectures it can target, and compilation of
//! CUDA C++ to a cubin for one exact architecture, with the ptxas report.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use super::arch::CUDA_MAJOR;
use super::error::{CudaError, LibraryError};
use super::libs::{self, LibrarySearch, NVRTC_SONAME};

type Program = *mut std::ffi::c_void;
type Res = c_int;

/// The NVRTC entry points plumbline uses (nvrtc.h of CUDA 12).
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    num_archs: unsafe extern "C" fn(*mut c_int) -> Res,
    archs: unsafe extern "C" fn(*mut c_int) -> Res,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Res,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Res,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Res,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Res,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Res,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Res,
    destroy: unsafe extern "C" fn(*mut Program) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
}

/// A loaded NVRTC.
pub struct Nvrtc {
    api: Api,
    path: PathBuf,
    major: u32,
    minor: u32,
    archs: Vec<u32>,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("version", &(self.major, self.minor))
            .field("archs", &self.archs)
            .finish()
    }
}

/// A compiled kernel file.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's program log: warnings and, with `-Xptxas -v`, the ptxas report.
    pub log: String,
}

fn sym<T: Copy>(
    lib: &'static libloading::Library,
    path: &Path,
    name: &'static str,
) -> Result<T, LibraryError> {
    // SAFETY: every caller names `T` as the C signature of `name` in nvrtc.h.
    unsafe { libs::symbol(lib, path, "NVRTC", name) }
}

impl Nvrtc {
    /// Find `libnvrtc.so.12` with `search`, load it and check that it is NVRTC 12.
    pub fn load(search: &LibrarySearch) -> Result<Nvrtc, CudaError> {
        let found = search.find(NVRTC_SONAME)?;
        Self::load_path(&found.path)
    }

    /// Load NVRTC from a file.
    pub fn load_path(path: &Path) -> Result<Nvrtc, CudaError> {
        let lib = libs::open(path)?;
        let api = Api {
            version: sym(lib, path, "nvrtcVersion")?,
            num_archs: sym(lib, path, "nvrtcGetNumSupportedArchs")?,
            archs: sym(lib, path, "nvrtcGetSupportedArchs")?,
            create: sym(lib, path, "nvrtcCreateProgram")?,
            compile: sym(lib, path, "nvrtcCompileProgram")?,
            log_size: sym(lib, path, "nvrtcGetProgramLogSize")?,
            log: sym(lib, path, "nvrtcGetProgramLog")?,
            cubin_size: sym(lib, path, "nvrtcGetCUBINSize")?,
            cubin: sym(lib, path, "nvrtcGetCUBIN")?,
            destroy: sym(lib, path, "nvrtcDestroyProgram")?,
            error_string: sym(lib, path, "nvrtcGetErrorString")?,
        };
        let (mut ma, mut mi) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        let r = unsafe { (api.version)(&mut ma, &mut mi) };
        let mut n = 0;
        // SAFETY: writes one int.
        let r2 = unsafe { (api.num_archs)(&mut n) };
        let mut archs = vec![0 as c_int; n.clamp(0, 1024) as usize];
        // SAFETY: `archs` has room for the `n` ints nvrtcGetSupportedArchs writes.
        let r3 = if n > 0 && n <= 1024 {
            unsafe { (api.archs)(archs.as_mut_ptr()) }
        } else {
            0
        };
        let mut nv = Nvrtc {
            api,
            path: path.to_path_buf(),
            major: ma.max(0) as u32,
            minor: mi.max(0) as u32,
            archs: Vec::new(),
        };
        for (call, r) in [
            ("nvrtcVersion", r),
            ("nvrtcGetSupportedArchs", r2),
            ("nvrtcGetSupportedArchs", r3),
        ] {
            if r != 0 {
                return Err(nv.err(call, "(library)", r));
            }
        }
        nv.archs = archs.into_iter().map(|a| a.max(0) as u32).collect();
        if nv.major != CUDA_MAJOR {
            return Err(LibraryError::MajorMismatch {
                path: path.to_path_buf(),
                library: "NVRTC",
                found: format!("{}.{}", nv.major, nv.minor),
                expected_major: CUDA_MAJOR,
                fix: "pip install nvidia-cuda-nvrtc-cu12",
            }
            .into());
        }
        Ok(nv)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `(major, minor)`.
    pub fn version(&self) -> (u32, u32) {
        (self.major, self.minor)
    }

    /// The architectures this NVRTC compiles for (`nvrtcGetSupportedArchs`), ascending.
    pub fn archs(&self) -> &[u32] {
        &self.archs
    }

    /// [`CudaError::ArchUnsupported`] unless this NVRTC can target `arch`.
    pub fn check_arch(&self, arch: u32) -> Result<(), CudaError> {
        check_arch(self.major, self.minor, &self.archs, arch)
    }

    fn err(&self, call: &'static str, kernel: &str, r: Res) -> CudaError {
        // SAFETY: nvrtcGetErrorString returns a static C string (or null).
        let p = unsafe { (self.api.error_string)(r) };
        let message = if p.is_null() {
            format!("error {r}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        CudaError::Nvrtc {
            call,
            kernel: kernel.to_string(),
            message,
        }
    }

    /// Compile `source` (named `name` in messages) to a cubin for `sm_{arch}`, with the ptxas
    /// report (`-Xptxas -v`) in the log.
    pub fn compile(&self, name: &str, source: &str, arch: u32) -> Result<Compiled, CudaError> {
        self.check_arch(arch)?;
        let src = CString::new(source).map_err(|_| CudaError::Nvrtc {
            call: "nvrtcCreateProgram",
            kernel: name.to_string(),
            message: "source holds a NUL byte".into(),
        })?;
        let cname = CString::new(name).unwrap_or_default();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: `src` and `cname` are NUL-terminated and outlive the call; no headers.
        let r = unsafe {
            (self.api.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(self.err("nvrtcCreateProgram", name, r));
        }
        let opts: Vec<CString> = [
            format!("--gpu-architecture=sm_{arch}"),
            "--std=c++17".into(),
            "-Xptxas".into(),
            "-v".into(),
        ]
        .into_iter()
        .filter_map(|o| CString::new(o).ok())
        .collect();
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let result = (|| {
            // SAFETY: `prog` was created above; `ptrs` point into `opts`, alive for the call.
            let rc = unsafe { (self.api.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr()) };
            let log = self.log(prog, name)?;
            if rc != 0 {
                return Err(CudaError::Compile {
                    kernel: name.to_string(),
                    arch,
                    log: if log.trim().is_empty() {
                        self.err("nvrtcCompileProgram", name, rc).to_string()
                    } else {
                        log
                    },
                });
            }
            let mut n = 0usize;
            // SAFETY: writes one size_t.
            let r = unsafe { (self.api.cubin_size)(prog, &mut n) };
            if r != 0 {
                return Err(self.err("nvrtcGetCUBINSize", name, r));
            }
            let mut cubin = vec![0u8; n];
            // SAFETY: `cubin` has the `n` bytes nvrtcGetCUBIN writes.
            let r = unsafe { (self.api.cubin)(prog, cubin.as_mut_ptr().cast()) };
            if r != 0 {
                return Err(self.err("nvrtcGetCUBIN", name, r));
            }
            Ok(Compiled { cubin, log })
        })();
        // SAFETY: destroys the program created above, once.
        unsafe { (self.api.destroy)(&mut prog) };
        result
    }

    fn log(&self, prog: Program, name: &str) -> Result<String, CudaError> {
        let mut n = 0usize;
        // SAFETY: writes one size_t.
        let r = unsafe { (self.api.log_size)(prog, &mut n) };
        if r != 0 {
            return Err(self.err("nvrtcGetProgramLogSize", name, r));
        }
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` has the `n` bytes (NUL included) the log takes.
        let r = unsafe { (self.api.log)(prog, buf.as_mut_ptr().cast()) };
        if r != 0 {
            return Err(self.err("nvrtcGetProgramLog", name, r));
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }
}

/// Whether NVRTC `major.minor`, which lists `supported`, can target `arch`. The list is the
/// authority (`nvrtcGetSupportedArchs`); an arch it lacks is named with the first release that
/// has it.
pub fn check_arch(major: u32, minor: u32, supported: &[u32], arch: u32) -> Result<(), CudaError> {
    if supported.contains(&arch) {
        return Ok(());
    }
    Err(CudaError::ArchUnsupported {
        major,
        minor,
        arch,
        supported: supported.to_vec(),
    })
}
