//! [`open`]: the one way to get a runnable engine. Given a model, a [`Device`] and a
//! [`Topology`], it starts the backends, plans the ranks and prepares the weights, and returns
//! an [`AnyEngine`] that every caller drives through [`BatchEngine`] — whole or
//! tensor-parallel, CPU or CUDA — the way candle's `Device` picks its storage at run time.

use crate::model::Model;
use crate::runtime::{
    Batch, CellMeta, CpuBackend, DeviceCounters, KvCache, KvDtype, Logits, RuntimeError, SeqCache,
    SeqId,
};
use crate::taps::TapObserver;
use crate::tp::{CommStats, TpCache, TpEngine, TpError, TpModel};

#[cfg(feature = "cuda")]
use crate::runtime::cuda::{CudaBackend, CudaError};

use super::batch_engine::TpHidden;
use super::device::{Comm, Device, Topology};
use super::{BatchEngine, Engine, Hidden};

/// Why an engine could not be opened. Each names the root cause.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("starting the CPU backend: {0}")]
    Cpu(#[source] RuntimeError),
    #[cfg(feature = "cuda")]
    #[error("{device}: {source} (run `plumbline doctor` for the whole preflight)")]
    Cuda {
        device: String,
        #[source]
        source: CudaError,
    },
    #[error("{0}: this build of plumbline has no CUDA backend (build with the `cuda` feature)")]
    NoCuda(String),
    #[error("preparing the weights: {0}")]
    Prepare(#[source] RuntimeError),
    #[error("tensor parallelism over {degree} ranks: {source}")]
    Tp {
        degree: usize,
        #[source]
        source: TpError,
    },
}

/// A model prepared on a device and topology chosen at run time.
pub enum AnyEngine<'m> {
    Cpu(Engine<'m, CpuBackend>),
    CpuTp(TpEngine<'m, CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<'m, CudaBackend>),
    #[cfg(feature = "cuda")]
    CudaTp(TpEngine<'m, CudaBackend>),
}

/// The cache of an [`AnyEngine`]: the same variant as the engine that made it.
pub enum AnyCache {
    Cpu(KvCache<CpuBackend>),
    CpuTp(TpCache<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(KvCache<CudaBackend>),
    #[cfg(feature = "cuda")]
    CudaTp(TpCache<CudaBackend>),
}

/// The residual stream of an [`AnyEngine`]'s `forward_hidden`.
pub enum AnyHidden {
    Cpu(Hidden<CpuBackend>),
    Tp(TpHidden),
    #[cfg(feature = "cuda")]
    Cuda(Hidden<CudaBackend>),
}

/// Open `model` on `device` with `topology`: the backends (one per rank; CPU threads split
/// evenly over the ranks, CUDA ranks on the one device), the shard plan and every rank's
/// prepared weights.
pub fn open<'m>(
    model: &'m Model,
    device: &Device,
    topology: &Topology,
) -> Result<AnyEngine<'m>, OpenError> {
    let degree = topology.tp.max(1);
    let tp_err = |source| OpenError::Tp { degree, source };
    match device {
        Device::Cpu { isa, threads } => {
            if degree == 1 {
                let be = CpuBackend::new(*isa, *threads).map_err(OpenError::Cpu)?;
                return Engine::owning(model, be)
                    .map(AnyEngine::Cpu)
                    .map_err(OpenError::Prepare);
            }
            let all = threads
                .filter(|&t| t > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let backends = (0..degree)
                .map(|_| CpuBackend::new(*isa, Some((all / degree).max(1))))
                .collect::<Result<Vec<_>, _>>()
                .map_err(OpenError::Cpu)?;
            let tp = TpModel::new(model, degree).map_err(tp_err)?;
            tp_engine(tp, backends, topology.comm)
                .map(AnyEngine::CpuTp)
                .map_err(tp_err)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { .. } | Device::CudaEmu { .. } => {
            let open_one = || {
                cuda::open(device).map_err(|source| OpenError::Cuda {
                    device: device.to_string(),
                    source,
                })
            };
            if degree == 1 {
                return Engine::owning(model, open_one()?)
                    .map(AnyEngine::Cuda)
                    .map_err(OpenError::Prepare);
            }
            let backends = (0..degree)
                .map(|_| open_one())
                .collect::<Result<Vec<_>, _>>()?;
            let tp = TpModel::new(model, degree).map_err(tp_err)?;
            tp_engine(tp, backends, topology.comm)
                .map(AnyEngine::CudaTp)
                .map_err(tp_err)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } | Device::CudaEmu { .. } => Err(OpenError::NoCuda(device.to_string())),
    }
}

fn tp_engine<'m, B: crate::runtime::Backend + 'm>(
    tp: TpModel<'m>,
    backends: Vec<B>,
    comm: Comm,
) -> Result<TpEngine<'m, B>, TpError> {
    match comm {
        Comm::Shm => TpEngine::over_shm_owned(tp, backends),
    }
}

#[cfg(feature = "cuda")]
pub mod cuda {
    //! Opening the CUDA backend on a real or emulated device.

    use std::path::PathBuf;

    use crate::runtime::cuda::libs::DRIVER_SONAME;
    use crate::runtime::cuda::{CudaBackend, CudaError, KernelCache, LibraryError, LibrarySearch};

    use super::Device;

    /// Where the emulated driver is looked for: the device's `dir`, else `$PLUMBLINE_CUDA_EMU`,
    /// else `target/cuda-emu` under the current directory (where the build step puts it).
    pub fn emulator_dir(dir: Option<&PathBuf>) -> PathBuf {
        dir.cloned()
            .or_else(|| {
                std::env::var_os(crate::runtime::cuda::libs::EMULATOR_ENV).map(PathBuf::from)
            })
            .unwrap_or_else(|| PathBuf::from("target/cuda-emu"))
    }

    /// The library search for `device`: the default one for a real device; for the emulator,
    /// its folder first — and only if the emulated `libcuda.so.1` is there, so a real driver is
    /// never picked up in its place (`CudaBackend::new` also checks that cudarc loads the very
    /// library it probed).
    pub fn search(device: &Device) -> Result<LibrarySearch, CudaError> {
        let Device::CudaEmu { dir } = device else {
            return Ok(LibrarySearch::from_env());
        };
        let dir = emulator_dir(dir.as_ref());
        if !dir.join(DRIVER_SONAME).is_file() {
            return Err(CudaError::Library(LibraryError::NotFound {
                soname: format!(
                    "the CUDA emulator's {DRIVER_SONAME} (build it: cargo xtask cuda-emu)"
                ),
                searched: vec![dir],
                other_majors: Vec::new(),
            }));
        }
        Ok(LibrarySearch::emulator(dir))
    }

    pub fn open(device: &Device) -> Result<CudaBackend, CudaError> {
        let ordinal = match device {
            Device::Cuda { ordinal } => *ordinal,
            _ => 0,
        };
        CudaBackend::new(
            ordinal,
            &search(device)?,
            &KernelCache::new(KernelCache::default_dir()),
        )
    }
}

/// Run `$body` on the engine of every variant, bound to `$e`.
macro_rules! each_engine {
    ($self:expr, $e:ident => $body:expr) => {
        match $self {
            AnyEngine::Cpu($e) => $body,
            AnyEngine::CpuTp($e) => $body,
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda($e) => $body,
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp($e) => $body,
        }
    };
}

/// Run `$body` with the engine and the cache of the same variant; a cache of another engine
/// is an error.
macro_rules! with_cache {
    ($self:expr, $cache:expr, $e:ident, $c:ident => $body:expr) => {
        match ($self, $cache) {
            (AnyEngine::Cpu($e), AnyCache::Cpu($c)) => $body,
            (AnyEngine::CpuTp($e), AnyCache::CpuTp($c)) => $body,
            #[cfg(feature = "cuda")]
            (AnyEngine::Cuda($e), AnyCache::Cuda($c)) => $body,
            #[cfg(feature = "cuda")]
            (AnyEngine::CudaTp($e), AnyCache::CudaTp($c)) => $body,
            #[allow(unreachable_patterns)]
            _ => Err(mismatch("cache")),
        }
    };
}

macro_rules! each_cache {
    ($self:expr, $c:ident => $body:expr) => {
        match $self {
            AnyCache::Cpu($c) => $body,
            AnyCache::CpuTp($c) => $body,
            #[cfg(feature = "cuda")]
            AnyCache::Cuda($c) => $body,
            #[cfg(feature = "cuda")]
            AnyCache::CudaTp($c) => $body,
        }
    };
}

fn mismatch(what: &'static str) -> RuntimeError {
    RuntimeError::BadBatch {
        index: 0,
        reason: format!("the {what} belongs to an engine of another device or topology"),
    }
}

impl<'m> AnyEngine<'m> {
    /// A drafter made of this engine's first `n_layers` layers, on the same backend (rank 0's
    /// for a tensor-parallel engine, the model whole).
    pub fn self_draft(&self, n_layers: usize) -> Result<AnyEngine<'_>, RuntimeError> {
        Ok(match self {
            AnyEngine::Cpu(e) => {
                AnyEngine::Cpu(Engine::with_layers(e.model(), e.backend(), n_layers)?)
            }
            AnyEngine::CpuTp(e) => AnyEngine::Cpu(Engine::with_layers(
                e.tp_model().model(),
                first(e.backends())?,
                n_layers,
            )?),
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => {
                AnyEngine::Cuda(Engine::with_layers(e.model(), e.backend(), n_layers)?)
            }
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => AnyEngine::Cuda(Engine::with_layers(
                e.tp_model().model(),
                first(e.backends())?,
                n_layers,
            )?),
        })
    }

    /// Another model (a drafter of the same vocabulary) prepared whole on this engine's
    /// backend (rank 0's for a tensor-parallel engine).
    pub fn on_same_device<'a>(&'a self, other: &'a Model) -> Result<AnyEngine<'a>, RuntimeError> {
        Ok(match self {
            AnyEngine::Cpu(e) => AnyEngine::Cpu(Engine::new(other, e.backend())?),
            AnyEngine::CpuTp(e) => AnyEngine::Cpu(Engine::new(other, first(e.backends())?)?),
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => AnyEngine::Cuda(Engine::new(other, e.backend())?),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => AnyEngine::Cuda(Engine::new(other, first(e.backends())?)?),
        })
    }

    /// The tensor-parallel degree (1: whole).
    pub fn tp_degree(&self) -> usize {
        match self {
            AnyEngine::CpuTp(e) => e.tp_model().degree(),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => e.tp_model().degree(),
            _ => 1,
        }
    }

    /// The shard plan of a tensor-parallel engine.
    pub fn tp_model(&self) -> Option<&TpModel<'m>> {
        match self {
            AnyEngine::CpuTp(e) => Some(e.tp_model()),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => Some(e.tp_model()),
            _ => None,
        }
    }

    /// Every rank's collective counters so far (empty for a whole engine).
    pub fn comm_stats(&self) -> Vec<CommStats> {
        match self {
            AnyEngine::CpuTp(e) => e.comm_stats(),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => e.comm_stats(),
            _ => Vec::new(),
        }
    }

    /// The device work its backends counted so far (summed over the ranks of a
    /// tensor-parallel engine; see [`DeviceCounters`]), or `None` on the CPU, which counts
    /// none. Subtract two snapshots for the work of the forwards in between.
    pub fn device_counters(&self) -> Option<DeviceCounters> {
        #[cfg(feature = "cuda")]
        use crate::runtime::Backend;
        match self {
            AnyEngine::Cpu(_) | AnyEngine::CpuTp(_) => None,
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => Backend::counters(e.backend()),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => e
                .backends()
                .iter()
                .map(Backend::counters)
                .try_fold(DeviceCounters::default(), |acc, c| c.map(|c| acc.plus(&c))),
        }
    }

    /// The CPU instruction set of a CPU engine.
    pub fn cpu_isa(&self) -> Option<kernels::cpu::Isa> {
        match self {
            AnyEngine::Cpu(e) => Some(e.backend().isa()),
            AnyEngine::CpuTp(e) => e.backends().first().map(CpuBackend::isa),
            #[cfg(feature = "cuda")]
            _ => None,
        }
    }

    /// The whole engine on the CPU, if that is what this is (for CPU-only tools such as the
    /// throughput benchmarks' kernel counters).
    pub fn as_cpu(&self) -> Option<&Engine<'m, CpuBackend>> {
        match self {
            AnyEngine::Cpu(e) => Some(e),
            _ => None,
        }
    }
}

