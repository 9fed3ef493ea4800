//! The backend-ops suite (llama.cpp's `test-backend-ops` pattern): every op of the [`Backend`]
//! trait, every weight type, odd and edge shapes — one row, rows and tokens not a multiple of
//! the kernels' tiles, one block and many blocks per row, empty inputs, window 0, tree masks,
//! long cell counts, more than 65535 tokens, a 262144-row output head — run on the backend under
//! test and on the CPU backend (best ISA), compared under a bound stated per op ([`bound`]).
//!
//! Every test body is generic over `B: Backend`; [`backend_ops_tests!`] instantiates them for
//! one device:
//!
//! - `emu`: the CUDA backend on the CUDA emulator (kernels/cuda/emu), on every machine;
//! - `gpu`: the CUDA backend on a real GPU, device 0 (the `gpu` nextest profile only; each test
//!   fails without one);
//! - `cpu_scalar`: the CPU backend with the scalar kernels, against the best ISA.
//!
//! [`cuda_tests!`] adds what only the CUDA backend has (device argmax and sampling, the
//! shared-memory bound on the head width). An integration test: it drives the backends through
//! the engine's public API only.

use std::borrow::Cow;
use std::fmt::Display;

use kernels::quant::GgmlType;

use engine::model::Model;
use engine::runtime::cuda::backend::{CudaBackend, GEMM_MIN_TOKENS};
use engine::runtime::params::{Activation, Gating, MoeConfig, RopeConfig, RopeStyle, Yarn};
use engine::runtime::sampling::{self, Rng, Sampler, SamplerConfig};
use engine::runtime::CpuBackend;
use engine::runtime::{
    AttnMeta, Backend, CellMeta, DeviceCounters, KvDtype, KvSource, Mask, QueryMeta, RuntimeError,
    Strided, WeightData,
};

/// NMSE bounds, Σ(a−b)²/Σb² of the backend under test (a) against the CPU backend (b), one per
/// op. Each is set from the smallest bug it must catch (the number in its comment), never from
/// what the kernels measure today; the measured agreement of correct kernels (the emulated CUDA
/// backend on this machine, see the commit) sits orders of magnitude below each.
pub(crate) mod bound {
    /// Quantized and float products (`matmul`, `matmul_experts`). Both backends round the
    /// activations to the weight type's `vec_dot_type` the same way (Q8_0/Q8_1 blocks, Q8_K
    /// blocks, f16, bf16) and sum in f32 in another order (measured ≤ 5e-12 on the
    /// matrix-vector path); the CUDA prefill GEMM also rounds dequantized weights to f16
    /// (measured ≤ 4e-8). The bug it must catch: the scale of one 32-value block of one row of
    /// 37 off by 1/16 (the size of the `wrong-dequant-scale` fault), on rows of 8 blocks: NMSE
    /// ≈ (1/16)²·(1/8)/37 ≈ 1.3e-5; the suite plants exactly that on the CPU result of every
    /// type, block by block, and checks that the bound sees the median
    /// ([`planted_block_scale_nmse`]).
    pub const MATMUL: f64 = 1e-6;
    /// Dequantized rows (`embed`) and `kv_read_k` of f16 cells: the same f32 arithmetic on both
    /// sides, up to one fused multiply-add rounding (≤ 1 ulp: NMSE ≤ 2⁻⁴⁶ ≈ 1.4e-14). Anything
    /// past rounding is a bug: one wrong value in 29 × 512 already gives ~7e-5.
    pub const DEQUANT: f64 = 1e-12;
    /// `rms_norm`: the mean of squares in f64 on both sides, then the same f32 products (a few
    /// ulp). The bug it must catch: eps added after the square root, or 1e-5 for 1e-6 — visible
    /// only on rows of small values, which the inputs include (a row of scale 1e-3, where eps is
    /// 1/1000 of the mean square: NMSE ≈ 1e-7 over the whole buffer).
    pub const RMS_NORM: f64 = 1e-9;
    /// `rope`: the CPU steps θ by repeated products, the CUDA kernel takes `powf` (angles of
    /// ~4000 rad differ by ~1e-4 rad: NMSE ≈ 1e-8 at position 4095). The bug it must catch: a
    /// position off by one changes every angle by θᵢ (≥ 1e-4 rad for the slowest pair at
    /// head width 80), NMSE ≥ 1e-5 on the slowest pairs alone and ~1 overall; a swapped pair
    /// convention (normal vs NeoX) ~1.
    pub const ROPE: f64 = 1e-6;
    /// Elementwise transcendental ops (`gated_act`, `softcap`): `expf`/`tanhf` within 2 ulp of
    /// Rust's (NMSE ~1e-14). The bug: the wrong activation or the tanh form of GELU for the
    /// exact one (~1e-6 relative at the smallest), a missing cap (~1).
    pub const ELEMENTWISE: f64 = 1e-10;
    /// `route`'s gate weights and `moe_combine`: the same f32 formulas (softmax sum in f64) in
    /// the same order, a few ulp. The bug: normalization skipped (~1e-1), another expert's gate
    /// (~1e-2).
    pub const MOE: f64 = 1e-10;
    /// `attention`: scores summed in another order (~1e-7 relative), the online softmax's
    /// rescaling (a few ulp): NMSE ~1e-13. The bug it must catch: one cell leaked through the
    /// mask (or one visible cell lost) among the ~1000 a long-context query sees, weight ~1e-3,
    /// NMSE ≈ 1e-6; one among ten: ~1e-2.
    pub const ATTENTION: f64 = 1e-9;
}

fn cpu() -> CpuBackend {
    CpuBackend::new(None, Some(2)).unwrap_or_else(|e| panic!("{e}"))
}

fn ok<T>(r: Result<T, RuntimeError>, what: impl Display) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Roughly normal values (sum of four uniforms), deterministic per seed.
fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| ((0..4).map(|_| r.next_f64()).sum::<f64>() - 2.0) as f32 * 1.7)
        .collect()
}

fn up<B: Backend>(b: &B, x: &[f32]) -> B::Buf {
    ok(b.upload(x), format_args!("{} upload", b.name()))
}

fn down<B: Backend>(b: &B, x: &B::Buf) -> Vec<f32> {
    let mut v = Vec::new();
    ok(b.download(x, &mut v), format_args!("{} download", b.name()));
    v
}

fn up_ids<B: Backend>(b: &B, x: &[u32]) -> B::Ids {
    ok(b.upload_ids(x), format_args!("{} upload_ids", b.name()))
}

fn down_ids<B: Backend>(b: &B, x: &B::Ids) -> Vec<u32> {
    let mut v = Vec::new();
    ok(
        b.download_ids(x, &mut v),
        format_args!("{} download_ids", b.name()),
    );
    v
}

fn zeros<B: Backend>(b: &B, n: usize) -> B::Buf {
    ok(b.alloc(n), format_args!("{} alloc", b.name()))
}

/// Σ(a−b)²/Σb² (0 when both are all zeros; infinite on a NaN or a length mismatch).
fn nmse(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    if num == 0.0 {
        return 0.0;
    }
    if num.is_nan() {
        return f64::INFINITY;
    }
    num / den.max(1e-30)
}

#[track_caller]
fn check(what: impl Display, got: &[f32], want: &[f32], bound: f64) {
    let e = nmse(got, want);
    // The measured agreement, for `--no-capture` runs (how far under its bound each op is).
    println!("{what}: NMSE {e:.3e} (bound {bound:e})");
    assert!(
        e <= bound,
        "{what}: NMSE {e:.3e} > {bound:e} (lengths {} and {})",
        got.len(),
        want.len()
    );
}

