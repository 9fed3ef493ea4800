//! Quantized matrix products on the CPU, as ggml computes them.
//!
//! [`CpuKernels::matmul`] multiplies a weight matrix stored in a GGML format (read in place from
//! the GGUF mapping, at any alignment, never dequantized as a whole) by `n_tokens` f32 activation
//! rows. As in ggml, the activations are first quantized once per call to the weight type's
//! [`vec_dot_type`] (Q8_0, Q8_1, Q8_K, or F16 / BF16 / F32 for the float types), then each output
//! is one per-block integer dot product (`ggml_vec_dot_q4_K_q8_K` and friends). Rows and token
//! tiles are spread over rayon's *current* thread pool.
//!
//! The instruction set is chosen once, in [`CpuKernels::new`], which fills a table of row-dot
//! functions; no call checks CPU features again.
//!
//! | weight type | activations | scalar | AVX2 | AVX-512 |
//! |---|---|---|---|---|
//! | F32 | F32 | ✓ | ✓ | ✓ |
//! | F16 | F16 | ✓ | ✓ | ✓ |
//! | BF16 | BF16 | ✓ | ✓ | AVX2 kernel |
//! | Q4_0, Q5_0, Q8_0 | Q8_0 | ✓ | ✓ | ✓ |
//! | IQ4_NL, MXFP4, Q8_1 | Q8_0 | ✓ | ✓ | AVX2 kernel |
//! | Q4_1, Q5_1 | Q8_1 | ✓ | scalar | scalar |
//! | Q4_K, Q6_K | Q8_K | ✓ | ✓ | ✓ |
//! | Q5_K | Q8_K | ✓ | ✓ | AVX2 kernel |
//! | Q2_K, Q3_K, Q8_K, IQ4_XS | Q8_K | ✓ | scalar | scalar |
//!
//! "AVX2 kernel" means the AVX-512 backend runs the 256-bit kernel (same results); "scalar" means
//! the backend runs the scalar twin for that type. Every SIMD kernel has its scalar twin in
//! [`scalar`], which is the test oracle and the fallback.
//!
//! How a product is cut depends on its token count. One token (decode) and small batches (up to
//! 16 tokens: a speculative verify, a few sequences) stream each weight row once per
//! eight tokens (`Rows`, Q4_0/Q5_0/Q8_0 with AVX-512 VNNI). Prefill cuts the product into tasks
//! of up to 64 rows × 64 tokens; with AVX-512 VNNI a task is one `Panel` call (Q4_0/Q5_0/Q8_0,
//! Q4_K/Q6_K): every weight row of the task unpacked once, every token's activations prepared
//! once, then a 4 × 4 register micro-kernel writing straight into the output. Elsewhere, tasks
//! run the four-token (`Dot4`) and one-token (`Dot`) kernels. Every path gives the one-token
//! kernel's bits for each (row, token), so prefill equals decode token by token.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod error;
mod isa;
mod scalar;
#[cfg(test)]
mod tests;
pub mod vector;

use std::cell::RefCell;

use half::{bf16, f16};
use rayon::prelude::*;

pub use act::{vec_dot_type, QuantizedActivations};
pub use error::KernelError;
pub use isa::Isa;

use crate::quant::k_quants::BlockQ8K;
use crate::quant::legacy::{BlockQ8_0, BlockQ8_1};
use crate::quant::GgmlType;
use act::ActSlice;

/// One weight row against one activation row.
///
/// # Safety
/// The caller guarantees that the CPU supports the ISA the function was compiled for, and that
/// `w` holds exactly `y.len()` blocks of the weight type (for the float types: `y.len()`
/// elements).
type Dot<A> = unsafe fn(&[u8], &[A]) -> f32;

/// A row-dot function, by the activation type it reads.
#[derive(Clone, Copy)]
enum RowDot {
    F32(Dot<f32>),
    F16(Dot<f16>),
    Bf16(Dot<bf16>),
    Q8_0(Dot<BlockQ8_0>),
    Q8_1(Dot<BlockQ8_1>),
    Q8K(Dot<BlockQ8K>),
}

/// One weight row against four activation rows at once (prefill): each weight block is unpacked
/// once for the four. Every output is bit-identical to the [`Dot`] of the same type on that row
/// (the per-row f32 operations are the same, in the same order), so how tokens are grouped never
/// changes a result. Its scalar twin is four calls of the scalar [`Dot`].
///
/// # Safety
/// As [`Dot`], for each of the four activation rows.
type Dot4<A> = unsafe fn(&[u8], &[&[A]; 4]) -> [f32; 4];

