//! The device suite: every CUDA kernel against its CPU twin (the `CpuBackend` op of the same
//! name) on random data — every weight type, odd shapes and tails — and the whole real model
//! against the CPU backend (which `cargo xtask verify` holds against the candle reference).
//!
//! Each test body takes the device; [`suite_tests!`] instantiates all of them for one: `gpu`
//! (a real device; excluded from the default nextest profile, run by the `gpu` profile, and
//! failing when no device opens) and `emu` (the CUDA emulator of kernels/cuda/emu, run
//! everywhere).

use std::borrow::Cow;

use kernels::quant::GgmlType;

use engine::model::Model;
use engine::runtime::cuda::backend::{CudaBackend, CUDA_TYPES, GEMM_MIN_TOKENS};
use engine::runtime::params::{Activation, Gating, MoeConfig, RopeConfig, RopeStyle, Yarn};
use engine::runtime::sampling::{self, Rng, Sampler, SamplerConfig};
use engine::runtime::CpuBackend;
use engine::runtime::{
    AttnMeta, Backend, CellMeta, KvDtype, KvSource, Mask, QueryMeta, Strided, WeightData,
};

fn cpu() -> CpuBackend {
    CpuBackend::new(None, Some(2)).unwrap_or_else(|e| panic!("{e}"))
}

/// Roughly normal values (sum of four uniforms), deterministic per seed.
fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| ((0..4).map(|_| r.next_f64()).sum::<f64>() - 2.0) as f32 * 1.7)
        .collect()
}

fn down(b: &CudaBackend, x: &<CudaBackend as Backend>::Buf) -> Vec<f32> {
    let mut v = Vec::new();
    b.download(x, &mut v).unwrap_or_else(|e| panic!("{e}"));
    v
}

fn up(b: &CudaBackend, x: &[f32]) -> <CudaBackend as Backend>::Buf {
    b.upload(x).unwrap_or_else(|e| panic!("{e}"))
}

/// Σ(a−b)²/Σb².
fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    num / den.max(1e-30)
}

/// Largest |a−b| / (1 + |b|).
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

fn weight(ty: GgmlType, n_rows: usize, k: usize, seed: u64) -> Vec<u8> {
    kernels::quant::quantize(ty, &randn(n_rows * k, seed)).unwrap_or_else(|e| panic!("{ty:?}: {e}"))
}

fn wd(ty: GgmlType, k: usize, n_rows: usize, n_mats: usize, data: &[u8]) -> WeightData<'_> {
    WeightData {
        name: "w".to_owned(),
        ty,
        k_dim: k,
        n_rows,
        n_mats,
        data: Cow::Borrowed(data),
    }
}

