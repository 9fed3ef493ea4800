//! The forward pass on tiny synthetic models of every architecture: KV-cache decode and
//! batched prefill agree with one full-sequence forward, taps come in the documented order and
//! shapes, sliding windows mask, and bad files give errors naming the tensor or key.

mod model_support;

use engine::exec::{Engine, Session};
use engine::model::{Model, ModelError};
use engine::runtime::{CpuBackend, Logits};
use engine::taps::TapRecorder;
use kernels::cpu::Isa;
use kernels::quant::GgmlType;
use model_support::{load, tokens, write, Arch, Spec, N_EMBD, N_VOCAB};

const ARCHES: [Arch; 3] = [Arch::Llama, Arch::Gemma3, Arch::Deepseek2];

fn backend(isa: Isa, threads: usize) -> CpuBackend {
    CpuBackend::new(Some(isa), Some(threads)).unwrap_or_else(|e| panic!("{e}"))
}

fn full_logits(model: &Model, be: &CpuBackend, toks: &[u32]) -> Logits {
    let engine = Engine::new(model, be).unwrap_or_else(|e| panic!("{e}"));
    let mut s = Session::new(&engine, 64).unwrap_or_else(|e| panic!("{e}"));
    s.set_logits_all(true);
    s.forward(toks, None).unwrap_or_else(|e| panic!("{e}"))
}

/// Largest |a - b| relative to the largest |b| of the row.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Decoding with the cache runs the same per-row arithmetic as a full forward (matmuls and
/// activation quantization are per row; attention reads the same keys), so the only
/// differences are summation-order effects in the kernels' token tiling: 1e-5 of the row's
/// largest logit is far below what a wrong position, mask or cache row produces (≥ 1e-2 here).
const DECODE_TOL: f32 = 1e-5;

fn check_decode_equals_full(arch: Arch, mat_type: GgmlType) {
    let mut spec = Spec::new(arch);
    spec.mat_type = mat_type;
    let (_dir, model) = load(&spec);
    let be = backend(Isa::detect(), 2);
    let toks = tokens(12, 7);
    let full = full_logits(&model, &be, &toks);
    assert_eq!(full.n_rows, toks.len());

    let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
    let mut s = Session::new(&engine, 64).unwrap_or_else(|e| panic!("{e}"));
    for (i, &t) in toks.iter().enumerate() {
        let l = s.forward(&[t], None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.n_rows, 1);
        let err = rel_err(l.last(), full.row(i));
        assert!(
            err <= DECODE_TOL,
            "{arch:?} {mat_type} position {i}: rel err {err}"
        );
    }
    assert_eq!(s.n_past(), toks.len());
}

#[test]
fn decode_equals_full_forward_llama() {
    check_decode_equals_full(Arch::Llama, GgmlType::Q8_0);
    check_decode_equals_full(Arch::Llama, GgmlType::F32);
}

#[test]
fn decode_equals_full_forward_gemma3() {
    check_decode_equals_full(Arch::Gemma3, GgmlType::Q8_0);
    check_decode_equals_full(Arch::Gemma3, GgmlType::F32);
}

#[test]
fn decode_equals_full_forward_deepseek2() {
    check_decode_equals_full(Arch::Deepseek2, GgmlType::Q8_0);
    check_decode_equals_full(Arch::Deepseek2, GgmlType::F32);
}

#[test]
fn chunked_prefill_equals_one_batch() {
    for arch in ARCHES {
        let (_dir, model) = load(&Spec::new(arch));
        let be = backend(Isa::detect(), 2);
        let toks = tokens(11, 3);
        let full = full_logits(&model, &be, &toks);
        let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
        let mut s = Session::new(&engine, 64).unwrap_or_else(|e| panic!("{e}"));
        s.set_logits_all(true);
        let mut row = 0;
        for chunk in [&toks[..5], &toks[5..6], &toks[6..]] {
            let l = s.forward(chunk, None).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(l.n_rows, chunk.len());
            for i in 0..chunk.len() {
                let err = rel_err(l.row(i), full.row(row));
                assert!(err <= DECODE_TOL, "{arch:?} row {row}: rel err {err}");
                row += 1;
            }
        }
    }
}