/// A four-row kernel, by the activation type it reads.
#[derive(Clone, Copy)]
enum RowDot4 {
    Q8_0(Dot4<BlockQ8_0>),
    Q8K(Dot4<BlockQ8K>),
}

/// Consecutive weight rows of `row_bytes` each (`w`) against up to eight activation rows `ys`
/// (decode, a small batch, a speculative verify, a prefill tile's last tokens): the activation
/// side of each pair of blocks is prepared once for all the rows, and the rows are streamed one
/// after another, each block unpacked once for every token. Output `(row r, token t)` goes to
/// `out[t * stride + r]`. Every output is bit-identical to the [`Dot`] of the same type on that
/// (row, token).
///
/// # Safety
/// As [`Dot`], for each of the weight rows and each activation row; `w` holds whole rows.
type Rows<A> = unsafe fn(&[u8], usize, &[&[A]], &mut [f32], usize);

/// A rows kernel (decode, small batches), by the activation type it reads.
#[derive(Clone, Copy)]
enum RowRows {
    Q8_0(Rows<BlockQ8_0>),
}

/// A prefill task: consecutive weight rows of `row_bytes` each (`w`) against every activation
/// row in `acts` (`nb` blocks each). Each weight row is unpacked once for all the task's tokens
/// and each activation row prepared once for all its weight rows. Output `(row r, token t)` goes
/// to `*out.add(t * stride + r)`, straight into the product's output (the tasks of a product
/// write disjoint blocks of it). Every output is bit-identical to the [`Dot`] of the same type
/// on that (row, token).
///
/// # Safety
/// As [`Dot`], for each of the weight rows and each activation row; `w` holds whole rows and
/// `acts` whole activation rows of `nb` blocks, the blocks of one weight row; `out.add(t *
/// stride + r)` is valid for writes, and written by no one else during the call, for every row
/// `r` and token `t` of the task.
type Panel<A> = unsafe fn(&[u8], usize, &[A], usize, *mut f32, usize);

/// A panel kernel (prefill), by the activation type it reads.
#[derive(Clone, Copy)]
enum RowPanel {
    Q8_0(Panel<BlockQ8_0>),
    Q8K(Panel<BlockQ8K>),
}

/// Largest GGUF type id plus one: the size of the dispatch table.
const TYPE_SLOTS: usize = 40;

/// The CPU matrix-product backend for one instruction set.
#[derive(Clone)]
pub struct CpuKernels {
    isa: Isa,
    table: [Option<RowDot>; TYPE_SLOTS],
    table4: [Option<RowDot4>; TYPE_SLOTS],
    rows: [Option<RowRows>; TYPE_SLOTS],
    panel: [Option<RowPanel>; TYPE_SLOTS],
    vector: vector::VectorFns,
}

impl std::fmt::Debug for CpuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuKernels")
            .field("isa", &self.isa)
            .finish()
    }
}

/// Reusable buffers for [`CpuKernels::matmul_with_scratch`]: the quantized activations and the
/// output tiles of a prefill product.
#[derive(Debug, Default, Clone)]
pub struct MatmulScratch {
    acts: QuantizedActivations,
    tiles: Vec<f32>,
}

impl MatmulScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

thread_local! {
    /// Scratch for [`CpuKernels::matmul`], one per calling thread. Taken out for the duration of a
    /// call, so a nested call on the same thread (rayon work stealing) gets a fresh one instead of
    /// a borrow conflict.
    static SCRATCH: RefCell<MatmulScratch> = RefCell::new(MatmulScratch::default());
}

impl CpuKernels {
    /// The backend for `isa`, or [`KernelError::IsaUnavailable`] when this CPU lacks it.
    pub fn new(isa: Isa) -> Result<Self, KernelError> {
        if !isa.is_available() {
            let missing = missing_features(isa);
            return Err(KernelError::IsaUnavailable { isa, missing });
        }
        Ok(Self::build(isa))
    }

    /// The backend for the widest ISA this CPU has.
    pub fn detect() -> Self {
        Self::build(Isa::detect())
    }