pub(super) fn matmul_of_every_weight_type_matches_the_cpu(g: CudaBackend) {
    let c = cpu();
    // 37 rows (not a multiple of the 4 rows per block), k = 768 (three K-quant super-blocks,
    // 24 chunks: fewer than a warp's 32 lanes, so some lanes idle), and token counts on both
    // sides of the GEMM switch.
    let (n_rows, k) = (37, 768);
    for &ty in &CUDA_TYPES {
        let bytes = weight(ty, n_rows, k, ty.id() as u64);
        let wg = g
            .prepare(wd(ty, k, n_rows, 1, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        let wc = c
            .prepare(wd(ty, k, n_rows, 1, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        for n_tok in [1, 3, GEMM_MIN_TOKENS + 3] {
            let x = randn(n_tok * k, 7 + n_tok as u64);
            let mut og = g.alloc(n_tok * n_rows).unwrap_or_else(|e| panic!("{e}"));
            g.matmul(&wg, &up(&g, &x), n_tok, &mut og)
                .unwrap_or_else(|e| panic!("{ty:?}: {e}"));
            let mut oc = vec![0f32; n_tok * n_rows];
            c.matmul(&wc, &x, n_tok, &mut oc)
                .unwrap_or_else(|e| panic!("{e}"));
            let e = nmse(&down(&g, &og), &oc);
            // Both sides quantize activations to 8 bits per 32 (or 256) values, independently:
            // each side's relative RMS error is about (2.5σ/127)/√12 / σ ≈ 0.6 %, NMSE ≈ 3e-5,
            // so two of them differ by ~7e-5; 3e-4 leaves 4×. A wrong scale, nibble or block
            // order gives NMSE near 1. Float weights: the CPU rounds activations to f16 (or
            // bf16: 2^-9 relative, NMSE ~1e-6); 1e-4 still catches any layout bug.
            let bound = if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                1e-4
            } else {
                3e-4
            };
            assert!(
                e < bound,
                "{ty:?}, {n_tok} tokens: NMSE {e:.3e} ≥ {bound:e}"
            );
        }
    }
}

pub(super) fn expert_products_and_routing_match_the_cpu(g: CudaBackend) {
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
        let logits = randn(n_tok * ne, 3);
        let bias = randn(ne, 4);
        let (mut ig, mut wg) = (
            g.upload_ids(&vec![0; n_tok * k])
                .unwrap_or_else(|e| panic!("{e}")),
            g.alloc(n_tok * k).unwrap_or_else(|e| panic!("{e}")),
        );
        let bg = up(&g, &bias);
        g.route(&up(&g, &logits), Some(&bg), &moe, n_tok, &mut ig, &mut wg)
            .unwrap_or_else(|e| panic!("{e}"));
        let (mut ic, mut wc) = (vec![0u32; n_tok * k], vec![0f32; n_tok * k]);
        c.route(&logits, Some(&bias), &moe, n_tok, &mut ic, &mut wc)
            .unwrap_or_else(|e| panic!("{e}"));
        let ids_g = g.download_ids(&ig).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ids_g, ic, "{gating:?}: expert ids");
        // Same formulas in f32; 1e-6 relative is a few ulp.
        assert!(
            max_rel(&down(&g, &wg), &wc) < 1e-6,
            "{gating:?}: gate weights"
        );

        let ty = GgmlType::Q4K;
        let bytes = weight(ty, ne * n_rows, kd, 9);
        let wgm = g
            .prepare(wd(ty, kd, n_rows, ne, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        let wcm = c
            .prepare(wd(ty, kd, n_rows, ne, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        for per_slot in [false, true] {
            let nx = if per_slot { n_tok * k } else { n_tok };
            let x = randn(nx * kd, 11);
            let mut og = g
                .alloc(n_tok * k * n_rows)
                .unwrap_or_else(|e| panic!("{e}"));
            g.matmul_experts(&wgm, &up(&g, &x), per_slot, &ig, n_tok, k, &mut og)
                .unwrap_or_else(|e| panic!("{e}"));
            let mut oc = vec![0f32; n_tok * k * n_rows];
            c.matmul_experts(&wcm, &x, per_slot, &ic, n_tok, k, &mut oc)
                .unwrap_or_else(|e| panic!("{e}"));
            let yg = down(&g, &og);
            // As for dense products (activation quantization on both sides).
            assert!(
                nmse(&yg, &oc) < 3e-4,
                "per_slot {per_slot}: NMSE {:.3e}",
                nmse(&yg, &oc)
            );
            let mut cg = g.alloc(n_tok * n_rows).unwrap_or_else(|e| panic!("{e}"));
            g.moe_combine(&up(&g, &oc), &wg, n_tok, k, &mut cg)
                .unwrap_or_else(|e| panic!("{e}"));
            let mut cc = vec![0f32; n_tok * n_rows];
            c.moe_combine(&oc, &wc, n_tok, k, &mut cc)
                .unwrap_or_else(|e| panic!("{e}"));
            // Same sums in the same order; the gate weights differ by ulps.
            assert!(max_rel(&down(&g, &cg), &cc) < 1e-5);
        }
    }
}

pub(super) fn embedding_rows_of_every_type_match_the_cpu(g: CudaBackend) {
    let c = cpu();
    let (n_vocab, k) = (29, 512);
    let tokens = [0u32, 28, 5, 5, 17];
    for &ty in &CUDA_TYPES {
        let bytes = weight(ty, n_vocab, k, 100 + ty.id() as u64);
        let wg = g
            .prepare(wd(ty, k, n_vocab, 1, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        let wc = c
            .prepare(wd(ty, k, n_vocab, 1, &bytes))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut og = g.alloc(tokens.len() * k).unwrap_or_else(|e| panic!("{e}"));
        let tg = g.upload_ids(&tokens).unwrap_or_else(|e| panic!("{e}"));
        g.embed(&wg, &tg, tokens.len(), &mut og)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut oc = vec![0f32; tokens.len() * k];
        c.embed(&wc, &tokens.to_vec(), tokens.len(), &mut oc)
            .unwrap_or_else(|e| panic!("{e}"));
        // Dequantization is the same arithmetic in f32 on both sides: exact but for fused
        // multiply-adds on the GPU (one rounding), hence 1e-6 rather than 0.
        assert!(max_rel(&down(&g, &og), &oc) < 1e-6, "{ty:?}");
    }
}

pub(super) fn norms_rope_activations_and_elementwise_ops_match_the_cpu(g: CudaBackend) {
    let c = cpu();
    let (n_tok, heads, hd) = (5, 3, 80);
    let x = randn(n_tok * heads * hd, 21);
    let w = randn(hd, 22);
    // RMSNorm per head row, out of place and in place. f64 sums on both sides: ~1e-6.
    let mut og = g.alloc(x.len()).unwrap_or_else(|e| panic!("{e}"));
    g.rms_norm(&up(&g, &x), &up(&g, &w), 1e-6, &mut og)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut oc = vec![0f32; x.len()];
    c.rms_norm(&x, &w, 1e-6, &mut oc)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(max_rel(&down(&g, &og), &oc) < 1e-5, "rms_norm");
    let mut xg = up(&g, &x);
    g.rms_norm_inplace(&mut xg, &up(&g, &w), 1e-6)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(max_rel(&down(&g, &xg), &oc) < 1e-5, "rms_norm in place");

    // RoPE: normal, NeoX, partial rotation, YaRN; positions far apart (the angle pos·θ grows
    // to ~4000 rad, where the GPU's powf-based θ and the CPU's repeated product differ by
    // ~1e-3 rad: tolerance 5e-3 relative).
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
        (RopeStyle::Normal, hd, Some(yarn), 0.25),
    ] {
        let cfg = RopeConfig {
            style,
            n_rot,
            freq_base: 10_000.0,
            freq_scale: scale,
            yarn,
        };
        let mut xg = up(&g, &x);
        g.rope(&mut xg, heads, hd, &positions, &cfg)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut xc = x.clone();
        c.rope(&mut xc, heads, hd, &positions, &cfg)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            max_rel(&down(&g, &xg), &xc) < 5e-3,
            "rope {style:?} n_rot {n_rot} yarn {}",
            yarn.is_some()
        );
    }

    // Gated activations, softcap, add, add_row, scale, fill: same f32 formulas; expf/tanhf
    // differ from Rust's by ≤ 2 ulp.
    let u = randn(x.len(), 23);
    for act in [Activation::Silu, Activation::GeluTanh] {
        let mut gg = up(&g, &x);
        g.gated_act(act, &mut gg, &up(&g, &u))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut gc = x.clone();
        c.gated_act(act, &mut gc, &u)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(max_rel(&down(&g, &gg), &gc) < 1e-5, "{act:?}");
    }
    let mut sg = up(&g, &x);
    g.softcap(&mut sg, 3.0).unwrap_or_else(|e| panic!("{e}"));
    let mut sc = x.clone();
    c.softcap(&mut sc, 3.0).unwrap_or_else(|e| panic!("{e}"));
    assert!(max_rel(&down(&g, &sg), &sc) < 1e-5, "softcap");
    let mut ag = up(&g, &x);
    g.add(&mut ag, &up(&g, &u))
        .unwrap_or_else(|e| panic!("{e}"));
    g.add_row(&mut ag, &up(&g, &w))
        .unwrap_or_else(|e| panic!("{e}"));
    g.scale(&mut ag, 0.5).unwrap_or_else(|e| panic!("{e}"));
    g.fill(&mut ag, 3, 17, -2.0)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut ac = x.clone();
    c.add(&mut ac, &u).unwrap_or_else(|e| panic!("{e}"));
    c.add_row(&mut ac, &w).unwrap_or_else(|e| panic!("{e}"));
    c.scale(&mut ac, 0.5).unwrap_or_else(|e| panic!("{e}"));
    c.fill(&mut ac, 3, 17, -2.0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&g, &ag), ac, "add/add_row/scale/fill are exact");

    // copy_strided with a broadcast (group stride 0) and gather_rows: exact copies.
    let (s, d) = (
        Strided::new(hd * heads, 0, 8),
        Strided::new(heads * 16, 16, 0),
    );
    let mut dg = g
        .alloc(n_tok * heads * 16)
        .unwrap_or_else(|e| panic!("{e}"));
    g.copy_strided(&up(&g, &x), s, &mut dg, d, n_tok, heads, 16)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut dc = vec![0f32; n_tok * heads * 16];
    c.copy_strided(&x, s, &mut dc, d, n_tok, heads, 16)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&g, &dg), dc, "copy_strided");
    let rows = [4u32, 0, 4];
    let mut rg = g.alloc(rows.len() * hd).unwrap_or_else(|e| panic!("{e}"));
    g.gather_rows(&up(&g, &x), hd, &rows, &mut rg)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rc = vec![0f32; rows.len() * hd];
    c.gather_rows(&x, hd, &rows, &mut rc)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&g, &rg), rc, "gather_rows");
}