fn first<B>(backends: &[B]) -> Result<&B, RuntimeError> {
    backends.first().ok_or(RuntimeError::Shape {
        op: "tensor-parallel ranks",
        expected: 1,
        found: 0,
    })
}

impl<'m> BatchEngine for AnyEngine<'m> {
    type Cache = AnyCache;
    type Hidden = AnyHidden;

    fn model(&self) -> &Model {
        each_engine!(self, e => BatchEngine::model(e))
    }

    fn n_layers(&self) -> usize {
        each_engine!(self, e => BatchEngine::n_layers(e))
    }

    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<AnyCache, RuntimeError> {
        Ok(match self {
            AnyEngine::Cpu(e) => AnyCache::Cpu(e.new_cache(capacity, dtype)?),
            AnyEngine::CpuTp(e) => AnyCache::CpuTp(e.new_cache(capacity, dtype)?),
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => AnyCache::Cuda(e.new_cache(capacity, dtype)?),
            #[cfg(feature = "cuda")]
            AnyEngine::CudaTp(e) => AnyCache::CudaTp(e.new_cache(capacity, dtype)?),
        })
    }

    fn forward(
        &self,
        cache: &mut AnyCache,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        with_cache!(self, cache, e, c => BatchEngine::forward(e, c, batch, taps))
    }

