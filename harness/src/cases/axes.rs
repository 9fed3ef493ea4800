//! The axes of a case other than model and weights: backend, topology, speculation. Each is
//! written in case names exactly as `Display` prints it and parses back with `FromStr`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::HarnessError;

/// CUDA architectures the matrix knows (ARCHITECTURE.md: sm_80 … sm_120).
pub const CUDA_ARCHS: [u32; 6] = [80, 86, 89, 90, 100, 120];

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    CpuScalar,
    CpuAvx2,
    CpuAvx512,
    /// `cuda-sm{sm}`, e.g. sm 90 for H100/H200. Any architecture number parses (sm103 exists);
    /// the matrix enumerates [`CUDA_ARCHS`].
    Cuda {
        sm: u32,
    },
    /// `cuda-emu`: the CUDA backend and kernels on the CPU execution of the driver
    /// (`kernels/cuda/emu/`), judged by the same gates and tolerances as a real CUDA case.
    CudaEmu,
}

impl Backend {
    pub const CPU: [Backend; 3] = [Backend::CpuScalar, Backend::CpuAvx2, Backend::CpuAvx512];

    /// The CUDA backend, on a device or emulated.
    pub fn is_cuda(self) -> bool {
        matches!(self, Backend::Cuda { .. } | Backend::CudaEmu)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::CpuScalar => f.write_str("cpu-scalar"),
            Backend::CpuAvx2 => f.write_str("cpu-avx2"),
            Backend::CpuAvx512 => f.write_str("cpu-avx512"),
            Backend::Cuda { sm } => write!(f, "cuda-sm{sm}"),
            Backend::CudaEmu => f.write_str("cuda-emu"),
        }
    }
}

impl FromStr for Backend {
    type Err = HarnessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu-scalar" => Ok(Backend::CpuScalar),
            "cpu-avx2" => Ok(Backend::CpuAvx2),
            "cpu-avx512" => Ok(Backend::CpuAvx512),
            "cuda-emu" => Ok(Backend::CudaEmu),
            _ => {
                let sm = s
                    .strip_prefix("cuda-sm")
                    .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|d| d.parse::<u32>().ok())
                    // Compute capability 5.0 is the oldest any CUDA toolkit still targets.
                    .filter(|sm| (50..=999).contains(sm))
                    .ok_or_else(|| HarnessError::UnknownBackend(s.to_owned()))?;
                Ok(Backend::Cuda { sm })
            }
        }
    }
}

/// How tensor-parallel ranks talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Topology {
    /// Ranks on one host, shared memory.
    Shm,
    Pcie,
    Nvlink,
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Topology::Shm => "shm",
            Topology::Pcie => "pcie",
            Topology::Nvlink => "nvlink",
        })
    }
}

impl FromStr for Topology {
    type Err = HarnessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shm" => Ok(Topology::Shm),
            "pcie" => Ok(Topology::Pcie),
            "nvlink" => Ok(Topology::Nvlink),
            _ => Err(HarnessError::UnknownTopology(s.to_owned())),
        }
    }
}

/// Speculative decoding mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Spec {
    Off,
    /// Tree speculation with a node budget and a per-node top-k: `tree-b{budget}k{top_k}`.
    Tree {
        budget: u32,
        top_k: u32,
    },
}

/// The path the tokens take through the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum PathMode {
    /// One batched prefill of the text (teacher-forced), or speculation's rounds.
    #[default]
    Prefill,
    /// The text prefilled in chunks of odd sizes (none a multiple of a tile), each chunk
    /// compared tap by tap with the reference's rows for its positions. On the real model the
    /// whole text (past the sliding window) a few rows at a time.
    Chunked,
    /// Part of the text prefilled, then one decode step per token to the end, each step
    /// compared tap by tap with the reference's row for its position.
    Decode,
    /// Served by `plumbline serve` and judged through its HTTP API.
    Serve,
    /// Several sequences of the text in ragged batches (prefill beside decode, equal positions),
    /// each judged against its run alone and the reference.
    Batched,
}

impl fmt::Display for PathMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathMode::Prefill => "prefill",
            PathMode::Chunked => "chunked",
            PathMode::Decode => "decode",
            PathMode::Serve => "serve",
            PathMode::Batched => "batched",
        })
    }
}

impl FromStr for PathMode {
    type Err = HarnessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(PathMode::Prefill),
            "chunked" => Ok(PathMode::Chunked),
            "decode" => Ok(PathMode::Decode),
            "serve" => Ok(PathMode::Serve),
            "batched" => Ok(PathMode::Batched),
            _ => Err(HarnessError::UnknownPath(s.to_owned())),
        }
    }
}

/// What the engine keeps its KV cache in (`--kv-dtype`). A case with an f16 cache compares
/// against the exact-numerics reference rounding its cache the same way
/// (`reference::CacheDtype`), and its name ends in `-kvf16` (`…/chunked-kvf16`); an f32 cache,
/// the default, adds nothing to the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum KvCache {
    #[default]
    F32,
    F16,
}