#[test]
fn last_only_logits_equal_the_last_row() {
    for arch in ARCHES {
        let (_dir, model) = load(&Spec::new(arch));
        let be = backend(Isa::detect(), 1);
        let toks = tokens(9, 5);
        let full = full_logits(&model, &be, &toks);
        let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
        let mut s = Session::new(&engine, 64).unwrap_or_else(|e| panic!("{e}"));
        let l = s.forward(&toks, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((l.n_rows, l.data.len()), (1, N_VOCAB));
        assert!(rel_err(l.last(), full.last()) <= DECODE_TOL, "{arch:?}");
    }
}

/// Different ISAs run different (ggml-equivalent) dot-product kernels that accumulate in a
/// different order. With F32 weights the activations stay f32 and the differences stay at
/// accumulation rounding: 1e-4 of the largest logit. With Q8_0 weights the activations are
/// quantized to Q8_0 per block, and a 1e-7 difference upstream can flip one rounding, an error
/// of half a quantization step (1/254 of a block's largest value) that later layers carry:
/// 5e-2 bounds that while still catching a wrong kernel (errors of order 1).
#[test]
fn isas_and_thread_counts_agree() {
    for (mat_type, tol) in [(GgmlType::F32, 1e-4), (GgmlType::Q8_0, 5e-2)] {
        check_isas(mat_type, tol);
    }
}

fn check_isas(mat_type: GgmlType, tol: f32) {
    for arch in ARCHES {
        let mut spec = Spec::new(arch);
        spec.mat_type = mat_type;
        let (_dir, model) = load(&spec);
        let toks = tokens(8, 11);
        let reference = full_logits(&model, &backend(Isa::Scalar, 1), &toks);
        for isa in Isa::available() {
            for threads in [1, 2] {
                let l = full_logits(&model, &backend(isa, threads), &toks);
                for i in 0..toks.len() {
                    let err = rel_err(l.row(i), reference.row(i));
                    assert!(
                        err <= tol,
                        "{arch:?} {mat_type} {isa} x{threads} row {i}: {err}"
                    );
                }
            }
        }
    }
}

fn expected_tap_names(n_layer: usize, moe_from: Option<usize>) -> Vec<String> {
    let mut v = vec!["embed".to_string()];
    for i in 0..n_layer {
        for t in ["attn_norm", "q", "k", "v", "attn", "attn_out", "ffn_norm"] {
            v.push(format!("blk.{i}.{t}"));
        }
        if moe_from.is_some_and(|f| i >= f) {
            v.push(format!("blk.{i}.router"));
        }
        v.push(format!("blk.{i}.ffn_out"));
        v.push(format!("blk.{i}.out"));
    }
    v.push("output_norm".into());
    v.push("logits".into());
    v
}

#[test]
fn taps_in_forward_order_with_shapes() {
    for arch in ARCHES {
        let spec = Spec::new(arch);
        let (_dir, model) = load(&spec);
        let c = model.config().clone();
        let be = backend(Isa::detect(), 1);
        let toks = tokens(5, 9);
        let mut rec = TapRecorder::new();
        let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
        let mut s = Session::new(&engine, 64).unwrap_or_else(|e| panic!("{e}"));
        // Generation mode: taps still cover every token of the call.
        let logits = s
            .forward(&toks, Some(&mut rec))
            .unwrap_or_else(|e| panic!("{e}"));
        let moe_from = c.moe.map(|m| m.n_dense_lead);
        assert_eq!(
            rec.names(),
            expected_tap_names(spec.n_layer, moe_from),
            "{arch:?}"
        );
        let (qk, kw, vw) = match c.mla {
            Some(m) => (
                c.n_head * (m.qk_nope + m.qk_rope),
                c.n_head * (m.qk_nope + m.qk_rope),
                c.n_head * m.v_head_dim,
            ),
            None => (
                c.n_head * c.head_dim_k,
                c.n_head_kv * c.head_dim_k,
                c.n_head_kv * c.head_dim_v,
            ),
        };
        for t in &rec.taps {
            let width = match t.name.rsplit('.').next().unwrap_or("") {
                "q" => qk,
                "k" => kw,
                "v" => vw,
                "attn" => c.n_head * c.head_dim_v,
                "router" => c.moe.map_or(0, |m| m.n_expert),
                "logits" => N_VOCAB,
                _ => N_EMBD,
            };
            assert_eq!(t.shape, vec![toks.len(), width], "{arch:?} {}", t.name);
            assert_eq!(t.data.len(), toks.len() * width, "{}", t.name);
        }
        // The logits tap's last row is what the call returned.
        let tap = rec.get("logits").unwrap_or_else(|| panic!("no logits tap"));
        assert_eq!(&tap.data[(toks.len() - 1) * N_VOCAB..], logits.last());
        // The residual stream after the last layer feeds output_norm: recompute nothing, just
        // check the decode call's taps have one row.
        let mut rec1 = TapRecorder::new();
        s.forward(&[toks[0]], Some(&mut rec1))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(rec1.taps.iter().all(|t| t.shape[0] == 1), "{arch:?}");
    }
}

#[test]
fn gemma3_embed_tap_is_scaled_by_sqrt_n_embd() {
    let (_dir, model) = load(&Spec::new(Arch::Gemma3));
    let be = backend(Isa::Scalar, 1);
    let mut rec = TapRecorder::new();
    let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
    let mut s = Session::new(&engine, 8).unwrap_or_else(|e| panic!("{e}"));
    s.forward(&[3], Some(&mut rec))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut row = vec![0f32; N_EMBD];
    model
        .embedding_row(3, &mut row)
        .unwrap_or_else(|e| panic!("{e}"));
    let scale = (N_EMBD as f32).sqrt();
    let tap = rec.get("embed").unwrap_or_else(|| panic!("no embed tap"));
    for (a, b) in tap.data.iter().zip(&row) {
        assert_eq!(*a, b * scale);
    }
}

/// With one sliding-window layer (gemma3, n_layer 1 < 6: every layer is local) the output at
/// position p depends only on tokens p-w+1 ..= p, and RoPE is relative: so the logits at p of
/// a long sequence equal the last logits of the window's tokens run on their own. Tolerance:
/// RoPE angles at larger positions round differently in f32 (~1e-6 rad per unit of position
/// times 1e-4 relative error of the angle), 1e-3 of the largest logit.
#[test]
fn sliding_window_limits_what_a_local_layer_sees() {
    let mut spec = Spec::new(Arch::Gemma3);
    spec.n_layer = 1;
    spec.sliding_window = 4;
    spec.mat_type = GgmlType::F32;
    let (_dir, model) = load(&spec);
    assert!(model.config().is_swa_layer(0));
    let be = backend(Isa::detect(), 1);
    let toks = tokens(12, 21);
    let full = full_logits(&model, &be, &toks);
    let w = 4;
    for p in w..toks.len() {
        let alone = full_logits(&model, &be, &toks[p + 1 - w..=p]);
        let err = rel_err(alone.last(), full.row(p));
        assert!(err <= 1e-3, "position {p}: rel err {err}");
        // And one token less would change it: the window is not narrower than w.
        let narrower = full_logits(&model, &be, &toks[p + 2 - w..=p]);
        let err = rel_err(narrower.last(), full.row(p));
        assert!(
            err > 1e-3,
            "position {p}: a window of w-1 tokens gives the same logits"
        );
    }
}

#[test]
fn gemma3_layer_pattern_and_rope_bases() {
    let (_dir, model) = load(&Spec::new(Arch::Gemma3));
    let c = model.config();
    let local: Vec<bool> = (0..6).map(|i| c.is_swa_layer(i)).collect();
    assert_eq!(local, [true, true, true, true, true, false]);
    assert_eq!(c.rope_for_layer(0).freq_base, 10_000.0);
    assert_eq!(c.rope_for_layer(5).freq_base, 1_000_000.0);
    assert_eq!(c.sliding_window, Some(4));
    // 1/sqrt(key_length) with key_length 32.
    assert_eq!(c.attn_scale, 1.0 / 32f32.sqrt());
}

fn load_err(spec: &Spec) -> String {
    let (_dir, path) = write(spec);
    match Model::load(&path) {
        Ok(_) => panic!("expected an error for {:?}", spec.skip),
        Err(e) => {
            let _: &ModelError = &e;
            e.to_string()
        }
    }
}

#[test]
fn missing_tensor_is_named() {
    for (arch, name) in [
        (Arch::Llama, "blk.1.attn_k.weight"),
        (Arch::Gemma3, "blk.3.attn_q_norm.weight"),
        (Arch::Gemma3, "blk.0.post_ffw_norm.weight"),
        (Arch::Deepseek2, "blk.1.ffn_down_exps.weight"),
        (Arch::Deepseek2, "blk.0.attn_kv_b.weight"),
        (Arch::Llama, "token_embd.weight"),
    ] {
        let mut spec = Spec::new(arch);
        spec.skip.push(name.into());
        let msg = load_err(&spec);
        assert!(msg.contains(name) && msg.contains("found nothing"), "{msg}");
    }
}

#[test]
fn wrong_shape_names_tensor_and_dims() {
    let mut spec = Spec::new(Arch::Llama);
    spec.wrong_shape.push("blk.0.ffn_up.weight".into());
    let msg = load_err(&spec);
    assert!(
        msg.contains("blk.0.ffn_up.weight")
            && msg.contains("[64, 128]")
            && msg.contains("[128, 128]"),
        "{msg}"
    );
    let mut spec = Spec::new(Arch::Deepseek2);
    spec.wrong_shape.push("blk.1.ffn_gate_exps.weight".into());
    let msg = load_err(&spec);
    assert!(msg.contains("[64, 64, 4]"), "{msg}");
}

#[test]
fn missing_key_is_named() {
    for (arch, key) in [
        (Arch::Llama, "llama.embedding_length"),
        (Arch::Gemma3, "gemma3.attention.sliding_window"),
        (Arch::Deepseek2, "deepseek2.attention.kv_lora_rank"),
        (Arch::Deepseek2, "deepseek2.expert_weights_scale"),
    ] {
        let mut spec = Spec::new(arch);
        spec.skip_keys.push(key.into());
        let msg = load_err(&spec);
        assert!(msg.contains(key), "{msg}");
    }
}

#[test]
fn forward_rejects_bad_tokens_and_overflow_without_touching_the_cache() {
    let (_dir, model) = load(&Spec::new(Arch::Llama));
    let be = backend(Isa::Scalar, 1);
    let engine = Engine::new(&model, &be).unwrap_or_else(|e| panic!("{e}"));
    let mut s = Session::new(&engine, 4).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.forward(&[], None).is_err());
    let e = s.forward(&[1, N_VOCAB as u32], None);
    assert!(matches!(
        e,
        Err(engine::runtime::RuntimeError::TokenOutOfRange { index: 1, .. })
    ));
    s.forward(&[1, 2, 3], None)
        .unwrap_or_else(|e| panic!("{e}"));
    let e = s.forward(&[1, 2], None);
    assert!(matches!(
        e,
        Err(engine::runtime::RuntimeError::ContextFull { .. })
    ));
    assert_eq!(s.n_past(), 3);
}