    /// Fill the dispatch table. Only called with an ISA the CPU has.
    fn build(isa: Isa) -> Self {
        let mut table = [None; TYPE_SLOTS];
        let mut table4 = [None; TYPE_SLOTS];
        let mut rows = [None; TYPE_SLOTS];
        let mut panel = [None; TYPE_SLOTS];
        for ty in GgmlType::ALL {
            let i = ty.id() as usize;
            if i < TYPE_SLOTS {
                table[i] = select(isa, ty);
                table4[i] = select4(isa, ty);
                (rows[i], panel[i]) = select_vnni(isa, ty);
            }
        }
        Self {
            isa,
            table,
            table4,
            rows,
            panel,
            vector: vector::VectorFns::select(isa),
        }
    }

    /// The instruction set this backend runs.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// This ISA's vector kernels (gated GELU, attention dots and updates), chosen with the
    /// matrix kernels.
    pub fn vector(&self) -> &vector::VectorFns {
        &self.vector
    }

    /// Whether [`Self::matmul`] accepts weights of type `ty`.
    pub fn supports(&self, ty: GgmlType) -> bool {
        self.row_dot(ty).is_some()
    }

    fn row_dot(&self, ty: GgmlType) -> Option<RowDot> {
        self.table.get(ty.id() as usize).copied().flatten()
    }

    /// `out[t * n_rows + r] = Σ_k W[r, k] · x[t * k_dim + k]`.
    ///
    /// `w` is the weight matrix in GGML layout: `n_rows` contiguous rows of `k_dim` elements of
    /// `ty` (`k_dim / block_size` blocks each), at any alignment. `x` is `n_tokens × k_dim` f32,
    /// row-major; `out` is `n_tokens × n_rows`. The activations are quantized to
    /// [`vec_dot_type`]`(ty)` first, as ggml does. Scratch buffers live in a thread-local and are
    /// reused across calls.
    pub fn matmul(
        &self,
        ty: GgmlType,
        w: &[u8],
        n_rows: usize,
        k_dim: usize,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let mut scratch = SCRATCH.with(|s| s.take());
        let r = self.matmul_with_scratch(ty, w, n_rows, k_dim, x, n_tokens, out, &mut scratch);
        SCRATCH.with(|s| s.replace(scratch));
        r
    }

    /// [`Self::matmul`] with caller-owned scratch buffers.
    pub fn matmul_with_scratch(
        &self,
        ty: GgmlType,
        w: &[u8],
        n_rows: usize,
        k_dim: usize,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) -> Result<(), KernelError> {
        // Check the weights and output before spending time on the activations.
        self.check_weights(ty, w, n_rows, k_dim)?;
        check_out(out, n_tokens, n_rows)?;
        let act_ty = self.act_type(ty)?;
        scratch
            .acts
            .quantize_with(&self.vector, act_ty, x, n_tokens, k_dim)?;
        self.matmul_tiles(ty, w, n_rows, &scratch.acts, out, &mut scratch.tiles)
    }

    /// Quantize `n_tokens × k_dim` activations for weights of type `ty`, so that several
    /// products sharing an input (Q, K, V; gate, up) quantize it once.
    pub fn quantize_activations(
        &self,
        ty: GgmlType,
        x: &[f32],
        n_tokens: usize,
        k_dim: usize,
        acts: &mut QuantizedActivations,
    ) -> Result<(), KernelError> {
        let act_ty = self.act_type(ty)?;
        acts.quantize_with(&self.vector, act_ty, x, n_tokens, k_dim)
    }

    /// [`Self::matmul`] on activations already quantized by [`Self::quantize_activations`]
    /// (for this weight type or another with the same [`vec_dot_type`]).
    pub fn matmul_quantized(
        &self,
        ty: GgmlType,
        w: &[u8],
        n_rows: usize,
        acts: &QuantizedActivations,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let mut scratch = SCRATCH.with(|s| s.take());
        let r = self.matmul_tiles(ty, w, n_rows, acts, out, &mut scratch.tiles);
        SCRATCH.with(|s| s.replace(scratch));
        r
    }