/// A ragged batch of two sequences (one a draft tree) over committed and new cells.
fn attention_case(g: CudaBackend, mask: Mask, dtype: KvDtype) {
    attention_dims(&g, mask, dtype, (4, 2, 72, 40)).unwrap_or_else(|e| panic!("{e}"));
}

/// Attention with `(n_head, n_head_kv, head_dim_k, head_dim_v)` against the CPU (the kernel's
/// error, if it refuses the shape).
fn attention_dims(
    g: &CudaBackend,
    mask: Mask,
    dtype: KvDtype,
    (n_head, n_kv, dk, dv): (usize, usize, usize, usize),
) -> Result<(), engine::runtime::RuntimeError> {
    let c = cpu();
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
    let anc_bits = [0b1u64, 0b11, 0b101, 0b1101, 0b1_0000, 0b11_0000];
    let n_cells = cells.len();
    let k = randn(n_cells * n_kv * dk, 31);
    let v = randn(n_cells * n_kv * dv, 32);
    let q = randn(queries.len() * n_head * dk, 33);
    let meta = AttnMeta {
        n_head,
        n_head_kv: n_kv,
        head_dim_k: dk,
        head_dim_v: dv,
        scale: 1.0 / (dk as f32).sqrt(),
        mask,
        queries: &queries,
        cells: &cells,
        ancestors: if mask.tree { &anc_bits } else { &[] },
        anc_words: usize::from(mask.tree),
    };
    let all: Vec<u32> = (0..n_cells as u32).collect();
    let mut kg = g
        .kv_new(n_kv * dk, n_kv * dv, dtype)
        .unwrap_or_else(|e| panic!("{e}"));
    g.kv_reserve(&mut kg, n_cells)
        .unwrap_or_else(|e| panic!("{e}"));
    g.kv_write(&mut kg, &all, &up(g, &k), &up(g, &v))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kc = c
        .kv_new(n_kv * dk, n_kv * dv, dtype)
        .unwrap_or_else(|e| panic!("{e}"));
    c.kv_reserve(&mut kc, n_cells)
        .unwrap_or_else(|e| panic!("{e}"));
    c.kv_write(&mut kc, &all, &k, &v)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut og = g
        .alloc(queries.len() * n_head * dv)
        .unwrap_or_else(|e| panic!("{e}"));
    g.attention(&up(g, &q), KvSource::Cache(&kg), &meta, &mut og)?;
    let mut oc = vec![0f32; queries.len() * n_head * dv];
    c.attention(&q, KvSource::Cache(&kc), &meta, &mut oc)
        .unwrap_or_else(|e| panic!("{e}"));
    // Same f16 rounding of keys and values, same softmax (f64 sum), dot products summed in a
    // different order (~1e-6 relative on a score, amplified by exp at most by the score range
    // of ~8): 1e-4. A mask leak to one wrong cell moves outputs by ~1e-1.
    let e = max_rel(&down(g, &og), &oc);
    assert!(e < 1e-4, "{mask:?} {dtype:?} dk {dk}: max rel {e:.3e}");

    // kv_read_k and kv_move (every source read before any destination written).
    let moves = [(10u32, 3u32), (3, 10), (14, 0)];
    g.kv_move(&mut kg, &moves).unwrap_or_else(|e| panic!("{e}"));
    c.kv_move(&mut kc, &moves).unwrap_or_else(|e| panic!("{e}"));
    let mut rg = g
        .alloc(n_cells * n_kv * dk)
        .unwrap_or_else(|e| panic!("{e}"));
    g.kv_read_k(&kg, n_cells, &mut rg)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rc = vec![0f32; n_cells * n_kv * dk];
    c.kv_read_k(&kc, n_cells, &mut rc)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        down(g, &rg),
        rc,
        "kv_move + kv_read_k are exact ({dtype:?})"
    );
    Ok(())
}

