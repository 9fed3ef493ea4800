//! Tiny synthetic models for the forward-pass tests: every architecture, deterministic
//! pseudo-random weights, written with the engine's GGUF writer to a temporary file.

#![allow(dead_code)]

use std::path::PathBuf;

use engine::gguf::{GgufWriter, MetadataValue};
use engine::model::Model;
use kernels::quant::{quantize, GgmlType};

/// A deterministic generator of values in [-1, 1) (64-bit LCG, top bits).
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Self {
        Lcg(seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407))
    }
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// Which tiny model to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Gemma3,
    Deepseek2,
}

pub struct Spec {
    pub arch: Arch,
    pub n_layer: usize,
    pub sliding_window: u32,
    /// Type of the big matrices (F32 or a quantized type with block size dividing 64).
    pub mat_type: GgmlType,
    /// Tensors to leave out (to test errors).
    pub skip: Vec<String>,
    /// Tensors to write with a wrong shape.
    pub wrong_shape: Vec<String>,
    /// Metadata keys to leave out.
    pub skip_keys: Vec<String>,
}

impl Spec {
    pub fn new(arch: Arch) -> Spec {
        Spec {
            arch,
            n_layer: if arch == Arch::Gemma3 { 6 } else { 2 },
            sliding_window: 4,
            mat_type: GgmlType::Q8_0,
            skip: vec![],
            wrong_shape: vec![],
            skip_keys: vec![],
        }
    }
}

pub const N_VOCAB: usize = 96;
pub const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const HEAD_DIM: usize = 32;
const N_FF: usize = 128;
// MLA and MoE sizes
const Q_LORA: usize = 32;
const KV_LORA: usize = 32;
const QK_NOPE: usize = 32;
const QK_ROPE: usize = 32;
const V_DIM: usize = 32;
const N_EXPERT: usize = 4;
const N_EXPERT_USED: usize = 2;
const N_FF_EXP: usize = 64;

struct Builder<'a> {
    w: GgufWriter,
    rng: Lcg,
    spec: &'a Spec,
}

impl Builder<'_> {
    fn key(&mut self, k: &str, v: MetadataValue) {
        if !self.spec.skip_keys.iter().any(|s| s == k) {
            self.w.add_metadata(k, v);
        }
    }

    fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, scale: f32, offset: f32) {
        let mut dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if self.spec.wrong_shape.iter().any(|s| s == name) {
            dims[0] *= 2;
        }
        let n: u64 = dims.iter().product();
        let vals: Vec<f32> = self
            .rng
            .vec(n as usize, scale)
            .into_iter()
            .map(|v| v + offset)
            .collect();
        if self.spec.skip.iter().any(|s| s == name) {
            return;
        }
        let data = quantize(ty, &vals).unwrap_or_else(|e| panic!("quantize {name}: {e}"));
        self.w
            .add_tensor(name, ty, &dims, data)
            .unwrap_or_else(|e| panic!("add {name}: {e}"));
    }

    fn mat(&mut self, name: &str, k: usize, n: usize) {
        let ty = self.spec.mat_type;
        self.tensor(name, &[k, n], ty, 1.0 / (k as f32).sqrt(), 0.0);
    }

    fn norm(&mut self, name: &str, n: usize) {
        self.tensor(name, &[n], GgmlType::F32, 0.2, 1.0);
    }
}

