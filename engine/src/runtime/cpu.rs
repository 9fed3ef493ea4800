//! [`CpuBackend`]: the forward-pass operations on the CPU.
//!
//! Matrix products are `kernels::cpu`'s quantized dot products (activations quantized as ggml
//! does); the gated GELU and attention's `q · k` and `out += w · v` are `kernels::cpu::vector`'s
//! SIMD kernels of the same ISA; everything else is plain f32 here, written after ggml's CPU ops
//! (RMSNorm sums in f64, RoPE angles by repeated multiplication in f32, softmax sums in f64). Work runs on the
//! backend's own rayon pool, sized at construction; the ISA is chosen once, at construction.

use std::borrow::Cow;

use half::f16;
use kernels::cpu::{vector, CpuKernels, Isa};
use kernels::quant::{dequantize, GgmlType};
use rayon::prelude::*;

use super::params::{yarn_corr_dims, Activation, Gating, MoeConfig, RopeConfig, RopeStyle};
use crate::faults::{self, Fault};

use super::backend::{AttnMeta, Backend, KvDtype, KvSource, Strided, WeightData, SELECTED_NONE};
use super::error::check_len;
use super::RuntimeError;

/// The CPU backend: one ISA, one thread pool.
pub struct CpuBackend {
    kernels: CpuKernels,
    pool: rayon::ThreadPool,
    threads: usize,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("isa", &self.kernels.isa())
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuBackend {
    /// A backend for `isa` (default: the widest this CPU has) on `threads` workers (default:
    /// every available core). Fails if the CPU lacks the ISA.
    pub fn new(isa: Option<Isa>, threads: Option<usize>) -> Result<CpuBackend, RuntimeError> {
        let isa = isa.unwrap_or_else(Isa::detect);
        let kernels = CpuKernels::new(isa).map_err(RuntimeError::Backend)?;
        let threads = threads
            .filter(|&t| t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("plumbline-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::ThreadPool(e.to_string()))?;
        Ok(CpuBackend {
            kernels,
            pool,
            threads,
        })
    }

    pub fn isa(&self) -> Isa {
        self.kernels.isa()
    }
}

/// ggml's RMSNorm of one row: the mean of squares summed in f64, then `x · 1/√(mean + eps)`,
/// then times the weight (a separate multiply in ggml, kept as a separate rounding here).
#[inline]
/// Rows of `width` elements per task when a row-wise op is split over the pool: at least
/// about 16k elements, so that a decode step's few rows stay on the calling thread.
fn rows_per_task(width: usize) -> usize {
    ((1 << 14) / width.max(1)).max(1)
}

fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// YaRN's ramp between the extrapolated and interpolated angle (ggml's `rope_yarn_ramp`).
fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// The `(cos, sin)` of every pair of one position, ggml's `ggml_rope_cache_init`.
pub(crate) fn rope_cache(pos: usize, rope: &RopeConfig, cache: &mut Vec<(f32, f32)>) {
    let n_dims = rope.n_rot;
    cache.clear();
    let theta_scale = rope.freq_base.powf(-2.0 / n_dims as f32);
    let (corr, ext_factor, mut mscale) = match rope.yarn {
        Some(y) => (
            yarn_corr_dims(
                n_dims,
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
    if ext_factor != 0.0 {
        mscale *= 1.0 + 0.1 * (1.0 / rope.freq_scale).ln();
    }
    let mut theta = pos as f32;
    for i0 in (0..n_dims).step_by(2) {
        let theta_interp = rope.freq_scale * theta;
        let t = if ext_factor != 0.0 {
            let mix = yarn_ramp(corr[0], corr[1], i0) * ext_factor;
            theta_interp * (1.0 - mix) + theta * mix
        } else {
            theta_interp
        };
        cache.push((t.cos() * mscale, t.sin() * mscale));
        theta *= theta_scale;
    }
}

#[inline]
fn rope_head(x: &mut [f32], cache: &[(f32, f32)], style: RopeStyle) {
    let n_dims = cache.len() * 2;
    match style {
        RopeStyle::Normal => {
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0 * c - x1 * s;
                x[2 * i + 1] = x0 * s + x1 * c;
            }
        }
        RopeStyle::Neox => {
            let half = n_dims / 2;
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[i], x[i + half]);
                x[i] = x0 * c - x1 * s;
                x[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Keys and values of every cell as one attention call reads them.
struct KvRows<'a, E> {
    k: &'a [E],
    v: &'a [E],
    k_stride: usize,
    v_stride: usize,
    /// The ISA's scores `q · k` and weighted sums `Σ w · v` for this storage type, for the query
    /// heads that share a KV head (each key and value row read once for all of them).
    scores: vector::Scores<E>,
    wsum_n: vector::WSumN<E>,
}

/// The cells query `t` sees, in index order.
fn visible_cells(m: &AttnMeta<'_>, t: usize) -> Vec<u32> {
    let (query, anc) = (m.queries[t], m.ancestors_of(t));
    m.cells
        .iter()
        .enumerate()
        .filter(|(_, &c)| m.mask.visible(query, c, anc))
        .map(|(j, _)| j as u32)
        .collect()
}

/// The cells query `t` sees among its row of a [`Backend::select_top_k`] selection, in index
/// order (the order [`visible_cells`] gives, so a selection of every visible cell attends with
/// the same bits as the dense op).
fn selected_cells(m: &AttnMeta<'_>, t: usize, row: &[u32]) -> Vec<u32> {
    let (query, anc) = (m.queries[t], m.ancestors_of(t));
    let mut cells: Vec<u32> = row
        .iter()
        .copied()
        .filter(|&c| {
            c != SELECTED_NONE
                && m.cells
                    .get(c as usize)
                    .is_some_and(|&cell| m.mask.visible(query, cell, anc))
        })
        .collect();
    cells.sort_unstable();
    cells.dedup();
    cells
}

/// One row of [`Backend::layer_norm`]: mean and variance summed in f64 (as `rms_norm_row`).
fn layer_norm_row(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    let inv = 1.0 / (var + f64::from(eps)).sqrt();
    for ((v, &wi), &bi) in x.iter_mut().zip(w).zip(b) {
        *v = ((f64::from(*v) - mean) * inv) as f32 * wi + bi;
    }
}

/// Scores (already scaled) to weights: `exp(s − max)`, summed in f64 as ggml does, normalized.
fn softmax_from(scores: &mut [f32], max: f32) {
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += f64::from(*s);
    }
    let inv = (1.0 / sum) as f32;
    for w in scores.iter_mut() {
        *w *= inv;
    }
}

/// The query heads `q` (`n_q` rows, consecutive heads sharing KV head `kv_head`; one head is
/// `n_q` = 1) against `cells` (those the mask lets them see, in index order): scores, softmax
/// (sum in f64, as ggml), weighted sum of values. The grouped kernels give each head the bits of
/// the one-row kernels, so grouping never changes a result; it reads each key and value row once
/// for all the heads.
#[allow(clippy::too_many_arguments)]
fn attend_group<E>(
    q: &[f32],
    n_q: usize,
    kv: &KvRows<'_, E>,
    kv_head: usize,
    cells: &[u32],
    m: &AttnMeta<'_>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    out.fill(0.0);
    if cells.is_empty() {
        return;
    }
    let n = cells.len();
    scores.clear();
    scores.resize(n_q * n, 0.0);
    let keys = vector::WRows {
        cells,
        stride: kv.k_stride,
        offset: kv_head * m.head_dim_k,
    };
    (kv.scores)(q, n_q, kv.k, keys, scores);
    for row in scores.chunks_exact_mut(n) {
        let mut max = f32::NEG_INFINITY;
        for s in row.iter_mut() {
            *s *= m.scale;
            max = max.max(*s);
        }
        softmax_from(row, max);
    }
    let values = vector::WRows {
        cells,
        stride: kv.v_stride,
        offset: kv_head * m.head_dim_v,
    };
    (kv.wsum_n)(out, n_q, scores, kv.v, values);
}

/// One token's routing: expert ids in rank order and their weights (see [`Backend::route`]).
pub(crate) fn route_one(
    logits: &[f32],
    bias: Option<&[f32]>,
    moe: &MoeConfig,
) -> (Vec<usize>, Vec<f32>) {
    let probs: Vec<f32> = match moe.gating {
        Gating::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f64 = e.iter().map(|&v| f64::from(v)).sum();
            let inv = (1.0 / sum) as f32;
            e.iter().map(|&v| v * inv).collect()
        }
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let select: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Descending by selection score; NaN last; ties keep the lower id first.
    order.sort_by(|&a, &b| {
        select[b]
            .partial_cmp(&select[a])
            .unwrap_or_else(|| select[a].is_nan().cmp(&select[b].is_nan()))
    });
    let k = moe.n_expert_used.min(order.len());
    let mut chosen: Vec<usize> = order[..k].to_vec();
    if faults::is_active(Fault::WrongRouterTopK) && order.len() > k && k > 0 {
        chosen[k - 1] = order[k];
    }
    let mut weights: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
    if moe.weights_norm {
        // llama.cpp clamps the sum at the smallest normal f16 before dividing.
        let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= moe.weights_scale);
    (chosen, weights)
}

/// A weight as the CPU keeps it: the file's bytes (borrowed from the map when possible).
#[derive(Debug)]
pub struct CpuMat<'w> {
    name: String,
    ty: GgmlType,
    k_dim: usize,
    n_rows: usize,
    n_mats: usize,
    data: Cow<'w, [u8]>,
}

impl CpuMat<'_> {
    fn mat_bytes(&self) -> usize {
        self.data.len() / self.n_mats.max(1)
    }

    /// Matrix `e` of the stack.
    fn matrix(&self, e: usize) -> Result<&[u8], RuntimeError> {
        let size = self.mat_bytes();
        self.data
            .get(e * size..(e + 1) * size)
            .ok_or(RuntimeError::Shape {
                op: "expert id (< number of experts)",
                expected: self.n_mats,
                found: e,
            })
    }

    fn kernel_err(&self, source: kernels::cpu::KernelError) -> RuntimeError {
        RuntimeError::Kernel {
            name: self.name.clone(),
            source,
        }
    }
}

/// Storage of one side (keys or values) of a CPU cache layer.
#[derive(Debug, Clone)]
enum KvStore {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// One layer of the CPU KV cache: `n_cells` rows of keys and of values.
#[derive(Debug, Clone)]
pub struct CpuKv {
    k: KvStore,
    v: KvStore,
    k_width: usize,
    v_width: usize,
    n_cells: usize,
}

impl KvStore {
    fn new(dtype: KvDtype) -> KvStore {
        match dtype {
            KvDtype::F32 => KvStore::F32(Vec::new()),
            KvDtype::F16 => KvStore::F16(Vec::new()),
        }
    }

    fn resize(&mut self, n: usize) {
        match self {
            KvStore::F32(v) => v.resize(n, 0.0),
            KvStore::F16(v) => v.resize(n, f16::ZERO),
        }
    }

    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            KvStore::F16(v) if faults::is_active(Fault::KvF16Truncates) => {
                // A conversion that truncates (rounds toward zero) instead of rounding to
                // nearest: the nearest f16, stepped one unit toward zero where it lies beyond x.
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    let h = f16::from_f32(s);
                    *d = if h.is_nan() || h.to_f32().abs() <= s.abs() {
                        h
                    } else {
                        f16::from_bits(h.to_bits() - 1)
                    };
                }
            }
            KvStore::F16(v) => {
                for (d, &s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
        }
    }

    /// Values `at..at + out.len()` as f32 (exact: f16 widens).
    fn read_at(&self, at: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            KvStore::F32(v) => out.copy_from_slice(&v[at..at + n]),
            KvStore::F16(v) => {
                for (o, &s) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = s.to_f32();
                }
            }
        }
    }

    fn read(&self, n: usize, out: &mut [f32]) {
        self.read_at(0, &mut out[..n]);
    }
}

/// Which rows of a cache layer [`CpuKv::read_rows`] reads.
#[derive(Clone, Copy)]
enum KvSide {
    K,
    V,
}

impl CpuKv {
    /// Cells `0..n_cells` of one side as f32 rows ([`Backend::kv_read_k`], `kv_read_v`).
    fn read_rows(&self, side: KvSide, n_cells: usize, out: &mut [f32]) -> Result<(), RuntimeError> {
        let (store, width, cells_op, out_op) = match side {
            KvSide::K => (
                &self.k,
                self.k_width,
                "kv_read_k cells (<= reserved cells)",
                "kv_read_k output",
            ),
            KvSide::V => (
                &self.v,
                self.v_width,
                "kv_read_v cells (<= reserved cells)",
                "kv_read_v output",
            ),
        };
        if n_cells > self.n_cells {
            return Err(shape(cells_op, self.n_cells, n_cells));
        }
        check_len(out_op, n_cells * width, out.len())?;
        store.read(n_cells * width, out);
        Ok(())
    }
}

/// `len` must be a whole, non-zero number of rows of `width`.
fn check_rows(op: &'static str, width: usize, len: usize) -> Result<(), RuntimeError> {
    if width == 0 || !len.is_multiple_of(width) {
        return Err(shape(op, width, len));
    }
    Ok(())
}

fn shape(op: &'static str, expected: usize, found: usize) -> RuntimeError {
    RuntimeError::Shape {
        op,
        expected,
        found,
    }
}

impl CpuBackend {
    /// Attention of every query over the cells it sees: all those its mask shows, or (sparse
    /// attention) those of its row of `selected` (`[n, k]`) that its mask shows.
    fn attend<E: Sync>(
        &self,
        q: &[f32],
        kv: KvRows<'_, E>,
        m: &AttnMeta<'_>,
        selected: Option<(&[u32], usize)>,
        out: &mut [f32],
    ) {
        let group = m.n_head / m.n_head_kv;
        self.pool.install(|| {
            // The mask is evaluated once per query token, not once per head.
            let visible: Vec<Vec<u32>> = (0..m.queries.len())
                .into_par_iter()
                .map(|t| match selected {
                    None => visible_cells(m, t),
                    Some((sel, k)) => selected_cells(m, t, &sel[t * k..(t + 1) * k]),
                })
                .collect();
            // One task per (token, KV head) with all the query heads that share it, when that
            // leaves every thread several tasks; otherwise (a decode step) one per head. Both
            // give the same bits.
            let tasks = m.queries.len() * m.n_head_kv;
            if group > 1 && tasks >= 4 * rayon::current_num_threads() {
                out.par_chunks_mut(group * m.head_dim_v)
                    .enumerate()
                    .for_each_init(Vec::new, |scores, (i, o)| {
                        let (t, kvh) = (i / m.n_head_kv, i % m.n_head_kv);
                        let h0 = t * m.n_head + kvh * group;
                        let qg = &q[h0 * m.head_dim_k..(h0 + group) * m.head_dim_k];
                        attend_group(qg, group, &kv, kvh, &visible[t], m, scores, o);
                    });
                return;
            }
            out.par_chunks_mut(m.head_dim_v).enumerate().for_each_init(
                Vec::new,
                |scores, (i, o)| {
                    let (t, h) = (i / m.n_head, i % m.n_head);
                    let qh = &q[(t * m.n_head + h) * m.head_dim_k..][..m.head_dim_k];
                    attend_group(qh, 1, &kv, h / group, &visible[t], m, scores, o);
                },
            );
        });
    }
}
impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Ids = Vec<u32>;
    type Mat<'w> = CpuMat<'w>;
    type Kv = CpuKv;

    fn name(&self) -> String {
        format!("cpu-{}", self.kernels.isa().name())
    }

    fn scoped<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn alloc(&self, n: usize) -> Result<Vec<f32>, RuntimeError> {
        Ok(vec![0.0; n])
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>, RuntimeError> {
        Ok(data.to_vec())
    }

    fn upload_ids(&self, ids: &[u32]) -> Result<Vec<u32>, RuntimeError> {
        Ok(ids.to_vec())
    }

    fn download(&self, buf: &Vec<f32>, out: &mut Vec<f32>) -> Result<(), RuntimeError> {
        out.clear();
        out.extend_from_slice(buf);
        Ok(())
    }

    fn take_host(&self, buf: Vec<f32>) -> Result<Vec<f32>, RuntimeError> {
        Ok(buf)
    }

    fn download_ids(&self, ids: &Vec<u32>, out: &mut Vec<u32>) -> Result<(), RuntimeError> {
        out.clear();
        out.extend_from_slice(ids);
        Ok(())
    }

    fn buf_len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn prepare<'w>(&self, w: WeightData<'w>) -> Result<CpuMat<'w>, RuntimeError>
    where
        Self: 'w,
    {
        if !self.kernels.supports(w.ty) {
            return Err(RuntimeError::Kernel {
                name: w.name.to_owned(),
                source: kernels::cpu::KernelError::UnsupportedType { ty: w.ty },
            });
        }
        let row_bytes = w.k_dim / w.ty.block_size() * w.ty.type_size();
        if !w.k_dim.is_multiple_of(w.ty.block_size()) {
            return Err(shape(
                "weight row (a whole number of blocks)",
                w.ty.block_size(),
                w.k_dim,
            ));
        }
        check_len(
            "weight bytes",
            w.n_mats * w.n_rows * row_bytes,
            w.data.len(),
        )?;
        let mut data = w.data;
        if w.ty == GgmlType::Q8_0
            && w.name != "token_embd.weight"
            && faults::is_active(Fault::Q8_0BlockTail)
        {
            // Values 24..32 of every block (f16 scale, then 32 i8) one quantum too high.
            for block in data.to_mut().chunks_exact_mut(GgmlType::Q8_0.type_size()) {
                for q in &mut block[2 + 24..] {
                    *q = (*q as i8).saturating_add(1) as u8;
                }
            }
        }
        Ok(CpuMat {
            name: w.name.to_owned(),
            ty: w.ty,
            k_dim: w.k_dim,
            n_rows: w.n_rows,
            n_mats: w.n_mats,
            data,
        })
    }

    fn matmul(
        &self,
        w: &CpuMat<'_>,
        x: &Vec<f32>,
        n_tokens: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        let data = w.matrix(0)?;
        self.pool
            .install(|| {
                self.kernels
                    .matmul(w.ty, data, w.n_rows, w.k_dim, x, n_tokens, out)
            })
            .map_err(|e| w.kernel_err(e))?;
        const TILE: usize = 64;
        if n_tokens > TILE
            && !n_tokens.is_multiple_of(TILE)
            && faults::is_active(Fault::PrefillTileTail)
        {
            // The rows of the last, partial tile scaled by 1 + 2⁻⁸.
            let tail = n_tokens / TILE * TILE * w.n_rows;
            for v in out.iter_mut().skip(tail) {
                *v *= 1.0 + 1.0 / 256.0;
            }
        }
        const AVX2_TILE: usize = 16;
        if self.isa() == Isa::Avx2
            && n_tokens > AVX2_TILE
            && !n_tokens.is_multiple_of(AVX2_TILE)
            && faults::is_active(Fault::Avx2TileTail)
        {
            // The AVX2 kernels' last, partial 16-token tile: its first token's outputs are the
            // previous token's (the accumulator of the tile before).
            let tail = n_tokens / AVX2_TILE * AVX2_TILE * w.n_rows;
            out.copy_within(tail - w.n_rows..tail, tail);
        }
        Ok(())
    }

    fn matmul_experts(
        &self,
        w: &CpuMat<'_>,
        x: &Vec<f32>,
        x_per_slot: bool,
        ids: &Vec<u32>,
        n_tokens: usize,
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        let (kd, nr) = (w.k_dim, w.n_rows);
        check_len("expert ids", n_tokens * k, ids.len())?;
        if nr == 0 {
            // Expert matrices of no rows: an empty output, nothing to compute.
            return check_len("expert output", 0, out.len());
        }
        let x_rows = if x_per_slot { n_tokens * k } else { n_tokens };
        check_len("expert input", x_rows * kd, x.len())?;
        check_len("expert output", n_tokens * k * nr, out.len())?;
        // Each expert runs once over all the slots routed to it.
        let mut slots: Vec<Vec<usize>> = vec![Vec::new(); w.n_mats];
        for (slot, &e) in ids.iter().enumerate() {
            slots
                .get_mut(e as usize)
                .ok_or(shape(
                    "expert id (< number of experts)",
                    w.n_mats,
                    e as usize,
                ))?
                .push(slot);
        }
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for (e, routed) in slots.iter().enumerate() {
            if routed.is_empty() {
                continue;
            }
            xs.clear();
            for &slot in routed {
                let row = if x_per_slot { slot } else { slot / k };
                xs.extend_from_slice(&x[row * kd..(row + 1) * kd]);
            }
            ys.clear();
            ys.resize(routed.len() * nr, 0.0);
            let data = w.matrix(e)?;
            self.pool
                .install(|| {
                    self.kernels
                        .matmul(w.ty, data, nr, kd, &xs, routed.len(), &mut ys)
                })
                .map_err(|err| w.kernel_err(err))?;
            for (&slot, y) in routed.iter().zip(ys.chunks_exact(nr)) {
                out[slot * nr..(slot + 1) * nr].copy_from_slice(y);
            }
        }
        Ok(())
    }

    fn embed(
        &self,
        w: &CpuMat<'_>,
        tokens: &Vec<u32>,
        n_tokens: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("embedding tokens", n_tokens, tokens.len())?;
        check_len("embedding output", n_tokens * w.k_dim, out.len())?;
        if w.k_dim == 0 {
            // Rows of no values: nothing to write, the ids still checked.
            return match tokens.iter().find(|&&t| t as usize >= w.n_rows) {
                Some(&t) => Err(RuntimeError::TokenOutOfRange {
                    token: t,
                    index: 0,
                    n_vocab: w.n_rows,
                }),
                None => Ok(()),
            };
        }
        let row_bytes = w.k_dim / w.ty.block_size() * w.ty.type_size();
        let data = w.matrix(0)?;
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(w.k_dim)) {
            let t = t as usize;
            let bytes = data.get(t * row_bytes..(t + 1) * row_bytes).ok_or(
                RuntimeError::TokenOutOfRange {
                    token: t as u32,
                    index: 0,
                    n_vocab: w.n_rows,
                },
            )?;
            dequantize(w.ty, bytes, row).map_err(|source| RuntimeError::Dequantize {
                name: w.name.clone(),
                source,
            })?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        let n = weight.len();
        check_len("rms_norm output", x.len(), out.len())?;
        check_rows(
            "rms_norm input (a multiple of the weight length)",
            n,
            x.len(),
        )?;
        if n == 0 {
            return Ok(());
        }
        // Rows split over the pool (a prefill's norms were a serial section at two threads);
        // each row's arithmetic is unchanged.
        self.pool.install(|| {
            x.par_chunks_exact(n)
                .zip(out.par_chunks_exact_mut(n))
                .with_min_len(rows_per_task(n))
                .for_each(|(xr, or)| rms_norm_row(xr, weight, eps, or))
        });
        Ok(())
    }

    fn rms_norm_inplace(
        &self,
        x: &mut Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
    ) -> Result<(), RuntimeError> {
        let n = weight.len();
        check_rows(
            "rms_norm input (a multiple of the weight length)",
            n,
            x.len(),
        )?;
        if n == 0 {
            return Ok(());
        }
        self.pool.install(|| {
            x.par_chunks_exact_mut(n)
                .with_min_len(rows_per_task(n))
                .for_each_init(
                    || vec![0f32; n],
                    |row, xr| {
                        row.copy_from_slice(xr);
                        rms_norm_row(row, weight, eps, xr);
                    },
                )
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeConfig,
    ) -> Result<(), RuntimeError> {
        check_len("rope input", positions.len() * n_heads * head_dim, x.len())?;
        if rope.n_rot > head_dim || !rope.n_rot.is_multiple_of(2) {
            return Err(shape(
                "rope dimensions (even, at most the head width)",
                head_dim,
                rope.n_rot,
            ));
        }
        if x.is_empty() {
            return Ok(());
        }
        let width = n_heads * head_dim;
        self.pool.install(|| {
            x.par_chunks_exact_mut(width)
                .zip(positions.par_iter())
                .with_min_len(rows_per_task(width))
                .for_each_init(
                    || Vec::with_capacity(rope.n_rot / 2),
                    |cache, (row, &pos)| {
                        rope_cache(pos as usize, rope, cache);
                        for head in row.chunks_exact_mut(head_dim) {
                            rope_head(&mut head[..rope.n_rot], cache, rope.style);
                        }
                    },
                )
        });
        Ok(())
    }

    fn gated_act(
        &self,
        act: Activation,
        gate: &mut Vec<f32>,
        up: &Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("gated activation", gate.len(), up.len())?;
        match act {
            Activation::Silu => gate.iter_mut().zip(up).for_each(|(g, u)| *g = silu(*g) * u),
            Activation::GeluTanh => {
                // The ISA's vector GELU (`x·σ(2z)`, within a few ulp of f64 on every lane, tested in
                // `kernels::cpu::vector`), split over the pool for a prefill's many rows.
                let gelu_mul = self.kernels.vector().gelu_mul;
                const CHUNK: usize = 1 << 14;
                self.pool.install(|| {
                    gate.par_chunks_mut(CHUNK)
                        .zip(up.par_chunks(CHUNK))
                        .for_each(|(g, u)| gelu_mul(g, u))
                });
            }
        }
        Ok(())
    }

    fn softcap(&self, x: &mut Vec<f32>, cap: f32) -> Result<(), RuntimeError> {
        let inv = 1.0 / cap;
        for a in x.iter_mut() {
            *a = (*a * inv).tanh() * cap;
        }
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), RuntimeError> {
        check_len("add", x.len(), y.len())?;
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn add_row(&self, x: &mut Vec<f32>, row: &Vec<f32>) -> Result<(), RuntimeError> {
        if row.is_empty() || !x.len().is_multiple_of(row.len()) {
            return Err(shape(
                "add_row (a multiple of the row length)",
                row.len(),
                x.len(),
            ));
        }
        for xr in x.chunks_exact_mut(row.len()) {
            for (a, &c) in xr.iter_mut().zip(row) {
                *a += c;
            }
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<(), RuntimeError> {
        for a in x.iter_mut() {
            *a *= s;
        }
        Ok(())
    }

    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>) -> Result<(), RuntimeError> {
        check_len("copy", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn fill(
        &self,
        x: &mut Vec<f32>,
        start: usize,
        len: usize,
        value: f32,
    ) -> Result<(), RuntimeError> {
        let n = x.len();
        x.get_mut(start..start.saturating_add(len))
            .ok_or(shape("fill range", n, start.saturating_add(len)))?
            .fill(value);
        Ok(())
    }

    fn copy_strided(
        &self,
        src: &Vec<f32>,
        s: Strided,
        dst: &mut Vec<f32>,
        d: Strided,
        n_rows: usize,
        n_groups: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        if n_rows == 0 || n_groups == 0 || len == 0 {
            return Ok(());
        }
        let last = |p: Strided| {
            (n_rows - 1) * p.row_stride + (n_groups - 1) * p.group_stride + p.offset + len
        };
        if last(s) > src.len() {
            return Err(shape("copy_strided source", last(s), src.len()));
        }
        if last(d) > dst.len() {
            return Err(shape("copy_strided destination", last(d), dst.len()));
        }
        for r in 0..n_rows {
            for g in 0..n_groups {
                let a = r * s.row_stride + g * s.group_stride + s.offset;
                let b = r * d.row_stride + g * d.group_stride + d.offset;
                dst[b..b + len].copy_from_slice(&src[a..a + len]);
            }
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        rows: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("gather_rows output", rows.len() * width, out.len())?;
        for (&r, o) in rows.iter().zip(out.chunks_exact_mut(width.max(1))) {
            let r = r as usize;
            let src = x.get(r * width..(r + 1) * width).ok_or(shape(
                "gather_rows row",
                x.len() / width.max(1),
                r,
            ))?;
            o.copy_from_slice(src);
        }
        Ok(())
    }

    fn route(
        &self,
        logits: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        moe: &MoeConfig,
        n_tokens: usize,
        ids: &mut Vec<u32>,
        weights: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        let (ne, k) = (moe.n_expert, moe.n_expert_used);
        check_len("router logits", n_tokens * ne, logits.len())?;
        if let Some(b) = bias {
            check_len("router bias", ne, b.len())?;
        }
        if k > ne {
            return Err(shape("experts used (at most the experts)", ne, k));
        }
        check_len("routed ids", n_tokens * k, ids.len())?;
        check_len("routed weights", n_tokens * k, weights.len())?;
        for (t, row) in logits.chunks_exact(ne).enumerate() {
            let (chosen, w) = route_one(row, bias.map(|b| &b[..]), moe);
            for (s, (&e, &wt)) in chosen.iter().zip(&w).enumerate() {
                ids[t * k + s] = e as u32;
                weights[t * k + s] = wt;
            }
        }
        Ok(())
    }

    fn moe_combine(
        &self,
        y: &Vec<f32>,
        weights: &Vec<f32>,
        n_tokens: usize,
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("combine weights", n_tokens * k, weights.len())?;
        if n_tokens == 0 || k == 0 {
            return Ok(());
        }
        let d = out.len() / n_tokens;
        check_len("combine output", n_tokens * d, out.len())?;
        check_len("combine input", n_tokens * k * d, y.len())?;
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            // Each slot's output is scaled by its weight first, then the slots are added in
            // rank order, as llama.cpp adds the selected experts' views.
            for s in 0..k {
                let wt = weights[t * k + s];
                let src = &y[(t * k + s) * d..(t * k + s + 1) * d];
                if s == 0 {
                    o.iter_mut().zip(src).for_each(|(a, &b)| *a = b * wt);
                } else {
                    o.iter_mut().zip(src).for_each(|(a, &b)| *a += b * wt);
                }
            }
        }
        Ok(())
    }

    fn kv_new(
        &self,
        k_width: usize,
        v_width: usize,
        dtype: KvDtype,
    ) -> Result<CpuKv, RuntimeError> {
        Ok(CpuKv {
            k: KvStore::new(dtype),
            v: KvStore::new(dtype),
            k_width,
            v_width,
            n_cells: 0,
        })
    }

    fn kv_reserve(&self, kv: &mut CpuKv, n_cells: usize) -> Result<(), RuntimeError> {
        if n_cells > kv.n_cells {
            kv.k.resize(n_cells * kv.k_width);
            kv.v.resize(n_cells * kv.v_width);
            kv.n_cells = n_cells;
        }
        Ok(())
    }

    fn kv_write(
        &self,
        kv: &mut CpuKv,
        cells: &[u32],
        k: &Vec<f32>,
        v: &Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len("kv_write keys", cells.len() * kv.k_width, k.len())?;
        check_len("kv_write values", cells.len() * kv.v_width, v.len())?;
        for (i, &c) in cells.iter().enumerate() {
            let c = c as usize;
            if c >= kv.n_cells {
                return Err(shape("kv_write cell (< reserved cells)", kv.n_cells, c));
            }
            kv.k.write(c * kv.k_width, &k[i * kv.k_width..(i + 1) * kv.k_width]);
            kv.v.write(c * kv.v_width, &v[i * kv.v_width..(i + 1) * kv.v_width]);
        }
        Ok(())
    }

    fn kv_move(&self, kv: &mut CpuKv, moves: &[(u32, u32)]) -> Result<(), RuntimeError> {
        let (kw, vw) = (kv.k_width, kv.v_width);
        if let Some(&(a, b)) = moves
            .iter()
            .find(|&&(a, b)| a.max(b) as usize >= kv.n_cells)
        {
            return Err(shape(
                "kv_move cell (< reserved cells)",
                kv.n_cells,
                a.max(b) as usize,
            ));
        }
        let (mut k, mut v) = (vec![0f32; moves.len() * kw], vec![0f32; moves.len() * vw]);
        for (i, &(from, _)) in moves.iter().enumerate() {
            kv.k.read_at(from as usize * kw, &mut k[i * kw..(i + 1) * kw]);
            kv.v.read_at(from as usize * vw, &mut v[i * vw..(i + 1) * vw]);
        }
        for (i, &(_, to)) in moves.iter().enumerate() {
            kv.k.write(to as usize * kw, &k[i * kw..(i + 1) * kw]);
            kv.v.write(to as usize * vw, &v[i * vw..(i + 1) * vw]);
        }
        Ok(())
    }

    fn kv_read_k(
        &self,
        kv: &CpuKv,
        n_cells: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        kv.read_rows(KvSide::K, n_cells, out)
    }

    fn kv_read_v(
        &self,
        kv: &CpuKv,
        n_cells: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        kv.read_rows(KvSide::V, n_cells, out)
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        kv: KvSource<'_, Self>,
        m: &AttnMeta<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        self.attention_impl(q, kv, m, None, out)
    }

    fn attention_selected(
        &self,
        q: &Vec<f32>,
        kv: KvSource<'_, Self>,
        m: &AttnMeta<'_>,
        selected: &Vec<u32>,
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_len(
            "attention_selected selection (queries × k)",
            m.queries.len() * k,
            selected.len(),
        )?;
        self.attention_impl(q, kv, m, Some((selected, k)), out)
    }

    fn layer_norm(
        &self,
        x: &mut Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        eps: f32,
    ) -> Result<(), RuntimeError> {
        let n = weight.len();
        check_len("layer_norm bias", n, bias.len())?;
        check_rows(
            "layer_norm input (a multiple of the weight length)",
            n,
            x.len(),
        )?;
        self.pool.install(|| {
            x.par_chunks_exact_mut(n)
                .with_min_len(rows_per_task(n))
                .for_each(|xr| layer_norm_row(xr, weight, bias, eps))
        });
        Ok(())
    }

    fn indexer_scores(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        weights: &Vec<f32>,
        n_head: usize,
        head_dim: usize,
        n_cells: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), RuntimeError> {
        check_rows(
            "indexer_scores weights (rows of n_head)",
            n_head,
            weights.len(),
        )?;
        let n = weights.len() / n_head;
        check_len("indexer_scores q", n * n_head * head_dim, q.len())?;
        check_len("indexer_scores keys", n_cells * head_dim, k.len())?;
        check_len("indexer_scores output", n * n_cells, out.len())?;
        if n_cells == 0 {
            return Ok(());
        }
        let dot = self.kernels.vector().dot_f32;
        self.pool.install(|| {
            out.par_chunks_exact_mut(n_cells)
                .enumerate()
                .for_each(|(t, row)| {
                    let qt = &q[t * n_head * head_dim..(t + 1) * n_head * head_dim];
                    let wt = &weights[t * n_head..(t + 1) * n_head];
                    for (c, o) in row.iter_mut().enumerate() {
                        let kc = &k[c * head_dim..(c + 1) * head_dim];
                        // Heads summed in order, each ReLU'd dot product weighted.
                        let mut s = 0f32;
                        for (h, &w) in wt.iter().enumerate() {
                            let d = dot(&qt[h * head_dim..(h + 1) * head_dim], kc);
                            s += w * d.max(0.0);
                        }
                        *o = s;
                    }
                })
        });
        Ok(())
    }

    fn select_top_k(
        &self,
        scores: &Vec<f32>,
        m: &AttnMeta<'_>,
        k: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), RuntimeError> {
        let (n, n_cells) = (m.queries.len(), m.cells.len());
        check_len(
            "select_top_k scores (queries × cells)",
            n * n_cells,
            scores.len(),
        )?;
        check_len("select_top_k output (queries × k)", n * k, out.len())?;
        if m.mask.tree {
            check_len("select_top_k ancestors", n * m.anc_words, m.ancestors.len())?;
        }
        if k == 0 {
            return Ok(());
        }
        self.pool.install(|| {
            out.par_chunks_exact_mut(k).enumerate().for_each(|(t, o)| {
                let row = &scores[t * n_cells..(t + 1) * n_cells];
                let mut cells = visible_cells(m, t);
                // Descending score; ties to the lower position, then the lower cell.
                cells.sort_unstable_by(|&a, &b| {
                    let (a, b) = (a as usize, b as usize);
                    row[b]
                        .total_cmp(&row[a])
                        .then(m.cells[a].pos.cmp(&m.cells[b].pos))
                        .then(a.cmp(&b))
                });
                o.fill(SELECTED_NONE);
                for (slot, &c) in o.iter_mut().zip(&cells) {
                    *slot = c;
                }
            })
        });
        Ok(())
    }
}

impl CpuBackend {
    /// [`Backend::attention`] or, with a selection, [`Backend::attention_selected`].
    fn attention_impl(
        &self,
        q: &[f32],
        kv: KvSource<'_, Self>,
        m: &AttnMeta<'_>,
        selected: Option<(&[u32], usize)>,
        out: &mut [f32],
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
        let (k_stride, v_stride) = (m.n_head_kv * m.head_dim_k, m.n_head_kv * m.head_dim_v);
        let vf = self.kernels.vector();
        match kv {
            KvSource::Cache(c) => {
                check_len("attention cache key width", k_stride, c.k_width)?;
                check_len("attention cache value width", v_stride, c.v_width)?;
                if n_cells > c.n_cells {
                    return Err(shape("attention cells (<= reserved)", c.n_cells, n_cells));
                }
                match (&c.k, &c.v) {
                    (KvStore::F32(k), KvStore::F32(v)) => {
                        let rows = KvRows {
                            k,
                            v,
                            k_stride,
                            v_stride,
                            scores: vf.scores_f32,
                            wsum_n: vf.wsum_n_f32,
                        };
                        self.attend(q, rows, m, selected, out)
                    }
                    (KvStore::F16(k), KvStore::F16(v)) => {
                        let rows = KvRows {
                            k,
                            v,
                            k_stride,
                            v_stride,
                            scores: vf.scores_f16,
                            wsum_n: vf.wsum_n_f16,
                        };
                        self.attend(q, rows, m, selected, out)
                    }
                    _ => return Err(shape("attention cache (one storage type)", 0, 1)),
                }
            }
            KvSource::Bufs { k, v } => {
                check_len("attention k", n_cells * k_stride, k.len())?;
                check_len("attention v", n_cells * v_stride, v.len())?;
                let rows = KvRows {
                    k,
                    v,
                    k_stride,
                    v_stride,
                    scores: vf.scores_f32,
                    wsum_n: vf.wsum_n_f32,
                };
                self.attend(q, rows, m, selected, out)
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::backend::{CellMeta, Mask, QueryMeta};

    fn backend() -> CpuBackend {
        CpuBackend::new(Some(Isa::Scalar), Some(1)).unwrap_or_else(|e| panic!("{e}"))
    }

    fn rope_cfg(style: RopeStyle, n_rot: usize) -> RopeConfig {
        RopeConfig {
            style,
            n_rot,
            freq_base: 10_000.0,
            freq_scale: 1.0,
            yarn: None,
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        // A row of equal values v has mean square v², so every output is w (up to eps).
        let b = backend();
        let x = vec![3.0f32; 8];
        let w = vec![0.5f32; 4];
        let mut out = vec![0f32; 8];
        b.rms_norm(&x, &w, 0.0, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        for o in out {
            approx::assert_abs_diff_eq!(o, 0.5, epsilon = 1e-6);
        }
    }

    #[test]
    fn rope_position_zero_is_identity_and_rotation_preserves_norm() {
        let b = backend();
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let cfg = rope_cfg(style, 8);
            let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
            let mut x = x0.clone();
            b.rope(&mut x, 2, 8, &[0], &cfg)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(x, x0);
            b.rope(&mut x, 2, 8, &[7], &cfg)
                .unwrap_or_else(|e| panic!("{e}"));
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            // A rotation keeps the norm; 1e-5 relative is f32 rounding over 16 values.
            approx::assert_relative_eq!(n0, n1, max_relative = 1e-5);
        }
    }

    #[test]
    fn rope_pairs_follow_the_style() {
        // Position 1, first pair: angle 1 radian (theta_scale^0). Normal rotates (x0, x1),
        // NeoX rotates (x0, x_{n/2}).
        let b = backend();
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        b.rope(&mut x, 1, 4, &[1], &rope_cfg(RopeStyle::Normal, 4))
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(x[0], 1f32.cos(), epsilon = 1e-6);
        approx::assert_abs_diff_eq!(x[1], 1f32.sin(), epsilon = 1e-6);
        assert_eq!(x[2], 0.0);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        b.rope(&mut x, 1, 4, &[1], &rope_cfg(RopeStyle::Neox, 4))
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(x[0], 1f32.cos(), epsilon = 1e-6);
        approx::assert_abs_diff_eq!(x[2], 1f32.sin(), epsilon = 1e-6);
        assert_eq!(x[1], 0.0);
    }

    fn cells(n: u32) -> Vec<CellMeta> {
        (0..n)
            .map(|pos| CellMeta {
                pos,
                seq: 0,
                batch: CellMeta::COMMITTED,
            })
            .collect()
    }

    fn meta<'a>(
        queries: &'a [QueryMeta],
        cells: &'a [CellMeta],
        mask: Mask,
        ancestors: &'a [u64],
    ) -> AttnMeta<'a> {
        AttnMeta {
            n_head: 1,
            n_head_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            scale: 1.0,
            mask,
            queries,
            cells,
            ancestors,
            anc_words: usize::from(!ancestors.is_empty()),
        }
    }

    /// One head, dim 1, keys all equal: the output is the mean of the visible values.
    fn attend_mean(cells: &[CellMeta], q: QueryMeta, mask: Mask, anc: &[u64]) -> f32 {
        let b = backend();
        let v: Vec<f32> = (0..cells.len()).map(|i| i as f32).collect();
        let k = vec![1.0f32; cells.len()];
        let mut out = vec![0f32];
        b.attention(
            &vec![1.0],
            KvSource::Bufs { k: &k, v: &v },
            &meta(&[q], cells, mask, anc),
            &mut out,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        out[0]
    }

    #[test]
    fn layer_norm_centres_scales_and_shifts() {
        // [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
        let b = backend();
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0];
        b.layer_norm(
            &mut x,
            &vec![1.0, 1.0, 2.0, 2.0],
            &vec![0.0, 0.5, 0.0, 0.5],
            0.0,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let s = 1.25f32.sqrt();
        let want = [-1.5 / s, -0.5 / s + 0.5, 1.0 / s, 3.0 / s + 0.5];
        for (g, w) in x.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{x:?}");
        }
        assert!(b
            .layer_norm(&mut x, &vec![1.0; 3], &vec![0.0; 3], 0.0)
            .is_err());
    }

    #[test]
    fn indexer_scores_sum_relu_dots_weighted_per_head() {
        // 1 query, 2 heads of dim 2, 3 cells.
        let b = backend();
        let q = vec![1.0, 0.0, /* head 1 */ 0.0, 1.0];
        let k = vec![
            2.0, -1.0, /* cell 1 */ -3.0, 4.0, /* cell 2 */ 1.0, 1.0,
        ];
        let w = vec![0.5, 2.0];
        let mut out = vec![0f32; 3];
        b.indexer_scores(&q, &k, &w, 2, 2, 3, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        // cell 0: 0.5·relu(2) + 2·relu(−1) = 1; cell 1: 0.5·relu(−3) + 2·relu(4) = 8;
        // cell 2: 0.5·1 + 2·1 = 2.5.
        assert_eq!(out, vec![1.0, 8.0, 2.5]);
    }

    #[test]
    fn top_k_keeps_visible_cells_by_score_ties_to_the_lower_position() {
        let b = backend();
        // Cells hold positions 3, 0, 2, 1 (any order: selection is by position, not row).
        let cells: Vec<CellMeta> = [3u32, 0, 2, 1]
            .iter()
            .map(|&pos| CellMeta {
                pos,
                seq: 0,
                batch: CellMeta::COMMITTED,
            })
            .collect();
        let queries = [QueryMeta { pos: 2, seq: 0 }, QueryMeta { pos: 3, seq: 0 }];
        // Query 0 (pos 2) sees cells 1, 2, 3; cell 0 (pos 3) scores highest but is in its
        // future. Cells 2 and 3 tie: position 1 (cell 3) before position 2 (cell 2).
        let scores = vec![9.0, 1.0, 5.0, 5.0, /* query 1 */ 9.0, 1.0, 5.0, 5.0];
        let m = meta(&queries, &cells, Mask::CAUSAL, &[]);
        let mut out = vec![0u32; 4];
        b.select_top_k(&scores, &m, 2, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out, vec![3, 2, 0, 3]);
        // k larger than what a query sees: the rest of its row is empty.
        let mut out = vec![0u32; 10];
        b.select_top_k(&scores, &m, 5, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&out[..5], &[3, 2, 1, SELECTED_NONE, SELECTED_NONE]);
        assert_eq!(&out[5..], &[0, 3, 2, 1, SELECTED_NONE]);
    }

    #[test]
    fn attention_over_a_selection_sees_only_it_and_equals_dense_when_it_holds_all() {
        let b = backend();
        let cells = cells(4);
        let q = QueryMeta { pos: 3, seq: 0 };
        let v: Vec<f32> = (0..4).map(|i| i as f32).collect();
        let k = vec![0.5f32, -1.0, 2.0, 0.25];
        let queries = [q];
        let m = meta(&queries, &cells, Mask::CAUSAL, &[]);
        let run = |sel: Option<Vec<u32>>| {
            let mut out = vec![0f32];
            let kv = KvSource::Bufs { k: &k, v: &v };
            match sel {
                None => b.attention(&vec![1.0], kv, &m, &mut out),
                Some(s) => {
                    let n = s.len();
                    b.attention_selected(&vec![1.0], kv, &m, &s, n, &mut out)
                }
            }
            .unwrap_or_else(|e| panic!("{e}"));
            out[0]
        };
        // Every visible cell selected, in any order: the dense op's bits.
        assert_eq!(run(Some(vec![2, 0, 3, 1])).to_bits(), run(None).to_bits());
        // One cell: its value, whatever the scores.
        assert_eq!(run(Some(vec![1, SELECTED_NONE])), 1.0);
        // Two cells: softmax over their scores only.
        let (e0, e2) = (0.5f32.exp(), 2f32.exp());
        let want = (0.0 * e0 + 2.0 * e2) / (e0 + e2);
        assert!((run(Some(vec![0, 2])) - want).abs() < 1e-6);
    }

    #[test]
    fn attention_window_masks_by_position_distance() {
        let c = cells(6);
        let q = QueryMeta { pos: 5, seq: 0 };
        approx::assert_abs_diff_eq!(attend_mean(&c, q, Mask::CAUSAL, &[]), 2.5, epsilon = 1e-6);
        // Window 2 at position 5: keys 4 and 5 (llama.cpp masks p - j >= window).
        let w2 = Mask {
            window: Some(2),
            ..Mask::CAUSAL
        };
        approx::assert_abs_diff_eq!(attend_mean(&c, q, w2, &[]), 4.5, epsilon = 1e-6);
        // The same positions in reversed cells: the mask follows positions, not rows.
        let rev: Vec<CellMeta> = c.iter().rev().copied().collect();
        approx::assert_abs_diff_eq!(attend_mean(&rev, q, w2, &[]), 0.5, epsilon = 1e-6);
        // Causal: a query at position 2 sees 0..=2 only.
        let q2 = QueryMeta { pos: 2, seq: 0 };
        approx::assert_abs_diff_eq!(attend_mean(&c, q2, Mask::CAUSAL, &[]), 1.0, epsilon = 1e-6);
    }

    #[test]
    fn attention_sees_only_its_sequence_and_its_tree_ancestors() {
        let mut c = cells(4);
        c[1].seq = 7; // another sequence's cell
        c[2].seq = CellMeta::FREE;
        let q = QueryMeta { pos: 3, seq: 0 };
        // Visible: cells 0 and 3 (values 0 and 3).
        approx::assert_abs_diff_eq!(attend_mean(&c, q, Mask::CAUSAL, &[]), 1.5, epsilon = 1e-6);
        // Tree: cells 2 and 3 written by batch tokens 0 and 1; the query is token 1 whose
        // ancestor set is {1}: token 0 (a sibling) is hidden.
        let mut t = cells(4);
        t[2] = CellMeta {
            pos: 2,
            seq: 0,
            batch: 0,
        };
        t[3] = CellMeta {
            pos: 2,
            seq: 0,
            batch: 1,
        };
        let tree = Mask {
            tree: true,
            ..Mask::CAUSAL
        };
        let q = QueryMeta { pos: 2, seq: 0 };
        approx::assert_abs_diff_eq!(attend_mean(&t, q, tree, &[0b10]), 4.0 / 3.0, epsilon = 1e-6);
        approx::assert_abs_diff_eq!(attend_mean(&t, q, Mask::CAUSAL, &[]), 1.5, epsilon = 1e-6);
    }

    #[test]
    fn kv_move_reads_every_source_first_and_f16_rounds() {
        let b = backend();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = b.kv_new(1, 1, dtype).unwrap_or_else(|e| panic!("{e}"));
            b.kv_reserve(&mut kv, 3).unwrap_or_else(|e| panic!("{e}"));
            let vals = vec![1.0, 2.0, 3.000_1];
            b.kv_write(&mut kv, &[0, 1, 2], &vals, &vals)
                .unwrap_or_else(|e| panic!("{e}"));
            // A swap: both rows read before either is written.
            b.kv_move(&mut kv, &[(0, 1), (1, 0)])
                .unwrap_or_else(|e| panic!("{e}"));
            let mut k = vec![0f32; 3];
            b.kv_read_k(&kv, 3, &mut k)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&k[..2], &[2.0, 1.0]);
            let third = if dtype == KvDtype::F16 {
                f16::from_f32(3.000_1).to_f32()
            } else {
                3.000_1
            };
            assert_eq!(k[2], third);
            // The values side reads back the same way (the kv_cache tap reads both).
            let mut v = vec![0f32; 3];
            b.kv_read_v(&kv, 3, &mut v)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(v, k);
            assert!(b.kv_read_v(&kv, 4, &mut vec![0f32; 4]).is_err());
            assert!(b.kv_read_v(&kv, 3, &mut vec![0f32; 2]).is_err());
            assert!(b.kv_write(&mut kv, &[3], &vec![0.0], &vec![0.0]).is_err());
        }
    }

    fn moe(gating: Gating, norm: bool, scale: f32, k: usize) -> MoeConfig {
        MoeConfig {
            n_expert: 4,
            n_expert_used: k,
            n_expert_shared: 0,
            n_ff_exp: 8,
            n_dense_lead: 0,
            weights_scale: scale,
            weights_norm: norm,
            gating,
        }
    }

    #[test]
    fn softmax_router_picks_top_k_by_probability() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let (ids, w) = route_one(&logits, None, &moe(Gating::Softmax, false, 1.0, 2));
        assert_eq!(ids, [1, 2]);
        // softmax(2) and softmax(1) over {0, 2, 1, -1}, computed by hand in f64.
        let z: f64 = [0f64, 2.0, 1.0, -1.0].iter().map(|v| v.exp()).sum();
        approx::assert_relative_eq!(w[0], (2f64.exp() / z) as f32, max_relative = 1e-6);
        approx::assert_relative_eq!(w[1], (1f64.exp() / z) as f32, max_relative = 1e-6);
    }

    #[test]
    fn bias_changes_the_choice_but_not_the_weights() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let bias = [0.0, 0.0, 0.0, 5.0];
        let cfg = moe(Gating::Sigmoid, false, 1.0, 2);
        let (ids, w) = route_one(&logits, Some(&bias), &cfg);
        assert_eq!(ids, [3, 1]);
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert_eq!(w, [sig(-1.0), sig(2.0)]);
    }

    #[test]
    fn weights_are_normalized_then_scaled() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let (_, w) = route_one(&logits, None, &moe(Gating::Sigmoid, true, 2.5, 3));
        approx::assert_relative_eq!(w.iter().sum::<f32>(), 2.5, max_relative = 1e-6);
    }

    #[test]
    fn route_op_writes_rank_ordered_ids_and_combine_sums_in_rank_order() {
        let b = backend();
        let cfg = moe(Gating::Softmax, true, 1.0, 2);
        let logits = vec![0.0, 2.0, 1.0, -1.0, 3.0, 0.0, 0.0, 0.0];
        let (mut ids, mut w) = (vec![0u32; 4], vec![0f32; 4]);
        b.route(&logits, None, &cfg, 2, &mut ids, &mut w)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&ids[..], &[1, 2, 0, 1]);
        let y = vec![1.0, 10.0, 100.0, 1000.0]; // [2 tokens × 2 slots, d = 1]
        let mut out = vec![0f32; 2];
        b.moe_combine(&y, &w, 2, 2, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_relative_eq!(out[0], w[0] + 10.0 * w[1], max_relative = 1e-6);
        assert!(b.route(&logits, None, &cfg, 3, &mut ids, &mut w).is_err());
    }

    #[test]
    fn gelu_matches_known_values() {
        // GELU-tanh(1) = 0.8411920 (tanh approximation, computed in f64).
        approx::assert_abs_diff_eq!(vector::gelu_tanh(1.0), 0.841_192, epsilon = 1e-6);
        approx::assert_abs_diff_eq!(vector::gelu_tanh(0.0), 0.0);
        approx::assert_abs_diff_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn shape_errors_are_reported() {
        let b = backend();
        let mut out = vec![0f32; 3];
        assert!(matches!(
            b.rms_norm(&vec![1.0; 4], &vec![1.0; 2], 1e-6, &mut out),
            Err(RuntimeError::Shape { .. })
        ));
    }
}
