//! [`CudaBackend`]: the engine's [`Backend`] on one CUDA device, through cudarc 0.19 (loaded
//! at run time) and the kernels of `kernels/cuda/`, compiled by NVRTC for the device's exact
//! architecture (cached on disk).
//!
//! Storage: `Buf` is a device `f32` buffer, `Ids` a device `u32` buffer, `Mat` the weight's
//! bytes uploaded unchanged (the GGML blocks), `Kv` a pair of device buffers (f32 or f16 bits).
//! Everything runs on the device's default stream, in order, so the host only waits in
//! `download`.
//!
//! Efficient by construction (issue 29), and counted ([`Backend::counters`]: launches,
//! allocations, host↔device bytes, KV bytes moved, weight bytes read, which `cargo xtask
//! verify` gates on every CUDA case):
//!
//! - a cache layer grows geometrically (twice the cells asked for), so a decode step within
//!   its allocation copies nothing;
//! - temporaries come from a [`Pool`] of freed buffers of the same exact size, so a
//!   steady-state decode step makes no device allocation;
//! - per-token metadata (RoPE positions, query and cell positions, sequences and batch
//!   indices, cache cells, gathered rows) lives on the device with a host copy of what it
//!   holds ([`Meta`]): every layer of a forward passes the same arrays, so each is uploaded
//!   once per forward, and then only the values that changed (a decode step: a few bytes).
//!
//! The pool and the geometric growth loosen one check of the emulator: a kernel reading past
//! what its caller reserved but within the allocation (a KV cell past `n_cells`, a metadata
//! value past its array) is not an out-of-bounds access there. Pooled buffers have the exact
//! size asked for, so every other buffer keeps the exact check.
//!
//! Products: decode (and any call with few tokens) runs the per-type matrix-vector kernel on
//! activations quantized once to q8_1 (`mmv.cu`); prefill with at least [`GEMM_MIN_TOKENS`]
//! tokens dequantizes the weight to f16 and runs the tiled GEMM (`dequant.cu`), except F32 and
//! BF16 weights, whose range or precision f16 would lose (they stay on the matrix-vector
//! kernels).
//!
//! Shapes: token counts never go to a grid's y or z dimension (65535 at most); kernels over
//! tokens stride over grid x. An empty shape launches nothing (a GPU refuses an empty grid).
//!
//! Not yet here (see the issue): CUDA graph capture of the decode step, cuBLAS for prefill, NCCL.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use kernels::quant::GgmlType;

use super::cache::KernelCache;
use super::driver;
use super::error::CudaError;
use super::libs::LibrarySearch;
use super::nvrtc::Nvrtc;
use super::sources::FILES;
use crate::runtime::backend::{AttnMeta, Backend, KvDtype, KvSource, Strided, WeightData};
use crate::runtime::counters::{AtomicCounters, DeviceCounters};
use crate::runtime::error::check_len;
use crate::runtime::params::{
    yarn_corr_dims, Activation, Gating, MoeConfig, RopeConfig, RopeStyle,
};
use crate::runtime::RuntimeError;

/// Every weight type the CUDA kernels multiply (the `FOR_EACH_TYPE` list of `quant.cuh`).
pub const CUDA_TYPES: [GgmlType; 18] = GgmlType::SUPPORTED;

/// From this many tokens on, a product dequantizes to f16 and runs the GEMM kernel.
pub const GEMM_MIN_TOKENS: usize = 16;

/// How ggml's CPU dot product for a weight type reads its activations (its `vec_dot_type`),
/// as `round_act` in quantize.cu numbers it: the CUDA products round activations the same way,
/// so that they compute what the CPU backend and the exact-numerics reference compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActRound {
    /// F32 weights: f32 activations.
    None = 0,
    /// Q8_0 blocks of 32 (also Q8_1's values): what `quantize_q8_1` gives the mmv kernels.
    Q8_0 = 1,
    /// Q8_K blocks of 256 (the K-quants, IQ4_XS).
    Q8K = 2,
    F16 = 3,
    Bf16 = 4,
}

impl ActRound {
    fn of(ty: GgmlType) -> ActRound {
        use GgmlType as G;
        match ty {
            G::F32 => ActRound::None,
            G::F16 => ActRound::F16,
            G::BF16 => ActRound::Bf16,
            G::Q2K | G::Q3K | G::Q4K | G::Q5K | G::Q6K | G::Q8K | G::Iq4Xs => ActRound::Q8K,
            // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL, MXFP4.
            _ => ActRound::Q8_0,
        }
    }
}

/// Rows per block of the matrix-vector kernels (`MMV_ROWS` in mmv.cu).
const MMV_ROWS: u32 = 4;

/// The largest grid x (2³¹ − 1); y and z stop at 65535, so token counts never go there.
const MAX_GRID_X: usize = 0x7fff_ffff;

/// Threads of an attention block, and cells per tile of its online softmax (`ATTN_THREADS` in
/// attention.cu).
const ATTN_THREADS: usize = 128;

fn drv(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Cuda(CudaError::Driver(e.to_string()))
}

fn shape(op: &'static str, expected: usize, found: usize) -> RuntimeError {
    RuntimeError::Shape {
        op,
        expected,
        found,
    }
}

/// `cuFuncGetParamInfo(func, index, offset, size)`.
type ParamInfoFn = unsafe extern "C" fn(
    cudarc::driver::sys::CUfunction,
    usize,
    *mut usize,
    *mut usize,
) -> cudarc::driver::sys::CUresult;

/// The driver's `cuFuncGetParamInfo`, if it has one (CUDA 12.4 drivers and later). Looked up
/// here rather than through cudarc, which panics on a symbol the driver lacks.
fn param_info_fn(driver: &std::path::Path) -> Option<ParamInfoFn> {
    let lib = super::libs::open(driver).ok()?;
    // SAFETY: the type is cuFuncGetParamInfo's C signature in cuda.h.
    unsafe { super::libs::symbol::<ParamInfoFn>(lib, driver, "CUDA driver", "cuFuncGetParamInfo") }
        .ok()
}