#[track_caller]
fn check_exact(what: impl Display, got: &[f32], want: &[f32]) {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
    assert!(
        same,
        "{what}: not bit-identical (NMSE {:.3e})",
        nmse(got, want)
    );
}

fn weight(ty: GgmlType, n_rows: usize, k: usize, seed: u64) -> Vec<u8> {
    kernels::quant::quantize(ty, &randn(n_rows * k, seed)).unwrap_or_else(|e| panic!("{ty:?}: {e}"))
}

fn wd(ty: GgmlType, k: usize, n_rows: usize, n_mats: usize, data: &[u8]) -> WeightData<'_> {
    WeightData {
        name: format!("w.{}", ty.name()),
        ty,
        k_dim: k,
        n_rows,
        n_mats,
        data: Cow::Borrowed(data),
    }
}

/// The NMSE a wrong scale (× 17/16) on block `block` (32 values) of row `row` would give
/// against the correct `out` (`[n_tok, n_rows]`), computed from the dequantized weights `w`
/// (`[n_rows, k]`) and the activations `x` — the smallest product bug [`bound::MATMUL`] is
/// there to catch.
fn planted_block_scale_nmse(
    w: &[f32],
    x: &[f32],
    out: &[f32],
    (n_rows, k, n_tok): (usize, usize, usize),
    (row, block): (usize, usize),
) -> f64 {
    let mut planted = out.to_vec();
    for t in 0..n_tok {
        let part: f64 = (block * 32..(block + 1) * 32)
            .map(|i| f64::from(w[row * k + i]) * f64::from(x[t * k + i]))
            .sum();
        planted[t * n_rows + row] += (part / 16.0) as f32;
    }
    nmse(&planted, out)
}

/// Every weight type the backend prepares (`prepare` says which it refuses; the CPU twin has
/// them all).
fn types_of<B: Backend>(g: &B) -> Vec<GgmlType> {
    GgmlType::SUPPORTED
        .iter()
        .copied()
        .filter(|&ty| {
            let bytes = weight(ty, 1, ty.block_size().max(32), 1);
            let prepared = g.prepare(wd(ty, ty.block_size().max(32), 1, 1, &bytes));
            prepared.is_ok()
        })
        .collect()
}

pub(crate) fn matmul_every_weight_type_and_shape<B: Backend>(g: &B) {
    let c = cpu();
    let types = types_of(g);
    assert!(types.len() >= 15, "{}: only {types:?}", g.name());
    for ty in types {
        let bs = ty.block_size().max(32);
        // One row of one block; 37 rows (not a multiple of the 4 rows per mmv block nor of the
        // GEMM's 32-row tile) of 256 values (8 chunks: the shape the bound is calibrated on) and
        // of 37 chunks of 32 (more than a warp's 32 lanes: lanes 0–4 take two, a partial second
        // round) or 5 super-blocks (40 chunks).
        let k_long = if bs == 256 { 5 * 256 } else { 37 * 32 };
        for (n_rows, k) in [(1, bs), (37, 256), (37, k_long)] {
            let bytes = weight(ty, n_rows, k, ty.id() as u64 + k as u64);
            let wg = ok(g.prepare(wd(ty, k, n_rows, 1, &bytes)), ty.name());
            let wc = ok(c.prepare(wd(ty, k, n_rows, 1, &bytes)), ty.name());
            // One token, a few, exactly the GEMM switch, and a partial last 32-token tile.
            for n_tok in [1, 3, GEMM_MIN_TOKENS, 33] {
                let x = randn(n_tok * k, 7 + n_tok as u64);
                let mut og = zeros(g, n_tok * n_rows);
                ok(
                    g.matmul(&wg, &up(g, &x), n_tok, &mut og),
                    format_args!("{ty:?} matmul"),
                );
                let mut oc = vec![0f32; n_tok * n_rows];
                ok(c.matmul(&wc, &x, n_tok, &mut oc), "cpu matmul");
                let what = format_args!("{ty:?} {n_rows}×{k}, {n_tok} tokens");
                check(what, &down(g, &og), &oc, bound::MATMUL);
                if (n_rows, k, n_tok) == (37, 256, 3) {
                    // The bound sees the smallest bug it is for.
                    let mut wf = vec![0f32; n_rows * k];
                    kernels::quant::dequantize(ty, &bytes, &mut wf)
                        .unwrap_or_else(|e| panic!("{ty:?}: {e}"));
                    // Planted in each block of the middle row in turn: the median is
                    // what a wrong scale in a typical block gives (a block of tiny weights
                    // hides any scale).
                    let mut planted: Vec<f64> = (0..k / 32)
                        .map(|b| {
                            planted_block_scale_nmse(
                                &wf,
                                &x,
                                &oc,
                                (n_rows, k, n_tok),
                                (n_rows / 2, b),
                            )
                        })
                        .collect();
                    planted.sort_by(f64::total_cmp);
                    let p = planted[planted.len() / 2];
                    println!("{what}: planted one-block scale error (median over the row's blocks): NMSE {p:.3e}");
                    assert!(
                        p > bound::MATMUL,
                        "{what}: a 1/16 scale error in a typical block gives NMSE {p:.3e}, \
                         under the bound {:e}",
                        bound::MATMUL
                    );
                }
            }
        }
    }
}

/// F32 and BF16 weights keep their range and precision on every path, prefill included:
/// values past f16's largest (65504) and below its smallest normal (6.1e-5), which a product
/// through f16 weights would turn into infinities and zeros.
pub(crate) fn float_weights_keep_their_range_in_prefill<B: Backend>(g: &B) {
    let c = cpu();
    let (n_rows, k) = (5, 64);
    let mut w = randn(n_rows * k, 51);
    for (i, v) in w.iter_mut().enumerate() {
        *v *= match i % 3 {
            0 => 1e6,  // up to ~5e6: past f16's 65504
            1 => 1e-7, // below f16's normal range (and most of its subnormals)
            _ => 1.0,
        };
    }
    for ty in [GgmlType::F32, GgmlType::BF16] {
        let bytes = kernels::quant::quantize(ty, &w).unwrap_or_else(|e| panic!("{ty:?}: {e}"));
        let wg = ok(g.prepare(wd(ty, k, n_rows, 1, &bytes)), ty.name());
        let wc = ok(c.prepare(wd(ty, k, n_rows, 1, &bytes)), ty.name());
        for n_tok in [1, GEMM_MIN_TOKENS + 1] {
            let x = randn(n_tok * k, 52);
            let mut og = zeros(g, n_tok * n_rows);
            ok(g.matmul(&wg, &up(g, &x), n_tok, &mut og), ty.name());
            let mut oc = vec![0f32; n_tok * n_rows];
            ok(c.matmul(&wc, &x, n_tok, &mut oc), "cpu");
            let og = down(g, &og);
            assert!(
                og.iter().all(|v| v.is_finite()),
                "{ty:?}, {n_tok} tokens: non-finite outputs"
            );
            check(
                format_args!("{ty:?} large-range weights, {n_tok} tokens"),
                &og,
                &oc,
                bound::MATMUL,
            );
        }
    }
}