    /// One weight row (`k_dim` elements of `ty`) against activation row `token`.
    pub fn vec_dot(
        &self,
        ty: GgmlType,
        w_row: &[u8],
        acts: &QuantizedActivations,
        token: usize,
    ) -> Result<f32, KernelError> {
        let dot = self
            .row_dot(ty)
            .ok_or(KernelError::UnsupportedType { ty })?;
        self.check_acts(ty, acts)?;
        self.check_weights(ty, w_row, 1, acts.k_dim())?;
        if token >= acts.n_tokens() {
            return Err(KernelError::TokenOutOfRange {
                token,
                n_tokens: acts.n_tokens(),
            });
        }
        let per_tok = acts.k_dim() / act_block(ty);
        let range = token * per_tok..(token + 1) * per_tok;
        // SAFETY: `new` checked that the CPU has this backend's ISA; `check_weights` checked that
        // `w_row` holds `k_dim / block_size` blocks, which is `per_tok` activation blocks since
        // the weight and activation block sizes are equal.
        let v = unsafe {
            match (dot, acts.slice()) {
                (RowDot::F32(f), Some(ActSlice::F32(a))) => f(w_row, &a[range]),
                (RowDot::F16(f), Some(ActSlice::F16(a))) => f(w_row, &a[range]),
                (RowDot::Bf16(f), Some(ActSlice::Bf16(a))) => f(w_row, &a[range]),
                (RowDot::Q8_0(f), Some(ActSlice::Q8_0(a))) => f(w_row, &a[range]),
                (RowDot::Q8_1(f), Some(ActSlice::Q8_1(a))) => f(w_row, &a[range]),
                (RowDot::Q8K(f), Some(ActSlice::Q8K(a))) => f(w_row, &a[range]),
                _ => return Err(self.act_mismatch(ty, acts)),
            }
        };
        Ok(v)
    }

    fn act_type(&self, ty: GgmlType) -> Result<GgmlType, KernelError> {
        match (self.row_dot(ty), vec_dot_type(ty)) {
            (Some(_), Some(a)) => Ok(a),
            _ => Err(KernelError::UnsupportedType { ty }),
        }
    }

    fn act_mismatch(&self, ty: GgmlType, acts: &QuantizedActivations) -> KernelError {
        match vec_dot_type(ty) {
            Some(expected) => KernelError::ActivationType {
                weight: ty,
                expected,
                found: acts.ty(),
            },
            None => KernelError::UnsupportedType { ty },
        }
    }

    fn check_acts(&self, ty: GgmlType, acts: &QuantizedActivations) -> Result<(), KernelError> {
        let expected = self.act_type(ty)?;
        if acts.ty() != Some(expected) {
            return Err(self.act_mismatch(ty, acts));
        }
        Ok(())
    }

    fn check_weights(
        &self,
        ty: GgmlType,
        w: &[u8],
        n_rows: usize,
        k_dim: usize,
    ) -> Result<(), KernelError> {
        if self.row_dot(ty).is_none() {
            return Err(KernelError::UnsupportedType { ty });
        }
        let bs = ty.block_size();
        if !k_dim.is_multiple_of(bs) {
            return Err(KernelError::KDimNotBlockMultiple {
                ty,
                k_dim,
                block_size: bs,
            });
        }
        let expected = (k_dim / bs)
            .checked_mul(ty.type_size())
            .and_then(|row| row.checked_mul(n_rows))
            .ok_or(KernelError::Overflow {
                what: "weight bytes",
            })?;
        if w.len() != expected {
            return Err(KernelError::WeightLen {
                ty,
                n_rows,
                k_dim,
                expected,
                found: w.len(),
            });
        }
        Ok(())
    }