/// A kernel's parameter sizes: indices 0, 1, … until the driver says there is no such index.
fn param_sizes(info: ParamInfoFn, f: &CudaFunction) -> Option<Vec<usize>> {
    let mut sizes = Vec::new();
    for i in 0..256 {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: `f` is a loaded function; the driver writes two integers.
        let r = unsafe { info(f.cu_function(), i, &mut off, &mut size) };
        match r {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

/// The arguments of a launch of `name` against the kernel's parameter sizes.
fn check_args(name: &str, sizes: &[usize], args: &[Arg]) -> Result<(), String> {
    if sizes.len() != args.len() {
        return Err(format!(
            "launch of {name}: {} arguments given, the kernel takes {} parameters",
            args.len(),
            sizes.len()
        ));
    }
    for (i, (s, a)) in sizes.iter().zip(args).enumerate() {
        if *s != a.width() {
            return Err(format!(
                "launch of {name}: argument {i} is a {}-byte value, the kernel's parameter {i} \
                 has {s} bytes",
                a.width()
            ));
        }
    }
    Ok(())
}

/// Checks that cudarc, which opens the driver by name, gets the library probed at `probed`:
/// the first of cudarc's candidate names that loads must be that library (the same `cuInit`).
fn same_driver_for_cudarc(probed: &std::path::Path) -> Result<(), CudaError> {
    type Init = unsafe extern "C" fn(u32) -> cudarc::driver::sys::CUresult;
    let ours = super::libs::open(probed)?;
    // SAFETY: cuInit's C signature; only its address is compared.
    let our_init = unsafe { super::libs::symbol::<Init>(ours, probed, "CUDA driver", "cuInit") }?;
    for name in cudarc::get_lib_name_candidates("cuda") {
        // SAFETY: opening a CUDA driver runs its initializers, which have no preconditions.
        let Ok(lib) = (unsafe { libloading::Library::new(&name) }) else {
            continue;
        };
        // SAFETY: as above.
        let theirs = unsafe { lib.get::<Init>(b"cuInit") }.map(|s| *s);
        return match theirs {
            Ok(f) if f as usize == our_init as usize => Ok(()),
            _ => Err(CudaError::Driver(format!(
                "cudarc would load the CUDA driver `{name}`, which is not the driver probed at {} \
                 (two drivers are installed: remove the other from the library path, or unset \
                 PLUMBLINE_CUDA_EMU)",
                probed.display()
            ))),
        };
    }
    Ok(())
}

/// One kernel argument, passed by value (cuLaunchKernel reads each parameter's size from the
/// kernel, so every value is stored in eight little-endian bytes).
#[derive(Clone, Copy)]
enum Arg {
    Ptr(u64),
    U32(u32),
    U64(u64),
    F32(f32),
    F64(f64),
}

impl Arg {
    /// The width of the kernel parameter this value is for.
    fn width(self) -> usize {
        match self {
            Arg::Ptr(_) | Arg::U64(_) | Arg::F64(_) => 8,
            Arg::U32(_) | Arg::F32(_) => 4,
        }
    }

    fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::U32(v) => u64::from(v),
            Arg::F32(f) => u64::from(f.to_bits()),
            Arg::F64(d) => d.to_bits(),
        }
    }
}

/// A device buffer of `len` values. The allocation has at least one element (the driver
/// rejects empty allocations), so the logical length is kept here; it derefs to the slice for
/// pointer arithmetic. A buffer from the backend's [`Pool`] goes back to it when dropped
/// (every stream operation is in order on the one stream, so a later op that takes it runs
/// after every earlier op that used it).
pub struct Dev<T> {
    mem: std::mem::ManuallyDrop<CudaSlice<T>>,
    len: usize,
    pool: Option<Arc<Pool>>,
}

impl<T> Drop for Dev<T> {
    fn drop(&mut self) {
        // SAFETY: `mem` is not used again: this is the end of `self`.
        let mem = unsafe { std::mem::ManuallyDrop::take(&mut self.mem) };
        match &self.pool {
            Some(p) => p.give(mem),
            None => drop(mem),
        }
    }
}

/// The most bytes of freed buffers the pool keeps; beyond it the largest are freed first, so
/// the small buffers of a decode step stay while a long prefill's large ones go.
const POOL_MAX_BYTES: usize = 1 << 30;

/// Freed device buffers kept for reuse, by exact size in bytes: the workspace of the
/// backend's temporaries. A forward pass allocates the same sizes as the forward before it
/// (one-token decode steps in particular), so in steady state every buffer comes from here and
/// no call reaches the driver's allocator. Exact sizes keep the emulator's bounds check exact:
/// a buffer is never larger than what it was asked for.
pub struct Pool {
    stream: Arc<CudaStream>,
    state: std::sync::Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    free: HashMap<usize, Vec<cudarc::driver::sys::CUdeviceptr>>,
    bytes: usize,
}

impl Pool {
    fn new(stream: Arc<CudaStream>) -> Pool {
        Pool {
            stream,
            state: std::sync::Mutex::new(PoolState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // A panic elsewhere leaves the lists consistent (each change is one push or pop).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A freed buffer of exactly `n` values of `T` (`n` ≥ 1), if one is kept.
    fn take<T>(&self, n: usize) -> Option<CudaSlice<T>> {
        let bytes = n * std::mem::size_of::<T>();
        let mut st = self.lock();
        let ptr = st.free.get_mut(&bytes)?.pop()?;
        st.bytes -= bytes;
        // SAFETY: `ptr` is a live allocation of `bytes` bytes that this pool owns (leaked from
        // a CudaSlice of that size); the caller zeroes or overwrites it before any read.
        Some(unsafe { self.stream.upgrade_device_ptr::<T>(ptr, n) })
    }

    /// Keep `mem` for reuse, freeing the largest kept buffers beyond [`POOL_MAX_BYTES`].
    fn give<T>(&self, mem: CudaSlice<T>) {
        let bytes = mem.len() * std::mem::size_of::<T>();
        if bytes == 0 || bytes > POOL_MAX_BYTES {
            return drop(mem);
        }
        let ptr = mem.leak();
        let mut st = self.lock();
        st.free.entry(bytes).or_default().push(ptr);
        st.bytes += bytes;
        while st.bytes > POOL_MAX_BYTES {
            let Some(&largest) = st
                .free
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, _)| k)
                .max()
            else {
                break;
            };
            if let Some(p) = st.free.get_mut(&largest).and_then(Vec::pop) {
                st.bytes -= largest;
                self.free_raw(p, largest);
            }
        }
    }

    fn free_raw(&self, ptr: cudarc::driver::sys::CUdeviceptr, bytes: usize) {
        // SAFETY: `ptr` is an allocation of `bytes` bytes this pool owned; dropping the slice
        // frees it on the stream, after every op enqueued before.
        drop(unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, bytes) });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let free = std::mem::take(&mut self.lock().free);
        for (bytes, ptrs) in free {
            for p in ptrs {
                self.free_raw(p, bytes);
            }
        }
    }
}

/// The per-token metadata arrays kernels read, each kept on the device with a host copy of
/// what it holds: a call uploads only the values that changed since the last call with the
/// same array (usually none: every layer of a forward passes the same positions and cells;
/// a decode step changes the newest cell or two). The device copy grows geometrically, so it
/// is reallocated O(log n) times as a context grows.
#[derive(Clone, Copy)]
enum Meta {
    RopePos,
    QPos,
    QSeq,
    CPos,
    CSeq,
    CBatch,
    KvCells,
    Rows,
}

const N_META: usize = 8;

#[derive(Default)]
struct MetaSlot {
    host: Vec<u32>,
    dev: Option<CudaSlice<u32>>,
}

#[derive(Default)]
struct MetaCache {
    slots: [MetaSlot; N_META],
}

impl<T> Dev<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> std::ops::Deref for Dev<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.mem
    }
}

impl<T> std::ops::DerefMut for Dev<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.mem
    }
}

/// A weight on the device: the file's GGML blocks, unchanged.
pub struct CudaMat {
    name: String,
    ty: GgmlType,
    k_dim: usize,
    n_rows: usize,
    n_mats: usize,
    row_bytes: usize,
    data: Dev<u8>,
}

/// One side of a cache layer.
pub enum KvStore {
    F32(CudaSlice<f32>),
    /// f16 bit patterns.
    F16(CudaSlice<u16>),
}

/// One layer of the KV cache on the device.
pub struct CudaKv {
    k: KvStore,
    v: KvStore,
    k_width: usize,
    v_width: usize,
    /// Cells reserved (`kv_reserve`): what kernels may address.
    n_cells: usize,
    /// Cells allocated (at least `n_cells`; the cache grows geometrically).
    cap: usize,
    dtype: KvDtype,
}

/// The fewest cells a cache layer allocates when it grows.
const KV_MIN_CELLS: usize = 256;

/// The CUDA backend of one device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<String, CudaFunction>,
    /// Each kernel's parameter sizes, as the driver reports them (`cuFuncGetParamInfo`, CUDA
    /// 12.4 and later); every launch is checked against them.
    params: HashMap<String, Vec<usize>>,
    ordinal: usize,
    arch: u32,
    /// Launches, allocations, copies and weight reads so far ([`Backend::counters`]).
    counters: AtomicCounters,
    /// Freed temporaries kept for reuse.
    pool: Arc<Pool>,
    /// The metadata arrays on the device; locked from the upload through the launch that
    /// reads them, so two threads never interleave their contents.
    meta: std::sync::Mutex<MetaCache>,
}

