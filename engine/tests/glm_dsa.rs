//! `glm-dsa` (GLM-5: MLA + DeepSeek Sparse Attention's lightning indexer + MoE + NextN) on a tiny
//! synthetic model: the file read as llama.cpp names it, the indexer's selection as documented
//! (docs/TAPS.md `indexer_top_k`), the sparse path differing from dense attention exactly where
//! the top-k leaves cells out, every path through the engine (decode, chunked prefill, draft
//! trees with compaction, rollback) equal to one full forward, and bad files refused by name.
//!
//! Bounds as in `model_forward.rs`: the same arithmetic on the same rows differs only by the
//! kernels' token tiling (summation order), ≤ 1e-5 of a row's largest logit; a wrong cell,
//! selection or cache row moves logits by ≥ 1e-2 on these models.

use std::path::PathBuf;

use engine::exec::{Engine, Session};
use engine::gguf::{GgufWriter, MetadataValue as V};
use engine::model::{Architecture, Model, ModelError};
use engine::runtime::{Batch, CpuBackend, KvDtype, Logits};
use engine::taps::TapRecorder;
use kernels::cpu::Isa;
use kernels::quant::{quantize, GgmlType};

const TOL: f32 = 1e-5;
const N_VOCAB: usize = 96;
const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const Q_LORA: usize = 32;
const KV_LORA: usize = 32;
const QK_NOPE: usize = 32;
const QK_ROPE: usize = 16;
const V_DIM: usize = 32;
const N_FF: usize = 128;
const N_EXPERT: usize = 4;
const N_FF_EXP: usize = 64;
const IDX_HEADS: usize = 2;
const IDX_DIM: usize = 32;
/// Three trunk layers (0 dense, 1 and 2 MoE) and one NextN block: `block_count` 4.
const N_TRUNK: usize = 3;

fn ok<T, E: std::fmt::Display>(r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[derive(Clone)]
struct Spec {
    top_k: usize,
    /// `attention.indexer.types` (`None`: the key left out).
    types: Option<Vec<bool>>,
    skip: Vec<String>,
    skip_keys: Vec<String>,
    mat_type: GgmlType,
}

impl Spec {
    fn new() -> Spec {
        Spec {
            top_k: 4,
            types: Some(vec![true, false, true]),
            skip: vec![],
            skip_keys: vec![],
            mat_type: GgmlType::Q8_0,
        }
    }
}

struct Builder<'a> {
    w: GgufWriter,
    rng: Lcg,
    spec: &'a Spec,
}

impl Builder<'_> {
    fn key(&mut self, k: &str, v: V) {
        let full = format!("glm-dsa.{k}");
        if !self.spec.skip_keys.contains(&full) {
            self.w.add_metadata(full, v);
        }
    }
    fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, scale: f32, offset: f32) {
        let n: usize = dims.iter().product();
        let vals: Vec<f32> = (0..n).map(|_| self.rng.next() * scale + offset).collect();
        if self.spec.skip.iter().any(|s| s == name) {
            return;
        }
        let data = quantize(ty, &vals).unwrap_or_else(|e| panic!("quantize {name}: {e}"));
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        ok(self.w.add_tensor(name, ty, &dims, data));
    }
    fn mat(&mut self, name: &str, k: usize, n: usize) {
        let ty = self.spec.mat_type;
        self.tensor(name, &[k, n], ty, 1.0 / (k as f32).sqrt(), 0.0);
    }
    fn norm(&mut self, name: &str, n: usize) {
        self.tensor(name, &[n], GgmlType::F32, 0.2, 1.0);
    }
}

