//! The case matrix: every (model, weights, backend, TP × topology, path, speculation) combination
//! `cargo xtask verify` knows, as serde values with stable names
//! `model/weights/backend/tpN-topology/spec`, e.g. `gemma3-270m/q4_k_m/cpu-avx512/tp1-shm/off`;
//! a case on another path than the batched prefill ends in its path instead
//! (`…/tp1-shm/chunked`), or in `path+spec` when it also speculates.
//!
//! [`Matrix::enumerate`] keeps the matrix small: every model × weight type runs on the three CPU
//! backends with TP 1 and no speculation; CUDA, tensor-parallel and speculative cases exist only for
//! models marked `extended` (the real model and one fixture), on their first weight type.
//! [`Case::skip_reason`] says why this machine (or this engine) cannot run a case: a skip is never a
//! pass.

mod axes;
mod filter;
mod glob;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use axes::{Backend, KvCache, PathMode, Spec, Topology, CUDA_ARCHS};
pub use filter::{Axis, Filter};
pub use glob::glob_match;

use crate::error::{HarnessError, Result};
use crate::tolerance::CaseContext;

/// Tensor-parallel degrees of the matrix.
pub const TP_DEGREES: [u32; 3] = [2, 4, 8];

/// One case.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Case {
    /// Model: a fixture name (`llama`, `gemma3`, `deepseek2`) or a real model (`gemma3-270m`).
    pub model: String,
    /// Weight type of the file, e.g. `f32`, `q8_0`, `q4_k_m`.
    pub weights: String,
    pub backend: Backend,
    pub tp: u32,
    pub topology: Topology,
    #[serde(default)]
    pub path: PathMode,
    pub spec: Spec,
    /// The engine's KV cache (f32 unless the name ends in `-kvf16`). Written only when f16, so
    /// an f32 case serializes as before the axis existed; absent, it reads as f32.
    #[serde(default, skip_serializing_if = "KvCache::is_f32")]
    pub kv: KvCache,
}

impl Case {
    pub fn new(
        model: &str,
        weights: &str,
        backend: Backend,
        tp: u32,
        topology: Topology,
        spec: Spec,
    ) -> Case {
        Case {
            model: model.to_owned(),
            weights: weights.to_owned(),
            backend,
            tp,
            topology,
            path: PathMode::Prefill,
            spec,
            kv: KvCache::F32,
        }
    }

    /// This case on `path`.
    pub fn on_path(mut self, path: PathMode) -> Case {
        self.path = path;
        self
    }

    /// This case with the engine's KV cache in `kv`.
    pub fn with_kv(mut self, kv: KvCache) -> Case {
        self.kv = kv;
        self
    }

    /// The stable name, `model/weights/backend/tpN-topology/spec`.
    pub fn name(&self) -> String {
        self.to_string()
    }

    /// What the tap comparison needs to know (weight class and backend).
    pub fn context(&self) -> Result<CaseContext> {
        CaseContext::new(&self.weights, &self.backend.to_string())
    }