    fn forward_hidden(
        &self,
        cache: &mut AnyCache,
        batch: &Batch,
    ) -> Result<AnyHidden, RuntimeError> {
        match (self, cache) {
            (AnyEngine::Cpu(e), AnyCache::Cpu(c)) => {
                Ok(AnyHidden::Cpu(e.forward_hidden(c, batch)?))
            }
            (AnyEngine::CpuTp(e), AnyCache::CpuTp(c)) => {
                Ok(AnyHidden::Tp(BatchEngine::forward_hidden(e, c, batch)?))
            }
            #[cfg(feature = "cuda")]
            (AnyEngine::Cuda(e), AnyCache::Cuda(c)) => {
                Ok(AnyHidden::Cuda(e.forward_hidden(c, batch)?))
            }
            #[cfg(feature = "cuda")]
            (AnyEngine::CudaTp(e), AnyCache::CudaTp(c)) => {
                Ok(AnyHidden::Tp(BatchEngine::forward_hidden(e, c, batch)?))
            }
            #[allow(unreachable_patterns)]
            _ => Err(mismatch("cache")),
        }
    }

    fn head(&self, hidden: &AnyHidden, rows: &[usize]) -> Result<Logits, RuntimeError> {
        match (self, hidden) {
            (AnyEngine::Cpu(e), AnyHidden::Cpu(h)) => e.head(h, rows),
            (AnyEngine::CpuTp(e), AnyHidden::Tp(h)) => BatchEngine::head(e, h, rows),
            #[cfg(feature = "cuda")]
            (AnyEngine::Cuda(e), AnyHidden::Cuda(h)) => e.head(h, rows),
            #[cfg(feature = "cuda")]
            (AnyEngine::CudaTp(e), AnyHidden::Tp(h)) => BatchEngine::head(e, h, rows),
            #[allow(unreachable_patterns)]
            _ => Err(mismatch("hidden state")),
        }
    }