/// The Gemma 3 output head's shape: 262144 rows (65536 blocks of the matrix-vector kernel), one
/// token, and the argmax of the logits.
pub(crate) fn output_head_of_262144_rows<B: Backend>(g: &B) {
    let c = cpu();
    let (n_rows, k, ty) = (262_144, 256, GgmlType::Q8_0);
    let bytes = weight(ty, n_rows, k, 61);
    let wg = ok(g.prepare(wd(ty, k, n_rows, 1, &bytes)), "head");
    let wc = ok(c.prepare(wd(ty, k, n_rows, 1, &bytes)), "head");
    let x = randn(k, 62);
    let mut og = zeros(g, n_rows);
    ok(g.matmul(&wg, &up(g, &x), 1, &mut og), "head matmul");
    let mut oc = vec![0f32; n_rows];
    ok(c.matmul(&wc, &x, 1, &mut oc), "cpu head");
    let og = down(g, &og);
    check("262144-row head", &og, &oc, bound::MATMUL);
    // A wrong row order or a lost last block of rows shows at the ends, whatever the NMSE.
    for r in [0, 1, n_rows / 2, n_rows - 1] {
        assert!(
            (og[r] - oc[r]).abs() <= 1e-3 * (1.0 + oc[r].abs()),
            "row {r}: {} vs {}",
            og[r],
            oc[r]
        );
    }
}

pub(crate) fn expert_products_and_routing<B: Backend>(g: &B) {
    let c = cpu();
    let (ne, k, n_rows, kd, n_tok) = (12, 3, 21, 256, 5);
    let moe = MoeConfig {
        n_expert: ne,
        n_expert_used: k,
        n_expert_shared: 0,
        n_ff_exp: n_rows,
        n_dense_lead: 0,
        weights_scale: 1.5,
        weights_norm: true,
        gating: Gating::Softmax,
    };
    for gating in [Gating::Softmax, Gating::Sigmoid] {
        let moe = MoeConfig { gating, ..moe };
        let mut logits = randn(n_tok * ne, 3);
        logits[ne + 2] = logits[ne + 5]; // a tie: the lower id first
        let bias = randn(ne, 4);
        let (mut ig, mut wg) = (up_ids(g, &vec![0; n_tok * k]), zeros(g, n_tok * k));
        let bg = up(g, &bias);
        ok(
            g.route(&up(g, &logits), Some(&bg), &moe, n_tok, &mut ig, &mut wg),
            "route",
        );
        let (mut ic, mut wc) = (vec![0u32; n_tok * k], vec![0f32; n_tok * k]);
        ok(
            c.route(&logits, Some(&bias), &moe, n_tok, &mut ic, &mut wc),
            "cpu route",
        );
        // The trait's download_ids (expert-parallel ranks remap ids with it).
        assert_eq!(down_ids(g, &ig), ic, "{gating:?}: expert ids");
        check(
            format_args!("{gating:?} gate weights"),
            &down(g, &wg),
            &wc,
            bound::MOE,
        );

        for ty in [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F16] {
            let bytes = weight(ty, ne * n_rows, kd, 9);
            let wgm = ok(g.prepare(wd(ty, kd, n_rows, ne, &bytes)), "experts");
            let wcm = ok(c.prepare(wd(ty, kd, n_rows, ne, &bytes)), "experts");
            for per_slot in [false, true] {
                let nx = if per_slot { n_tok * k } else { n_tok };
                let x = randn(nx * kd, 11);
                let mut og = zeros(g, n_tok * k * n_rows);
                ok(
                    g.matmul_experts(&wgm, &up(g, &x), per_slot, &ig, n_tok, k, &mut og),
                    "matmul_experts",
                );
                let mut oc = vec![0f32; n_tok * k * n_rows];
                ok(
                    c.matmul_experts(&wcm, &x, per_slot, &ic, n_tok, k, &mut oc),
                    "cpu matmul_experts",
                );
                check(
                    format_args!("{ty:?} experts, per_slot {per_slot}"),
                    &down(g, &og),
                    &oc,
                    bound::MATMUL,
                );
                let mut cg = zeros(g, n_tok * n_rows);
                ok(
                    g.moe_combine(&up(g, &oc), &wg, n_tok, k, &mut cg),
                    "moe_combine",
                );
                let mut cc = vec![0f32; n_tok * n_rows];
                ok(c.moe_combine(&oc, &wc, n_tok, k, &mut cc), "cpu combine");
                check("moe_combine", &down(g, &cg), &cc, bound::MOE);
            }
        }
    }
    // 256 experts, 8 used (DeepSeek V3's shape), sigmoid with a bias.
    let moe = MoeConfig {
        n_expert: 256,
        n_expert_used: 8,
        gating: Gating::Sigmoid,
        ..moe
    };
    let logits = randn(3 * 256, 13);
    let bias = randn(256, 14);
    let (mut ig, mut wg) = (up_ids(g, &[0; 24]), zeros(g, 24));
    let bg = up(g, &bias);
    ok(
        g.route(&up(g, &logits), Some(&bg), &moe, 3, &mut ig, &mut wg),
        "route 256",
    );
    let (mut ic, mut wc) = (vec![0u32; 24], vec![0f32; 24]);
    ok(
        c.route(&logits, Some(&bias), &moe, 3, &mut ic, &mut wc),
        "cpu",
    );
    assert_eq!(down_ids(g, &ig), ic, "256 experts: ids");
    check("256 experts: weights", &down(g, &wg), &wc, bound::MOE);
}

/// `download_ids` of the trait (expert-parallel tensor-parallel ranks read routed ids back with
/// it): what was uploaded comes back, empty included.
pub(crate) fn ids_round_trip<B: Backend>(g: &B) {
    for ids in [vec![], vec![7u32], (0..1000).rev().collect::<Vec<u32>>()] {
        assert_eq!(down_ids(g, &up_ids(g, &ids)), ids);
    }
}

pub(crate) fn embedding_rows_of_every_type<B: Backend>(g: &B) {
    let c = cpu();
    let (n_vocab, k) = (29, 512);
    let tokens = [0u32, 28, 5, 5, 17];
    for ty in types_of(g) {
        let bytes = weight(ty, n_vocab, k, 100 + ty.id() as u64);
        let wg = ok(g.prepare(wd(ty, k, n_vocab, 1, &bytes)), ty.name());
        let wc = ok(c.prepare(wd(ty, k, n_vocab, 1, &bytes)), ty.name());
        let mut og = zeros(g, tokens.len() * k);
        ok(
            g.embed(&wg, &up_ids(g, &tokens), tokens.len(), &mut og),
            "embed",
        );
        let mut oc = vec![0f32; tokens.len() * k];
        ok(
            c.embed(&wc, &tokens.to_vec(), tokens.len(), &mut oc),
            "cpu embed",
        );
        check(
            format_args!("{ty:?} embed"),
            &down(g, &og),
            &oc,
            bound::DEQUANT,
        );
    }
}