/// The widest head the kernel takes (the query head in shared memory, beside the kernel's own
/// static shared memory, within the 48 KiB a block gets without opting in) runs and matches
/// the CPU; one wider is refused with a shape error naming that width, not a failed launch.
pub(super) fn attention_head_width_limit(g: CudaBackend) {
    let r = attention_dims(&g, Mask::CAUSAL, KvDtype::F32, (1, 1, 12_288, 8));
    let Err(engine::runtime::RuntimeError::Shape { expected, .. }) = r else {
        panic!("a 12288-wide head: expected a shape error, got {r:?}");
    };
    assert!(expected < 12_288, "{expected}");
    attention_dims(&g, Mask::CAUSAL, KvDtype::F32, (1, 1, expected, 8))
        .unwrap_or_else(|e| panic!("the widest head, {expected}: {e}"));
    let r = attention_dims(&g, Mask::CAUSAL, KvDtype::F32, (1, 1, expected + 1, 8));
    assert!(
        matches!(r, Err(engine::runtime::RuntimeError::Shape { .. })),
        "{r:?}"
    );
}

pub(super) fn attention_causal_f16(g: CudaBackend) {
    attention_case(g, Mask::CAUSAL, KvDtype::F16);
}

pub(super) fn attention_causal_f32(g: CudaBackend) {
    attention_case(g, Mask::CAUSAL, KvDtype::F32);
}