    /// Why this case cannot run here, or `None` when it can. Reasons are checked in order:
    /// hardware, interconnect, engine features, model files.
    pub fn skip_reason(&self, machine: &MachineCaps) -> Option<String> {
        let e = &machine.engine;
        match self.backend {
            Backend::CpuScalar => {}
            Backend::CpuAvx2 if !machine.avx2 => return Some("CPU lacks AVX2".into()),
            Backend::CpuAvx512 if !machine.avx512 => return Some("CPU lacks AVX-512".into()),
            Backend::CpuAvx2 | Backend::CpuAvx512 => {}
            Backend::CudaEmu | Backend::Cuda { .. } if self.model.starts_with("glm-dsa") => {
                return Some(
                    "the CUDA backend has no lightning-indexer kernels yet (layer_norm, \
                     indexer_scores and select_top_k answer Unsupported)"
                        .into(),
                );
            }
            Backend::CudaEmu => {
                if !e.cuda {
                    return Some("engine built without the `cuda` feature".into());
                }
                if let Some(why) = &machine.cuda_emu_missing {
                    return Some(why.clone());
                }
            }
            Backend::Cuda { sm } => {
                if machine.cuda_archs.is_empty() {
                    return Some("no CUDA device".into());
                }
                let n = machine.cuda_archs.iter().filter(|&&a| a == sm).count();
                if n == 0 {
                    let found: Vec<String> = machine
                        .cuda_archs
                        .iter()
                        .map(|a| format!("sm_{a}"))
                        .collect();
                    return Some(format!(
                        "no CUDA device of architecture sm_{sm} (found {})",
                        found.join(", ")
                    ));
                }
                if !e.cuda {
                    return Some("engine built without the `cuda` feature".into());
                }
                if self.tp as usize > n {
                    return Some(format!(
                        "TP {} needs {} CUDA devices of sm_{sm}, found {n}",
                        self.tp, self.tp
                    ));
                }
            }
        }
        // PCIe and NVLink join CUDA devices; the emulated device is one device, its ranks meet
        // over `shm`.
        match (self.topology, matches!(self.backend, Backend::Cuda { .. })) {
            (Topology::Pcie | Topology::Nvlink, false) => {
                return Some(format!("topology {} needs CUDA devices", self.topology))
            }
            (_, _) if self.tp == 1 && self.topology != Topology::Shm => {
                return Some(format!(
                    "TP 1 has no interconnect: name it tp1-shm, not tp1-{}",
                    self.topology
                ))
            }
            (Topology::Nvlink, true) if !machine.nvlink => {
                return Some("no NVLink between the GPUs".into())
            }
            _ => {}
        }
        if self.tp > 1 && !e.tensor_parallel {
            return Some("tensor parallelism not implemented in the engine yet".into());
        }
        if matches!(self.spec, Spec::Tree { .. }) && !e.speculative {
            return Some("speculative decoding not implemented yet".into());
        }
        if let Some(how) = machine.models_missing.get(&self.model) {
            return Some(format!("model not fetched: run {how}"));
        }
        None
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}/tp{}-{}/",
            self.model, self.weights, self.backend, self.tp, self.topology
        )?;
        match (self.path, self.spec) {
            (PathMode::Prefill, spec) => write!(f, "{spec}"),
            (path, Spec::Off) => write!(f, "{path}"),
            (path, spec) => write!(f, "{path}+{spec}"),
        }?;
        match self.kv {
            KvCache::F32 => Ok(()),
            KvCache::F16 => f.write_str(KvCache::F16_SUFFIX),
        }
    }
}

impl FromStr for Case {
    type Err = HarnessError;
    fn from_str(name: &str) -> Result<Case> {
        let bad = |why: &str| HarnessError::CaseName {
            name: name.to_owned(),
            why: why.to_owned(),
        };
        let parts: Vec<&str> = name.split('/').collect();
        let [model, weights, backend, tp_topo, last] = parts[..] else {
            return Err(bad(&format!(
                "expected 5 parts separated by '/', found {}",
                parts.len()
            )));
        };
        if model.is_empty() || weights.is_empty() {
            return Err(bad("model and weights must not be empty"));
        }
        let (tp, topology) = tp_topo
            .strip_prefix("tp")
            .and_then(|r| r.split_once('-'))
            .ok_or_else(|| bad(&format!("expected tpN-topology, found `{tp_topo}`")))?;
        let tp: u32 = tp
            .parse()
            .ok()
            .filter(|&t| t >= 1 && tp.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| bad(&format!("expected a TP degree of at least 1, found `{tp}`")))?;
        // An f16 KV cache ends the name in `-kvf16`, whatever comes before it.
        let (last, kv) = match last.strip_suffix(KvCache::F16_SUFFIX) {
            Some(rest) => (rest, KvCache::F16),
            None => (last, KvCache::F32),
        };
        // `spec` on the batched prefill, `path`, or `path+spec`.
        let (path, spec) = match last.split_once('+') {
            Some((path, spec)) => (path.parse()?, spec.parse()?),
            None => match last.parse::<PathMode>() {
                Ok(PathMode::Prefill) => {
                    return Err(bad("the prefill path is named by its spec alone"))
                }
                Ok(path) => (path, Spec::Off),
                Err(_) => (PathMode::Prefill, last.parse()?),
            },
        };
        Ok(Case {
            model: model.to_owned(),
            weights: weights.to_owned(),
            backend: backend.parse()?,
            tp,
            topology: topology.parse()?,
            path,
            spec,
            kv,
        })
    }
}