pub(crate) fn norms_rope_and_activations<B: Backend>(g: &B) {
    let c = cpu();
    let (n_tok, heads, hd) = (5, 3, 80);
    let mut x = randn(n_tok * heads * hd, 21);
    // One row of small values, where eps matters.
    x[..hd].iter_mut().for_each(|v| *v *= 1e-3);
    let w = randn(hd, 22);
    let mut og = zeros(g, x.len());
    ok(
        g.rms_norm(&up(g, &x), &up(g, &w), 1e-6, &mut og),
        "rms_norm",
    );
    let mut oc = vec![0f32; x.len()];
    ok(c.rms_norm(&x, &w, 1e-6, &mut oc), "cpu rms_norm");
    check("rms_norm", &down(g, &og), &oc, bound::RMS_NORM);
    let mut xg = up(g, &x);
    ok(g.rms_norm_inplace(&mut xg, &up(g, &w), 1e-6), "in place");
    check("rms_norm in place", &down(g, &xg), &oc, bound::RMS_NORM);
    // One row of one value, and rows wider than a block of threads (1000 > 256).
    for width in [1, 1000] {
        let x = randn(3 * width, 24);
        let w = randn(width, 25);
        let mut og = zeros(g, x.len());
        ok(
            g.rms_norm(&up(g, &x), &up(g, &w), 1e-5, &mut og),
            "rms_norm",
        );
        let mut oc = vec![0f32; x.len()];
        ok(c.rms_norm(&x, &w, 1e-5, &mut oc), "cpu");
        check(
            format_args!("rms_norm width {width}"),
            &down(g, &og),
            &oc,
            bound::RMS_NORM,
        );
    }

    // RoPE: normal, NeoX, partial rotation, YaRN; positions far apart.
    let positions = [0u32, 1, 7, 513, 4095];
    let yarn = Yarn {
        n_ctx_orig: 4096,
        ext_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attn_factor: 1.0,
    };
    for (style, n_rot, yarn, scale) in [
        (RopeStyle::Normal, hd, None, 1.0),
        (RopeStyle::Neox, hd, None, 1.0),
        (RopeStyle::Neox, 32, None, 1.0),
        (RopeStyle::Normal, 0, None, 1.0),
        (RopeStyle::Normal, hd, Some(yarn), 0.25),
    ] {
        let cfg = RopeConfig {
            style,
            n_rot,
            freq_base: 10_000.0,
            freq_scale: scale,
            yarn,
        };
        let mut xg = up(g, &x);
        ok(g.rope(&mut xg, heads, hd, &positions, &cfg), "rope");
        let mut xc = x.clone();
        ok(c.rope(&mut xc, heads, hd, &positions, &cfg), "cpu rope");
        check(
            format_args!("rope {style:?} n_rot {n_rot} yarn {}", yarn.is_some()),
            &down(g, &xg),
            &xc,
            bound::ROPE,
        );
    }

    let u = randn(x.len(), 23);
    for act in [Activation::Silu, Activation::GeluTanh] {
        let mut gg = up(g, &x);
        ok(g.gated_act(act, &mut gg, &up(g, &u)), "gated_act");
        let mut gc = x.clone();
        ok(c.gated_act(act, &mut gc, &u), "cpu");
        check(
            format_args!("{act:?}"),
            &down(g, &gg),
            &gc,
            bound::ELEMENTWISE,
        );
    }
    let mut sg = up(g, &x);
    ok(g.softcap(&mut sg, 3.0), "softcap");
    let mut sc = x.clone();
    ok(c.softcap(&mut sc, 3.0), "cpu");
    check("softcap", &down(g, &sg), &sc, bound::ELEMENTWISE);
}

/// The exact ops (no arithmetic but one f32 add or multiply per value): bit-identical.
pub(crate) fn data_movement_is_exact<B: Backend>(g: &B) {
    let c = cpu();
    let (n_tok, heads, hd) = (5, 3, 80);
    let x = randn(n_tok * heads * hd, 21);
    let u = randn(x.len(), 23);
    let w = randn(hd, 22);
    let mut ag = up(g, &x);
    ok(g.add(&mut ag, &up(g, &u)), "add");
    ok(g.add_row(&mut ag, &up(g, &w)), "add_row");
    ok(g.scale(&mut ag, 0.5), "scale");
    ok(g.fill(&mut ag, 3, 17, -2.0), "fill");
    let mut ac = x.clone();
    ok(c.add(&mut ac, &u), "cpu");
    ok(c.add_row(&mut ac, &w), "cpu");
    ok(c.scale(&mut ac, 0.5), "cpu");
    ok(c.fill(&mut ac, 3, 17, -2.0), "cpu");
    check_exact("add/add_row/scale/fill", &down(g, &ag), &ac);
    let mut cg = zeros(g, x.len());
    ok(g.copy(&up(g, &x), &mut cg), "copy");
    check_exact("copy", &down(g, &cg), &x);
    assert_eq!(g.buf_len(&cg), x.len());

    // copy_strided: a broadcast (group stride 0), a head slice, and a scatter back.
    for (s, d, rows, groups, len, dst_len) in [
        (
            Strided::new(hd * heads, 0, 8),
            Strided::new(heads * 16, 16, 0),
            n_tok,
            heads,
            16,
            n_tok * heads * 16,
        ),
        (
            Strided::new(hd * heads, hd, 5),
            Strided::new(heads * 7, 7, 0),
            n_tok,
            heads,
            7,
            n_tok * heads * 7,
        ),
        (Strided::new(1, 0, 0), Strided::new(3, 1, 0), 1, 1, 1, 3),
    ] {
        let mut dg = zeros(g, dst_len);
        ok(
            g.copy_strided(&up(g, &x), s, &mut dg, d, rows, groups, len),
            "copy_strided",
        );
        let mut dc = vec![0f32; dst_len];
        ok(
            c.copy_strided(&x, s, &mut dc, d, rows, groups, len),
            "cpu copy_strided",
        );
        check_exact(
            format_args!("copy_strided {s:?} → {d:?}"),
            &down(g, &dg),
            &dc,
        );
    }
    let rows = [4u32, 0, 4];
    let mut rg = zeros(g, rows.len() * hd);
    ok(g.gather_rows(&up(g, &x), hd, &rows, &mut rg), "gather_rows");
    let mut rc = vec![0f32; rows.len() * hd];
    ok(c.gather_rows(&x, hd, &rows, &mut rc), "cpu gather_rows");
    check_exact("gather_rows", &down(g, &rg), &rc);
}