pub(super) fn attention_sliding_window_f16(g: CudaBackend) {
    attention_case(
        g,
        Mask {
            causal: true,
            window: Some(4),
            tree: false,
        },
        KvDtype::F16,
    );
}

pub(super) fn attention_tree_f16(g: CudaBackend) {
    attention_case(
        g,
        Mask {
            causal: true,
            window: None,
            tree: true,
        },
        KvDtype::F16,
    );
}

pub(super) fn argmax_and_sampling_on_the_device_match_the_cpu(g: CudaBackend) {
    let n = 262_147; // Gemma's vocabulary plus a tail
    let mut logits = randn(2 * n, 41);
    logits[n + 17] = f32::NAN;
    logits[5] = 50.0;
    logits[9] = 50.0; // a tie: the lower id wins
    let lg = up(&g, &logits);
    let ids = g.argmax_rows(&lg, 2, n).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        ids,
        vec![
            sampling::argmax(&logits[..n]),
            sampling::argmax(&logits[n..])
        ]
    );
    assert_eq!(ids[0], 5);

    let row = up(&g, &logits[n..]);
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
        let got = g
            .sample_top_k(&row, 40, 0.7, u)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got, want, "u = {u}");
    }
}

/// Where the real model test finds Gemma 3 270M (Q4_K_M).
pub(super) fn real_model_path() -> std::path::PathBuf {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/plumbline/models"),
    };
    dir.join("gemma-3-270m-q4_k_m.gguf")
}