    fn matmul_tiles(
        &self,
        ty: GgmlType,
        w: &[u8],
        n_rows: usize,
        acts: &QuantizedActivations,
        out: &mut [f32],
        tiles: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        let dot = self
            .row_dot(ty)
            .ok_or(KernelError::UnsupportedType { ty })?;
        self.check_acts(ty, acts)?;
        let k_dim = acts.k_dim();
        let n_tokens = acts.n_tokens();
        self.check_weights(ty, w, n_rows, k_dim)?;
        check_out(out, n_tokens, n_rows)?;
        if n_rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        if k_dim == 0 {
            // Rows of no values: every product is the empty sum (no row kernel divides by it).
            out.fill(0.0);
            return Ok(());
        }
        let row_bytes = w.len() / n_rows;
        let per_tok = k_dim / act_block(ty);
        let dot4 = self.table4.get(ty.id() as usize).copied().flatten();
        let rows = self.rows.get(ty.id() as usize).copied().flatten();
        let panel = self.panel.get(ty.id() as usize).copied().flatten();
        let geo = Geometry::new(n_rows, n_tokens, k_dim, TOK_TILE);
        // SAFETY (for every arm): `new` checked the CPU has this backend's ISA, and
        // `check_weights` checked that each `row_bytes` row holds `per_tok` blocks, the length of
        // every activation row handed to the kernel.
        match (dot, acts.slice()) {
            (RowDot::F32(f), Some(ActSlice::F32(a))) => {
                run(f, Fast::none(), w, row_bytes, a, per_tok, geo, out, tiles)
            }
            (RowDot::F16(f), Some(ActSlice::F16(a))) => {
                run(f, Fast::none(), w, row_bytes, a, per_tok, geo, out, tiles)
            }
            (RowDot::Bf16(f), Some(ActSlice::Bf16(a))) => {
                run(f, Fast::none(), w, row_bytes, a, per_tok, geo, out, tiles)
            }
            (RowDot::Q8_0(f), Some(ActSlice::Q8_0(a))) => {
                let f4 = match dot4 {
                    Some(RowDot4::Q8_0(f4)) => Some(f4),
                    _ => None,
                };
                let fr = rows.map(|RowRows::Q8_0(fr)| fr);
                let fp = match panel {
                    Some(RowPanel::Q8_0(fp)) => Some(fp),
                    _ => None,
                };
                let fast = Fast {
                    dot4: f4,
                    rows: fr,
                    panel: fp,
                };
                let geo = match fp {
                    Some(_) if n_tokens > SMALL_BATCH => Geometry::new(
                        n_rows,
                        n_tokens,
                        k_dim,
                        panel_tok_tile(per_tok * std::mem::size_of::<BlockQ8_0>()),
                    ),
                    _ => geo,
                };
                run(f, fast, w, row_bytes, a, per_tok, geo, out, tiles)
            }
            (RowDot::Q8_1(f), Some(ActSlice::Q8_1(a))) => {
                run(f, Fast::none(), w, row_bytes, a, per_tok, geo, out, tiles)
            }
            (RowDot::Q8K(f), Some(ActSlice::Q8K(a))) => {
                let f4 = match dot4 {
                    Some(RowDot4::Q8K(f4)) => Some(f4),
                    _ => None,
                };
                let fp = match panel {
                    Some(RowPanel::Q8K(fp)) => Some(fp),
                    _ => None,
                };
                let fast = Fast {
                    dot4: f4,
                    panel: fp,
                    ..Fast::none()
                };
                // The panel reads each token's blocks in place (it prepares only their sums),
                // so its tasks take the most tokens.
                let geo = match fp {
                    Some(_) if n_tokens > SMALL_BATCH => {
                        Geometry::new(n_rows, n_tokens, k_dim, PANEL_TOK_TILE)
                    }
                    _ => geo,
                };
                run(f, fast, w, row_bytes, a, per_tok, geo, out, tiles)
            }
            _ => return Err(self.act_mismatch(ty, acts)),
        }
        Ok(())
    }
}

/// Elements per activation block for weights of type `ty` (the weight block size: 1 for the
/// float types, 32 for Q8_0 / Q8_1, 256 for Q8_K).
fn act_block(ty: GgmlType) -> usize {
    ty.block_size()
}

fn check_out(out: &[f32], n_tokens: usize, n_rows: usize) -> Result<(), KernelError> {
    let expected = n_tokens.checked_mul(n_rows).ok_or(KernelError::Overflow {
        what: "n_tokens * n_rows",
    })?;
    if out.len() != expected {
        return Err(KernelError::OutputLen {
            n_tokens,
            n_rows,
            expected,
            found: out.len(),
        });
    }
    Ok(())
}

fn missing_features(isa: Isa) -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        isa.required_features()
            .iter()
            .copied()
            .filter(|f| !x86_feature(f))
            .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        isa.required_features().to_vec()
    }
}

/// Whether this CPU has AVX-512 VNNI (`vpdpbusd`, `vpdpwssd`), which the AVX-512 backend uses
/// where it has it, with the same results.
#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    is_x86_feature_detected!("avx512vnni")
}