/// Write the model of `spec` into a temporary directory; returns the directory (keep it alive)
/// and the file.
pub fn write(spec: &Spec) -> (tempfile::TempDir, PathBuf) {
    let arch = match spec.arch {
        Arch::Llama => "llama",
        Arch::Gemma3 => "gemma3",
        Arch::Deepseek2 => "deepseek2",
    };
    let mut b = Builder {
        w: GgufWriter::new(),
        rng: Lcg::new(42),
        spec,
    };
    let u = |v: usize| MetadataValue::U32(v as u32);
    b.key("general.architecture", MetadataValue::String(arch.into()));
    let k = |s: &str| format!("{arch}.{s}");
    b.key(&k("context_length"), u(256));
    b.key(&k("embedding_length"), u(N_EMBD));
    b.key(&k("block_count"), u(spec.n_layer));
    b.key(&k("feed_forward_length"), u(N_FF));
    b.key(&k("attention.head_count"), u(N_HEAD));
    b.key(
        &k("attention.layer_norm_rms_epsilon"),
        MetadataValue::F32(1e-6),
    );
    b.key(&k("rope.freq_base"), MetadataValue::F32(10_000.0));
    match spec.arch {
        Arch::Llama => {
            b.key(&k("attention.head_count_kv"), u(2));
            b.key(&k("attention.key_length"), u(HEAD_DIM));
            b.key(&k("attention.value_length"), u(HEAD_DIM));
            b.key(&k("rope.dimension_count"), u(HEAD_DIM));
        }
        Arch::Gemma3 => {
            b.key(&k("attention.head_count_kv"), u(2));
            b.key(&k("attention.key_length"), u(HEAD_DIM));
            b.key(&k("attention.value_length"), u(HEAD_DIM));
            b.key(
                &k("attention.sliding_window"),
                u(spec.sliding_window as usize),
            );
            b.key(&k("rope.freq_base"), MetadataValue::F32(1_000_000.0));
        }
        Arch::Deepseek2 => {
            b.key(&k("attention.head_count_kv"), u(N_HEAD));
            b.key(&k("attention.key_length"), u(QK_NOPE + QK_ROPE));
            b.key(&k("attention.value_length"), u(V_DIM));
            b.key(&k("attention.q_lora_rank"), u(Q_LORA));
            b.key(&k("attention.kv_lora_rank"), u(KV_LORA));
            b.key(&k("rope.dimension_count"), u(QK_ROPE));
            b.key(&k("expert_count"), u(N_EXPERT));
            b.key(&k("expert_used_count"), u(N_EXPERT_USED));
            b.key(&k("expert_shared_count"), u(1));
            b.key(&k("expert_feed_forward_length"), u(N_FF_EXP));
            b.key(&k("leading_dense_block_count"), u(1));
            b.key(&k("expert_weights_scale"), MetadataValue::F32(1.5));
            b.key(&k("expert_weights_norm"), MetadataValue::Bool(true));
            b.key(&k("expert_gating_func"), u(2));
        }
    }

    b.tensor(
        "token_embd.weight",
        &[N_EMBD, N_VOCAB],
        GgmlType::Q8_0,
        1.0,
        0.0,
    );
    b.norm("output_norm.weight", N_EMBD);
    if spec.arch != Arch::Gemma3 {
        b.mat("output.weight", N_EMBD, N_VOCAB);
    }
    for il in 0..spec.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        b.norm(&n("attn_norm"), N_EMBD);
        b.norm(&n("ffn_norm"), N_EMBD);
        match spec.arch {
            Arch::Llama | Arch::Gemma3 => {
                b.mat(&n("attn_q"), N_EMBD, N_HEAD * HEAD_DIM);
                b.mat(&n("attn_k"), N_EMBD, 2 * HEAD_DIM);
                b.mat(&n("attn_v"), N_EMBD, 2 * HEAD_DIM);
                b.mat(&n("attn_output"), N_HEAD * HEAD_DIM, N_EMBD);
                b.mat(&n("ffn_gate"), N_EMBD, N_FF);
                b.mat(&n("ffn_up"), N_EMBD, N_FF);
                b.mat(&n("ffn_down"), N_FF, N_EMBD);
                if spec.arch == Arch::Gemma3 {
                    b.norm(&n("attn_q_norm"), HEAD_DIM);
                    b.norm(&n("attn_k_norm"), HEAD_DIM);
                    b.norm(&n("post_attention_norm"), N_EMBD);
                    b.norm(&n("post_ffw_norm"), N_EMBD);
                }
            }
            Arch::Deepseek2 => {
                b.mat(&n("attn_q_a"), N_EMBD, Q_LORA);
                b.norm(&n("attn_q_a_norm"), Q_LORA);
                b.mat(&n("attn_q_b"), Q_LORA, N_HEAD * (QK_NOPE + QK_ROPE));
                b.mat(&n("attn_kv_a_mqa"), N_EMBD, KV_LORA + QK_ROPE);
                b.norm(&n("attn_kv_a_norm"), KV_LORA);
                b.mat(&n("attn_kv_b"), KV_LORA, N_HEAD * (QK_NOPE + V_DIM));
                b.mat(&n("attn_output"), N_HEAD * V_DIM, N_EMBD);
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
            }
        }
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let path = dir.path().join(format!("tiny-{arch}.gguf"));
    b.w.write(&path).unwrap_or_else(|e| panic!("write: {e}"));
    (dir, path)
}

/// Build and load the model of `spec`.
pub fn load(spec: &Spec) -> (tempfile::TempDir, Model) {
    let (dir, path) = write(spec);
    let model = Model::load(&path).unwrap_or_else(|e| panic!("load {}: {e}", path.display()));
    (dir, model)
}

/// A deterministic token sequence.
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut r = Lcg::new(seed);
    (0..n)
        .map(|_| ((r.next() + 1.0) * 0.5 * N_VOCAB as f32) as u32 % N_VOCAB as u32)
        .collect()
}
