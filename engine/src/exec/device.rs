//! Where an engine runs: the [`Device`] (CPU with its instruction set and threads, a CUDA device
//! by ordinal, or the CUDA backend on the CPU execution of the driver) and the [`Topology`]
//! (tensor-parallel degree and communicator). Both are plain values, parsed here once for every
//! command (`--device`, `--tp`), and handed to [`super::open`].

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use kernels::cpu::Isa;

/// A device to run on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend: `isa` (default: the widest this CPU has) and `threads` (default: every
    /// available core; split evenly over tensor-parallel ranks).
    Cpu {
        isa: Option<Isa>,
        threads: Option<usize>,
    },
    /// The CUDA backend on device `ordinal`, through the NVIDIA driver.
    Cuda { ordinal: usize },
    /// The CUDA backend on the CPU execution of the driver (`libcuda.so.1` built from
    /// `kernels/cuda/emu/`, found in `dir` or `$PLUMBLINE_CUDA_EMU`): the same backend code and
    /// kernels, checked stricter than a GPU. Never chosen unless asked for.
    CudaEmu { dir: Option<PathBuf> },
}

impl Device {
    /// The CPU with its defaults.
    pub fn cpu() -> Device {
        Device::Cpu {
            isa: None,
            threads: None,
        }
    }

    /// The CPU with the given instruction set and thread count (`None`: the defaults).
    pub fn cpu_with(isa: Option<Isa>, threads: Option<usize>) -> Device {
        Device::Cpu { isa, threads }
    }

    /// Whether this device runs the CUDA backend (real or emulated).
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda { .. } | Device::CudaEmu { .. })
    }
}

/// Why a device or topology string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceParseError {
    #[error("device {found:?}: expected cpu, cuda, cuda:N (N a device ordinal) or cuda-emu")]
    Device { found: String },
}

impl FromStr for Device {
    type Err = DeviceParseError;

    /// `cpu`, `cuda` (device 0), `cuda:N`, `cuda-emu`.
    fn from_str(s: &str) -> Result<Device, DeviceParseError> {
        let bad = || DeviceParseError::Device {
            found: s.to_owned(),
        };
        match s {
            "cpu" => Ok(Device::cpu()),
            "cuda" => Ok(Device::Cuda { ordinal: 0 }),
            "cuda-emu" => Ok(Device::CudaEmu { dir: None }),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                let ordinal = n.parse().map_err(|_| bad())?;
                Ok(Device::Cuda { ordinal })
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu { isa, threads } => {
                write!(f, "cpu")?;
                if let Some(i) = isa {
                    write!(f, "-{}", i.name())?;
                }
                if let Some(t) = threads {
                    write!(f, " ({t} threads)")?;
                }
                Ok(())
            }
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
            Device::CudaEmu { .. } => write!(f, "cuda-emu"),
        }
    }
}

/// How the model is spread over devices: `tp` tensor-parallel ranks (1: the model whole), the
/// ranks meeting through `comm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    pub tp: usize,
    pub comm: Comm,
}

/// The communicator of tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comm {
    /// Ranks as threads of this process, meeting in shared memory. On CUDA the ranks share one
    /// device (the single-device communicator): reductions go through the host.
    Shm,
}

impl Topology {
    /// The model whole on one device.
    pub fn single() -> Topology {
        Topology {
            tp: 1,
            comm: Comm::Shm,
        }
    }

    /// `tp` ranks over shared memory (`tp <= 1`: the model whole).
    pub fn tp(tp: usize) -> Topology {
        Topology {
            tp: tp.max(1),
            comm: Comm::Shm,
        }
    }
}

impl Default for Topology {
    fn default() -> Self {
        Topology::single()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(s: &str, expect: Result<Device, ()>) {
        assert_eq!(s.parse::<Device>().map_err(|_| ()), expect, "{s}");
    }

    #[test]
    fn device_strings() {
        check("cpu", Ok(Device::cpu()));
        check("cuda", Ok(Device::Cuda { ordinal: 0 }));
        check("cuda:3", Ok(Device::Cuda { ordinal: 3 }));
        check("cuda-emu", Ok(Device::CudaEmu { dir: None }));
        check("gpu", Err(()));
        check("cuda:", Err(()));
        check("cuda:-1", Err(()));
        check("cuda:x", Err(()));
        check("CPU", Err(()));
    }

    #[test]
    fn a_bad_device_names_what_it_expected() {
        let e = "tpu".parse::<Device>().err().map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some("device \"tpu\": expected cpu, cuda, cuda:N (N a device ordinal) or cuda-emu")
        );
    }

    #[test]
    fn topology_tp_one_is_whole() {
        assert_eq!(Topology::tp(0), Topology::single());
        assert_eq!(Topology::tp(1), Topology::single());
        assert_eq!(Topology::tp(4).tp, 4);
    }
}