impl CudaBackend {
    /// The backend on device `ordinal`: finds the driver and NVRTC with `search`, checks the
    /// driver version and the architecture, compiles (or takes from `cache`) every kernel file
    /// for the device's architecture and loads it.
    pub fn new(
        ordinal: usize,
        search: &LibrarySearch,
        cache: &KernelCache,
    ) -> Result<CudaBackend, CudaError> {
        let info = driver::probe(search)?;
        let devices = info.devices.clone().map_err(CudaError::Driver)?;
        let dev = devices
            .get(ordinal)
            .ok_or(CudaError::NoDevice(devices.len()))?
            .clone();
        // NVRTC compiles the kernels (or finds them in the cache under its version); without
        // it, prebuilt cubins in the cache are used as they are, if every file has one.
        let nvrtc = Nvrtc::load(search);
        let mut cubins = Vec::with_capacity(FILES.len());
        let (ma, mi) = match nvrtc {
            Ok(n) => {
                n.check_arch(dev.arch)?;
                for file in &FILES {
                    cubins.push(cache.get(&n, file, dev.arch)?.0);
                }
                n.version()
            }
            Err(e) => {
                let mut version = (0, 0);
                for file in &FILES {
                    match cache.find_any(file, dev.arch) {
                        Some((c, v)) => {
                            cubins.push(c);
                            version = version.max(v);
                        }
                        None => return Err(e),
                    }
                }
                version
            }
        };
        if info.version / 1000 < ma {
            return Err(CudaError::DriverTooOld {
                driver_major: info.version / 1000,
                driver_minor: info.version % 1000 / 10,
                cubin_major: ma,
                cubin_minor: mi,
            });
        }
        // The driver library is loaded (by its full path, in `driver::probe`), so cudarc's
        // by-name load finds it — unless another driver answers one of the names cudarc tries
        // first (`libcuda.so`), which would put the backend on a driver other than the one
        // probed (the emulator beside a real driver, or the reverse): that is an error.
        same_driver_for_cudarc(&info.path)?;
        let param_info = param_info_fn(&info.path);
        // cudarc panics on a symbol the driver lacks; that becomes an error naming the driver.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                CudaError::Driver(format!(
                    "{} lacks a driver API entry point cudarc needs: update the NVIDIA driver",
                    info.path.display()
                ))
            })?
            .map_err(|e| CudaError::Driver(e.to_string()))?;
        // One stream, in order: cudarc's cross-stream event tracking is not needed.
        // SAFETY: every buffer of this backend is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let mut funcs = HashMap::new();
        let mut params = HashMap::new();
        for (file, cubin) in FILES.iter().zip(cubins) {
            let entries: Vec<String> = entry_points(&file.program());
            let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| {
                CudaError::Driver(format!("loading {} (sm_{}): {e}", file.name, dev.arch))
            })?;
            for name in entries {
                let f = module
                    .load_function(&name)
                    .map_err(|e| CudaError::Driver(format!("{} in {}: {e}", name, file.name)))?;
                if let Some(sizes) = param_info.and_then(|p| param_sizes(p, &f)) {
                    params.insert(name.clone(), sizes);
                }
                funcs.insert(name, f);
            }
        }
        Ok(CudaBackend {
            ctx,
            funcs,
            params,
            ordinal,
            arch: dev.arch,
            counters: AtomicCounters::default(),
            pool: Arc::new(Pool::new(stream.clone())),
            meta: std::sync::Mutex::new(MetaCache::default()),
            stream,
        })
    }

    /// The backend on device `ordinal` with the default library search and kernel cache.
    pub fn open(ordinal: usize) -> Result<CudaBackend, CudaError> {
        Self::new(
            ordinal,
            &LibrarySearch::from_env(),
            &KernelCache::new(KernelCache::default_dir()),
        )
    }

    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// Number of loaded entry points.
    pub fn n_kernels(&self) -> usize {
        self.funcs.len()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Every counter back to zero (the device work counted since the backend started is
    /// [`Backend::counters`]).
    pub fn reset_counters(&self) {
        self.counters.reset();
    }

    /// A new device allocation of `n` values (at least one: the driver rejects empty
    /// allocations), zeroed; counted.
    fn alloc_zeroed<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, RuntimeError> {
        let n = n.max(1);
        let mem = self.stream.alloc_zeros::<T>(n).map_err(drv)?;
        self.counters.alloc(n * std::mem::size_of::<T>());
        Ok(mem)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// Launch `name` with `args` in the kernel's parameter order.
    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), RuntimeError> {
        let f = self.funcs.get(name).ok_or_else(|| {
            RuntimeError::Cuda(CudaError::Unsupported(format!("no kernel {name} loaded")))
        })?;
        if let Some(sizes) = self.params.get(name) {
            check_args(name, sizes, args).map_err(|e| RuntimeError::Cuda(CudaError::Driver(e)))?;
        }
        self.counters.launch();
        let vals: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut b = self.stream.launch_builder(f);
        for v in &vals {
            b.arg(v);
        }
        // SAFETY: every call site passes the arguments in the order and of the types of the
        // kernel's C signature (named there), device pointers of buffers whose lengths it has
        // checked against the kernel's indexing (the contract in the kernel's comment), and a
        // grid no larger than that contract covers.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// The static shared memory of kernel `name`, in bytes, as the driver reports it.
    fn static_shared(&self, name: &str) -> Result<usize, RuntimeError> {
        let f = self.funcs.get(name).ok_or_else(|| {
            RuntimeError::Cuda(CudaError::Unsupported(format!("no kernel {name} loaded")))
        })?;
        let b = f
            .get_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
            .map_err(drv)?;
        Ok(usize::try_from(b).unwrap_or(0))
    }

    fn upload_u32(&self, v: &[u32]) -> Result<Dev<u32>, RuntimeError> {
        self.upload_any(v)
    }

    fn zeros_f32(&self, n: usize) -> Result<Dev<f32>, RuntimeError> {
        self.zeros(n)
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<Dev<T>, RuntimeError> {
        let mem = match self.pool.take::<T>(n.max(1)) {
            Some(mut mem) => {
                self.stream.memset_zeros(&mut mem).map_err(drv)?;
                mem
            }
            None => self.alloc_zeroed::<T>(n)?,
        };
        Ok(Dev {
            mem: std::mem::ManuallyDrop::new(mem),
            len: n,
            pool: Some(self.pool.clone()),
        })
    }

    fn upload_any<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<Dev<T>, RuntimeError> {
        if v.is_empty() {
            return self.zeros(0);
        }
        let bytes = std::mem::size_of_val(v);
        let mem = match self.pool.take::<T>(v.len()) {
            Some(mut mem) => {
                self.stream.memcpy_htod(v, &mut mem).map_err(drv)?;
                mem
            }
            None => {
                self.counters.alloc(bytes);
                self.stream.clone_htod(v).map_err(drv)?
            }
        };
        self.counters.htod(bytes);
        Ok(Dev {
            mem: std::mem::ManuallyDrop::new(mem),
            len: v.len(),
            pool: Some(self.pool.clone()),
        })
    }

    /// A copy of `v` on the device in an allocation of its own, outside the pool (weights:
    /// they live as long as the engine, and a pool would keep them after).
    fn upload_owned(&self, v: &[u8]) -> Result<Dev<u8>, RuntimeError> {
        if v.is_empty() {
            let mem = self.alloc_zeroed::<u8>(1)?;
            return Ok(Dev {
                mem: std::mem::ManuallyDrop::new(mem),
                len: 0,
                pool: None,
            });
        }
        let mem = self.stream.clone_htod(v).map_err(drv)?;
        self.counters.alloc(v.len());
        self.counters.htod(v.len());
        Ok(Dev {
            mem: std::mem::ManuallyDrop::new(mem),
            len: v.len(),
            pool: None,
        })
    }

    fn lock_meta(&self) -> std::sync::MutexGuard<'_, MetaCache> {
        // A failed upload clears its slot (below), so a poisoned cache is still consistent.
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device address of metadata array `slot` holding `data`, uploading only the values
    /// that differ from what the slot held (see [`Meta`]).
    fn meta_ptr(
        &self,
        cache: &mut MetaCache,
        slot: Meta,
        data: &[u32],
    ) -> Result<u64, RuntimeError> {
        let s = &mut cache.slots[slot as usize];
        let r = self.meta_update(s, data);
        if r.is_err() {
            // Unknown device contents: the next call uploads everything.
            s.host.clear();
            s.dev = None;
        }
        r
    }

    fn meta_update(&self, s: &mut MetaSlot, data: &[u32]) -> Result<u64, RuntimeError> {
        let n = data.len();
        let cap = s.dev.as_ref().map_or(0, |d| d.len());
        let (lo, hi) = if cap < n.max(1) {
            // Twice what is needed, so a growing context reallocates O(log n) times.
            s.dev = Some(self.alloc_zeroed::<u32>((2 * n).max(64))?);
            s.host.clear();
            (0, n)
        } else {
            let common = s.host.len().min(n);
            let lo = (0..common)
                .find(|&i| s.host[i] != data[i])
                .unwrap_or(common);
            let hi = if n > common {
                n
            } else {
                (lo..common)
                    .rev()
                    .find(|&i| s.host[i] != data[i])
                    .map_or(lo, |i| i + 1)
            };
            (lo, hi)
        };
        let Some(dev) = s.dev.as_mut() else {
            return Err(RuntimeError::Cuda(CudaError::Driver(
                "metadata array missing after its allocation".into(),
            )));
        };
        if hi > lo {
            self.stream
                .memcpy_htod(&data[lo..hi], &mut dev.slice_mut(lo..hi))
                .map_err(drv)?;
            self.counters.htod((hi - lo) * 4);
        }
        s.host.clear();
        s.host.extend_from_slice(data);
        Ok(self.ptr(dev))
    }

    /// Quantize `n_tok × k` activations to q8_1 blocks (36 bytes per 32 values).
    fn quantize_q8_1(&self, x: &Dev<f32>, n_tok: usize, k: usize) -> Result<Dev<u8>, RuntimeError> {
        let n_blocks = n_tok * k / 32;
        let y = self.zeros::<u8>(n_blocks * 36)?;
        if n_blocks == 0 {
            return Ok(y);
        }
        let cfg = LaunchConfig {
            grid_dim: ((n_blocks as u32).div_ceil(8), 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // Kernel quantize_q8_1(const float* x, block_q8_1* y, u32 n_blocks).
        self.launch(
            "quantize_q8_1",
            cfg,
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(self.ptr(&y)),
                Arg::U32(n_blocks as u32),
            ],
        )?;
        Ok(y)
    }

    /// The matrix-vector kernel for `w` over `n_out` output rows.
    /// A copy of the `n` activations `x` rounded as `mode` says (`round_act`), or `None` when
    /// `mode` keeps f32 (read `x` itself).
    fn rounded(
        &self,
        x: &Dev<f32>,
        n: usize,
        mode: ActRound,
    ) -> Result<Option<Dev<f32>>, RuntimeError> {
        if mode == ActRound::None {
            return Ok(None);
        }
        let block = match mode {
            ActRound::Q8_0 => 32,
            ActRound::Q8K => 256,
            _ => 1,
        };
        if !n.is_multiple_of(block) || n > x.len() {
            return Err(shape(
                "activations (whole rounding blocks)",
                n.next_multiple_of(block),
                n,
            ));
        }
        if n == 0 {
            return Ok(None);
        }
        let mut y = self.zeros_f32(n)?;
        self.stream
            .memcpy_dtod(&x.mem.slice(..n), &mut y.mem.slice_mut(..n))
            .map_err(drv)?;
        let threads = (n / block) as u32;
        // Kernel round_act(float* x, u64 n, u32 mode).
        self.launch(
            "round_act",
            LaunchConfig {
                grid_dim: (threads.div_ceil(256).max(1), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&y)),
                Arg::U64(n as u64),
                Arg::U32(mode as u32),
            ],
        )?;
        Ok(Some(y))
    }

    fn mmv(
        &self,
        w: &CudaMat,
        x: &Dev<f32>,
        ids: Option<(&Dev<u32>, usize, bool)>,
        n_x_rows: usize,
        n_out: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        // Q8_0-family weights read q8_1 blocks (the same values as ggml's Q8_0); the others read
        // f32 activations rounded as their CPU dot product reads them (mmvf_<type>).
        let mode = ActRound::of(w.ty);
        let (q, rounded);
        let (xp, prefix) = if mode == ActRound::Q8_0 {
            q = self.quantize_q8_1(x, n_x_rows, w.k_dim)?;
            (self.ptr(&q), "mmv")
        } else {
            rounded = self.rounded(x, n_x_rows * w.k_dim, mode)?;
            (self.ptr(rounded.as_ref().unwrap_or(x)), "mmvf")
        };
        let (ids_p, k_slots, per_slot) = match ids {
            Some((i, k, p)) => (self.ptr(i), k, p),
            None => (0, 1, false),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                (w.n_rows as u32).div_ceil(MMV_ROWS),
                (n_out as u32).min(65_535),
                1,
            ),
            block_dim: (32, MMV_ROWS, 1),
            shared_mem_bytes: 0,
        };
        let name = format!("{prefix}_{}", w.ty.name().to_ascii_lowercase());
        // Each output row `o` (a token, or a token's expert slot) reads one whole matrix.
        self.counters.weights_read(n_out * w.row_bytes * w.n_rows);
        // Kernel mmv[f]_<type>(w, u64 row_bytes, u64 mat_bytes, u32 n_mats, x, u32 k_dim,
        // u32 n_rows, u32 n_out, const u32* ids, u32 k_slots, u32 x_per_slot, float* out).
        self.launch(
            &name,
            cfg,
            &[
                Arg::Ptr(self.ptr(&w.data)),
                Arg::U64(w.row_bytes as u64),
                Arg::U64((w.row_bytes * w.n_rows) as u64),
                Arg::U32(w.n_mats as u32),
                Arg::Ptr(xp),
                Arg::U32(w.k_dim as u32),
                Arg::U32(w.n_rows as u32),
                Arg::U32(n_out as u32),
                Arg::Ptr(ids_p),
                Arg::U32(k_slots as u32),
                Arg::U32(u32::from(per_slot)),
                Arg::Ptr(self.ptr(out)),
            ],
        )
    }

    /// Prefill product: dequantize `w` (one matrix) to f16, then the tiled GEMM.
    fn gemm(
        &self,
        w: &CudaMat,
        x: &Dev<f32>,
        n_tok: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        let rounded = self.rounded(x, n_tok * w.k_dim, ActRound::of(w.ty))?;
        let x = rounded.as_ref().unwrap_or(x);
        let n = w.n_rows * w.k_dim;
        let wf = self.zeros::<u16>(n)?;
        let chunks = (n / 32) as u32;
        let name = format!("dequant_{}_f16", w.ty.name().to_ascii_lowercase());
        self.counters.weights_read(w.row_bytes * w.n_rows);
        // Kernel dequant_<type>_f16(w, u64 row_bytes, u32 k_dim, u32 n_rows, u16* out).
        self.launch(
            &name,
            LaunchConfig {
                grid_dim: (chunks.div_ceil(256), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&w.data)),
                Arg::U64(w.row_bytes as u64),
                Arg::U32(w.k_dim as u32),
                Arg::U32(w.n_rows as u32),
                Arg::Ptr(self.ptr(&wf)),
            ],
        )?;
        // Kernel gemm_f16_f32(const u16* w, const float* x, float* out, u32 n_rows, u32 k_dim,
        // u32 n_tok): 32×32 tiles, blockDim (32, 8), grid (row tiles, ≤ 65535 token tiles).
        self.launch(
            "gemm_f16_f32",
            LaunchConfig {
                // Token tiles beyond 65535 are strided over by the kernel.
                grid_dim: (
                    (w.n_rows as u32).div_ceil(32),
                    (n_tok.div_ceil(32)).min(65_535) as u32,
                    1,
                ),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&wf)),
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(self.ptr(out)),
                Arg::U32(w.n_rows as u32),
                Arg::U32(w.k_dim as u32),
                Arg::U32(n_tok as u32),
            ],
        )
    }

    /// A one-dimensional grid-stride launch over `n` elements.
    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256).clamp(1, 65_535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Token ids of the most likely next token for each of `n_rows` rows of `width` logits,
    /// on the device. Twin: [`crate::sampling::argmax`].
    pub fn argmax_rows(
        &self,
        logits: &Dev<f32>,
        n_rows: usize,
        width: usize,
    ) -> Result<Vec<u32>, RuntimeError> {
        check_len("argmax logits", n_rows * width, logits.len())?;
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        if width == 0 {
            return Err(shape("argmax row width (at least one logit)", 1, 0));
        }
        let out = self.zeros::<u32>(n_rows)?;
        // Kernel argmax_rows(const float* x, u32 width, u32* out): one block of 256 per row.
        self.launch(
            "argmax_rows",
            LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(logits)),
                Arg::U32(width as u32),
                Arg::Ptr(self.ptr(&out)),
            ],
        )?;
        let mut v = self.stream.clone_dtoh(&*out.mem).map_err(drv)?;
        self.counters.dtoh(std::mem::size_of_val(v.as_slice()));
        v.truncate(n_rows);
        Ok(v)
    }

    /// Sample one token from `logits` (top-k ≤ 64 at `temperature`) with the uniform draw `u`
    /// in [0, 1). Twin: [`crate::sampling::Sampler::sample`] with top_p 1, min_p 0, no penalty.
    pub fn sample_top_k(
        &self,
        logits: &Dev<f32>,
        top_k: usize,
        temperature: f32,
        u: f64,
    ) -> Result<u32, RuntimeError> {
        if top_k == 0 || top_k > 64 {
            return Err(shape("device sampling top_k (1..=64)", 64, top_k));
        }
        if logits.is_empty() {
            return Err(shape("device sampling logits (at least one)", 1, 0));
        }
        let out = self.zeros::<u32>(1)?;
        // Kernel sample_top_k(const float* logits, u32 n, u32 top_k, float temperature,
        // double u, u32* out): one block of 256.
        self.launch(
            "sample_top_k",
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(logits)),
                Arg::U32(logits.len() as u32),
                Arg::U32(top_k as u32),
                Arg::F32(temperature),
                Arg::F64(u),
                Arg::Ptr(self.ptr(&out)),
            ],
        )?;
        let v = self.stream.clone_dtoh(&*out.mem).map_err(drv)?;
        self.counters.dtoh(std::mem::size_of_val(v.as_slice()));
        Ok(v.first().copied().unwrap_or(0))
    }
}