/// Every op on empty shapes: no launch (a GPU and the emulator refuse an empty grid), an empty
/// or all-zero result equal to the CPU's, no error.
pub(crate) fn empty_shapes<B: Backend>(g: &B) {
    let c = cpu();
    let e: &[f32] = &[];
    assert_eq!(down(g, &up(g, e)), e);
    assert_eq!(down(g, &zeros(g, 0)), e);

    // Products: no tokens; a matrix of no rows; rows of no values (the sum over nothing, 0);
    // on both sides of the GEMM switch.
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F16, GgmlType::F32] {
        let bs = ty.block_size().max(32);
        for (n_rows, k, n_tok) in [
            (4, bs, 0),
            (0, bs, 3),
            (0, bs, GEMM_MIN_TOKENS),
            (4, 0, 3),
            (4, 0, GEMM_MIN_TOKENS),
            (0, 0, 0),
        ] {
            let what = format!("{ty:?} {n_rows}×{k}, {n_tok} tokens");
            let bytes = weight(ty, n_rows, k, 3);
            let wg = ok(g.prepare(wd(ty, k, n_rows, 1, &bytes)), &what);
            let x = randn(n_tok * k, 4);
            // Sums over no values are 0; no rows or no tokens: nothing to write.
            let want = vec![if k == 0 { 0.0 } else { f32::NAN }; n_tok * n_rows];
            let mut og = up(g, &vec![f32::NAN; n_tok * n_rows]);
            ok(
                g.matmul(&wg, &up(g, &x), n_tok, &mut og),
                format_args!("matmul {what}"),
            );
            check_exact(format_args!("matmul {what}"), &down(g, &og), &want);
            let ids = up_ids(g, &vec![0; n_tok]);
            let mut og = up(g, &vec![f32::NAN; n_tok * n_rows]);
            ok(
                g.matmul_experts(&wg, &up(g, &x), false, &ids, n_tok, 1, &mut og),
                format_args!("matmul_experts {what}"),
            );
            check_exact(format_args!("matmul_experts {what}"), &down(g, &og), &want);
            if n_rows > 0 {
                let toks = vec![0u32; n_tok];
                let mut og = zeros(g, n_tok * k);
                ok(
                    g.embed(&wg, &up_ids(g, &toks), n_tok, &mut og),
                    format_args!("embed {what}"),
                );
                assert_eq!(down(g, &og).len(), n_tok * k);
            }
        }
    }

    // Norms, RoPE, elementwise ops on no rows.
    let w = randn(4, 1);
    let mut o = zeros(g, 0);
    ok(g.rms_norm(&up(g, e), &up(g, &w), 1e-6, &mut o), "rms_norm");
    let mut x = up(g, e);
    ok(
        g.rms_norm_inplace(&mut x, &up(g, &w), 1e-6),
        "rms_norm_inplace",
    );
    let rope = RopeConfig {
        style: RopeStyle::Normal,
        n_rot: 4,
        freq_base: 10_000.0,
        freq_scale: 1.0,
        yarn: None,
    };
    ok(g.rope(&mut x, 2, 4, &[], &rope), "rope, no tokens");
    ok(g.rope(&mut x, 0, 4, &[3, 4], &rope), "rope, no heads");
    ok(
        g.gated_act(Activation::Silu, &mut x, &up(g, e)),
        "gated_act",
    );
    ok(g.softcap(&mut x, 2.0), "softcap");
    ok(g.add(&mut x, &up(g, e)), "add");
    ok(g.add_row(&mut x, &up(g, &w)), "add_row");
    ok(g.scale(&mut x, 2.0), "scale");
    ok(g.copy(&up(g, e), &mut x), "copy");
    ok(g.fill(&mut x, 0, 0, 1.0), "fill");
    let mut y = up(g, &[1.0, 2.0]);
    ok(g.fill(&mut y, 2, 0, 9.0), "fill of nothing at the end");
    ok(
        g.copy_strided(
            &up(g, e),
            Strided::new(4, 0, 0),
            &mut y,
            Strided::new(2, 0, 0),
            0,
            1,
            2,
        ),
        "copy_strided, no rows",
    );
    ok(
        g.copy_strided(
            &up(g, e),
            Strided::new(4, 0, 0),
            &mut y,
            Strided::new(2, 0, 0),
            1,
            1,
            0,
        ),
        "copy_strided, no values",
    );
    check_exact("untouched", &down(g, &y), &[1.0, 2.0]);
    ok(g.gather_rows(&up(g, &w), 4, &[], &mut o), "gather_rows");

    // Routing and mixing no tokens.
    let moe = MoeConfig {
        n_expert: 8,
        n_expert_used: 2,
        n_expert_shared: 0,
        n_ff_exp: 4,
        n_dense_lead: 0,
        weights_scale: 1.0,
        weights_norm: true,
        gating: Gating::Softmax,
    };
    let (mut ids, mut wts) = (up_ids(g, &[]), zeros(g, 0));
    ok(
        g.route(&up(g, e), None, &moe, 0, &mut ids, &mut wts),
        "route",
    );
    ok(
        g.moe_combine(&up(g, e), &up(g, e), 0, 2, &mut o),
        "moe_combine",
    );
    // No experts: `out` is left as it is (the CPU twin's rule).
    let mut o3 = up(g, &[f32::NAN; 3]);
    ok(
        g.moe_combine(&up(g, e), &up(g, e), 3, 0, &mut o3),
        "moe_combine of no experts",
    );
    let mut o3c = vec![f32::NAN; 3];
    ok(c.moe_combine(&vec![], &vec![], 3, 0, &mut o3c), "cpu");
    check_exact("moe_combine of no experts", &down(g, &o3), &o3c);

    // The cache: no cells written, moved or read; attention of no queries, of no cells, of no
    // heads.
    let mut kv = ok(g.kv_new(4, 4, KvDtype::F16), "kv_new");
    ok(g.kv_reserve(&mut kv, 0), "kv_reserve 0");
    ok(g.kv_write(&mut kv, &[], &up(g, e), &up(g, e)), "kv_write");
    ok(g.kv_move(&mut kv, &[]), "kv_move");
    ok(g.kv_read_k(&kv, 0, &mut o), "kv_read_k");
    let q = randn(2 * 4, 6);
    let queries = [QueryMeta { pos: 0, seq: 0 }, QueryMeta { pos: 1, seq: 0 }];
    let meta = AttnMeta {
        n_head: 1,
        n_head_kv: 1,
        head_dim_k: 4,
        head_dim_v: 4,
        scale: 0.5,
        mask: Mask::CAUSAL,
        queries: &queries,
        cells: &[],
        ancestors: &[],
        anc_words: 0,
    };
    let mut og = up(g, &[f32::NAN; 8]);
    ok(
        g.attention(&up(g, &q), KvSource::Cache(&kv), &meta, &mut og),
        "attention over no cells",
    );
    check_exact("attention over no cells", &down(g, &og), &[0.0; 8]);
    let none = AttnMeta {
        queries: &[],
        ..meta
    };
    ok(
        g.attention(&up(g, e), KvSource::Cache(&kv), &none, &mut o),
        "attention of no queries",
    );
    let headless = AttnMeta { n_head: 0, ..meta };
    ok(
        g.attention(&up(g, e), KvSource::Cache(&kv), &headless, &mut o),
        "attention of no heads",
    );
    assert_eq!(down_ids(g, &up_ids(g, &[])), Vec::<u32>::new());
}

/// Keys, values and metadata of one attention scenario.
struct AttnCase {
    queries: Vec<QueryMeta>,
    cells: Vec<CellMeta>,
    anc: Vec<u64>,
    anc_words: usize,
}

/// A ragged batch of two sequences (one a draft tree) over committed and new cells, and a free
/// cell between them.
fn ragged_batch() -> AttnCase {
    let committed = 9;
    let queries: Vec<QueryMeta> = (0..6)
        .map(|i| QueryMeta {
            pos: if i < 4 { committed as u32 + i } else { 3 + i },
            seq: u32::from(i >= 4),
        })
        .collect();
    let mut cells: Vec<CellMeta> = (0..committed)
        .map(|p| CellMeta {
            pos: p as u32,
            seq: 0,
            batch: CellMeta::COMMITTED,
        })
        .collect();
    cells.push(CellMeta {
        pos: 0,
        seq: CellMeta::FREE,
        batch: CellMeta::COMMITTED,
    });
    for (i, q) in queries.iter().enumerate() {
        cells.push(CellMeta {
            pos: q.pos,
            seq: q.seq,
            batch: i as u32,
        });
    }
    // Tree: tokens 1 and 2 are siblings under 0, 3 under 2; 4 and 5 another sequence's chain.
    AttnCase {
        queries,
        cells,
        anc: vec![0b1, 0b11, 0b101, 0b1101, 0b1_0000, 0b11_0000],
        anc_words: 1,
    }
}