    fn compact(&self, cache: &mut AnyCache, keep: &[usize]) -> Result<(), RuntimeError> {
        with_cache!(self, cache, e, c => BatchEngine::compact(e, c, keep))
    }

    fn device_name(&self) -> String {
        each_engine!(self, e => BatchEngine::device_name(e))
    }

    fn threads(&self) -> usize {
        each_engine!(self, e => BatchEngine::threads(e))
    }

    fn describe(&self) -> String {
        each_engine!(self, e => BatchEngine::describe(e))
    }

    fn communicator(&self) -> Option<&'static str> {
        each_engine!(self, e => BatchEngine::communicator(e))
    }
}

impl SeqCache for AnyCache {
    fn cells(&self) -> &[CellMeta] {
        each_cache!(self, c => SeqCache::cells(c))
    }
    fn pending(&self) -> &[u32] {
        each_cache!(self, c => SeqCache::pending(c))
    }
    fn next_pos(&self, seq: SeqId) -> u32 {
        each_cache!(self, c => SeqCache::next_pos(c, seq))
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        each_cache!(self, c => SeqCache::seq_len(c, seq))
    }
    fn capacity(&self) -> usize {
        each_cache!(self, c => SeqCache::capacity(c))
    }
    fn used(&self) -> usize {
        each_cache!(self, c => SeqCache::used(c))
    }
    fn dtype(&self) -> KvDtype {
        each_cache!(self, c => SeqCache::dtype(c))
    }
    fn commit(&mut self) {
        each_cache!(self, c => SeqCache::commit(c))
    }
    fn rollback(&mut self) {
        each_cache!(self, c => SeqCache::rollback(c))
    }
    fn truncate(&mut self, seq: SeqId, from: u32) {
        each_cache!(self, c => SeqCache::truncate(c, seq, from))
    }
    fn forget_before(&mut self, seq: SeqId, before: u32) {
        each_cache!(self, c => SeqCache::forget_before(c, seq, before))
    }
    fn remove_seq(&mut self, seq: SeqId) {
        each_cache!(self, c => SeqCache::remove_seq(c, seq))
    }
    fn clear(&mut self) {
        each_cache!(self, c => SeqCache::clear(c))
    }
}