#[cfg(target_arch = "x86_64")]
fn x86_feature(name: &str) -> bool {
    match name {
        "avx2" => is_x86_feature_detected!("avx2"),
        "fma" => is_x86_feature_detected!("fma"),
        "f16c" => is_x86_feature_detected!("f16c"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        _ => false,
    }
}

/// The row-dot kernel for weights of type `ty` on `isa`, `None` when there is no CPU product for
/// `ty`. Only called for an ISA the CPU has.
fn select(isa: Isa, ty: GgmlType) -> Option<RowDot> {
    use GgmlType as T;
    let scalar = match ty {
        T::F32 => RowDot::F32(scalar::dot_f32),
        T::F16 => RowDot::F16(scalar::dot_f16),
        T::BF16 => RowDot::Bf16(scalar::dot_bf16),
        T::Q4_0 => RowDot::Q8_0(scalar::dot_q4_0),
        T::Q4_1 => RowDot::Q8_1(scalar::dot_q4_1),
        T::Q5_0 => RowDot::Q8_0(scalar::dot_q5_0),
        T::Q5_1 => RowDot::Q8_1(scalar::dot_q5_1),
        T::Q8_0 => RowDot::Q8_0(scalar::dot_q8_0),
        T::Q8_1 => RowDot::Q8_0(scalar::dot_q8_1),
        T::Iq4Nl => RowDot::Q8_0(scalar::dot_iq4_nl),
        T::Mxfp4 => RowDot::Q8_0(scalar::dot_mxfp4),
        T::Q2K => RowDot::Q8K(scalar::dot_q2k),
        T::Q3K => RowDot::Q8K(scalar::dot_q3k),
        T::Q4K => RowDot::Q8K(scalar::dot_q4k),
        T::Q5K => RowDot::Q8K(scalar::dot_q5k),
        T::Q6K => RowDot::Q8K(scalar::dot_q6k),
        T::Q8K => RowDot::Q8K(scalar::dot_q8k),
        T::Iq4Xs => RowDot::Q8K(scalar::dot_iq4_xs),
        _ => return None,
    };
    #[cfg(target_arch = "x86_64")]
    {
        let simd = match isa {
            Isa::Scalar => None,
            Isa::Avx2 => avx2::select(ty),
            Isa::Avx512 => avx512::select(ty, has_vnni()).or_else(|| avx2::select(ty)),
        };
        Some(simd.unwrap_or(scalar))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        Some(scalar)
    }
}

/// The four-row kernel for weights of type `ty` on `isa`, if there is one (only AVX-512 has
/// them; elsewhere prefill runs the one-row kernel per token, with the same results).
fn select4(isa: Isa, ty: GgmlType) -> Option<RowDot4> {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512 => avx512::select4(ty, has_vnni()),
            Isa::Scalar | Isa::Avx2 => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        None
    }
}

/// The VNNI kernels for weights of type `ty` on `isa` (rows: a task's rows × up to eight
/// tokens, decode and small batches; panel: a task's rows × all its tokens, prefill), if there
/// are: AVX-512 with VNNI (`vpdpbusd`) only; elsewhere the four-row or one-row kernels run, with
/// the same results.
fn select_vnni(isa: Isa, ty: GgmlType) -> (Option<RowRows>, Option<RowPanel>) {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512 if has_vnni() => (avx512::select_rows(ty), avx512::select_panel(ty)),
            _ => (None, None),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        (None, None)
    }
}

/// The multi-row kernels a product may use besides the one-row [`Dot`]; each gives the same
/// bits as `Dot` per output.
struct Fast<A> {
    dot4: Option<Dot4<A>>,
    rows: Option<Rows<A>>,
    panel: Option<Panel<A>>,
}

impl<A> Fast<A> {
    fn none() -> Self {
        Self {
            dot4: None,
            rows: None,
            panel: None,
        }
    }
}

/// How a product is cut into tasks: `tok_tile` tokens × `row_tile` rows each.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n_rows: usize,
    n_tokens: usize,
    row_tile: usize,
    tok_tile: usize,
    n_row_tiles: usize,
    n_tok_tiles: usize,
}