/// Where a model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// A generated fixture (`cargo xtask fixtures`).
    Fixture,
    /// A real model (`cargo xtask fetch-model NAME`).
    Real,
}

/// A model the matrix covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub source: ModelSource,
    /// Weight types available for it, the primary one first.
    pub weights: Vec<String>,
    /// Whether its files are on this machine.
    pub available: bool,
    /// Whether CUDA, TP and speculation cases are enumerated for it.
    pub extended: bool,
    /// The paths (chunked, decode) also run with the engine's KV cache in f16, on the best CPU
    /// backend and the first weight type ([`ModelEntry::kv_f16`]).
    #[serde(default)]
    pub kv_f16_paths: Vec<PathMode>,
}

/// Split a fixture file's name such as `deepseek2-lite-q8_0` into the matrix's model
/// (`deepseek2-lite`) and weights (`q8_0`): the weights are the longest suffix after a `-` that
/// names a weight type (so `llama-mix-all` is `llama` + `mix-all`).
pub fn split_fixture_name(name: &str) -> Option<(&str, &str)> {
    name.match_indices('-')
        .map(|(i, _)| (&name[..i], &name[i + 1..]))
        .find(|(_, w)| crate::tolerance::WeightClass::parse(w).is_ok())
}

impl ModelEntry {
    /// A fixture: not extended unless [`ModelEntry::extended`] says so.
    pub fn fixture(name: &str, weights: &[&str], available: bool) -> ModelEntry {
        ModelEntry {
            name: name.to_owned(),
            source: ModelSource::Fixture,
            weights: weights.iter().map(|w| w.to_string()).collect(),
            available,
            extended: false,
            kv_f16_paths: Vec::new(),
        }
    }

    /// A real model: always extended.
    pub fn real(name: &str, weights: &[&str], available: bool) -> ModelEntry {
        ModelEntry {
            name: name.to_owned(),
            source: ModelSource::Real,
            weights: weights.iter().map(|w| w.to_string()).collect(),
            available,
            extended: true,
            kv_f16_paths: Vec::new(),
        }
    }

    pub fn extended(mut self) -> ModelEntry {
        self.extended = true;
        self
    }

    /// Also run `paths` with the engine's KV cache in f16.
    pub fn kv_f16(mut self, paths: &[PathMode]) -> ModelEntry {
        self.kv_f16_paths = paths.to_vec();
        self
    }

    /// The command that puts the model's files on this machine.
    pub fn provide_command(&self) -> String {
        match self.source {
            ModelSource::Fixture => "cargo xtask fixtures".into(),
            ModelSource::Real => format!("cargo xtask fetch-model {}", self.name),
        }
    }
}

/// What the engine (as built) can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EngineCaps {
    pub cuda: bool,
    pub tensor_parallel: bool,
    pub speculative: bool,
}

/// What this machine has. Fill `avx2`/`avx512` from the kernels' runtime detection
/// (`kernels::cpu::Isa::available()`), `cuda_archs` with one entry per device.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MachineCaps {
    pub avx2: bool,
    pub avx512: bool,
    /// Compute capability of each CUDA device as `major*10+minor` (90 for sm_90), one per device.
    pub cuda_archs: Vec<u32>,
    pub nvlink: bool,
    /// Why the CUDA emulator cannot run here (not built, no NVRTC), or `None` when it can.
    #[serde(default)]
    pub cuda_emu_missing: Option<String>,
    pub engine: EngineCaps,
    /// Model name → the command that provides it, for models whose files are absent.
    pub models_missing: BTreeMap<String, String>,
}

impl MachineCaps {
    /// Record which of `models` are missing (see [`Case::skip_reason`]).
    pub fn with_models(mut self, models: &[ModelEntry]) -> MachineCaps {
        for m in models.iter().filter(|m| !m.available) {
            self.models_missing
                .insert(m.name.clone(), m.provide_command());
        }
        self
    }

    /// The CPU backend extended cases use: the best this CPU runs.
    pub fn best_cpu_backend(&self) -> Backend {
        if self.avx512 {
            Backend::CpuAvx512
        } else if self.avx2 {
            Backend::CpuAvx2
        } else {
            Backend::CpuScalar
        }
    }