/// Runs attention with `(n_head, n_head_kv, head_dim_k, head_dim_v)` on both backends through a
/// cache of `dtype` (or, with `dtype` None, through f32 key and value buffers, as MLA does) and
/// returns (backend under test, CPU) outputs — or the backend's error, if it refuses the shape.
fn attention_run<B: Backend>(
    g: &B,
    case: &AttnCase,
    mask: Mask,
    dtype: Option<KvDtype>,
    (n_head, n_kv, dk, dv): (usize, usize, usize, usize),
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let c = cpu();
    let n_cells = case.cells.len();
    let n = case.queries.len();
    let k = randn(n_cells * n_kv * dk, 31);
    let v = randn(n_cells * n_kv * dv, 32);
    let q = randn(n * n_head * dk, 33);
    let meta = AttnMeta {
        n_head,
        n_head_kv: n_kv,
        head_dim_k: dk,
        head_dim_v: dv,
        scale: 1.0 / (dk as f32).sqrt(),
        mask,
        queries: &case.queries,
        cells: &case.cells,
        ancestors: if mask.tree { &case.anc } else { &[] },
        anc_words: if mask.tree { case.anc_words } else { 0 },
    };
    let mut og = zeros(g, n * n_head * dv);
    let mut oc = vec![0f32; n * n_head * dv];
    match dtype {
        Some(dtype) => {
            let all: Vec<u32> = (0..n_cells as u32).collect();
            let mut kg = ok(g.kv_new(n_kv * dk, n_kv * dv, dtype), "kv_new");
            ok(g.kv_reserve(&mut kg, n_cells), "kv_reserve");
            ok(
                g.kv_write(&mut kg, &all, &up(g, &k), &up(g, &v)),
                "kv_write",
            );
            let mut kc = ok(c.kv_new(n_kv * dk, n_kv * dv, dtype), "cpu");
            ok(c.kv_reserve(&mut kc, n_cells), "cpu");
            ok(c.kv_write(&mut kc, &all, &k, &v), "cpu");
            g.attention(&up(g, &q), KvSource::Cache(&kg), &meta, &mut og)?;
            ok(
                c.attention(&q, KvSource::Cache(&kc), &meta, &mut oc),
                "cpu attention",
            );
        }
        None => {
            let (kg, vg) = (up(g, &k), up(g, &v));
            g.attention(
                &up(g, &q),
                KvSource::Bufs { k: &kg, v: &vg },
                &meta,
                &mut og,
            )?;
            ok(
                c.attention(&q, KvSource::Bufs { k: &k, v: &v }, &meta, &mut oc),
                "cpu attention",
            );
        }
    }
    Ok((down(g, &og), oc))
}

fn attention_check<B: Backend>(
    g: &B,
    case: &AttnCase,
    mask: Mask,
    dtype: Option<KvDtype>,
    dims: (usize, usize, usize, usize),
) -> Vec<f32> {
    let (og, oc) = ok(
        attention_run(g, case, mask, dtype, dims),
        format_args!("attention {mask:?} {dtype:?} {dims:?}"),
    );
    check(
        format_args!("attention {mask:?} {dtype:?} {dims:?}"),
        &og,
        &oc,
        bound::ATTENTION,
    );
    og
}

const fn mask(causal: bool, window: Option<usize>, tree: bool) -> Mask {
    Mask {
        causal,
        window,
        tree,
    }
}

/// Every mask (causal, sliding windows of 1 and 4, a tree, none), both cache types and f32
/// buffers, grouped-query heads and unequal key and value widths.
pub(crate) fn attention_masks_and_layouts<B: Backend>(g: &B) {
    let case = ragged_batch();
    for m in [
        Mask::CAUSAL,
        mask(true, Some(4), false),
        mask(true, Some(1), false),
        mask(true, None, true),
        mask(true, Some(3), true),
        mask(false, None, false),
    ] {
        for dtype in [Some(KvDtype::F16), Some(KvDtype::F32), None] {
            attention_check(g, &case, m, dtype, (4, 2, 72, 40));
        }
    }
    attention_check(g, &case, Mask::CAUSAL, Some(KvDtype::F16), (8, 1, 64, 64));
    attention_check(g, &case, Mask::CAUSAL, None, (2, 2, 192, 128));
}

/// A window of 0 sees nothing (the CPU rule: distance ≥ 0 is always masked), so every output
/// is 0 — not the query's own cell, which a window of 1 sees.
pub(crate) fn attention_window_zero<B: Backend>(g: &B) {
    let case = ragged_batch();
    for dtype in [Some(KvDtype::F16), None] {
        let og = attention_check(g, &case, mask(true, Some(0), false), dtype, (4, 2, 8, 8));
        assert!(og.iter().all(|&v| v == 0.0), "window 0 saw a cell: {og:?}");
        let og = attention_check(g, &case, mask(true, Some(1), false), dtype, (4, 2, 8, 8));
        assert!(og.iter().any(|&v| v != 0.0), "window 1 saw nothing");
    }
}

/// 1500 cells (a dozen tiles of 128 and a partial one) of three sequences, queries at the end
/// of each, under a causal mask, a 700-cell window and a tree of the batch's own cells.
pub(crate) fn attention_long_cells<B: Backend>(g: &B) {
    let n_cells = 1500u32;
    let mut cells: Vec<CellMeta> = (0..n_cells)
        .map(|j| CellMeta {
            pos: j / 3,
            seq: j % 3,
            batch: CellMeta::COMMITTED,
        })
        .collect();
    let queries: Vec<QueryMeta> = (0..6)
        .map(|i| QueryMeta {
            pos: 500 + i / 3,
            seq: i % 3,
        })
        .collect();
    for (i, q) in queries.iter().enumerate() {
        cells.push(CellMeta {
            pos: q.pos,
            seq: q.seq,
            batch: i as u32,
        });
    }
    let case = AttnCase {
        queries,
        cells,
        anc: (0..6).map(|i| 1u64 << i | 1 << (i % 3)).collect(),
        anc_words: 1,
    };
    for m in [
        Mask::CAUSAL,
        mask(true, Some(700), false),
        mask(true, None, true),
    ] {
        attention_check(g, &case, m, Some(KvDtype::F16), (2, 1, 32, 16));
    }
}

/// More queries than a grid's y dimension holds (65535): 65537 tokens of one sequence, each
/// seeing the four cells of a short prefix and itself.
pub(crate) fn attention_and_rope_past_65535_tokens<B: Backend>(g: &B) {
    let n = 65_537u32;
    let prefix = 4u32;
    let queries: Vec<QueryMeta> = (0..n)
        .map(|i| QueryMeta {
            pos: prefix + i,
            seq: 0,
        })
        .collect();
    let cells: Vec<CellMeta> = (0..prefix)
        .map(|p| CellMeta {
            pos: p,
            seq: 0,
            batch: CellMeta::COMMITTED,
        })
        .collect();
    let case = AttnCase {
        queries,
        cells,
        anc: vec![],
        anc_words: 0,
    };
    // Causal: every query sees the 4 prefix cells.
    attention_check(g, &case, Mask::CAUSAL, None, (1, 1, 4, 4));

    let c = cpu();
    let positions: Vec<u32> = (0..n).collect();
    let x = randn(n as usize * 4, 71);
    let cfg = RopeConfig {
        style: RopeStyle::Neox,
        n_rot: 4,
        freq_base: 10_000.0,
        freq_scale: 1.0,
        yarn: None,
    };
    let mut xg = up(g, &x);
    ok(
        g.rope(&mut xg, 1, 4, &positions, &cfg),
        "rope of 65537 tokens",
    );
    let mut xc = x.clone();
    ok(c.rope(&mut xc, 1, 4, &positions, &cfg), "cpu rope");
    let xg = down(g, &xg);
    check("rope of 65537 tokens", &xg, &xc, bound::ROPE);
    // The last token, the one a grid of 65535 rows of tokens loses, checked on its own.
    let tail = (n as usize - 1) * 4;
    check("rope of token 65536", &xg[tail..], &xc[tail..], bound::ROPE);
}