fn write(spec: &Spec) -> (tempfile::TempDir, PathBuf) {
    let mut b = Builder {
        w: GgufWriter::new(),
        rng: Lcg(42),
        spec,
    };
    let u = |v: usize| V::U32(v as u32);
    b.w.add_metadata("general.architecture", V::String("glm-dsa".into()));
    b.key("context_length", u(256));
    b.key("embedding_length", u(N_EMBD));
    b.key("block_count", u(N_TRUNK + 1));
    b.key("nextn_predict_layers", u(1));
    b.key("feed_forward_length", u(N_FF));
    b.key("attention.head_count", u(N_HEAD));
    b.key("attention.head_count_kv", u(N_HEAD));
    b.key("attention.layer_norm_rms_epsilon", V::F32(1e-6));
    b.key("rope.freq_base", V::F32(10_000.0));
    b.key("attention.key_length", u(QK_NOPE + QK_ROPE));
    b.key("attention.value_length", u(V_DIM));
    b.key("attention.q_lora_rank", u(Q_LORA));
    b.key("attention.kv_lora_rank", u(KV_LORA));
    b.key("rope.dimension_count", u(QK_ROPE));
    b.key("expert_count", u(N_EXPERT));
    b.key("expert_used_count", u(2));
    b.key("expert_shared_count", u(1));
    b.key("expert_feed_forward_length", u(N_FF_EXP));
    b.key("leading_dense_block_count", u(1));
    b.key("expert_weights_scale", V::F32(2.5));
    b.key("expert_weights_norm", V::Bool(true));
    b.key("attention.indexer.head_count", u(IDX_HEADS));
    b.key("attention.indexer.key_length", u(IDX_DIM));
    b.key("attention.indexer.top_k", u(spec.top_k));
    if let Some(t) = &spec.types {
        b.key(
            "attention.indexer.types",
            V::Array(t.iter().map(|&f| V::Bool(f)).collect()),
        );
    }
    b.tensor(
        "token_embd.weight",
        &[N_EMBD, N_VOCAB],
        GgmlType::Q8_0,
        1.0,
        0.0,
    );
    b.norm("output_norm.weight", N_EMBD);
    b.mat("output.weight", N_EMBD, N_VOCAB);
    let full = spec.types.clone().unwrap_or(vec![true; N_TRUNK]);
    for il in 0..=N_TRUNK {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        b.norm(&n("attn_norm"), N_EMBD);
        b.norm(&n("ffn_norm"), N_EMBD);
        b.mat(&n("attn_q_a"), N_EMBD, Q_LORA);
        b.norm(&n("attn_q_a_norm"), Q_LORA);
        b.mat(&n("attn_q_b"), Q_LORA, N_HEAD * (QK_NOPE + QK_ROPE));
        b.mat(&n("attn_kv_a_mqa"), N_EMBD, KV_LORA + QK_ROPE);
        b.norm(&n("attn_kv_a_norm"), KV_LORA);
        b.mat(&n("attn_kv_b"), KV_LORA, N_HEAD * (QK_NOPE + V_DIM));
        b.mat(&n("attn_output"), N_HEAD * V_DIM, N_EMBD);
        if il == N_TRUNK || full.get(il).copied().unwrap_or(false) {
            b.mat(&n("indexer.attn_q_b"), Q_LORA, IDX_HEADS * IDX_DIM);
            b.mat(&n("indexer.attn_k"), N_EMBD, IDX_DIM);
            b.norm(&n("indexer.k_norm"), IDX_DIM);
            b.tensor(
                &format!("blk.{il}.indexer.k_norm.bias"),
                &[IDX_DIM],
                GgmlType::F32,
                0.1,
                0.0,
            );
            b.mat(&n("indexer.proj"), N_EMBD, IDX_HEADS);
        }
        if il == 0 {
            b.mat(&n("ffn_gate"), N_EMBD, N_FF);
            b.mat(&n("ffn_up"), N_EMBD, N_FF);
            b.mat(&n("ffn_down"), N_FF, N_EMBD);
        } else {
            b.tensor(
                &n("ffn_gate_inp"),
                &[N_EMBD, N_EXPERT],
                GgmlType::F32,
                1.0,
                0.0,
            );
            b.tensor(
                &format!("blk.{il}.exp_probs_b.bias"),
                &[N_EXPERT],
                GgmlType::F32,
                0.1,
                0.0,
            );
            let ty = spec.mat_type;
            let s = 1.0 / (N_EMBD as f32).sqrt();
            b.tensor(
                &n("ffn_gate_exps"),
                &[N_EMBD, N_FF_EXP, N_EXPERT],
                ty,
                s,
                0.0,
            );
            b.tensor(&n("ffn_up_exps"), &[N_EMBD, N_FF_EXP, N_EXPERT], ty, s, 0.0);
            let s = 1.0 / (N_FF_EXP as f32).sqrt();
            b.tensor(
                &n("ffn_down_exps"),
                &[N_FF_EXP, N_EMBD, N_EXPERT],
                ty,
                s,
                0.0,
            );
            b.mat(&n("ffn_gate_shexp"), N_EMBD, N_FF_EXP);
            b.mat(&n("ffn_up_shexp"), N_EMBD, N_FF_EXP);
            b.mat(&n("ffn_down_shexp"), N_FF_EXP, N_EMBD);
        }
        if il == N_TRUNK {
            b.mat(&n("nextn.eh_proj"), 2 * N_EMBD, N_EMBD);
            b.norm(&n("nextn.enorm"), N_EMBD);
            b.norm(&n("nextn.hnorm"), N_EMBD);
            b.norm(&n("nextn.shared_head_norm"), N_EMBD);
        }
    }
    let dir = ok(tempfile::tempdir());
    let path = dir.path().join("tiny-glm-dsa.gguf");
    ok(b.w.write(&path));
    (dir, path)
}