impl KvCache {
    /// The case-name suffix of a non-default cache.
    pub const F16_SUFFIX: &'static str = "-kvf16";

    /// The default (serde skips writing it).
    pub fn is_f32(&self) -> bool {
        *self == KvCache::F32
    }
}

impl fmt::Display for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvCache::F32 => "f32",
            KvCache::F16 => "f16",
        })
    }
}

impl FromStr for KvCache {
    type Err = HarnessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(KvCache::F32),
            "f16" => Ok(KvCache::F16),
            _ => Err(HarnessError::UnknownKvCache(s.to_owned())),
        }
    }
}

impl Spec {
    /// The production tree setting (budget 8, top-k 4) the speculation cases run.
    pub const TREE_B8K4: Spec = Spec::Tree {
        budget: 8,
        top_k: 4,
    };
    /// A larger budget beside it.
    pub const TREE_B16K4: Spec = Spec::Tree {
        budget: 16,
        top_k: 4,
    };
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Spec::Off => f.write_str("off"),
            Spec::Tree { budget, top_k } => write!(f, "tree-b{budget}k{top_k}"),
        }
    }
}

impl FromStr for Spec {
    type Err = HarnessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" {
            return Ok(Spec::Off);
        }
        let bad = || HarnessError::UnknownSpec(s.to_owned());
        let rest = s.strip_prefix("tree-b").ok_or_else(bad)?;
        let (budget, top_k) = rest.split_once('k').ok_or_else(bad)?;
        let num = |d: &str| {
            if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            d.parse::<u32>().ok().filter(|&v| v > 0)
        };
        match (num(budget), num(top_k)) {
            (Some(budget), Some(top_k)) => Ok(Spec::Tree { budget, top_k }),
            _ => Err(bad()),
        }
    }
}

macro_rules! serde_as_string {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
serde_as_string!(Backend, Topology, Spec, PathMode, KvCache);

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: FromStr + fmt::Display>(s: &str) -> Option<String> {
        s.parse::<T>().ok().map(|v| v.to_string())
    }

    #[test]
    fn backends_parse_and_print() {
        for s in [
            "cpu-scalar",
            "cpu-avx2",
            "cpu-avx512",
            "cuda-sm80",
            "cuda-sm90",
            "cuda-sm120",
            "cuda-sm103",
        ] {
            assert_eq!(round_trip::<Backend>(s).as_deref(), Some(s));
        }
        for s in [
            "cpu",
            "cuda-sm",
            "cuda-sm9x",
            "cuda-sm7",
            "cuda-sm+90",
            "CPU-AVX2",
            "",
        ] {
            assert!(s.parse::<Backend>().is_err(), "{s}");
        }
    }

    #[test]
    fn topologies_and_specs_parse_and_print() {
        for s in ["shm", "pcie", "nvlink"] {
            assert_eq!(round_trip::<Topology>(s).as_deref(), Some(s));
        }
        assert!("nvl".parse::<Topology>().is_err());
        for s in ["off", "tree-b8k4", "tree-b16k2"] {
            assert_eq!(round_trip::<Spec>(s).as_deref(), Some(s));
        }
        for s in ["prefill", "chunked", "decode", "serve"] {
            assert_eq!(round_trip::<PathMode>(s).as_deref(), Some(s));
            assert!(
                s == "prefill" || s.parse::<Spec>().is_err(),
                "{s} is a path"
            );
        }
        assert!("Chunked".parse::<PathMode>().is_err());
        for s in [
            "on",
            "tree",
            "tree-b8",
            "tree-bk4",
            "tree-b0k4",
            "tree-b8k",
            "tree-b8k4x",
            "chunk",
            "Decode",
        ] {
            assert!(s.parse::<Spec>().is_err(), "{s}");
        }
    }

    #[test]
    fn kv_caches_parse_and_print() {
        for s in ["f32", "f16"] {
            assert_eq!(round_trip::<KvCache>(s).as_deref(), Some(s));
        }
        for s in ["F16", "kvf16", "bf16", "q8_0", ""] {
            assert!(s.parse::<KvCache>().is_err(), "{s}");
        }
        assert_eq!(KvCache::default(), KvCache::F32);
    }

    #[test]
    fn serde_uses_the_case_name_spelling() {
        let json =
            serde_json::to_string(&(Backend::Cuda { sm: 90 }, Topology::Nvlink, Spec::TREE_B8K4))
                .unwrap_or_default();
        assert_eq!(json, r#"["cuda-sm90","nvlink","tree-b8k4"]"#);
        let back: Result<Backend, _> = serde_json::from_str(r#""cuda-smX""#);
        assert!(back.is_err());
    }
}