pub(crate) fn kv_cache_moves_and_reads<B: Backend>(g: &B) {
    let c = cpu();
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let (kw, vw, n_cells) = (24, 8, 15);
        let k = randn(n_cells * kw, 41);
        let v = randn(n_cells * vw, 42);
        let all: Vec<u32> = (0..n_cells as u32).rev().collect();
        let mut kg = ok(g.kv_new(kw, vw, dtype), "kv_new");
        let mut kc = ok(c.kv_new(kw, vw, dtype), "cpu");
        // Reserve in two steps (rows kept when the cache grows).
        ok(g.kv_reserve(&mut kg, 5), "reserve");
        ok(c.kv_reserve(&mut kc, 5), "cpu");
        ok(
            g.kv_write(
                &mut kg,
                &all[10..],
                &up(g, &k[..5 * kw]),
                &up(g, &v[..5 * vw]),
            ),
            "kv_write",
        );
        ok(
            c.kv_write(
                &mut kc,
                &all[10..],
                &k[..5 * kw].to_vec(),
                &v[..5 * vw].to_vec(),
            ),
            "cpu",
        );
        ok(g.kv_reserve(&mut kg, n_cells), "reserve");
        ok(c.kv_reserve(&mut kc, n_cells), "cpu");
        ok(
            g.kv_write(
                &mut kg,
                &all[..10],
                &up(g, &k[5 * kw..]),
                &up(g, &v[5 * vw..]),
            ),
            "kv_write",
        );
        ok(
            c.kv_write(
                &mut kc,
                &all[..10],
                &k[5 * kw..].to_vec(),
                &v[5 * vw..].to_vec(),
            ),
            "cpu",
        );
        // Moves that read a cell another move writes: every source is read first.
        let moves = [(10u32, 3u32), (3, 10), (14, 0), (0, 14), (7, 7)];
        ok(g.kv_move(&mut kg, &moves), "kv_move");
        ok(c.kv_move(&mut kc, &moves), "cpu");
        let mut rg = zeros(g, n_cells * kw);
        ok(g.kv_read_k(&kg, n_cells, &mut rg), "kv_read_k");
        let mut rc = vec![0f32; n_cells * kw];
        ok(c.kv_read_k(&kc, n_cells, &mut rc), "cpu");
        check_exact(
            format_args!("kv_move + kv_read_k ({dtype:?})"),
            &down(g, &rg),
            &rc,
        );
        // The values side, as the f16 cache's `kv_cache` tap reads it.
        let mut vg = zeros(g, n_cells * vw);
        ok(g.kv_read_v(&kg, n_cells, &mut vg), "kv_read_v");
        let mut vc = vec![0f32; n_cells * vw];
        ok(c.kv_read_v(&kc, n_cells, &mut vc), "cpu");
        check_exact(
            format_args!("kv_move + kv_read_v ({dtype:?})"),
            &down(g, &vg),
            &vc,
        );
        // Out-of-range cells are shape errors on both, not faults.
        let bad = g.kv_write(
            &mut kg,
            &[n_cells as u32],
            &up(g, &k[..kw]),
            &up(g, &v[..vw]),
        );
        assert!(matches!(bad, Err(RuntimeError::Shape { .. })), "{bad:?}");
        let bad = g.kv_move(&mut kg, &[(0, n_cells as u32)]);
        assert!(matches!(bad, Err(RuntimeError::Shape { .. })), "{bad:?}");
    }
}

/// Where the real model test finds Gemma 3 270M (Q4_K_M).
pub(crate) fn real_model_path() -> std::path::PathBuf {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/plumbline/models"),
    };
    dir.join("gemma-3-270m-q4_k_m.gguf")
}

pub(crate) fn the_real_model_matches_the_cpu_backend<B: Backend>(
    g: &B,
    model: &Model,
    steps: usize,
) {
    use engine::exec::{Engine, Session};
    let c = cpu();
    let eg = ok(Engine::new(model, g), "engine");
    let ec = ok(Engine::new(model, &c), "cpu engine");
    // <bos>The capital of France is (ids from model_real.rs), then `steps` greedy decode steps.
    let prompt = [2u32, 818, 5279, 529, 7001, 563];
    let mut sg = ok(Session::new(&eg, 32), "session");
    let mut sc = ok(Session::new(&ec, 32), "cpu session");
    let t = std::time::Instant::now();
    let mut lg = ok(sg.forward(&prompt, None), "prefill");
    println!(
        "device prefill of {} tokens: {:.2} s",
        prompt.len(),
        t.elapsed().as_secs_f64()
    );
    let mut lc = ok(sc.forward(&prompt, None), "cpu prefill");
    for step in 0..steps {
        let (a, b) = (lg.last(), lc.last());
        // The two backends round activations the same way, so their logits differ by
        // summation order through 18 layers; verify's real-model bound against the float
        // reference is 1e-3 NMSE on the logits, and two quantized paths must be well inside it.
        let e = nmse(a, b);
        assert!(e < 5e-3, "step {step}: logits NMSE {e:.3e}");
        let id = sampling::argmax(b);
        let t = std::time::Instant::now();
        lg = ok(sg.forward(&[id], None), "decode");
        println!(
            "device decode step {step}: {:.2} s",
            t.elapsed().as_secs_f64()
        );
        lc = ok(sc.forward(&[id], None), "cpu decode");
    }
}

// ---- CUDA only --------------------------------------------------------------------------------

/// The widest head the kernel takes (the query head and one tile of weights in shared memory,
/// beside the kernel's own static shared memory, within the 48 KiB a block gets without opting
/// in) runs and matches the CPU; one wider is refused with a shape error naming that width, not
/// a failed launch.
pub(crate) fn attention_head_width_limit(g: &CudaBackend) {
    let case = ragged_batch();
    let r = attention_run(
        g,
        &case,
        Mask::CAUSAL,
        Some(KvDtype::F32),
        (1, 1, 12_288, 8),
    );
    let Err(RuntimeError::Shape { expected, .. }) = r else {
        panic!("a 12288-wide head: expected a shape error, got {r:?}");
    };
    assert!(expected < 12_288, "{expected}");
    attention_check(
        g,
        &case,
        Mask::CAUSAL,
        Some(KvDtype::F32),
        (1, 1, expected, 8),
    );
    let r = attention_run(
        g,
        &case,
        Mask::CAUSAL,
        Some(KvDtype::F32),
        (1, 1, expected + 1, 8),
    );
    assert!(matches!(r, Err(RuntimeError::Shape { .. })), "{r:?}");
}

