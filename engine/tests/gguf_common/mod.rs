//! Shared helpers for the GGUF tests: a hand-rolled byte-level encoder (independent of
//! `GgufWriter`, so malformed files can be built field by field) and sample models.
#![allow(dead_code)]

use engine::gguf::{GgmlType, GgufWriter, MetadataValue as V};

/// Little-endian bytes of a GGUF file, built field by field.
#[derive(Default, Clone)]
pub struct Raw {
    pub bytes: Vec<u8>,
}

impl Raw {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn b(mut self, b: &[u8]) -> Self {
        self.bytes.extend_from_slice(b);
        self
    }
    pub fn u8(self, v: u8) -> Self {
        self.b(&[v])
    }
    pub fn u32(self, v: u32) -> Self {
        self.b(&v.to_le_bytes())
    }
    pub fn u64(self, v: u64) -> Self {
        self.b(&v.to_le_bytes())
    }
    pub fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).b(s.as_bytes())
    }
    /// `GGUF`, version, tensor count, metadata count.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        Raw::new().b(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    /// A u32 metadata pair.
    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.str(key).u32(4).u32(v)
    }
    /// A string metadata pair.
    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.str(key).u32(8).str(v)
    }
    /// A tensor info.
    pub fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut r = self.str(name).u32(dims.len() as u32);
        for d in dims {
            r = r.u64(*d);
        }
        r.u32(ty).u64(offset)
    }
    /// Zero padding up to a multiple of `a`.
    pub fn pad(mut self, a: usize) -> Self {
        let n = self.bytes.len().next_multiple_of(a);
        self.bytes.resize(n, 0);
        self
    }
    pub fn zeros(mut self, n: usize) -> Self {
        self.bytes.resize(self.bytes.len() + n, 0);
        self
    }
}

/// Every metadata value type, nested arrays and edge values included.
pub fn sample_metadata() -> Vec<(&'static str, V)> {
    vec![
        ("general.architecture", V::String("llama".into())),
        ("general.name", V::String("tiny ünïcödé 🦙".into())),
        ("t.u8", V::U8(255)),
        ("t.i8", V::I8(-128)),
        ("t.u16", V::U16(65535)),
        ("t.i16", V::I16(-32768)),
        ("t.u32", V::U32(u32::MAX)),
        ("t.i32", V::I32(i32::MIN)),
        ("t.u64", V::U64(u64::MAX)),
        ("t.i64", V::I64(i64::MIN)),
        ("t.f32", V::F32(-1.5e-7)),
        ("t.f64", V::F64(std::f64::consts::PI)),
        ("t.true", V::Bool(true)),
        ("t.false", V::Bool(false)),
        ("t.empty_str", V::String(String::new())),
        (
            "t.arr_str",
            V::Array(vec![
                V::String("<s>".into()),
                V::String("".into()),
                V::String("▁a".into()),
            ]),
        ),
        (
            "t.arr_f32",
            V::Array(vec![V::F32(0.0), V::F32(-2.25), V::F32(1e30)]),
        ),
        ("t.arr_i32", V::Array(vec![V::I32(-1), V::I32(7)])),
        ("t.arr_u8", V::Array(vec![V::U8(1), V::U8(2)])),
        ("t.arr_bool", V::Array(vec![V::Bool(true), V::Bool(false)])),
        ("t.arr_u64", V::Array(vec![V::U64(1 << 40)])),
        ("t.arr_f64", V::Array(vec![V::F64(-0.125)])),
        ("t.arr_empty", V::Array(vec![])),
        (
            "t.nested",
            V::Array(vec![
                V::Array(vec![V::String("x".into())]),
                V::Array(vec![V::I16(3), V::I16(-3)]),
                V::Array(vec![]),
            ]),
        ),
    ]
}

/// Deterministic pseudo-random bytes (xorshift), so tensor data is not all zeros.
pub fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Tensors of the types candle-core also reads, with their ggml dims.
pub fn sample_tensors() -> Vec<(&'static str, GgmlType, Vec<u64>)> {
    vec![
        ("token_embd.weight", GgmlType::Q8_0, vec![64, 3]),
        ("blk.0.attn_q.weight", GgmlType::Q4K, vec![256, 2]),
        ("blk.0.attn_k.weight", GgmlType::Q6K, vec![512]),
        ("blk.0.ffn_up.weight", GgmlType::Q5_0, vec![32, 2, 2]),
        ("blk.0.attn_norm.weight", GgmlType::F32, vec![7]),
        ("blk.0.ffn_down.weight", GgmlType::F16, vec![3, 1, 1, 5]),
        ("output.weight", GgmlType::BF16, vec![2, 9]),
        ("blk.0.ffn_gate.weight", GgmlType::Q4_0, vec![32]),
    ]
}

/// A writer holding [`sample_metadata`] and [`sample_tensors`].
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in sample_metadata() {
        w.add_metadata(k, v);
    }
    for (i, (name, ty, dims)) in sample_tensors().into_iter().enumerate() {
        let n: u64 = dims.iter().product();
        let len = ty.bytes_for(n).unwrap_or(0) as usize;
        if let Err(e) = w.add_tensor(name, ty, &dims, bytes(len, i as u64 + 1)) {
            panic!("sample tensor {name}: {e}");
        }
    }
    w
}

/// The model directory: `$PLUMBLINE_MODELS` or `~/.cache/plumbline/models`.
pub fn model_path(file: &str) -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache/plumbline/models"),
    };
    let p = dir.join(file);
    p.exists().then_some(p)
}