/// The `extern "C" __global__` entry points of a program, macro-generated ones expanded for
/// every type of `FOR_EACH_TYPE`.
fn entry_points(program: &str) -> Vec<String> {
    let types: Vec<&str> = CUDA_TYPES.iter().map(|t| t.name()).collect();
    let mut out = Vec::new();
    for line in program.lines() {
        let Some(rest) = line
            .trim_start()
            .strip_prefix("extern \"C\" __global__ void ")
        else {
            continue;
        };
        let name = rest.split('(').next().unwrap_or("").trim();
        if let Some(stem) = name.strip_suffix("##T##_f16") {
            out.extend(
                types
                    .iter()
                    .map(|t| format!("{stem}{}_f16", t.to_ascii_lowercase())),
            );
        } else if let Some(stem) = name.strip_suffix("##T") {
            out.extend(
                types
                    .iter()
                    .map(|t| format!("{stem}{}", t.to_ascii_lowercase())),
            );
        } else if !name.is_empty() {
            out.push(name.to_string());
        }
    }
    out.sort();
    out.dedup();
    out
}

/// `plumbline doctor`'s device check: open the backend on `ordinal` (which compiles and loads
/// every kernel) and run known-answer products and ops; a one-line summary or the root cause.
pub fn self_test(
    ordinal: usize,
    search: &LibrarySearch,
    cache: &KernelCache,
) -> Result<String, CudaError> {
    let b = CudaBackend::new(ordinal, search, cache)?;
    let fail = |what: &str, e: RuntimeError| CudaError::Driver(format!("known-answer {what}: {e}"));
    // A Q8_0 row of the values 1..=32 with d = 1, times x = 127 everywhere: the q8_1
    // activations are then exact too (d = 127/127 = 1, q = 127), and Σ (i+1)·127 = 67056 is
    // exact in f32, so any deviation is a kernel or loading fault, not rounding.
    let mut block = vec![0u8; 34];
    block[..2].copy_from_slice(&half::f16::ONE.to_bits().to_le_bytes());
    for i in 0..32 {
        block[2 + i] = (i as u8) + 1;
    }
    let w = b
        .prepare(WeightData {
            name: "self-test".to_owned(),
            ty: GgmlType::Q8_0,
            k_dim: 32,
            n_rows: 1,
            n_mats: 1,
            data: std::borrow::Cow::Owned(block),
        })
        .map_err(|e| fail("prepare", e))?;
    let x = b.upload(&[127.0; 32]).map_err(|e| fail("upload", e))?;
    let mut out = b.alloc(1).map_err(|e| fail("alloc", e))?;
    b.matmul(&w, &x, 1, &mut out)
        .map_err(|e| fail("q8_0 matmul", e))?;
    let mut host = Vec::new();
    b.download(&out, &mut host)
        .map_err(|e| fail("download", e))?;
    if host.first() != Some(&67056.0) {
        return Err(CudaError::Driver(format!(
            "known-answer q8_0 product: expected 67056, found {host:?}"
        )));
    }
    let mut y = b.upload(&[1.0, 2.0, 3.0]).map_err(|e| fail("upload", e))?;
    let z = b
        .upload(&[10.0, 20.0, 30.0])
        .map_err(|e| fail("upload", e))?;
    b.add(&mut y, &z).map_err(|e| fail("add", e))?;
    b.download(&y, &mut host).map_err(|e| fail("download", e))?;
    if host != [11.0, 22.0, 33.0] {
        return Err(CudaError::Driver(format!(
            "known-answer add: expected [11, 22, 33], found {host:?}"
        )));
    }
    Ok(format!(
        "{} entry points loaded for sm_{}; known answers: q8_0 product, add",
        b.n_kernels(),
        b.arch()
    ))
}