/// Tokens per task in a prefill product: their activation rows (≤ 16 × 2.3 KB for k = 2048 in
/// Q8_K) stay in L2 while a weight row (≈ 1.2 KB of Q4_K) stays in L1 across them.
const TOK_TILE: usize = 16;
/// Tokens per task in a prefill product through a [`Panel`] kernel: each weight row is unpacked
/// once per task, so more tokens per task amortize it better, as long as the task's prepared
/// activations (three registers per pair of blocks, 192 bytes per 68 activation bytes) stay
/// within about [`PANEL_ACT_BYTES`].
const PANEL_TOK_TILE: usize = 64;
/// The size the prepared activations of a panel task aim to stay within (a Zen 4's L2 is 1 MiB,
/// an Intel server core's 1–2 MiB).
const PANEL_ACT_BYTES: usize = 256 << 10;

/// Tokens per panel task for activation rows of `row_bytes` quantized bytes: [`PANEL_TOK_TILE`],
/// fewer for long rows, never fewer than four.
fn panel_tok_tile(row_bytes: usize) -> usize {
    let prepared = row_bytes.max(1) * 3;
    (PANEL_ACT_BYTES / prepared).clamp(4, PANEL_TOK_TILE) / 4 * 4
}

/// Most rows per task.
const MAX_ROW_TILE: usize = 64;
/// Most tokens of a product that go through the [`Rows`] kernel alone (weights streamed once per
/// eight tokens) rather than the panel kernel.
const SMALL_BATCH: usize = 16;

/// Most activation rows per [`Rows`] call (every [`Rows`] kernel takes 1 ..= this many).
const ROWS_MAX_TOKENS: usize = 8;

/// Fewest multiply-adds per task worth a rayon job.
const MIN_TASK_MACS: usize = 1 << 15;

impl Geometry {
    /// At most `max_tok_tile` tokens per task.
    fn new(n_rows: usize, n_tokens: usize, k_dim: usize, max_tok_tile: usize) -> Self {
        let tok_tile = n_tokens.clamp(1, max_tok_tile);
        let n_tok_tiles = n_tokens.div_ceil(tok_tile);
        // About four tasks per thread, for balance, but none too small to be worth scheduling.
        let target_tasks = 4 * rayon::current_num_threads().max(1);
        let by_balance = (n_rows * n_tok_tiles).div_ceil(target_tasks);
        let by_size = MIN_TASK_MACS.div_ceil(k_dim.max(1) * tok_tile);
        let row_tile = by_balance.max(by_size).clamp(1, MAX_ROW_TILE).min(n_rows);
        Self {
            n_rows,
            n_tokens,
            row_tile,
            tok_tile,
            n_row_tiles: n_rows.div_ceil(row_tile),
            n_tok_tiles,
        }
    }
}

