//! The shard plan on hand-built configurations: the real model's shapes, the fallbacks, and
//! properties over random shapes (every part is a valid `Weight::shard`, splits partition).

use proptest::prelude::*;

use super::*;
use crate::gguf::TensorInfo;
use crate::model::{
    Activation, Architecture, Gating, MlaConfig, MoeConfig, RopeConfig, RopeStyle, Weight,
};

use GgmlType as T;

fn rope() -> RopeConfig {
    RopeConfig {
        style: RopeStyle::Neox,
        n_rot: 16,
        freq_base: 10_000.0,
        freq_scale: 1.0,
        yarn: None,
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn dense(
    arch: Architecture,
    n_vocab: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_ff: usize,
) -> ModelConfig {
    ModelConfig {
        arch,
        arch_name: "test".into(),
        n_vocab,
        n_embd,
        n_layer,
        n_ctx_train: 4096,
        n_head,
        n_head_kv,
        head_dim_k: head_dim,
        head_dim_v: head_dim,
        n_ff,
        rms_eps: 1e-6,
        rope: rope(),
        rope_swa: rope(),
        sliding_window: None,
        swa_pattern: 0,
        attn_scale: 1.0,
        embed_scale: None,
        final_logit_softcap: None,
        activation: Activation::Silu,
        mla: None,
        moe: None,
        dsa: None,
        n_nextn: 0,
    }
}

/// The tensors of a dense model, every matrix of type `ty` except `attn_output` (`wo`) and
/// `ffn_down` (`down`), the two row-parallel ones.
fn dense_tensors(c: &ModelConfig, ty: T, wo: T, down: T, tied: bool) -> Vec<TensorDesc> {
    // Rows that are not whole blocks fall back to Q8_0, as llama.cpp's quantizer does.
    let fit = |ty: T, k: usize| {
        if k.is_multiple_of(ty.block_size()) {
            ty
        } else {
            T::Q8_0
        }
    };
    let (ty, wo, down) = (
        fit(ty, c.n_embd),
        fit(wo, c.n_head * c.head_dim_v),
        fit(down, c.n_ff),
    );
    let d = c.n_embd as u64;
    let mut v = vec![TensorDesc::new(
        "token_embd.weight",
        &[d, c.n_vocab as u64],
        ty,
    )];
    for il in 0..c.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let q = (c.n_head * c.head_dim_k) as u64;
        let kv = (c.n_head_kv * c.head_dim_k) as u64;
        v.push(TensorDesc::new(&n("attn_norm"), &[d], T::F32));
        v.push(TensorDesc::new(&n("attn_q"), &[d, q], ty));
        v.push(TensorDesc::new(&n("attn_k"), &[d, kv], ty));
        v.push(TensorDesc::new(&n("attn_v"), &[d, kv], ty));
        v.push(TensorDesc::new(&n("attn_output"), &[q, d], wo));
        v.push(TensorDesc::new(&n("ffn_norm"), &[d], T::F32));
        v.push(TensorDesc::new(&n("ffn_gate"), &[d, c.n_ff as u64], ty));
        v.push(TensorDesc::new(&n("ffn_up"), &[d, c.n_ff as u64], ty));
        v.push(TensorDesc::new(&n("ffn_down"), &[c.n_ff as u64, d], down));
    }
    v.push(TensorDesc::new("output_norm.weight", &[d], T::F32));
    if !tied {
        v.push(TensorDesc::new("output.weight", &[d, c.n_vocab as u64], ty));
    }
    v
}

fn plan(c: &ModelConfig, t: &[TensorDesc], n: usize) -> ShardPlan {
    ShardPlan::new(c, t, n).unwrap_or_else(|e| panic!("{e}"))
}

fn placement(p: &ShardPlan, name: &str) -> Placement {
    p.tensor(name)
        .unwrap_or_else(|| panic!("{name} not planned"))
        .placement
}

/// Gemma 3 270M: 4 query heads of 256, 1 KV head, n_embd 640, n_ff 2048, vocab 262144; its
/// Q4_K_M file has Q8_0/Q5_0 projections of rows of 640 and Q4_K/Q6_K row-parallel matrices.
fn gemma270m() -> (ModelConfig, Vec<TensorDesc>) {
    let c = dense(Architecture::Gemma3, 262_144, 640, 2, 4, 1, 256, 2048);
    let t = dense_tensors(&c, T::Q8_0, T::Q4K, T::Q6K, true);
    (c, t)
}

#[test]
fn real_model_shapes_split_at_tp2_and_tp4() {
    let (c, t) = gemma270m();
    for n in [2, 4] {
        let p = plan(&c, &t, n);
        let d = &p.decisions;
        assert!(
            d.attn.is_split() && d.ffn.is_split() && d.vocab.is_split(),
            "tp{n}"
        );
        assert_eq!(placement(&p, "blk.0.attn_q.weight"), Placement::Column);
        // One KV head: every rank computes it.
        assert_eq!(placement(&p, "blk.0.attn_k.weight"), Placement::Replicated);
        assert_eq!(placement(&p, "blk.0.attn_v.weight"), Placement::Replicated);
        assert!(d.kv_note.is_some());
        assert_eq!(d.kv_heads, vec![0..1; n]);
        assert_eq!(placement(&p, "blk.0.attn_output.weight"), Placement::Row);
        assert_eq!(placement(&p, "blk.1.ffn_down.weight"), Placement::Row);
        assert_eq!(placement(&p, "token_embd.weight"), Placement::Replicated);
        assert_eq!(
            placement(&p, "output (tied: token_embd.weight)"),
            Placement::Column
        );
        let q = p.tensor("blk.0.attn_q.weight").map(|p| p.ranks.clone());
        let rows: Vec<_> = q.unwrap_or_default().into_iter().map(|r| r.rows).collect();
        assert_eq!(rows, even_ranges(1024, n));
    }
}

#[test]
fn real_model_at_tp8_replicates_attention_and_says_why() {
    let (c, t) = gemma270m();
    let p = plan(&c, &t, 8);
    // 4 heads over 8 ranks cannot split.
    let Decision::Replicated { reason } = &p.decisions.attn else {
        panic!("attention split at tp8")
    };
    assert!(reason.contains("4 query heads"), "{reason}");
    // 2048 / 8 = 256 columns: a whole Q6_K block, so the FFN still splits.
    assert!(p.decisions.ffn.is_split());
    assert_eq!(placement(&p, "blk.0.attn_q.weight"), Placement::Replicated);
}

#[test]
fn a_column_split_that_would_cut_a_block_falls_back() {
    // n_ff 768 over 2 ranks = 384 columns of a Q4_K ffn_down: cuts a 256 block.
    let c = dense(Architecture::Llama, 256, 256, 1, 4, 2, 64, 768);
    let t = dense_tensors(&c, T::Q4K, T::Q4K, T::Q4K, false);
    let p = plan(&c, &t, 2);
    let Decision::Replicated { reason } = &p.decisions.ffn else {
        panic!("ffn split through a block")
    };
    assert!(reason.contains("blk.0.ffn_down.weight (q4_K)") || reason.contains("ffn_down"));
    assert!(reason.contains("256-value blocks"), "{reason}");
    assert_eq!(
        placement(&p, "blk.0.ffn_gate.weight"),
        Placement::Replicated
    );
    // attn_output: 4 heads × 64 = 256 over 2 = 128 columns of Q4_K: replicated too.
    assert!(!p.decisions.attn.is_split());
    // The same split on Q8_0 (block 32, activations Q8_0) is fine.
    let t = dense_tensors(&c, T::Q8_0, T::Q8_0, T::Q8_0, false);
    let p = plan(&c, &t, 2);
    assert!(p.decisions.ffn.is_split() && p.decisions.attn.is_split());
}

#[test]
fn kv_heads_fewer_than_the_degree_are_replicated_per_group() {
    // 8 query heads, 2 KV heads, TP 4: ranks 0,1 read KV head 0 and ranks 2,3 KV head 1.
    let c = dense(Architecture::Llama, 128, 256, 1, 8, 2, 32, 256);
    let t = dense_tensors(&c, T::Q8_0, T::Q8_0, T::Q8_0, false);
    let p = plan(&c, &t, 4);
    assert_eq!(p.decisions.kv_heads, vec![0..1, 0..1, 1..2, 1..2]);
    assert_eq!(placement(&p, "blk.0.attn_k.weight"), Placement::Column);
    let rows: Vec<_> = p
        .tensor("blk.0.attn_v.weight")
        .map(|p| p.ranks.iter().map(|r| r.rows.clone()).collect())
        .unwrap_or_default();
    assert_eq!(rows, vec![0..32, 0..32, 32..64, 32..64]);
    // 3 KV heads can neither split over 2 ranks nor be grouped: replicate attention.
    let c = dense(Architecture::Llama, 128, 192, 1, 6, 3, 32, 256);
    let t = dense_tensors(&c, T::Q8_0, T::Q8_0, T::Q8_0, false);
    let p = plan(&c, &t, 4);
    assert!(!p.decisions.attn.is_split());
}

fn mla_moe(n_ff_exp: usize, n_expert: usize, exp_ty: T) -> (ModelConfig, Vec<TensorDesc>) {
    let mut c = dense(Architecture::Deepseek2, 128, 256, 2, 8, 8, 48, 512);
    c.head_dim_v = 32;
    c.mla = Some(MlaConfig {
        q_lora_rank: 128,
        kv_lora_rank: 128,
        qk_nope: 32,
        qk_rope: 16,
        v_head_dim: 32,
    });
    c.moe = Some(MoeConfig {
        n_expert,
        n_expert_used: 2,
        n_expert_shared: 1,
        n_ff_exp,
        n_dense_lead: 1,
        weights_scale: 1.0,
        weights_norm: true,
        gating: Gating::Sigmoid,
    });
    let d = 256u64;
    let nh = 8u64;
    let mut t = vec![TensorDesc::new("token_embd.weight", &[d, 128], T::Q8_0)];
    for il in 0..2 {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        t.push(TensorDesc::new(&n("attn_q_a"), &[d, 128], T::Q8_0));
        t.push(TensorDesc::new(&n("attn_q_a_norm"), &[128], T::F32));
        t.push(TensorDesc::new(&n("attn_q_b"), &[128, nh * 48], T::Q8_0));
        t.push(TensorDesc::new(&n("attn_kv_a_mqa"), &[d, 144], T::Q8_0));
        t.push(TensorDesc::new(&n("attn_kv_a_norm"), &[128], T::F32));
        t.push(TensorDesc::new(&n("attn_kv_b"), &[128, nh * 64], T::Q8_0));
        t.push(TensorDesc::new(&n("attn_output"), &[nh * 32, d], T::Q8_0));
        if il == 0 {
            t.push(TensorDesc::new(&n("ffn_gate"), &[d, 512], T::Q8_0));
            t.push(TensorDesc::new(&n("ffn_up"), &[d, 512], T::Q8_0));
            t.push(TensorDesc::new(&n("ffn_down"), &[512, d], T::Q8_0));
        } else {
            let (fe, ne) = (n_ff_exp as u64, n_expert as u64);
            t.push(TensorDesc::new(&n("ffn_gate_inp"), &[d, ne], T::F32));
            t.push(TensorDesc::new(&n("ffn_gate_exps"), &[d, fe, ne], exp_ty));
            t.push(TensorDesc::new(&n("ffn_up_exps"), &[d, fe, ne], exp_ty));
            let down_ty = if n_ff_exp.is_multiple_of(exp_ty.block_size()) {
                exp_ty
            } else {
                T::Q8_0
            };
            t.push(TensorDesc::new(&n("ffn_down_exps"), &[fe, d, ne], down_ty));
            t.push(TensorDesc::new(&n("ffn_gate_shexp"), &[d, fe], T::Q8_0));
            t.push(TensorDesc::new(&n("ffn_up_shexp"), &[d, fe], T::Q8_0));
            t.push(TensorDesc::new(&n("ffn_down_shexp"), &[fe, d], T::Q8_0));
        }
    }
    t.push(TensorDesc::new("output_norm.weight", &[d], T::F32));
    t.push(TensorDesc::new("output.weight", &[d, 128], T::Q8_0));
    (c, t)
}

#[test]
fn mla_replicates_the_latent_path_and_splits_heads() {
    let (c, t) = mla_moe(256, 8, T::Q8_0);
    let p = plan(&c, &t, 4);
    assert!(p.decisions.attn.is_split());
    for name in [
        "attn_q_a",
        "attn_kv_a_mqa",
        "attn_q_a_norm",
        "attn_kv_a_norm",
    ] {
        assert_eq!(
            placement(&p, &format!("blk.0.{name}.weight")),
            Placement::Replicated,
            "{name}"
        );
    }
    let rows = |name: &str| -> Vec<Range<usize>> {
        p.tensor(name)
            .map(|p| p.ranks.iter().map(|r| r.rows.clone()).collect())
            .unwrap_or_default()
    };
    // 8 heads over 4 ranks: 2 heads each of 48 (q) and 64 (k_nope + v).
    assert_eq!(
        rows("blk.0.attn_q_b.weight"),
        vec![0..96, 96..192, 192..288, 288..384]
    );
    assert_eq!(rows("blk.0.attn_kv_b.weight")[1], 128..256);
    assert_eq!(placement(&p, "blk.0.attn_output.weight"), Placement::Row);
}

#[test]
fn moe_splits_experts_on_blocks_or_goes_expert_parallel() {
    // Q8_0 experts of 256 over 4 ranks: 64 columns, whole blocks.
    let (c, t) = mla_moe(256, 8, T::Q8_0);
    let p = plan(&c, &t, 4);
    assert_eq!(p.decisions.moe, MoeMode::SplitExperts);
    assert_eq!(placement(&p, "blk.1.ffn_down_exps.weight"), Placement::Row);
    assert_eq!(
        placement(&p, "blk.1.ffn_gate_shexp.weight"),
        Placement::Column
    );
    assert_eq!(
        placement(&p, "blk.1.ffn_gate_inp.weight"),
        Placement::Replicated
    );
    // Q4_K experts of 256: any split cuts a block, so whole experts per rank.
    let (c, t) = mla_moe(256, 8, T::Q4K);
    let p = plan(&c, &t, 4);
    assert_eq!(p.decisions.moe, MoeMode::ExpertParallel);
    assert_eq!(p.decisions.experts, even_ranges(8, 4));
    assert_eq!(placement(&p, "blk.1.ffn_up_exps.weight"), Placement::Expert);
    assert_eq!(
        placement(&p, "blk.1.ffn_down_shexp.weight"),
        Placement::RankZero
    );
    let e = p
        .tensor("blk.1.ffn_gate_exps.weight")
        .map(|p| p.ranks[3].clone());
    assert_eq!(e.map(|r| r.experts), Some(6..8));
    // 6 experts cannot be spread over 4 ranks either: replicated, and says both reasons.
    let (c, t) = mla_moe(256, 6, T::Q4K);
    let p = plan(&c, &t, 4);
    let MoeMode::Replicated { reason } = &p.decisions.moe else {
        panic!("{:?}", p.decisions.moe)
    };
    assert!(
        reason.contains("256-value blocks") && reason.contains("6 experts"),
        "{reason}"
    );
}

#[test]
fn degree_zero_is_an_error_and_degree_one_is_whole() {
    let (c, t) = gemma270m();
    assert_eq!(ShardPlan::new(&c, &t, 0), Err(PlanError::ZeroDegree));
    let p = plan(&c, &t, 1);
    let total: u64 = t
        .iter()
        .map(|t| t.ty.bytes_for(t.dims.iter().product()).unwrap_or(0))
        .sum();
    assert_eq!(p.bytes_per_rank(), vec![total]);
}

/// A `Weight` for a planned tensor, to cut with [`Weight::shard`].
fn weight(t: &TensorDesc) -> Weight {
    let k = t.dim(0);
    Weight {
        info: TensorInfo {
            name: t.name.clone(),
            ggml_type: t.ty,
            dims: t.dims.clone(),
            shard: 0,
            offset: 0,
            n_bytes: t.ty.bytes_for(t.dims.iter().product()).unwrap_or(0),
        },
        ty: t.ty,
        k_dim: k,
        n_rows: t.dim(1),
        n_mats: t.dim(2),
        row_bytes: k / t.ty.block_size() * t.ty.type_size(),
        view: None,
    }
}

/// Every matrix part is a valid block-aligned shard view, split parts partition the tensor
/// along their axis, and the bytes add up.
fn check_plan_invariants(p: &ShardPlan) {
    let n = p.degree();
    for tp in &p.tensors {
        let t = &tp.tensor;
        assert_eq!(tp.ranks.len(), n, "{}", t.name);
        let full = t.ty.bytes_for(t.dims.iter().product()).unwrap_or(0);
        if t.dims.len() >= 2 {
            let w = weight(t);
            for r in tp.ranks.iter().filter(|r| r.bytes > 0) {
                let shard = w.shard(r.rows.clone(), r.cols.clone());
                assert!(shard.is_ok(), "{}: {:?} {:?}", t.name, r, shard);
                let rb = r.row_bytes(t);
                assert_eq!(
                    (rb.end - rb.start) * r.rows.len() as u64 * r.experts.len() as u64,
                    r.bytes,
                    "{}",
                    t.name
                );
            }
        }
        let axis = |r: &RankPart| match tp.placement {
            Placement::Column if t.dims.len() == 1 => r.cols.clone(),
            Placement::Column => r.rows.clone(),
            Placement::Row => r.cols.clone(),
            _ => r.experts.clone(),
        };
        match tp.placement {
            Placement::Column | Placement::Row | Placement::Expert => {
                let mut ranges: Vec<_> = tp.ranks.iter().map(axis).collect();
                ranges.sort_by_key(|r| r.start);
                ranges.dedup();
                let covered = ranges.windows(2).all(|w| w[0].end == w[1].start);
                assert!(covered, "{}: {ranges:?}", t.name);
                let sum: u64 = if tp.note.is_some() && tp.placement == Placement::Column {
                    // Replicated KV groups: count each distinct part once.
                    let mut seen = Vec::new();
                    tp.ranks
                        .iter()
                        .filter(|r| {
                            let new = !seen.contains(&r.rows);
                            seen.push(r.rows.clone());
                            new
                        })
                        .map(|r| r.bytes)
                        .sum()
                } else {
                    tp.ranks.iter().map(|r| r.bytes).sum()
                };
                assert_eq!(sum, full, "{}", t.name);
            }
            Placement::Replicated => {
                assert!(tp.ranks.iter().all(|r| r.bytes == full), "{}", t.name);
            }
            Placement::RankZero => {
                assert_eq!(tp.ranks[0].bytes, full);
                assert!(tp.ranks[1..].iter().all(|r| r.bytes == 0));
            }
        }
    }
}

const TYPES: [T; 8] = [
    T::F32,
    T::F16,
    T::Q4_0,
    T::Q8_0,
    T::Q4K,
    T::Q5K,
    T::Q6K,
    T::Iq4Xs,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn dense_plans_hold_their_invariants(
        heads in prop::sample::select(vec![1usize, 2, 4, 6, 8, 16]),
        kv_div in prop::sample::select(vec![1usize, 2, 4, 8]),
        head_dim in prop::sample::select(vec![32usize, 64, 128, 256]),
        ff_mult in 1usize..12,
        ty in prop::sample::select(TYPES.to_vec()),
        wo in prop::sample::select(TYPES.to_vec()),
        down in prop::sample::select(TYPES.to_vec()),
        degree in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        tied in any::<bool>(),
    ) {
        let kv = (heads / kv_div).max(1);
        let n_embd = 256;
        let c = dense(Architecture::Llama, 300, n_embd, 2, heads, kv, head_dim, 256 * ff_mult);
        let t = dense_tensors(&c, ty, wo, down, tied);
        let p = plan(&c, &t, degree);
        check_plan_invariants(&p);
        // A split kind really splits: each rank holds 1/degree of the query rows.
        if p.decisions.attn.is_split() {
            prop_assert!(p.decisions.q_heads.iter().all(|h| h.len() == heads / degree));
        }
        // Replication always comes with a reason.
        for (name, why) in p.replications() {
            prop_assert!(!why.is_empty(), "{}", name);
        }
    }

    #[test]
    fn moe_plans_hold_their_invariants(
        fe in prop::sample::select(vec![64usize, 128, 256, 512]),
        ne in prop::sample::select(vec![4usize, 6, 8, 16]),
        ty in prop::sample::select(TYPES.to_vec()),
        degree in prop::sample::select(vec![1usize, 2, 4, 8]),
    ) {
        let (c, t) = mla_moe(fe, ne, ty);
        let p = plan(&c, &t, degree);
        check_plan_invariants(&p);
        if p.decisions.moe == MoeMode::ExpertParallel {
            prop_assert!(p.decisions.experts.iter().all(|e| e.len() == ne / degree));
        }
    }
}