impl CudaBackend {
    /// Cells `0..n_cells` of one side (`store`, rows of `width`, `reserved` cells) of a cache
    /// layer as f32 rows: [`Backend::kv_read_k`] and `kv_read_v` (`op` names which).
    fn kv_read_rows(
        &self,
        store: &KvStore,
        width: usize,
        reserved: usize,
        n_cells: usize,
        out: &mut Dev<f32>,
        op: &'static str,
    ) -> Result<(), RuntimeError> {
        let (cells_op, out_op) = match op {
            "kv_read_v" => ("kv_read_v cells (<= reserved)", "kv_read_v output"),
            _ => ("kv_read_k cells (<= reserved)", "kv_read_k output"),
        };
        check_len(out_op, n_cells * width, out.len())?;
        if n_cells > reserved {
            return Err(shape(cells_op, reserved, n_cells));
        }
        let n = n_cells * width;
        if n == 0 {
            return Ok(());
        }
        match store {
            KvStore::F32(s) => self
                .stream
                .memcpy_dtod(&s.slice(..n), &mut out.mem.slice_mut(..n))
                .map_err(drv),
            // Kernel f16_to_f32_rows(const u16* src, float* dst, u64 n).
            KvStore::F16(s) => self.launch(
                "f16_to_f32_rows",
                Self::grid(n),
                &[
                    Arg::Ptr(self.ptr(s)),
                    Arg::Ptr(self.ptr(out)),
                    Arg::U64(n as u64),
                ],
            ),
        }
    }
}

impl Backend for CudaBackend {
    type Buf = Dev<f32>;
    type Ids = Dev<u32>;
    type Mat<'w> = CudaMat;
    type Kv = CudaKv;

    fn name(&self) -> String {
        format!("cuda:{} (sm_{})", self.ordinal, self.arch)
    }

    fn threads(&self) -> usize {
        1
    }

    fn counters(&self) -> Option<DeviceCounters> {
        Some(self.counters.snapshot())
    }

    fn alloc(&self, n: usize) -> Result<Dev<f32>, RuntimeError> {
        self.zeros(n)
    }

    fn upload(&self, data: &[f32]) -> Result<Dev<f32>, RuntimeError> {
        self.upload_any(data)
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<Dev<u32>, RuntimeError> {
        self.upload_any(ids)
    }

    fn download(&self, buf: &Dev<f32>, out: &mut Vec<f32>) -> Result<(), RuntimeError> {
        out.resize(buf.len(), 0.0);
        if buf.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&buf.mem.slice(..buf.len), out.as_mut_slice())
            .map_err(drv)?;
        self.counters.dtoh(buf.len * 4);
        self.stream.synchronize().map_err(drv)
    }