/// The output of a product, shared by its panel tasks, which write disjoint elements of it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the pointer is only written through by tasks whose elements are disjoint (see `run`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The element `i` places on (a method, so that closures capture the whole `SendPtr`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Run `dot` over every (row, token) pair of the product, in parallel tiles.
///
/// # Safety contract (upheld by the callers in this module)
/// `dot` may be called: the CPU has its ISA, and `w` holds `n_rows` rows of `row_bytes`, each of
/// exactly `per_tok` blocks; `acts` holds `n_tokens` rows of `per_tok` blocks.
#[allow(clippy::too_many_arguments)]
fn run<A: Sync>(
    dot: Dot<A>,
    fast: Fast<A>,
    w: &[u8],
    row_bytes: usize,
    acts: &[A],
    per_tok: usize,
    g: Geometry,
    out: &mut [f32],
    tiles: &mut Vec<f32>,
) {
    let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
    let act = |t: usize| &acts[t * per_tok..(t + 1) * per_tok];
    let Fast { dot4, rows, panel } = fast;
    if g.n_tokens == 1 {
        let a = act(0);
        out.par_chunks_mut(g.row_tile)
            .enumerate()
            .for_each(|(ri, o)| {
                let r0 = ri * g.row_tile;
                if let Some(rows) = rows {
                    let ws = &w[r0 * row_bytes..(r0 + o.len()) * row_bytes];
                    let stride = o.len();
                    // SAFETY: see the contract above; `ws` is `o.len()` whole weight rows and
                    // `a` a whole activation row, and `select_vnni` checked the CPU has VNNI.
                    unsafe { rows(ws, row_bytes, &[a], o, stride) };
                    return;
                }
                for (k, v) in o.iter_mut().enumerate() {
                    // SAFETY: see the contract above; `row` and `act` are whole rows.
                    *v = unsafe { dot(row(r0 + k), a) };
                }
            });
        return;
    }
    let n_tasks = g.n_tok_tiles * g.n_row_tiles;
    if let Some(panel) = panel.filter(|_| g.n_tokens > SMALL_BATCH) {
        // Each task writes its block of `out` in place: no tile buffers to zero and copy.
        let out_ptr = SendPtr(out.as_mut_ptr());
        (0..n_tasks).into_par_iter().for_each(|task| {
            let (ti, ri) = (task / g.n_row_tiles, task % g.n_row_tiles);
            let (r0, t0) = (ri * g.row_tile, ti * g.tok_tile);
            let r1 = (r0 + g.row_tile).min(g.n_rows);
            let t1 = (t0 + g.tok_tile).min(g.n_tokens);
            let ws = &w[r0 * row_bytes..r1 * row_bytes];
            let ys = &acts[t0 * per_tok..t1 * per_tok];
            // SAFETY: see the contract above; `ws` is whole weight rows and `ys` whole
            // activation rows, `select_vnni` checked the CPU has VNNI, and the task writes only
            // the elements (t, r) of `out` (`n_tokens × n_rows`, checked by the caller) with t in
            // [t0, t1) and r in [r0, r1), which no other task writes.
            unsafe {
                panel(
                    ws,
                    row_bytes,
                    ys,
                    per_tok,
                    out_ptr.at(t0 * g.n_rows + r0),
                    g.n_rows,
                )
            };
        });
        return;
    }
    // Each task fills its own `tok_tile × row_tile` tile; the tiles are then copied into `out`.
    let chunk = g.tok_tile * g.row_tile;
    tiles.clear();
    tiles.resize(n_tasks * chunk, 0.0);
    tiles
        .par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(task, buf)| {
            let (ti, ri) = (task / g.n_row_tiles, task % g.n_row_tiles);
            let (r0, t0) = (ri * g.row_tile, ti * g.tok_tile);
            let r1 = (r0 + g.row_tile).min(g.n_rows);
            let t1 = (t0 + g.tok_tile).min(g.n_tokens);
            // A small batch (a verify, a few sequences) goes through the Rows kernel, if there
            // is one, which streams the weights once per eight tokens, row after row; otherwise
            // tokens go through the four-row and one-row kernels.
            if let Some(rows) = rows {
                let ws = &w[r0 * row_bytes..r1 * row_bytes];
                let mut t = t0;
                while t < t1 {
                    let c = (t1 - t).min(ROWS_MAX_TOKENS);
                    let mut ys = [act(t); ROWS_MAX_TOKENS];
                    for (k, y) in ys.iter_mut().enumerate().take(c) {
                        *y = act(t + k);
                    }
                    let o = &mut buf[(t - t0) * g.row_tile..];
                    // SAFETY: see the contract above; `ws` is whole weight rows and each of
                    // `ys` a whole activation row, and `select_vnni` checked the CPU has VNNI.
                    unsafe { rows(ws, row_bytes, &ys[..c], o, g.row_tile) };
                    t += c;
                }
                return;
            }
            for r in r0..r1 {
                let wr = row(r);
                let mut t = t0;
                if let Some(dot4) = dot4 {
                    while t + 4 <= t1 {
                        let a4 = [act(t), act(t + 1), act(t + 2), act(t + 3)];
                        // SAFETY: see the contract above; `wr` and each `act` are whole rows.
                        let v = unsafe { dot4(wr, &a4) };
                        for (k, v) in v.into_iter().enumerate() {
                            buf[(t + k - t0) * g.row_tile + (r - r0)] = v;
                        }
                        t += 4;
                    }
                }
                for t in t..t1 {
                    // SAFETY: see the contract above; `wr` and `act(t)` are whole rows.
                    buf[(t - t0) * g.row_tile + (r - r0)] = unsafe { dot(wr, act(t)) };
                }
            }
        });
    let tiles = &tiles[..];
    out.par_chunks_mut(g.n_rows).enumerate().for_each(|(t, o)| {
        let (ti, tt) = (t / g.tok_tile, t % g.tok_tile);
        for ri in 0..g.n_row_tiles {
            let r0 = ri * g.row_tile;
            let len = g.row_tile.min(g.n_rows - r0);
            let src = (ti * g.n_row_tiles + ri) * chunk + tt * g.row_tile;
            o[r0..r0 + len].copy_from_slice(&tiles[src..src + len]);
        }
    });
}