pub(super) fn the_real_model_matches_the_cpu_backend(g: CudaBackend, model: &Model, steps: usize) {
    use engine::exec::{Engine, Session};
    let c = cpu();
    let eg = Engine::new(model, &g).unwrap_or_else(|e| panic!("{e}"));
    let ec = Engine::new(model, &c).unwrap_or_else(|e| panic!("{e}"));
    // <bos>The capital of France is (ids from model_real.rs), then `steps` greedy decode steps.
    let prompt = [2u32, 818, 5279, 529, 7001, 563];
    let mut sg = Session::new(&eg, 32).unwrap_or_else(|e| panic!("{e}"));
    let mut sc = Session::new(&ec, 32).unwrap_or_else(|e| panic!("{e}"));
    let t = std::time::Instant::now();
    let mut lg = sg.forward(&prompt, None).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "device prefill of {} tokens: {:.2} s",
        prompt.len(),
        t.elapsed().as_secs_f64()
    );
    let mut lc = sc.forward(&prompt, None).unwrap_or_else(|e| panic!("{e}"));
    for step in 0..steps {
        let (a, b) = (lg.last(), lc.last());
        // Independent activation quantization on the two sides through 18 layers: the CPU
        // Q4_K_M path against the NumPy float reference has NMSE ~1e-3 on the logits
        // (verify's real-model tolerance); the two quantized paths must be at least as close.
        let e = nmse(a, b);
        assert!(e < 5e-3, "step {step}: logits NMSE {e:.3e}");
        let id = sampling::argmax(b);
        let t = std::time::Instant::now();
        lg = sg.forward(&[id], None).unwrap_or_else(|e| panic!("{e}"));
        println!(
            "device decode step {step}: {:.2} s",
            t.elapsed().as_secs_f64()
        );
        lc = sc.forward(&[id], None).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The suite's tests for one device: `$device` is an expression of type
/// `Option<CudaBackend>` (`None`: skipped, with the reason printed by it), `$model` one of type
/// `Option<Model>` for the real-model test and `$steps` its number of decode steps.
macro_rules! suite_tests {
    ($device:expr, $model:expr, $steps:expr) => {
        use crate::suite;
        crate::suite::suite_tests!(@each $device;
            matmul_of_every_weight_type_matches_the_cpu,
            expert_products_and_routing_match_the_cpu,
            embedding_rows_of_every_type_match_the_cpu,
            norms_rope_activations_and_elementwise_ops_match_the_cpu,
            attention_causal_f16,
            attention_causal_f32,
            attention_sliding_window_f16,
            attention_tree_f16,
            attention_head_width_limit,
            argmax_and_sampling_on_the_device_match_the_cpu
        );
        #[test]
        fn the_real_model_matches_the_cpu_backend() {
            let Some(model) = $model else { return };
            if let Some(g) = $device {
                suite::the_real_model_matches_the_cpu_backend(g, &model, $steps);
            }
        }
    };
    (@each $device:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                if let Some(g) = $device {
                    suite::$name(g);
                }
            }
        )*
    };
}
pub(crate) use suite_tests;