    /// CUDA architectures extended TP/spec cases use: this machine's (distinct, ascending), or
    /// sm_90 when there is none, so the report still lists them as skipped.
    pub fn cuda_targets(&self) -> Vec<u32> {
        let mut a = self.cuda_archs.clone();
        a.sort_unstable();
        a.dedup();
        if a.is_empty() {
            a.push(90);
        }
        a
    }
}

/// The case matrix.
pub struct Matrix;

impl Matrix {
    /// Every case for `models` on `machine`, in a stable order (models as given; CPU base cases,
    /// then CUDA, TP, speculation). Skipped cases are included: filter, then ask
    /// [`Case::skip_reason`].
    pub fn enumerate(models: &[ModelEntry], machine: &MachineCaps) -> Vec<Case> {
        let mut cases = Vec::new();
        for m in models {
            for w in &m.weights {
                for b in Backend::CPU {
                    cases.push(Case::new(&m.name, w, b, 1, Topology::Shm, Spec::Off));
                }
            }
            let Some(w0) = m.weights.first().filter(|_| m.extended) else {
                continue;
            };
            let cpu = machine.best_cpu_backend();
            let cuda = machine.cuda_targets();
            for sm in CUDA_ARCHS {
                cases.push(Case::new(
                    &m.name,
                    w0,
                    Backend::Cuda { sm },
                    1,
                    Topology::Shm,
                    Spec::Off,
                ));
            }
            for tp in TP_DEGREES {
                cases.push(Case::new(&m.name, w0, cpu, tp, Topology::Shm, Spec::Off));
            }
            for &sm in &cuda {
                for tp in TP_DEGREES {
                    for topo in [Topology::Pcie, Topology::Nvlink] {
                        cases.push(Case::new(
                            &m.name,
                            w0,
                            Backend::Cuda { sm },
                            tp,
                            topo,
                            Spec::Off,
                        ));
                    }
                }
            }
            cases.push(Case::new(
                &m.name,
                w0,
                cpu,
                1,
                Topology::Shm,
                Spec::TREE_B8K4,
            ));
            cases.push(Case::new(
                &m.name,
                w0,
                cpu,
                1,
                Topology::Shm,
                Spec::TREE_B16K4,
            ));
            cases.push(Case::new(
                &m.name,
                w0,
                cpu,
                2,
                Topology::Shm,
                Spec::TREE_B8K4,
            ));
            for &sm in &cuda {
                cases.push(Case::new(
                    &m.name,
                    w0,
                    Backend::Cuda { sm },
                    1,
                    Topology::Shm,
                    Spec::TREE_B8K4,
                ));
            }
            // Serving: the greedy gate through `plumbline serve` (xtask verify/serve_case.rs).
            cases.push(
                Case::new(&m.name, w0, cpu, 1, Topology::Shm, Spec::Off).on_path(PathMode::Serve),
            );
        }
        // The other paths through the engine (xtask verify/path_case.rs): chunked prefill with
        // odd chunk sizes, and decode step by step, for every model on its first weight type.
        let cpu = machine.best_cpu_backend();
        for m in models {
            if let Some(w0) = m.weights.first() {
                for path in [PathMode::Chunked, PathMode::Decode] {
                    cases.push(
                        Case::new(&m.name, w0, cpu, 1, Topology::Shm, Spec::Off).on_path(path),
                    );
                }
                // The same paths with an f16 KV cache, where the model asks for them (a few
                // models covering each cache layout: CI time).
                for &path in &m.kv_f16_paths {
                    cases.push(
                        Case::new(&m.name, w0, cpu, 1, Topology::Shm, Spec::Off)
                            .on_path(path)
                            .with_kv(KvCache::F16),
                    );
                }
            }
        }
        // Several sequences in ragged batches (xtask verify/batch_case.rs), every fixture on the
        // best CPU backend.
        for m in models.iter().filter(|m| m.source == ModelSource::Fixture) {
            if let Some(w0) = m.weights.first() {
                cases.push(
                    Case::new(&m.name, w0, cpu, 1, Topology::Shm, Spec::Off)
                        .on_path(PathMode::Batched),
                );
            }
        }
        // The chunked path on the other CPU backends too, for every fixture (each covers a weight
        // type's kernels): its odd chunks leave every tile a tail, and a tail bug in one ISA's
        // kernels is invisible to the best backend's cases.
        for m in models.iter().filter(|m| m.source == ModelSource::Fixture) {
            if let Some(w0) = m.weights.first() {
                for b in Backend::CPU.into_iter().filter(|&b| b != cpu) {
                    cases.push(
                        Case::new(&m.name, w0, b, 1, Topology::Shm, Spec::Off)
                            .on_path(PathMode::Chunked),
                    );
                }
            }
        }
        cases
    }