    fn download_ids(&self, ids: &Dev<u32>, out: &mut Vec<u32>) -> Result<(), RuntimeError> {
        out.resize(ids.len(), 0);
        if ids.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&ids.mem.slice(..ids.len), out.as_mut_slice())
            .map_err(drv)?;
        self.counters.dtoh(ids.len * 4);
        self.stream.synchronize().map_err(drv)
    }

    fn buf_len(&self, buf: &Dev<f32>) -> usize {
        buf.len()
    }

    fn prepare<'w>(&self, w: WeightData<'w>) -> Result<CudaMat, RuntimeError>
    where
        Self: 'w,
    {
        if !CUDA_TYPES.contains(&w.ty) {
            return Err(RuntimeError::Cuda(CudaError::Unsupported(format!(
                "{}: no CUDA kernel for type {}",
                w.name,
                w.ty.name()
            ))));
        }
        if !w.k_dim.is_multiple_of(32) || !w.k_dim.is_multiple_of(w.ty.block_size()) {
            return Err(shape(
                "CUDA weight row length (a multiple of 32 and of the block size)",
                w.ty.block_size().max(32),
                w.k_dim,
            ));
        }
        let row_bytes = w.k_dim / w.ty.block_size() * w.ty.type_size();
        check_len(
            "weight bytes",
            row_bytes * w.n_rows * w.n_mats,
            w.data.len(),
        )?;
        let data = self.upload_owned(w.data.as_ref())?;
        Ok(CudaMat {
            name: w.name.to_string(),
            ty: w.ty,
            k_dim: w.k_dim,
            n_rows: w.n_rows,
            n_mats: w.n_mats,
            row_bytes,
            data,
        })
    }

    fn matmul(
        &self,
        w: &CudaMat,
        x: &Dev<f32>,
        n_tokens: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("matmul input", n_tokens * w.k_dim, x.len())?;
        check_len("matmul output", n_tokens * w.n_rows, out.len())?;
        if w.n_mats != 1 {
            return Err(shape("matmul weight (one matrix)", 1, w.n_mats));
        }
        if n_tokens == 0 || w.n_rows == 0 {
            return Ok(()); // no outputs: no launch (an empty grid is an invalid launch)
        }
        if w.k_dim == 0 {
            // Sums over no values.
            return self.stream.memset_zeros(&mut *out.mem).map_err(drv);
        }
        // The GEMM multiplies f16 weights: F32 and BF16 weights (whose range or precision f16
        // would lose) stay on the matrix-vector kernels, and so do Q4_1 and Q5_1, whose dot
        // product adds min × the f16-rounded sum of each activation block (ggml's q8_1 `s`),
        // which only the matrix-vector kernel reproduces (a GEMM on dequantized weights differs
        // from the CPU by NMSE ~6e-7, the size of a wrong scale in one block of a long row).
        let gemm_ok = !matches!(
            w.ty,
            GgmlType::F32 | GgmlType::BF16 | GgmlType::Q4_1 | GgmlType::Q5_1
        );
        if n_tokens >= GEMM_MIN_TOKENS && gemm_ok {
            return self.gemm(w, x, n_tokens, out);
        }
        self.mmv(w, x, None, n_tokens, n_tokens, out)
            .map_err(|e| match e {
                RuntimeError::Cuda(c) => {
                    RuntimeError::Cuda(CudaError::Driver(format!("matmul {}: {c}", w.name)))
                }
                e => e,
            })
    }

    fn matmul_experts(
        &self,
        w: &CudaMat,
        x: &Dev<f32>,
        x_per_slot: bool,
        ids: &Dev<u32>,
        n_tokens: usize,
        k: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        let n_x = if x_per_slot { n_tokens * k } else { n_tokens };
        check_len("expert matmul input", n_x * w.k_dim, x.len())?;
        check_len("expert ids", n_tokens * k, ids.len())?;
        check_len("expert matmul output", n_tokens * k * w.n_rows, out.len())?;
        if n_tokens * k == 0 || w.n_rows == 0 {
            return Ok(());
        }
        if w.k_dim == 0 {
            return self.stream.memset_zeros(&mut *out.mem).map_err(drv);
        }
        self.mmv(w, x, Some((ids, k, x_per_slot)), n_x, n_tokens * k, out)
    }

    fn embed(
        &self,
        w: &CudaMat,
        tokens: &Dev<u32>,
        n_tokens: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("embed tokens", n_tokens, tokens.len())?;
        check_len("embed output", n_tokens * w.k_dim, out.len())?;
        if n_tokens == 0 || w.k_dim == 0 {
            return Ok(());
        }
        let chunks = n_tokens * w.k_dim / 32;
        let name = format!("embed_{}", w.ty.name().to_ascii_lowercase());
        // One row per token.
        self.counters.weights_read(n_tokens * w.row_bytes);
        // Kernel embed_<type>(w, u64 row_bytes, u32 k_dim, u32 n_vocab, const u32* tokens,
        // u32 n_tokens, float* out); a token ≥ n_vocab gives a NaN row (the forward pass
        // checks ids on the host before they get here).
        self.launch(
            &name,
            LaunchConfig {
                grid_dim: ((chunks as u32).div_ceil(256), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(&w.data)),
                Arg::U64(w.row_bytes as u64),
                Arg::U32(w.k_dim as u32),
                Arg::U32(w.n_rows as u32),
                Arg::Ptr(self.ptr(tokens)),
                Arg::U32(n_tokens as u32),
                Arg::Ptr(self.ptr(out)),
            ],
        )
    }

    fn rms_norm(
        &self,
        x: &Dev<f32>,
        weight: &Dev<f32>,
        eps: f32,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        let width = weight.len();
        check_len("rms_norm output", x.len(), out.len())?;
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(shape(
                "rms_norm rows (a multiple of the weight length)",
                width,
                x.len(),
            ));
        }
        let rows = x.len() / width;
        if rows == 0 {
            return Ok(());
        }
        // Kernel rms_norm(const float* x, const float* weight, float* out, u32 width, float eps).
        self.launch(
            "rms_norm",
            LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(self.ptr(weight)),
                Arg::Ptr(self.ptr(out)),
                Arg::U32(width as u32),
                Arg::F32(eps),
            ],
        )
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Dev<f32>,
        weight: &Dev<f32>,
        eps: f32,
    ) -> Result<(), RuntimeError> {
        let width = weight.len();
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(shape(
                "rms_norm rows (a multiple of the weight length)",
                width,
                x.len(),
            ));
        }
        let rows = x.len() / width;
        if rows == 0 {
            return Ok(());
        }
        let p = self.ptr(x);
        // rms_norm in place (out == x): each block reads its row fully before writing.
        self.launch(
            "rms_norm",
            LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(p),
                Arg::Ptr(self.ptr(weight)),
                Arg::Ptr(p),
                Arg::U32(width as u32),
                Arg::F32(eps),
            ],
        )
    }

    fn rope(
        &self,
        x: &mut Dev<f32>,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeConfig,
    ) -> Result<(), RuntimeError> {
        check_len("rope input", positions.len() * n_heads * head_dim, x.len())?;
        if positions.len() > u32::MAX as usize {
            return Err(shape(
                "rope tokens (< 2^32)",
                u32::MAX as usize,
                positions.len(),
            ));
        }
        if rope.n_rot > head_dim || !rope.n_rot.is_multiple_of(2) {
            return Err(shape(
                "rope dimensions (even, at most the head width)",
                head_dim,
                rope.n_rot,
            ));
        }
        if x.is_empty() || rope.n_rot == 0 {
            return Ok(());
        }
        // The host part of ggml's rope_yarn: correction dims and magnitude scale, once per call
        // (the CPU twin computes them in rope_cache).
        let (corr, ext, mut mscale) = match rope.yarn {
            Some(y) => (
                yarn_corr_dims(
                    rope.n_rot,
                    y.n_ctx_orig,
                    rope.freq_base,
                    y.beta_fast,
                    y.beta_slow,
                ),
                y.ext_factor,
                y.attn_factor,
            ),
            None => ([0.0, 0.0], 0.0, 1.0),
        };
        if ext != 0.0 {
            mscale *= 1.0 + 0.1 * (1.0 / rope.freq_scale).ln();
        }
        let mut meta = self.lock_meta();
        let pos = self.meta_ptr(&mut meta, Meta::RopePos, positions)?;
        let style = match rope.style {
            RopeStyle::Normal => 0,
            RopeStyle::Neox => 1,
        };
        // Kernel rope(float* x, const u32* positions, u32 n_tok, u32 n_heads, u32 head_dim,
        // u32 n_rot, u32 style, float freq_base, float freq_scale, float ext_factor,
        // float mscale, float corr0, float corr1): one block per (token, head) pair, the
        // blocks striding over them (grid x only: any token count).
        let pairs = positions.len() * n_heads;
        let (mut base, mut scale) = (rope.freq_base, rope.freq_scale);
        if crate::faults::is_active(crate::faults::Fault::CudaRopeArgsSwapped) {
            std::mem::swap(&mut base, &mut scale);
        }
        self.launch(
            "rope",
            LaunchConfig {
                grid_dim: (pairs.min(MAX_GRID_X) as u32, 1, 1),
                block_dim: (((rope.n_rot / 2) as u32).clamp(1, 256), 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(pos),
                Arg::U32(positions.len() as u32),
                Arg::U32(n_heads as u32),
                Arg::U32(head_dim as u32),
                Arg::U32(rope.n_rot as u32),
                Arg::U32(style),
                Arg::F32(base),
                Arg::F32(scale),
                Arg::F32(ext),
                Arg::F32(mscale),
                Arg::F32(corr[0]),
                Arg::F32(corr[1]),
            ],
        )
    }

    fn gated_act(
        &self,
        act: Activation,
        gate: &mut Dev<f32>,
        up: &Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("gated activation", gate.len(), up.len())?;
        let name = match act {
            Activation::Silu => "gated_silu",
            Activation::GeluTanh => "gated_gelu_tanh",
        };
        let n = gate.len();
        if n == 0 {
            return Ok(());
        }
        // Kernel gated_*(float* gate, const float* up, u64 n).
        self.launch(
            name,
            Self::grid(n),
            &[
                Arg::Ptr(self.ptr(gate)),
                Arg::Ptr(self.ptr(up)),
                Arg::U64(n as u64),
            ],
        )
    }

    fn softcap(&self, x: &mut Dev<f32>, cap: f32) -> Result<(), RuntimeError> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // Kernel softcap(float* x, u64 n, float cap).
        self.launch(
            "softcap",
            Self::grid(n),
            &[Arg::Ptr(self.ptr(x)), Arg::U64(n as u64), Arg::F32(cap)],
        )
    }

    fn add(&self, x: &mut Dev<f32>, y: &Dev<f32>) -> Result<(), RuntimeError> {
        check_len("add", x.len(), y.len())?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // Kernel add(float* x, const float* y, u64 n).
        self.launch(
            "add",
            Self::grid(n),
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(self.ptr(y)),
                Arg::U64(n as u64),
            ],
        )
    }

    fn add_row(&self, x: &mut Dev<f32>, row: &Dev<f32>) -> Result<(), RuntimeError> {
        let w = row.len();
        if w == 0 || !x.len().is_multiple_of(w) {
            return Err(shape(
                "add_row rows (a multiple of the row length)",
                w,
                x.len(),
            ));
        }
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // Kernel add_row(float* x, const float* row, u64 n, u32 width).
        self.launch(
            "add_row",
            Self::grid(n),
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(self.ptr(row)),
                Arg::U64(n as u64),
                Arg::U32(w as u32),
            ],
        )
    }

    fn scale(&self, x: &mut Dev<f32>, s: f32) -> Result<(), RuntimeError> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // Kernel scale(float* x, u64 n, float s).
        self.launch(
            "scale",
            Self::grid(n),
            &[Arg::Ptr(self.ptr(x)), Arg::U64(n as u64), Arg::F32(s)],
        )
    }

    fn copy(&self, src: &Dev<f32>, dst: &mut Dev<f32>) -> Result<(), RuntimeError> {
        check_len("copy", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let n = src.len;
        self.stream
            .memcpy_dtod(&src.mem.slice(..n), &mut dst.mem.slice_mut(..n))
            .map_err(drv)
    }

    fn fill(
        &self,
        x: &mut Dev<f32>,
        start: usize,
        len: usize,
        value: f32,
    ) -> Result<(), RuntimeError> {
        if start + len > x.len() {
            return Err(shape(
                "fill range (within the buffer)",
                x.len(),
                start + len,
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let p = self.ptr(x) + (start * 4) as u64;
        // Kernel fill(float* x, u64 n, float value) on the sub-range.
        self.launch(
            "fill",
            Self::grid(len),
            &[Arg::Ptr(p), Arg::U64(len as u64), Arg::F32(value)],
        )
    }

    fn copy_strided(
        &self,
        src: &Dev<f32>,
        s: Strided,
        dst: &mut Dev<f32>,
        d: Strided,
        n_rows: usize,
        n_groups: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        if n_rows == 0 || n_groups == 0 || len == 0 {
            return Ok(());
        }
        let last = |t: Strided| {
            (n_rows - 1) * t.row_stride + (n_groups - 1) * t.group_stride + t.offset + len
        };
        if last(s) > src.len() {
            return Err(shape(
                "copy_strided source (within the buffer)",
                src.len(),
                last(s),
            ));
        }
        if last(d) > dst.len() {
            return Err(shape(
                "copy_strided destination (within the buffer)",
                dst.len(),
                last(d),
            ));
        }
        // Kernel copy_strided(src, u64 srs, u64 sgs, u64 soff, dst, u64 drs, u64 dgs, u64 doff,
        // u32 n_rows, u32 n_groups, u32 len).
        self.launch(
            "copy_strided",
            Self::grid(n_rows * n_groups * len),
            &[
                Arg::Ptr(self.ptr(src)),
                Arg::U64(s.row_stride as u64),
                Arg::U64(s.group_stride as u64),
                Arg::U64(s.offset as u64),
                Arg::Ptr(self.ptr(dst)),
                Arg::U64(d.row_stride as u64),
                Arg::U64(d.group_stride as u64),
                Arg::U64(d.offset as u64),
                Arg::U32(n_rows as u32),
                Arg::U32(n_groups as u32),
                Arg::U32(len as u32),
            ],
        )
    }

    fn gather_rows(
        &self,
        x: &Dev<f32>,
        width: usize,
        rows: &[u32],
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("gather_rows output", rows.len() * width, out.len())?;
        if width == 0 || rows.is_empty() {
            return Ok(());
        }
        let n_in = x.len() / width;
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n_in) {
            return Err(shape(
                "gather_rows row (< rows of the input)",
                n_in,
                r as usize,
            ));
        }
        let mut meta = self.lock_meta();
        let r = self.meta_ptr(&mut meta, Meta::Rows, rows)?;
        // Kernel gather_rows(const float* x, const u32* rows, float* out, u32 n_out, u32 width).
        self.launch(
            "gather_rows",
            Self::grid(rows.len() * width),
            &[
                Arg::Ptr(self.ptr(x)),
                Arg::Ptr(r),
                Arg::Ptr(self.ptr(out)),
                Arg::U32(rows.len() as u32),
                Arg::U32(width as u32),
            ],
        )
    }

    fn route(
        &self,
        logits: &Dev<f32>,
        bias: Option<&Dev<f32>>,
        moe: &MoeConfig,
        n_tokens: usize,
        ids: &mut Dev<u32>,
        weights: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        let (ne, k) = (moe.n_expert, moe.n_expert_used);
        check_len("route logits", n_tokens * ne, logits.len())?;
        check_len("route ids", n_tokens * k, ids.len())?;
        check_len("route weights", n_tokens * k, weights.len())?;
        if let Some(b) = bias {
            check_len("route bias", ne, b.len())?;
        }
        if ne > 256 || k > ne || k > 64 {
            return Err(shape(
                "CUDA routing (at most 256 experts, k ≤ min(64, experts))",
                256,
                ne,
            ));
        }
        if n_tokens == 0 || k == 0 {
            return Ok(());
        }
        let probs = self.zeros_f32(n_tokens * ne)?;
        let gating = match moe.gating {
            Gating::Softmax => 0,
            Gating::Sigmoid => 1,
        };
        // Kernel route(logits, bias, u32 n_tok, u32 n_expert, u32 k, u32 gating, u32 norm,
        // float weights_scale, float* probs, u32* ids, float* weights): a thread per token.
        self.launch(
            "route",
            LaunchConfig {
                grid_dim: ((n_tokens as u32).div_ceil(64), 1, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::Ptr(self.ptr(logits)),
                Arg::Ptr(bias.map_or(0, |b| self.ptr(b))),
                Arg::U32(n_tokens as u32),
                Arg::U32(ne as u32),
                Arg::U32(k as u32),
                Arg::U32(gating),
                Arg::U32(u32::from(moe.weights_norm)),
                Arg::F32(moe.weights_scale),
                Arg::Ptr(self.ptr(&probs)),
                Arg::Ptr(self.ptr(ids)),
                Arg::Ptr(self.ptr(weights)),
            ],
        )
    }

    fn moe_combine(
        &self,
        y: &Dev<f32>,
        weights: &Dev<f32>,
        n_tokens: usize,
        k: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("moe_combine weights", n_tokens * k, weights.len())?;
        // As the CPU twin: no tokens or no experts leave `out` as it is.
        if n_tokens == 0 || k == 0 {
            return Ok(());
        }
        let width = out.len() / n_tokens;
        check_len("moe_combine output", n_tokens * width, out.len())?;
        check_len("moe_combine input", n_tokens * k * width, y.len())?;
        if width == 0 {
            return Ok(());
        }
        // Kernel moe_combine(y, weights, out, u32 n_tok, u32 k, u32 width).
        self.launch(
            "moe_combine",
            Self::grid(n_tokens * width),
            &[
                Arg::Ptr(self.ptr(y)),
                Arg::Ptr(self.ptr(weights)),
                Arg::Ptr(self.ptr(out)),
                Arg::U32(n_tokens as u32),
                Arg::U32(k as u32),
                Arg::U32(width as u32),
            ],
        )
    }

    fn kv_new(
        &self,
        k_width: usize,
        v_width: usize,
        dtype: KvDtype,
    ) -> Result<CudaKv, RuntimeError> {
        // No cells yet; one-element placeholders (the driver rejects empty allocations).
        let store = || -> Result<KvStore, RuntimeError> {
            Ok(match dtype {
                KvDtype::F32 => KvStore::F32(self.alloc_zeroed::<f32>(1)?),
                KvDtype::F16 => KvStore::F16(self.alloc_zeroed::<u16>(1)?),
            })
        };
        Ok(CudaKv {
            k: store()?,
            v: store()?,
            k_width,
            v_width,
            n_cells: 0,
            cap: 0,
            dtype,
        })
    }

    fn kv_reserve(&self, kv: &mut CudaKv, n_cells: usize) -> Result<(), RuntimeError> {
        if n_cells <= kv.n_cells {
            return Ok(());
        }
        if n_cells <= kv.cap {
            // Within the allocation: a decode step lands here, and moves nothing.
            kv.n_cells = n_cells;
            return Ok(());
        }
        // Grow geometrically: twice the cells asked for, so that the cache is copied
        // O(log n) times as a context grows, not at every step.
        let mut cap = n_cells
            .checked_mul(2)
            .ok_or_else(|| shape("KV cells (< usize::MAX / 2)", usize::MAX / 2, n_cells))?
            .max(KV_MIN_CELLS);
        if crate::faults::is_active(crate::faults::Fault::CudaKvGrowsByTheNewCells) {
            cap = n_cells;
        }
        let have = kv.n_cells;
        let grow = |s: &mut KvStore, width: usize| -> Result<(), RuntimeError> {
            let (keep, size) = (have * width, (cap * width).max(1));
            match s {
                KvStore::F32(old) => {
                    let mut new = self.alloc_zeroed::<f32>(size)?;
                    if keep > 0 {
                        self.counters.kv_moved(keep * 4);
                        self.stream
                            .memcpy_dtod(&old.slice(..keep), &mut new.slice_mut(..keep))
                            .map_err(drv)?;
                    }
                    *old = new;
                }
                KvStore::F16(old) => {
                    let mut new = self.alloc_zeroed::<u16>(size)?;
                    if keep > 0 {
                        self.counters.kv_moved(keep * 2);
                        self.stream
                            .memcpy_dtod(&old.slice(..keep), &mut new.slice_mut(..keep))
                            .map_err(drv)?;
                    }
                    *old = new;
                }
            }
            Ok(())
        };
        grow(&mut kv.k, kv.k_width)?;
        grow(&mut kv.v, kv.v_width)?;
        kv.n_cells = n_cells;
        kv.cap = cap;
        Ok(())
    }

    fn kv_write(
        &self,
        kv: &mut CudaKv,
        cells: &[u32],
        k: &Dev<f32>,
        v: &Dev<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("kv_write keys", cells.len() * kv.k_width, k.len())?;
        check_len("kv_write values", cells.len() * kv.v_width, v.len())?;
        if let Some(&c) = cells.iter().find(|&&c| c as usize >= kv.n_cells) {
            return Err(shape(
                "kv_write cell (< reserved cells)",
                kv.n_cells,
                c as usize,
            ));
        }
        if cells.is_empty() {
            return Ok(());
        }
        let mut meta = self.lock_meta();
        let idx = self.meta_ptr(&mut meta, Meta::KvCells, cells)?;
        let n = cells.len() as u32;
        for (store, src, width) in [(&kv.k, k, kv.k_width), (&kv.v, v, kv.v_width)] {
            let (name, dst) = match store {
                KvStore::F32(s) => ("kv_write_f32", self.ptr(s)),
                KvStore::F16(s) => ("kv_write_f16", self.ptr(s)),
            };
            // Kernel kv_write_*(kv, const u32* cells, const float* src, u32 n_rows, u32 width).
            self.launch(
                name,
                Self::grid(cells.len() * width),
                &[
                    Arg::Ptr(dst),
                    Arg::Ptr(idx),
                    Arg::Ptr(self.ptr(src)),
                    Arg::U32(n),
                    Arg::U32(width as u32),
                ],
            )?;
        }
        Ok(())
    }

    fn kv_move(&self, kv: &mut CudaKv, moves: &[(u32, u32)]) -> Result<(), RuntimeError> {
        if moves.is_empty() {
            return Ok(());
        }
        for &(a, b) in moves {
            let m = a.max(b) as usize;
            if m >= kv.n_cells {
                return Err(shape("kv_move cell (< reserved cells)", kv.n_cells, m));
            }
        }
        let from: Vec<u32> = moves.iter().map(|m| m.0).collect();
        let to: Vec<u32> = moves.iter().map(|m| m.1).collect();
        let (from, to) = (self.upload_u32(&from)?, self.upload_u32(&to)?);
        let words_per = match kv.dtype {
            KvDtype::F32 => 2,
            KvDtype::F16 => 1,
        };
        for (store, width) in [(&kv.k, kv.k_width), (&kv.v, kv.v_width)] {
            let words = width * words_per;
            self.counters.kv_moved(moves.len() * words * 2);
            let base = match store {
                KvStore::F32(s) => self.ptr(s),
                KvStore::F16(s) => self.ptr(s),
            };
            let tmp = self.zeros::<u16>(moves.len() * words)?;
            let cfg = Self::grid(moves.len() * words);
            // Kernel copy_rows_u16(src, src_idx, dst, dst_idx, u32 n_rows, u32 words): gather
            // every source row first, then scatter (all reads before any write).
            self.launch(
                "copy_rows_u16",
                cfg,
                &[
                    Arg::Ptr(base),
                    Arg::Ptr(self.ptr(&from)),
                    Arg::Ptr(self.ptr(&tmp)),
                    Arg::Ptr(0),
                    Arg::U32(moves.len() as u32),
                    Arg::U32(words as u32),
                ],
            )?;
            self.launch(
                "copy_rows_u16",
                cfg,
                &[
                    Arg::Ptr(self.ptr(&tmp)),
                    Arg::Ptr(0),
                    Arg::Ptr(base),
                    Arg::Ptr(self.ptr(&to)),
                    Arg::U32(moves.len() as u32),
                    Arg::U32(words as u32),
                ],
            )?;
        }
        Ok(())
    }

    fn kv_read_k(
        &self,
        kv: &CudaKv,
        n_cells: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        self.kv_read_rows(&kv.k, kv.k_width, kv.n_cells, n_cells, out, "kv_read_k")
    }

    fn kv_read_v(
        &self,
        kv: &CudaKv,
        n_cells: usize,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        self.kv_read_rows(&kv.v, kv.v_width, kv.n_cells, n_cells, out, "kv_read_v")
    }

    fn attention(
        &self,
        q: &Dev<f32>,
        kv: KvSource<'_, Self>,
        m: &AttnMeta<'_>,
        out: &mut Dev<f32>,
    ) -> Result<(), RuntimeError> {
        let n = m.queries.len();
        let n_cells = m.cells.len();
        check_len("attention q", n * m.n_head * m.head_dim_k, q.len())?;
        check_len("attention out", n * m.n_head * m.head_dim_v, out.len())?;
        if m.n_head_kv == 0 || !m.n_head.is_multiple_of(m.n_head_kv) {
            return Err(shape(
                "attention heads (n_head a multiple of n_head_kv)",
                m.n_head_kv,
                m.n_head,
            ));
        }
        if m.mask.tree {
            check_len("attention ancestors", n * m.anc_words, m.ancestors.len())?;
        }
        if n * m.n_head == 0 {
            return Ok(()); // no outputs: no launch
        }
        if n > u32::MAX as usize || n_cells > u32::MAX as usize {
            return Err(shape(
                "attention tokens and cells (< 2^32 each)",
                u32::MAX as usize,
                n.max(n_cells),
            ));
        }
        let (k_stride, v_stride) = (m.n_head_kv * m.head_dim_k, m.n_head_kv * m.head_dim_v);
        let (name, kp, vp) = match kv {
            KvSource::Cache(c) => {
                check_len("attention cache key width", k_stride, c.k_width)?;
                check_len("attention cache value width", v_stride, c.v_width)?;
                if n_cells > c.n_cells {
                    return Err(shape("attention cells (<= reserved)", c.n_cells, n_cells));
                }
                match (&c.k, &c.v) {
                    (KvStore::F32(k), KvStore::F32(v)) => {
                        ("attention_f32", self.ptr(k), self.ptr(v))
                    }
                    (KvStore::F16(k), KvStore::F16(v)) => {
                        ("attention_f16", self.ptr(k), self.ptr(v))
                    }
                    _ => return Err(shape("attention cache (one storage type)", 0, 1)),
                }
            }
            KvSource::Bufs { k, v } => {
                check_len("attention k", n_cells * k_stride, k.len())?;
                check_len("attention v", n_cells * v_stride, v.len())?;
                ("attention_f32", self.ptr(k), self.ptr(v))
            }
        };
        // The query head and one tile of weights go to dynamic shared memory, beside the
        // kernel's static shared memory (its reduction scratch): together at most the 48 KiB a
        // block gets without opting in.
        let static_smem = self.static_shared(name)?;
        let max_dk = (48 * 1024 - static_smem.min(48 * 1024)) / 4 - ATTN_THREADS.min(12 * 1024);
        if m.head_dim_k > max_dk {
            return Err(shape(
                "attention head width (the query head in 48 KiB of shared memory)",
                max_dk,
                m.head_dim_k,
            ));
        }
        // Every layer of a forward passes the same queries and cells: uploaded once per
        // forward (and then only what changed), see `Meta`.
        let mut meta = self.lock_meta();
        let mut arr = |slot, v: Vec<u32>| self.meta_ptr(&mut meta, slot, &v);
        let q_pos = arr(Meta::QPos, m.queries.iter().map(|q| q.pos).collect())?;
        let q_seq = arr(Meta::QSeq, m.queries.iter().map(|q| q.seq).collect())?;
        let c_pos = arr(Meta::CPos, m.cells.iter().map(|c| c.pos).collect())?;
        let c_seq = arr(Meta::CSeq, m.cells.iter().map(|c| c.seq).collect())?;
        let c_batch = arr(Meta::CBatch, m.cells.iter().map(|c| c.batch).collect())?;
        let anc: Option<Dev<u64>> = if m.mask.tree && !m.ancestors.is_empty() {
            Some(self.upload_any(m.ancestors)?)
        } else {
            None
        };
        // The mask's rule exactly (`Mask::visible`): distance ≥ window is masked, so a window
        // of 0 sees nothing; u64::MAX (WINDOW_NONE) is no window, and no distance between two
        // u32 positions reaches it.
        let window = match m.mask.window {
            Some(w) => u64::try_from(w).unwrap_or(u64::MAX),
            None => u64::MAX,
        };
        let shared = ((m.head_dim_k + ATTN_THREADS) * 4) as u32;
        // Kernel attention_{f32,f16}(q, k, v, u64 k_stride, u64 v_stride, out, u32 n_tok,
        // u32 n_head, u32 n_head_kv, u32 dk, u32 dv, float scale, u32 causal, u64 window,
        // u32 tree, q_pos, q_seq, c_pos, c_seq, c_batch, u32 n_cells, const u64* anc,
        // u32 anc_words): one block of ATTN_THREADS per (token, head) pair, the blocks striding
        // over the pairs (grid x only: any token count); dynamic shared memory dk + ATTN_THREADS
        // floats; no scratch that grows with tokens × cells (an online softmax over tiles).
        let pairs = n * m.n_head;
        self.launch(
            name,
            LaunchConfig {
                grid_dim: (pairs.min(MAX_GRID_X) as u32, 1, 1),
                block_dim: (ATTN_THREADS as u32, 1, 1),
                shared_mem_bytes: shared,
            },
            &[
                Arg::Ptr(self.ptr(q)),
                Arg::Ptr(kp),
                Arg::Ptr(vp),
                Arg::U64(k_stride as u64),
                Arg::U64(v_stride as u64),
                Arg::Ptr(self.ptr(out)),
                Arg::U32(n as u32),
                Arg::U32(m.n_head as u32),
                Arg::U32(m.n_head_kv as u32),
                Arg::U32(m.head_dim_k as u32),
                Arg::U32(m.head_dim_v as u32),
                Arg::F32(m.scale),
                Arg::U32(u32::from(m.mask.causal)),
                Arg::U64(window),
                Arg::U32(u32::from(m.mask.tree)),
                Arg::Ptr(q_pos),
                Arg::Ptr(q_seq),
                Arg::Ptr(c_pos),
                Arg::Ptr(c_seq),
                Arg::Ptr(c_batch),
                Arg::U32(n_cells as u32),
                Arg::Ptr(anc.as_ref().map_or(0, |a| self.ptr(a))),
                Arg::U32(m.anc_words as u32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_arguments_are_checked_against_the_parameter_sizes() {
        let sizes = [8, 4, 8];
        assert_eq!(
            check_args("k", &sizes, &[Arg::Ptr(1), Arg::U32(2), Arg::F64(3.0)]),
            Ok(())
        );
        let short = check_args("k", &sizes, &[Arg::Ptr(1), Arg::U32(2)]);
        assert_eq!(
            short,
            Err("launch of k: 2 arguments given, the kernel takes 3 parameters".into())
        );
        let wide = check_args("k", &sizes, &[Arg::Ptr(1), Arg::U64(2), Arg::Ptr(3)]);
        assert_eq!(
            wide,
            Err(
                "launch of k: argument 1 is a 8-byte value, the kernel's parameter 1 has 4 bytes"
                    .into()
            )
        );
    }

    #[test]
    fn every_macro_generated_kernel_is_listed_for_every_type() {
        let mmv = FILES
            .iter()
            .find(|f| f.name == "mmv.cu")
            .map(|f| f.program())
            .unwrap_or_default();
        let e = entry_points(&mmv);
        // mmv_<type> (q8_1 or f32 activations) and mmvf_<type> (rounded f32 activations).
        assert_eq!(e.len(), 2 * CUDA_TYPES.len(), "{e:?}");
        assert!(e.contains(&"mmv_q4_k".to_string()) && e.contains(&"mmv_iq4_xs".to_string()));
        assert!(e.contains(&"mmvf_q4_k".to_string()) && e.contains(&"mmvf_bf16".to_string()));
        let deq = FILES
            .iter()
            .find(|f| f.name == "dequant.cu")
            .map(|f| f.program())
            .unwrap_or_default();
        let e = entry_points(&deq);
        assert!(
            e.contains(&"dequant_q6_k_f16".to_string())
                && e.contains(&"embed_mxfp4".to_string())
                && e.contains(&"gemm_f16_f32".to_string())
        );
        assert_eq!(e.len(), 2 * CUDA_TYPES.len() + 1);
    }

    /// quant.cuh's `FOR_EACH_TYPE` lists exactly the supported types, with their GGUF ids.
    #[test]
    fn the_cuda_type_list_matches_the_ggml_ids() {
        let prog = FILES[0].program();
        let start = prog.find("#define FOR_EACH_TYPE(X)").unwrap_or(0);
        let listed: Vec<(String, u32)> = prog[start..]
            .lines()
            .skip(1)
            .take_while(|l| l.trim_start().starts_with("X("))
            .filter_map(|l| {
                let inner = l.trim().trim_start_matches("X(").split(')').next()?;
                let (n, id) = inner.split_once(',')?;
                Some((n.trim().to_string(), id.trim().parse().ok()?))
            })
            .collect();
        assert_eq!(listed.len(), CUDA_TYPES.len(), "{listed:?}");
        for (name, id) in listed {
            let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("id {id}"));
            assert_eq!(ty.name().to_ascii_lowercase(), name);
            assert!(CUDA_TYPES.contains(&ty));
        }
    }
}