fn load(spec: &Spec) -> (tempfile::TempDir, Model) {
    let (dir, path) = write(spec);
    (dir, ok(Model::load(&path)))
}

fn load_err(spec: &Spec) -> String {
    let (_dir, path) = write(spec);
    match Model::load(&path) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut r = Lcg(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n)
        .map(|_| ((r.next() + 1.0) * 0.5 * N_VOCAB as f32) as u32 % N_VOCAB as u32)
        .collect()
}

fn backend() -> CpuBackend {
    ok(CpuBackend::new(Some(Isa::detect()), Some(2)))
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn full_logits(model: &Model, be: &CpuBackend, toks: &[u32]) -> Logits {
    let engine = ok(Engine::new(model, be));
    let mut s = ok(Session::new(&engine, 64));
    s.set_logits_all(true);
    ok(s.forward(toks, None))
}

#[test]
fn config_and_tensors_are_read_as_llama_cpp_names_them() {
    let (_dir, model) = load(&Spec::new());
    let c = model.config();
    assert_eq!(c.arch, Architecture::GlmDsa);
    // block_count 4 = 3 trunk layers + 1 NextN block.
    assert_eq!((c.n_layer, c.n_nextn), (N_TRUNK, 1));
    let dsa = c.dsa.as_ref().expect("indexer config");
    assert_eq!(
        (dsa.n_head, dsa.head_dim, dsa.top_k),
        (IDX_HEADS, IDX_DIM, 4)
    );
    assert_eq!(dsa.full, vec![true, false, true]);
    // (n_head · head_dim)^-½, DeepSeek-V3.2's n_heads^-½ · head_dim^-½.
    assert!((dsa.weights_scale() - 0.125).abs() < 1e-7);
    // Full layers have an indexer, the shared one (no tensors in the file) has none.
    assert!(model.indexer(0).is_some() && model.indexer(1).is_none());
    assert!(model.indexer(2).is_some());
    // Indexer matrices keep the file's type: never dequantized at load.
    let ix = model.indexer(0).expect("layer 0 indexer");
    assert_eq!(
        (ix.q_b.ty, ix.k.ty, ix.proj.ty),
        (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0)
    );
    assert_eq!((ix.q_b.k_dim, ix.q_b.n_rows), (Q_LORA, IDX_HEADS * IDX_DIM));
    // The NextN block is recognised and kept with its whole layer and indexer.
    let mtp = model.mtp_layers();
    assert_eq!(mtp.len(), 1);
    assert_eq!(mtp[0].index, N_TRUNK);
    assert!(mtp[0].indexer.is_some() && mtp[0].shared_head_norm.is_some());
    assert_eq!(
        (mtp[0].eh_proj.k_dim, mtp[0].eh_proj.n_rows),
        (2 * N_EMBD, N_EMBD)
    );
    assert!(mtp[0].embed_tokens.is_none());
    // The indexer's matrices are listed with the model's weights.
    let names: Vec<&str> = model.weights().iter().map(|w| w.name()).collect();
    assert!(names.contains(&"blk.2.indexer.attn_q_b.weight"));
    assert!(!names.iter().any(|n| n.starts_with("blk.3.")));
}

#[test]
fn without_indexer_types_every_layer_is_full() {
    // GLM-5 / 5.1 files (context below 1M) carry no `indexer.types`: a full indexer everywhere.
    let spec = Spec {
        types: None,
        ..Spec::new()
    };
    let (_dir, model) = load(&spec);
    let dsa = model.config().dsa.as_ref().expect("indexer config");
    assert_eq!(dsa.full, vec![true; N_TRUNK]);
    assert!((0..N_TRUNK).all(|i| model.indexer(i).is_some()));
}

#[test]
fn bad_files_are_refused_by_name() {
    let mut spec = Spec::new();
    spec.skip = vec!["blk.2.indexer.attn_k.weight".into()];
    let e = load_err(&spec);
    assert!(e.contains("blk.2.indexer.attn_k.weight"), "{e}");

    let mut spec = Spec::new();
    spec.skip = vec!["blk.0.indexer.k_norm.bias".into()];
    let e = load_err(&spec);
    assert!(e.contains("blk.0.indexer.k_norm.bias"), "{e}");

    let mut spec = Spec::new();
    spec.skip = vec!["blk.3.nextn.eh_proj.weight".into()];
    let e = load_err(&spec);
    assert!(e.contains("blk.3.nextn.eh_proj.weight"), "{e}");

    let mut spec = Spec::new();
    spec.skip_keys = vec!["glm-dsa.attention.indexer.top_k".into()];
    let e = load_err(&spec);
    assert!(e.contains("glm-dsa.attention.indexer.top_k"), "{e}");

    // A shared layer needs a full one before it.
    let spec = Spec {
        types: Some(vec![false, true, true]),
        ..Spec::new()
    };
    let e = load_err(&spec);
    assert!(e.contains("glm-dsa.attention.indexer.types"), "{e}");

    // Fewer flags than layers.
    let spec = Spec {
        types: Some(vec![true]),
        ..Spec::new()
    };
    let e = load_err(&spec);
    assert!(e.contains("one per layer"), "{e}");

    let spec = Spec {
        top_k: 0,
        ..Spec::new()
    };
    let e = load_err(&spec);
    assert!(e.contains("glm-dsa.attention.indexer.top_k"), "{e}");
    assert!(matches!(
        {
            let (_d, p) = write(&Spec {
                top_k: 0,
                ..Spec::new()
            });
            Model::load(&p)
        },
        Err(ModelError::InvalidConfig { .. })
    ));
}

/// Each full layer's `indexer_top_k` tap: per query its `min(top_k, p + 1)` selected positions,
/// ascending, all causal, padded with −1; shared layers emit none.
#[test]
fn selection_tap_is_causal_top_k_on_full_layers_only() {
    let (_dir, model) = load(&Spec::new());
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let toks = tokens(12, 3);
    let mut rec = TapRecorder::new();
    let mut s = ok(Session::new(&engine, 64));
    s.set_logits_all(true);
    ok(s.forward(&toks, Some(&mut rec)));
    assert!(rec.get("blk.1.indexer_top_k").is_none());
    for il in [0, 2] {
        let t = rec
            .get(&format!("blk.{il}.indexer_top_k"))
            .unwrap_or_else(|| panic!("blk.{il}.indexer_top_k"));
        assert_eq!(t.shape, vec![toks.len(), 4]);
        for (p, row) in t.data.chunks(4).enumerate() {
            let chosen: Vec<f32> = row.iter().copied().filter(|&v| v >= 0.0).collect();
            assert_eq!(
                chosen.len(),
                (p + 1).min(4),
                "layer {il} query {p}: {row:?}"
            );
            assert!(chosen.windows(2).all(|w| w[0] < w[1]), "{row:?}");
            assert!(chosen.iter().all(|&v| v <= p as f32), "{row:?}");
            assert!(row[chosen.len()..].iter().all(|&v| v == -1.0), "{row:?}");
        }
    }
    // Past the top-k the layers select differently somewhere (two indexers, not one copied).
    let a = &rec.get("blk.0.indexer_top_k").expect("tap").data;
    let b = &rec.get("blk.2.indexer_top_k").expect("tap").data;
    assert_ne!(a, b);
}

/// The sparse path changes the result exactly where the top-k leaves visible cells out: with
/// top-k 4 the first 4 positions see every cell (the same bits as a top-k that never binds),
/// later ones differ.
#[test]
fn sparse_attention_differs_from_dense_only_past_the_top_k() {
    let be = backend();
    let toks = tokens(12, 5);
    let (_d1, sparse) = load(&Spec::new());
    let (_d2, dense) = load(&Spec {
        top_k: 1000,
        ..Spec::new()
    });
    let a = full_logits(&sparse, &be, &toks);
    let b = full_logits(&dense, &be, &toks);
    for p in 0..toks.len() {
        let err = rel_err(a.row(p), b.row(p));
        if p < 4 {
            assert_eq!(a.row(p), b.row(p), "position {p}");
        } else if p >= 6 {
            // ≥ 2 visible cells left out of every layer's attention.
            assert!(
                err > 1e-3,
                "position {p}: sparse equals dense (rel err {err})"
            );
        }
    }
}

#[test]
fn decode_and_chunked_prefill_equal_one_forward() {
    for ty in [GgmlType::Q8_0, GgmlType::F32] {
        let spec = Spec {
            mat_type: ty,
            ..Spec::new()
        };
        let (_dir, model) = load(&spec);
        let be = backend();
        let toks = tokens(14, 7);
        let full = full_logits(&model, &be, &toks);
        let engine = ok(Engine::new(&model, &be));
        let mut s = ok(Session::new(&engine, 64));
        for (i, &t) in toks.iter().enumerate() {
            let l = ok(s.forward(&[t], None));
            let err = rel_err(l.last(), full.row(i));
            assert!(err <= TOL, "{ty} decode position {i}: rel err {err}");
        }
        let mut s = ok(Session::new(&engine, 64));
        s.set_logits_all(true);
        let mut row = 0;
        for chunk in [&toks[..5], &toks[5..6], &toks[6..]] {
            let l = ok(s.forward(chunk, None));
            for i in 0..chunk.len() {
                let err = rel_err(l.row(i), full.row(row));
                assert!(err <= TOL, "{ty} chunked row {row}: rel err {err}");
                row += 1;
            }
        }
    }
}

/// A draft tree: (token, parent index).
const TREE: [(u32, Option<usize>); 7] = [
    (3, None),
    (17, Some(0)),
    (29, Some(0)),
    (41, Some(1)),
    (52, Some(2)),
    (60, Some(2)),
    (71, Some(5)),
];

fn path_to(node: usize) -> Vec<usize> {
    let mut p = vec![node];
    while let Some(parent) = TREE[*p.last().unwrap_or(&0)].1 {
        p.push(parent);
    }
    p.reverse();
    p
}

fn alone(engine: &Engine<'_, CpuBackend>, toks: &[u32]) -> Logits {
    let mut cache = ok(engine.new_cache(64, KvDtype::F32));
    let l = ok(engine.forward(&mut cache, &Batch::chain(0, 0, toks, true), None));
    cache.commit();
    l
}

/// Tree speculation over the sparse path: every node's selection is made among its own
/// ancestors (the tree mask composed with the top-k), so each node equals its path run alone;
/// after compaction to an accepted path that moved cells, the indexer's key rows moved with the
/// latent rows, so the next decode equals plain decoding. A rolled-back draft leaves no trace.
#[test]
fn tree_forward_compaction_and_rollback_keep_the_indexer_cache() {
    let (_dir, model) = load(&Spec::new());
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    // A prompt longer than the top-k, so the selection binds on every node.
    let prompt = tokens(7, 21);
    let n0 = prompt.len() as u32;
    let mut cache = ok(engine.new_cache(64, KvDtype::F32));
    ok(engine.forward(&mut cache, &Batch::chain(0, 0, &prompt, false), None));
    cache.commit();
    // A rejected draft first: rolled back, it must not disturb anything after.
    ok(engine.forward(&mut cache, &Batch::chain(0, n0, &[5, 6, 7], false), None));
    cache.rollback();
    let mut tree = Batch::new();
    for &(tok, parent) in &TREE {
        let depth = parent.map_or(0, |p| path_to(p).len() as u32);
        tree.push_node(tok, n0 + depth, 0, parent, true);
    }
    let logits = ok(engine.forward(&mut cache, &tree, None));
    for node in 0..TREE.len() {
        let mut seq = prompt.clone();
        seq.extend(path_to(node).iter().map(|&i| TREE[i].0));
        let want = alone(&engine, &seq);
        let err = rel_err(logits.row(node), want.row(seq.len() - 1));
        assert!(err <= TOL, "tree node {node}: rel err {err}");
    }
    // Accept 0 → 2 → 5 → 6: nodes 5 and 6 sit in cells after siblings, so compaction moves them.
    let accepted = path_to(6);
    ok(cache.compact(&be, &accepted));
    let mut seq = prompt.clone();
    seq.extend(accepted.iter().map(|&i| TREE[i].0));
    for extra in [9u32, 33, 47] {
        let next = cache.next_pos(0);
        let l = ok(engine.forward(&mut cache, &Batch::chain(0, next, &[extra], false), None));
        cache.commit();
        seq.push(extra);
        let want = alone(&engine, &seq);
        let err = rel_err(l.last(), want.row(seq.len() - 1));
        assert!(
            err <= TOL,
            "decode after compaction at {}: rel err {err}",
            seq.len() - 1
        );
    }
}

/// Two sequences in one ragged batch: each one's selection is made among its own cells.
#[test]
fn ragged_sequences_select_among_their_own_cells() {
    let (_dir, model) = load(&Spec::new());
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let a = tokens(9, 31);
    let b = tokens(6, 32);
    let mut cache = ok(engine.new_cache(64, KvDtype::F32));
    let mut batch = Batch::chain(1, 0, &a, true);
    for (i, &t) in b.iter().enumerate() {
        batch.push(t, i as u32, 2, true);
    }
    let l = ok(engine.forward(&mut cache, &batch, None));
    let (wa, wb) = (alone(&engine, &a), alone(&engine, &b));
    for i in 0..a.len() {
        assert!(rel_err(l.row(i), wa.row(i)) <= TOL, "sequence 1 row {i}");
    }
    for i in 0..b.len() {
        assert!(
            rel_err(l.row(a.len() + i), wb.row(i)) <= TOL,
            "sequence 2 row {i}"
        );
    }
}