    /// The CUDA backend on the emulated device (`cuda-emu`; verify adds these where no GPU is
    /// present, or with `--cuda-emu`): every model and weight mix; the chunked and decode paths
    /// of every fixture; tree speculation and TP 2 on the one device for the extended fixtures.
    /// The real model runs its teacher-forced case only: its long path and speculation cases
    /// would take the emulator most of an hour on two cores.
    pub fn emulated(models: &[ModelEntry]) -> Vec<Case> {
        let emu = Backend::CudaEmu;
        let mut cases = Vec::new();
        for m in models {
            for w in &m.weights {
                cases.push(Case::new(&m.name, w, emu, 1, Topology::Shm, Spec::Off));
            }
        }
        for m in models.iter().filter(|m| m.source == ModelSource::Fixture) {
            if let Some(w0) = m.weights.first() {
                for path in [PathMode::Chunked, PathMode::Decode] {
                    cases.push(
                        Case::new(&m.name, w0, emu, 1, Topology::Shm, Spec::Off).on_path(path),
                    );
                }
            }
        }
        let extended_fixtures = models
            .iter()
            .filter(|m| m.extended && m.source == ModelSource::Fixture);
        for m in extended_fixtures {
            if let Some(w0) = m.weights.first() {
                cases.push(Case::new(
                    &m.name,
                    w0,
                    emu,
                    1,
                    Topology::Shm,
                    Spec::TREE_B8K4,
                ));
                cases.push(Case::new(&m.name, w0, emu, 2, Topology::Shm, Spec::Off));
            }
        }
        cases
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn fixture_names_split_into_model_and_weights() {
        assert_eq!(split_fixture_name("llama-q4_0"), Some(("llama", "q4_0")));
        assert_eq!(
            split_fixture_name("llama-q4_k_m"),
            Some(("llama", "q4_k_m"))
        );
        assert_eq!(
            split_fixture_name("llama-mix-all"),
            Some(("llama", "mix-all"))
        );
        assert_eq!(
            split_fixture_name("deepseek2-lite-q8_0"),
            Some(("deepseek2-lite", "q8_0"))
        );
        assert_eq!(split_fixture_name("gemma3"), None);
    }

    fn case(name: &str) -> Case {
        match name.parse() {
            Ok(c) => c,
            Err(e) => panic!("{name}: {e}"),
        }
    }

    fn models() -> Vec<ModelEntry> {
        vec![
            ModelEntry::real("gemma3-270m", &["q4_k_m"], false),
            ModelEntry::fixture("llama", &["q4_0", "q8_0", "f16"], true).extended(),
            ModelEntry::fixture("gemma3", &["q4_k", "f32"], true),
        ]
    }

    fn avx2_box() -> MachineCaps {
        MachineCaps {
            avx2: true,
            ..MachineCaps::default()
        }
        .with_models(&models())
    }

    #[test]
    fn names_round_trip() {
        for n in [
            "gemma3-270m/q4_k_m/cpu-avx512/tp1-shm/off",
            "llama/q4_0/cpu-scalar/tp1-shm/off",
            "gemma3-270m/q4_k_m/cuda-sm90/tp1-shm/off",
            "gemma3-270m/q4_k_m/cuda-sm90/tp2-pcie/off",
            "gemma3-270m/q4_k_m/cpu-avx512/tp2-shm/tree-b8k4",
        ] {
            assert_eq!(case(n).name(), n);
        }
    }

    #[test]
    fn kv_f16_names_round_trip_and_old_names_read_as_f32() {
        for n in [
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16",
            "deepseek2/q4_k/cpu-avx512/tp1-shm/decode-kvf16",
            "llama/q8_0/cpu-avx2/tp1-shm/off-kvf16",
            "llama/q8_0/cpu-avx2/tp1-shm/decode+tree-b8k4-kvf16",
        ] {
            assert_eq!(case(n).name(), n);
            assert_eq!(case(n).kv, KvCache::F16, "{n}");
        }
        let c = case("gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16");
        assert_eq!(c.path, PathMode::Chunked);
        assert_eq!(
            case("gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked").kv,
            KvCache::F32
        );
        for bad in [
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf8",
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/-kvf16",
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16-kvf16",
        ] {
            assert!(bad.parse::<Case>().is_err(), "{bad}");
        }
        // A report written before the axis existed has no `kv`: an f32 cache.
        let old = r#"{"model":"llama","weights":"q8_0","backend":"cpu-avx2","tp":1,"topology":"shm","path":"chunked","spec":"off"}"#;
        let c: Case = serde_json::from_str(old).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.kv, KvCache::F32);
        assert_eq!(c.name(), "llama/q8_0/cpu-avx2/tp1-shm/chunked");
    }