pub(crate) fn argmax_and_sampling_on_the_device(g: &CudaBackend) {
    let n = 262_147; // Gemma's vocabulary plus a tail
    let mut logits = randn(2 * n, 41);
    logits[n + 17] = f32::NAN;
    logits[5] = 50.0;
    logits[9] = 50.0; // a tie: the lower id wins
    let lg = up(g, &logits);
    let ids = ok(g.argmax_rows(&lg, 2, n), "argmax_rows");
    assert_eq!(
        ids,
        vec![
            sampling::argmax(&logits[..n]),
            sampling::argmax(&logits[n..])
        ]
    );
    assert_eq!(ids[0], 5);
    // No rows: no launch, no ids.
    assert_eq!(
        ok(g.argmax_rows(&up(g, &[]), 0, n), "argmax of no rows"),
        []
    );

    let row = up(g, &logits[n..]);
    let cfg = SamplerConfig {
        temperature: 0.7,
        top_k: 40,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed: 0,
    };
    let dist = Sampler::new(cfg).distribution(&logits[n..], &[]);
    let mut r = Rng::new(99);
    for _ in 0..50 {
        let u = r.next_f64();
        let mut acc = 0.0;
        let want = dist.iter().find(|(_, p)| {
            acc += p;
            u < acc
        });
        let want = want.or(dist.last()).map_or(0, |&(id, _)| id);
        let got = ok(g.sample_top_k(&row, 40, 0.7, u), "sample_top_k");
        assert_eq!(got, want, "u = {u}");
    }
}

/// The device counters of `g` now.
fn counted(g: &CudaBackend) -> DeviceCounters {
    g.counters()
        .unwrap_or_else(|| panic!("the CUDA backend counts its work"))
}

/// A cache layer grown one cell at a time, as decoding grows it, is reallocated and copied only
/// when it outgrows its allocation, which doubles: 600 cells cost three allocations per side
/// (256, 514 and 1030 cells) and copy 256 + 514 cells, not 600 copies of everything before.
/// The cells written before each growth read back unchanged.
pub(crate) fn kv_cache_grows_geometrically_and_keeps_its_cells(g: &CudaBackend) {
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let (w, n) = (8usize, 600usize);
        let elem = if dtype == KvDtype::F16 { 2 } else { 4 };
        let mut kv = ok(g.kv_new(w, w, dtype), "kv_new");
        let start = counted(g);
        let mut moving_steps = 0;
        for cell in 0..n {
            let before = counted(g);
            ok(g.kv_reserve(&mut kv, cell + 1), "kv_reserve");
            let grew = counted(g).since(&before);
            if grew.kv_bytes_moved > 0 {
                moving_steps += 1;
            }
            // Small integers: exact in f16 too.
            let row = vec![(cell % 1000) as f32; w];
            let (k, v) = (up(g, &row), up(g, &row));
            ok(g.kv_write(&mut kv, &[cell as u32], &k, &v), "kv_write");
        }
        let total = counted(g).since(&start);
        assert_eq!(
            moving_steps, 2,
            "{dtype:?}: reservations that copied the cache"
        );
        assert_eq!(
            total.kv_bytes_moved,
            ((256 + 514) * w * 2 * elem) as u64,
            "{dtype:?}"
        );
        let mut keys = ok(g.alloc(n * w), "alloc");
        ok(g.kv_read_k(&kv, n, &mut keys), "kv_read_k");
        let got = down(g, &keys);
        for cell in 0..n {
            assert_eq!(got[cell * w], cell as f32, "{dtype:?}: cell {cell}");
        }
    }
}

/// A temporary dropped goes back to the backend's pool: the next buffer of that size is not a
/// new device allocation, and `alloc` still hands out zeros.
pub(crate) fn temporaries_come_from_the_pool(g: &CudaBackend) {
    let n = 1001;
    drop(up(g, &vec![3.5; n]));
    let before = counted(g);
    let b = ok(g.alloc(n), "alloc");
    let c = up(g, &vec![1.0; n]); // a second buffer of the size: the pool has none left
    let d = counted(g).since(&before);
    assert_eq!((d.allocs, d.alloc_bytes), (1, (n * 4) as u64), "{d:?}");
    assert!(
        down(g, &b).iter().all(|&x| x == 0.0),
        "a pooled alloc is zeroed"
    );
    assert_eq!(down(g, &c), vec![1.0; n]);
}

/// Metadata arrays (here RoPE positions) are uploaded once and then only where they change.
pub(crate) fn metadata_is_uploaded_only_where_it_changes(g: &CudaBackend) {
    let rope = RopeConfig {
        n_rot: 8,
        freq_base: 10000.0,
        freq_scale: 1.0,
        style: RopeStyle::Neox,
        yarn: None,
    };
    let (heads, dim) = (2, 8);
    let mut pos: Vec<u32> = (100..110).collect();
    let x = randn(pos.len() * heads * dim, 7);
    let htod = |pos: &[u32]| {
        let mut b = up(g, &x);
        let before = counted(g);
        ok(g.rope(&mut b, heads, dim, pos, &rope), "rope");
        counted(g).since(&before).htod_bytes
    };
    let first = htod(&pos);
    assert!(
        first >= 40,
        "the first call uploads the 10 positions: {first}"
    );
    assert_eq!(htod(&pos), 0, "the same positions again");
    pos[4] = 7;
    assert_eq!(htod(&pos), 4, "one position changed");
    // The result does not depend on what was uploaded before: the CPU's rope of the same input.
    let c = cpu();
    let mut want = x.clone();
    ok(c.rope(&mut want, heads, dim, &pos, &rope), "cpu rope");
    let mut got = up(g, &x);
    ok(g.rope(&mut got, heads, dim, &pos, &rope), "rope");
    let got = down(g, &got);
    let err: f32 = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(err < 1e-4, "max abs error {err}");
}

/// The suite's tests for one backend: `$device` is an expression of type `Option<B>` for some
/// `B: Backend` (`None`: skipped, with the reason printed by it), `$model` one of type
/// `Option<Model>` for the real-model test and `$steps` its number of decode steps.
macro_rules! backend_ops_tests {
    ($device:expr, $model:expr, $steps:expr) => {
        crate::suite::backend_ops_tests!(@each $device;
            matmul_every_weight_type_and_shape,
            float_weights_keep_their_range_in_prefill,
            output_head_of_262144_rows,
            expert_products_and_routing,
            ids_round_trip,
            embedding_rows_of_every_type,
            norms_rope_and_activations,
            data_movement_is_exact,
            empty_shapes,
            attention_masks_and_layouts,
            attention_window_zero,
            attention_long_cells,
            attention_and_rope_past_65535_tokens,
            kv_cache_moves_and_reads
        );
        #[test]
        fn the_real_model_matches_the_cpu_backend() {
            let Some(model) = $model else { return };
            if let Some(g) = $device {
                crate::suite::the_real_model_matches_the_cpu_backend(&g, &model, $steps);
            }
        }
    };
    (@each $device:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                if let Some(g) = $device {
                    crate::suite::$name(&g);
                }
            }
        )*
    };
}
pub(crate) use backend_ops_tests;

/// The CUDA backend's own tests (`$device`: an `Option<CudaBackend>`).
macro_rules! cuda_tests {
    ($device:expr) => {
        crate::suite::backend_ops_tests!(@each $device;
            attention_head_width_limit,
            argmax_and_sampling_on_the_device,
            kv_cache_grows_geometrically_and_keeps_its_cells,
            temporaries_come_from_the_pool,
            metadata_is_uploaded_only_where_it_changes
        );
    };
}
pub(crate) use cuda_tests;
