//! What every kind of verify case shares: the fixed texts, the work budget, the case's
//! environment and device, small helpers. A leaf: it uses no other case module.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use engine::exec::Device;
use harness::cases::Backend;
use harness::coherence;
use harness::throughput::Baselines;
use harness::tolerance::TolerancePolicy;
use kernels::cpu::Isa;

/// The fixed English text every case is teacher-forced on (public domain, golden/data/README.md).
pub const TEXT: &str = include_str!("../../../golden/data/pride_and_prejudice_ch1.txt");
/// Greedy continuation prompt for the coherence gates.
pub const PROMPT: &str = "The capital of France is";

/// How much work a case does; the real model gets more tokens than the tiny fixtures need.
#[derive(Clone, Copy)]
pub struct Budget {
    /// Teacher-forced tokens for the tap comparison and the logit gates.
    pub n_text: usize,
    /// Greedy tokens compared with the reference's greedy continuation.
    pub n_greedy: usize,
    /// Greedy tokens judged by the degeneracy detector.
    pub n_generate: usize,
    /// Runs of the throughput measurement (the median is kept).
    pub bench_runs: usize,
}

impl Budget {
    /// [`Budget::for_model`] for a case on `backend`: on the emulated CUDA device the greedy
    /// continuation stops at the tokens the greedy gate compares (each decode step of the real
    /// model costs the emulator seconds); the reference's side is the same for every backend.
    pub fn for_case(real: bool, backend: Backend) -> Budget {
        let mut b = Budget::for_model(real);
        if backend == Backend::CudaEmu {
            b.n_generate = b.n_greedy;
        }
        b
    }

    pub fn for_model(real: bool) -> Budget {
        if real {
            Budget {
                n_text: 64,
                n_greedy: 8,
                n_generate: 32,
                bench_runs: 3,
            }
        } else {
            Budget {
                n_text: 32,
                n_greedy: 4,
                n_generate: 32,
                bench_runs: 3,
            }
        }
    }
}

/// The device a case's backend names, with the case's threads.
pub fn device_of(backend: Backend, threads: usize) -> Result<Device> {
    match backend {
        Backend::CudaEmu => Ok(Device::CudaEmu {
            dir: Some(crate::cuda_emu::dir()),
        }),
        Backend::Cuda { sm } => {
            // The first device of the case's architecture (skip_reason checked there is one).
            let caps = engine::capabilities();
            match caps.cuda_devices.iter().find(|d| d.arch == sm) {
                Some(d) => Ok(Device::Cuda { ordinal: d.ordinal }),
                None => bail!("no CUDA device of architecture sm_{sm}"),
            }
        }
        _ => {
            let isa = isa_of(backend).ok_or_else(|| anyhow!("{backend} is not a CPU backend"))?;
            Ok(Device::cpu_with(Some(isa), Some(threads)))
        }
    }
}

pub fn isa_of(backend: Backend) -> Option<Isa> {
    match backend {
        Backend::CpuScalar => Some(Isa::Scalar),
        Backend::CpuAvx2 => Some(Isa::Avx2),
        Backend::CpuAvx512 => Some(Isa::Avx512),
        Backend::Cuda { .. } | Backend::CudaEmu => None,
    }
}

pub struct CaseEnv<'a> {
    pub path: &'a Path,
    /// A real model (not a fixture's random weights): judged for degeneracy, and benched.
    pub real: bool,
    /// How many tokens the case feeds ([`Budget::for_model`] unless `verify --model` says).
    pub budget: Budget,
    pub threads: usize,
    pub policy: &'a TolerancePolicy,
    pub baselines: &'a Baselines,
    pub bench: bool,
}

/// The first `n` ids of the fixed text, at least 2.
pub fn truncate_text(ids: &[u32], n: usize) -> Result<Vec<u32>> {
    anyhow::ensure!(
        ids.len() >= 2,
        "the fixed text tokenizes to {} tokens, need at least 2",
        ids.len()
    );
    Ok(ids[..n.min(ids.len())].to_vec())
}

pub fn argmax(row: &[f32]) -> u32 {
    coherence::logits::argmax(row).unwrap_or(0) as u32
}

/// A single model file and its tokenizer, loaded for a case.
pub fn load_model(path: &Path) -> Result<(engine::model::Model, engine::tokenizer::Tokenizer)> {
    use anyhow::Context;
    let model =
        engine::model::Model::load(path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer =
        engine::tokenizer::Tokenizer::from_gguf(model.gguf()).context("loading the tokenizer")?;
    Ok((model, tokenizer))
}