    #[test]
    fn kv_f16_paths_are_enumerated_on_the_best_cpu_only() {
        let models = vec![
            ModelEntry::fixture("gemma3", &["q4_k_m", "f32"], true)
                .kv_f16(&[PathMode::Chunked, PathMode::Decode]),
            ModelEntry::fixture("llama", &["q8_0"], true),
        ];
        let m = avx2_box();
        let f16: Vec<String> = Matrix::enumerate(&models, &m)
            .into_iter()
            .filter(|c| c.kv == KvCache::F16)
            .map(|c| c.name())
            .collect();
        assert_eq!(
            f16,
            [
                "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16",
                "gemma3/q4_k_m/cpu-avx2/tp1-shm/decode-kvf16"
            ]
        );
    }

    #[test]
    fn malformed_names_are_errors() {
        for n in [
            "llama/q4_0/cpu-scalar/tp1-shm",
            "llama/q4_0/cpu-scalar/tp1-shm/off/x",
            "llama/q4_0/cpu-scalar/1-shm/off",
            "llama/q4_0/cpu-scalar/tp0-shm/off",
            "llama/q4_0/cpu-scalar/tp+1-shm/off",
            "llama/q4_0/gpu/tp1-shm/off",
            "llama/q4_0/cpu-scalar/tp1-ib/off",
            "llama/q4_0/cpu-scalar/tp1-shm/on",
            "/q4_0/cpu-scalar/tp1-shm/off",
        ] {
            assert!(n.parse::<Case>().is_err(), "{n}");
        }
    }

