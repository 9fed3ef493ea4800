//! The options every model command shares — `--device`, `--threads`, `--isa`, `--tp`,
//! `--weights`, `--kv-dtype` — parsed here once, and the one way the commands open a model on them
//! ([`engine::exec::open`]).

use std::path::Path;

use anyhow::{Context, Result};
use engine::exec::{self, AnyEngine, Device, Topology};
use engine::gguf::WeightPages;
use engine::model::Model;
use engine::runtime::KvDtype;
use kernels::cpu::Isa;

/// The CPU instruction set to run the kernels with.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum IsaArg {
    Scalar,
    Avx2,
    Avx512,
}

impl From<IsaArg> for Isa {
    fn from(a: IsaArg) -> Isa {
        match a {
            IsaArg::Scalar => Isa::Scalar,
            IsaArg::Avx2 => Isa::Avx2,
            IsaArg::Avx512 => Isa::Avx512,
        }
    }
}

/// Storage type of the KV cache.
#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
pub enum KvDtypeArg {
    /// Exact: a forward reads back what it wrote.
    #[default]
    F32,
    /// Half the memory and bandwidth (llama.cpp's and vLLM's default): keys and values rounded
    /// to f16 (round to nearest even) when written.
    F16,
}

impl From<KvDtypeArg> for KvDtype {
    fn from(a: KvDtypeArg) -> KvDtype {
        match a {
            KvDtypeArg::F32 => KvDtype::F32,
            KvDtypeArg::F16 => KvDtype::F16,
        }
    }
}

/// Where and how a model command runs the model.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Device: cpu, cuda (device 0), cuda:N, or cuda-emu (the CUDA backend on the CPU execution
    /// of the driver, `target/cuda-emu` or `$PLUMBLINE_CUDA_EMU`)
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Worker threads of the CPU backend (default: every available core; split over TP ranks)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Instruction set of the CPU kernels (default: the widest this CPU has)
    #[arg(long, value_enum)]
    pub isa: Option<IsaArg>,
    /// Tensor-parallel ranks (on the CPU: threads of this process over `shm`; on CUDA: ranks
    /// sharing the one device); 1 runs the model whole
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Where the weights live: `resident` (a copy in huge pages: decode streams faster),
    /// `map` (the file's memory map, nothing copied), `auto` (resident when the model takes at
    /// most half the available memory)
    #[arg(long, default_value = "auto")]
    pub weights: WeightPages,
    /// Storage of the KV cache: `f32` (exact) or `f16` (half the memory: twice the sequences
    /// or the context in the same space)
    #[arg(long, value_enum, default_value = "f32")]
    pub kv_dtype: KvDtypeArg,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs {
            device: Device::cpu(),
            threads: None,
            isa: None,
            tp: 1,
            weights: WeightPages::Auto,
            kv_dtype: KvDtypeArg::F32,
        }
    }
}

impl EngineArgs {
    /// The device with the CPU options folded in (`--isa`/`--threads` on a CUDA device are
    /// refused rather than ignored).
    pub fn device(&self) -> Result<Device> {
        match &self.device {
            Device::Cpu { .. } => Ok(Device::cpu_with(self.isa.map(Isa::from), self.threads)),
            d => {
                if self.isa.is_some() {
                    anyhow::bail!("--isa applies to --device cpu, not {d}");
                }
                Ok(d.clone())
            }
        }
    }

    /// The KV cache's storage type.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype.into()
    }

    pub fn topology(&self) -> Result<Topology> {
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1, found 0");
        }
        Ok(Topology::tp(self.tp))
    }

    /// Refuse a misspelt fault setting, then load the model (weights placed as `--weights`).
    pub fn load_model(&self, path: &Path) -> Result<Model> {
        engine::faults::setting().context("reading the fault-injection setting")?;
        // Parse both before the (possibly long) load, so a bad option fails at once.
        self.device()?;
        self.topology()?;
        Model::load_with(path, self.weights)
            .with_context(|| format!("loading model {}", path.display()))
    }

    /// Open `model` on the chosen device and topology.
    pub fn open<'m>(&self, model: &'m Model) -> Result<AnyEngine<'m>> {
        let device = self.device()?;
        exec::open(model, &device, &self.topology()?)
            .with_context(|| format!("opening the model on {device} (tp {})", self.tp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        e: EngineArgs,
    }

    fn parse(args: &[&str]) -> Result<EngineArgs, String> {
        let mut v = vec!["x"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
            .map(|c| c.e)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_the_whole_model_on_the_cpu() {
        let e = parse(&[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.device().ok(), Some(Device::cpu()));
        assert_eq!(e.topology().ok(), Some(Topology::single()));
    }

    #[test]
    fn cpu_options_fold_into_the_device() {
        let e = parse(&["--threads", "3", "--isa", "scalar", "--tp", "2"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            e.device().ok(),
            Some(Device::cpu_with(Some(Isa::Scalar), Some(3)))
        );
        assert_eq!(e.topology().ok(), Some(Topology::tp(2)));
    }

    #[test]
    fn bad_values_are_refused_with_what_was_expected() {
        let e = parse(&["--device", "tpu"]).err().unwrap_or_default();
        assert!(e.contains("expected cpu, cuda, cuda:N"), "{e}");
        let e = parse(&["--device", "cuda:1", "--isa", "avx2"]).unwrap_or_else(|e| panic!("{e}"));
        let msg = e.device().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(msg, "--isa applies to --device cpu, not cuda:1");
        let e = parse(&["--tp", "0"]).unwrap_or_else(|e| panic!("{e}"));
        let msg = e
            .topology()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(msg, "--tp must be at least 1, found 0");
    }
}
