//! The CUDA driver (`libcuda.so.1`), probed without creating a context: its version and the
//! devices with their architecture and memory. The backend itself drives the GPU through
//! cudarc; this probe is what `plumbline doctor` and `engine::capabilities()` read, and it
//! never panics when the driver is absent or broken.

use std::ffi::{c_char, c_int};
use std::path::{Path, PathBuf};

use super::error::{CudaError, LibraryError};
use super::libs::{self, LibrarySearch, DRIVER_SONAME};

/// One device as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// `major × 10 + minor`.
    pub arch: u32,
    pub memory_bytes: u64,
}

/// What the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    pub path: PathBuf,
    /// CUDA version the driver supports, `major × 1000 + minor × 10` (12090 = 12.9).
    pub version: u32,
    /// `Err` when `cuInit` failed (no device, or the kernel module is not loaded): the message
    /// names the driver's error.
    pub devices: Result<Vec<DeviceInfo>, String>,
    /// The library is plumbline's CUDA emulator (`kernels/cuda/emu`, it exports
    /// `plumblineEmuLastError`), not an NVIDIA driver: its device is no GPU.
    pub emulated: bool,
}

impl DriverInfo {
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, self.version % 1000 / 10)
    }
}

const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

type Fn0 = unsafe extern "C" fn(u32) -> c_int;
type FnI = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnDev = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type FnName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type FnAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type FnMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type FnErr = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

fn sym<T: Copy>(
    lib: &'static libloading::Library,
    path: &Path,
    name: &'static str,
) -> Result<T, LibraryError> {
    // SAFETY: every caller names `T` as the C signature of `name` in cuda.h.
    unsafe { libs::symbol(lib, path, "CUDA driver", name) }
}

/// Find and probe the driver.
pub fn probe(search: &LibrarySearch) -> Result<DriverInfo, CudaError> {
    let found = search.find(DRIVER_SONAME)?;
    probe_path(&found.path)
}

/// Probe the driver library at `path`.
pub fn probe_path(path: &Path) -> Result<DriverInfo, CudaError> {
    let lib = libs::open(path)?;
    let get_version: FnI = sym(lib, path, "cuDriverGetVersion")?;
    let init: Fn0 = sym(lib, path, "cuInit")?;
    let count: FnI = sym(lib, path, "cuDeviceGetCount")?;
    let get: FnDev = sym(lib, path, "cuDeviceGet")?;
    let name: FnName = sym(lib, path, "cuDeviceGetName")?;
    let attr: FnAttr = sym(lib, path, "cuDeviceGetAttribute")?;
    let mem: FnMem = sym(lib, path, "cuDeviceTotalMem_v2")?;
    let err_name: FnErr = sym(lib, path, "cuGetErrorName")?;
    let describe = |r: c_int| {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string.
        let ok = unsafe { err_name(r, &mut p) } == 0 && !p.is_null();
        if ok {
            // SAFETY: non-null, static, NUL-terminated.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {r}")
        }
    };
    let mut v = 0;
    // SAFETY: writes one int; callable before cuInit.
    let r = unsafe { get_version(&mut v) };
    if r != 0 {
        return Err(CudaError::Driver(format!(
            "cuDriverGetVersion: {}",
            describe(r)
        )));
    }
    let devices = (|| {
        // SAFETY: flags must be 0.
        let r = unsafe { init(0) };
        if r != 0 {
            return Err(format!("cuInit: {}", describe(r)));
        }
        let mut n = 0;
        // SAFETY: writes one int.
        let r = unsafe { count(&mut n) };
        if r != 0 {
            return Err(format!("cuDeviceGetCount: {}", describe(r)));
        }
        let mut out = Vec::new();
        for i in 0..n {
            let (mut dev, mut ma, mut mi, mut bytes) = (0, 0, 0, 0usize);
            let mut buf = [0 as c_char; 256];
            // SAFETY: each call writes into the locals/buffer given; `dev` is a valid ordinal.
            let rs = unsafe {
                [
                    get(&mut dev, i),
                    name(buf.as_mut_ptr(), buf.len() as c_int, dev),
                    attr(&mut ma, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                    attr(&mut mi, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                    mem(&mut bytes, dev),
                ]
            };
            if let Some(&r) = rs.iter().find(|&&r| r != 0) {
                return Err(format!("device {i}: {}", describe(r)));
            }
            // SAFETY: the driver NUL-terminates the name within the buffer.
            let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            out.push(DeviceInfo {
                ordinal: i as usize,
                name,
                arch: (ma.max(0) * 10 + mi.max(0)) as u32,
                memory_bytes: bytes as u64,
            });
        }
        Ok(out)
    })();
    // SAFETY: only the symbol's presence is looked up; it is never called here.
    let emulated =
        unsafe { lib.get::<unsafe extern "C" fn() -> *const c_char>(b"plumblineEmuLastError\0") }
            .is_ok();
    Ok(DriverInfo {
        path: path.to_path_buf(),
        version: v.max(0) as u32,
        devices,
        emulated,
    })
}
