//! The on-disk cubin cache, keyed by (source hash, architecture, NVRTC version): a service
//! start compiles each kernel file once per machine, and a changed source, a new device or an
//! updated NVRTC never reuses a stale cubin.

use std::path::{Path, PathBuf};

use super::cubin::cubin_arch;
use super::error::CudaError;
use super::nvrtc::{Compiled, Nvrtc};
use super::sources::KernelFile;

/// A cubin cache directory.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

/// Where a cubin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Compiled,
    Cached,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// `$PLUMBLINE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/plumbline/kernels`, else
    /// `~/.cache/plumbline/kernels`.
    pub fn default_dir() -> PathBuf {
        if let Some(d) = std::env::var_os("PLUMBLINE_KERNEL_CACHE") {
            return PathBuf::from(d);
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        base.join("plumbline").join("kernels")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache file of `file` for `arch` under NVRTC `version`.
    pub fn path_for(&self, file: &KernelFile, arch: u32, version: (u32, u32)) -> PathBuf {
        let stem = file.name.trim_end_matches(".cu");
        let h = file.hash();
        self.dir.join(format!(
            "{stem}-{}-sm_{arch}-nvrtc{}.{}.cubin",
            &h[..16],
            version.0,
            version.1
        ))
    }

    /// A cached cubin of `file` for `arch` made by any NVRTC version, with that version: how a
    /// machine without NVRTC runs prebuilt kernels (`cargo xtask gpu-archive` ships them).
    pub fn find_any(&self, file: &KernelFile, arch: u32) -> Option<(Vec<u8>, (u32, u32))> {
        let stem = file.name.trim_end_matches(".cu");
        let h = file.hash();
        let prefix = format!("{stem}-{}-sm_{arch}-nvrtc", &h[..16]);
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&prefix) && n.ends_with(".cubin"))
            .collect();
        names.sort();
        for n in names.iter().rev() {
            let ver = n[prefix.len()..].trim_end_matches(".cubin");
            let Some((ma, mi)) = ver.split_once('.') else {
                continue;
            };
            let (Ok(ma), Ok(mi)) = (ma.parse(), mi.parse()) else {
                continue;
            };
            if let Ok(bytes) = std::fs::read(self.dir.join(n)) {
                if cubin_arch(&bytes) == Ok(arch) {
                    return Some((bytes, (ma, mi)));
                }
            }
        }
        None
    }

    /// The cubin of `file` for `arch`: from the cache when present and valid (an ELF for that
    /// architecture), else compiled and stored (written to a temporary name, then renamed, so
    /// a concurrent reader never sees half a file).
    pub fn get(
        &self,
        nvrtc: &Nvrtc,
        file: &KernelFile,
        arch: u32,
    ) -> Result<(Vec<u8>, Origin), CudaError> {
        let path = self.path_for(file, arch, nvrtc.version());
        if let Ok(bytes) = std::fs::read(&path) {
            if cubin_arch(&bytes) == Ok(arch) {
                return Ok((bytes, Origin::Cached));
            }
        }
        let Compiled { cubin, .. } = nvrtc.compile(file.name, &file.program(), arch)?;
        check_cubin(file.name, &cubin, arch)?;
        let cache_err = |e: std::io::Error| CudaError::Cache {
            path: path.clone(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(&self.dir).map_err(cache_err)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &cubin).map_err(cache_err)?;
        std::fs::rename(&tmp, &path).map_err(cache_err)?;
        Ok((cubin, Origin::Compiled))
    }
}

/// [`CudaError::BadCubin`] unless `cubin` is an ELF for `arch`.
pub fn check_cubin(kernel: &str, cubin: &[u8], arch: u32) -> Result<(), CudaError> {
    match cubin_arch(cubin) {
        Ok(a) if a == arch => Ok(()),
        Ok(a) => Err(CudaError::BadCubin {
            kernel: kernel.to_string(),
            reason: format!("built for sm_{a}, expected sm_{arch}"),
        }),
        Err(reason) => Err(CudaError::BadCubin {
            kernel: kernel.to_string(),
            reason,
        }),
    }
}