    #[test]
    fn case_serializes_with_axis_spellings() {
        let json = serde_json::to_string(&case("llama/q8_0/cuda-sm86/tp4-nvlink/tree-b8k4"))
            .unwrap_or_default();
        assert_eq!(
            json,
            r#"{"model":"llama","weights":"q8_0","backend":"cuda-sm86","tp":4,"topology":"nvlink","path":"prefill","spec":"tree-b8k4"}"#
        );
        // The path axis apart from the speculation axis; a report without it reads as prefill.
        let c = case("gemma3/q4_k_m/cpu-avx2/tp1-shm/decode");
        assert_eq!((c.path, c.spec), (PathMode::Decode, Spec::Off));
        assert_eq!(
            case("llama/q8_0/cpu-avx2/tp1-shm/serve+tree-b8k4").spec,
            Spec::TREE_B8K4
        );
        let old: Case = serde_json::from_str(
            r#"{"model":"llama","weights":"q8_0","backend":"cpu-avx2","tp":1,"topology":"shm","spec":"off"}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(old.path, PathMode::Prefill);
        // An f16 cache is written, and read back.
        let f16 = case("gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16");
        let json = serde_json::to_string(&f16).unwrap_or_default();
        assert!(json.ends_with(r#","kv":"f16"}"#), "{json}");
        let back: Case = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, f16);
        assert!("llama/q8_0/cpu-avx2/tp1-shm/prefill"
            .parse::<Case>()
            .is_err());
    }

    fn reason(name: &str, m: &MachineCaps) -> Option<String> {
        case(name).skip_reason(m)
    }

    #[test]
    fn skip_reasons() {
        let m = avx2_box();
        for (n, expect) in [
            ("llama/q4_0/cpu-scalar/tp1-shm/off", None),
            ("llama/q4_0/cpu-avx2/tp1-shm/off", None),
            (
                "llama/q4_0/cpu-avx512/tp1-shm/off",
                Some("CPU lacks AVX-512"),
            ),
            ("llama/q4_0/cuda-sm90/tp1-shm/off", Some("no CUDA device")),
            (
                "llama/q4_0/cpu-avx2/tp2-shm/off",
                Some("tensor parallelism not implemented in the engine yet"),
            ),
            (
                "llama/q4_0/cpu-avx2/tp1-shm/tree-b8k4",
                Some("speculative decoding not implemented yet"),
            ),
            (
                "llama/q4_0/cpu-avx2/tp2-pcie/off",
                Some("topology pcie needs CUDA devices"),
            ),
            (
                "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off",
                Some("model not fetched: run cargo xtask fetch-model gemma3-270m"),
            ),
        ] {
            assert_eq!(reason(n, &m).as_deref(), expect, "{n}");
        }
    }

    #[test]
    fn gpu_skip_reasons() {
        let m = MachineCaps {
            cuda_archs: vec![90],
            engine: EngineCaps {
                cuda: true,
                tensor_parallel: true,
                speculative: true,
            },
            ..MachineCaps::default()
        };
        for (n, expect) in [
            ("llama/q4_0/cuda-sm90/tp1-shm/off", None),
            ("llama/q4_0/cuda-sm90/tp1-shm/tree-b8k4", None),
            (
                "llama/q4_0/cuda-sm80/tp1-shm/off",
                Some("no CUDA device of architecture sm_80 (found sm_90)"),
            ),
            (
                "llama/q4_0/cuda-sm90/tp2-pcie/off",
                Some("TP 2 needs 2 CUDA devices of sm_90, found 1"),
            ),
            (
                "llama/q4_0/cuda-sm90/tp1-pcie/off",
                Some("TP 1 has no interconnect: name it tp1-shm, not tp1-pcie"),
            ),
        ] {
            assert_eq!(reason(n, &m).as_deref(), expect, "{n}");
        }
        let two = MachineCaps {
            cuda_archs: vec![90, 90],
            ..m.clone()
        };
        assert_eq!(reason("llama/q4_0/cuda-sm90/tp2-pcie/off", &two), None);
        assert_eq!(
            reason("llama/q4_0/cuda-sm90/tp2-nvlink/off", &two).as_deref(),
            Some("no NVLink between the GPUs")
        );
        let no_feature = MachineCaps {
            engine: EngineCaps::default(),
            ..m
        };
        assert_eq!(
            reason("llama/q4_0/cuda-sm90/tp1-shm/off", &no_feature).as_deref(),
            Some("engine built without the `cuda` feature")
        );
    }

    #[test]
    fn emulated_cuda_skip_reasons() {
        let built = MachineCaps {
            engine: EngineCaps {
                cuda: true,
                tensor_parallel: true,
                speculative: true,
            },
            ..MachineCaps::default()
        };
        assert_eq!(reason("llama/q4_0/cuda-emu/tp1-shm/off", &built), None);
        assert_eq!(reason("llama/q4_0/cuda-emu/tp2-shm/off", &built), None);
        assert_eq!(
            reason("llama/q4_0/cuda-emu/tp2-pcie/off", &built).as_deref(),
            Some("topology pcie needs CUDA devices")
        );
        let missing = MachineCaps {
            cuda_emu_missing: Some("CUDA emulator not built: cargo xtask cuda-emu".into()),
            ..built.clone()
        };
        assert_eq!(
            reason("llama/q4_0/cuda-emu/tp1-shm/off", &missing).as_deref(),
            Some("CUDA emulator not built: cargo xtask cuda-emu")
        );
        let no_feature = MachineCaps {
            engine: EngineCaps::default(),
            ..built
        };
        assert_eq!(
            reason("llama/q4_0/cuda-emu/tp1-shm/off", &no_feature).as_deref(),
            Some("engine built without the `cuda` feature")
        );
    }

    #[test]
    fn matrix_stays_small_and_names_are_unique() {
        let m = avx2_box();
        let mut cases = Matrix::enumerate(&models(), &m);
        cases.extend(Matrix::emulated(&models()));
        // Base: (1 + 3 + 2) weight types × 3 CPU backends = 18. Extended (gemma3-270m, llama):
        // 6 CUDA + 3 CPU TP + 6 CUDA TP (sm90 stand-in) + 4 spec (CPU b8k4 and b16k4, TP2,
        // CUDA) + 1 serve = 20 each. Paths: chunked and decode of every model's first weight
        // type on the best CPU backend, 2 × 3, chunked of each fixture on the other two CPU
        // backends, 2 × 2, and each fixture's batched case, 2. Emulated CUDA: every model ×
        // weight type (6), the fixtures' paths (2 × 2), speculation and TP 2 of the extended
        // fixture (2).
        assert_eq!(cases.len(), 18 + 2 * 20 + 2 * 3 + 2 * 2 + 2 + 6 + 4 + 2);
        let names: std::collections::BTreeSet<String> = cases.iter().map(Case::name).collect();
        assert_eq!(names.len(), cases.len());
        for n in [
            "gemma3-270m/q4_k_m/cpu-avx512/tp1-shm/off",
            "gemma3-270m/q4_k_m/cuda-sm120/tp1-shm/off",
            "gemma3-270m/q4_k_m/cuda-sm90/tp8-nvlink/off",
            "gemma3-270m/q4_k_m/cpu-avx2/tp2-shm/tree-b8k4",
            "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/tree-b16k4",
            "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/serve",
            "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/chunked",
            "gemma3/q4_k/cpu-avx2/tp1-shm/decode",
            "llama/q4_0/cpu-avx2/tp4-shm/off",
            "gemma3-270m/q4_k_m/cuda-emu/tp1-shm/off",
            "gemma3/f32/cuda-emu/tp1-shm/off",
            "gemma3/q4_k/cuda-emu/tp1-shm/chunked",
            "llama/q4_0/cuda-emu/tp1-shm/tree-b8k4",
            "llama/q4_0/cuda-emu/tp2-shm/off",
        ] {
            assert!(names.contains(n), "{n}");
        }
        // The non-extended fixture and the non-primary weights get CPU TP 1 only, without
        // speculation or serving; the paths only on the first weight type.
        assert!(cases
            .iter()
            .filter(|c| c.model == "gemma3" || c.weights == "f16")
            .filter(|c| c.backend != Backend::CudaEmu)
            .all(|c| !c.backend.is_cuda()
                && c.tp == 1
                && c.spec == Spec::Off
                && match c.path {
                    PathMode::Prefill => true,
                    PathMode::Chunked | PathMode::Decode => c.weights != "f16",
                    PathMode::Serve => false,
                    PathMode::Batched => c.weights != "f16",
                }));
        // The real model runs on the emulator teacher-forced only.
        assert!(cases
            .iter()
            .filter(|c| c.backend == Backend::CudaEmu && c.model == "gemma3-270m")
            .all(|c| c.spec == Spec::Off && c.path == PathMode::Prefill && c.tp == 1));
        // Every case can be named and parsed back.
        assert!(cases.iter().all(|c| case(&c.name()) == *c));
    }

    #[test]
    fn on_this_box_only_cpu_tp1_cases_of_present_models_run() {
        let m = avx2_box();
        let runnable: Vec<String> = Matrix::enumerate(&models(), &m)
            .into_iter()
            .filter(|c| c.skip_reason(&m).is_none())
            .map(|c| c.name())
            .collect();
        // llama 3 weights + gemma3 2 weights, on scalar and avx2, llama's serve case, the
        // chunked, decode and batched cases of both fixtures, and their chunked cases on scalar
        // too (the real model is not fetched).
        assert_eq!(runnable.len(), 19);
        assert!(runnable.iter().all(|n| (n.contains("/tp1-shm/off")
            || n.ends_with("/cpu-avx2/tp1-shm/batched")
            || n == "llama/q4_0/cpu-avx2/tp1-shm/serve"
            || n.ends_with("/tp1-shm/chunked")
            || n.ends_with("/cpu-avx2/tp1-shm/decode"))
            && !n.contains("avx512")
            && !n.starts_with("gemma3-270m")));
    }
}
