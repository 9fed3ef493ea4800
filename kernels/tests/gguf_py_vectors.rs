//! IQ4_NL, IQ4_XS and MXFP4 (which candle lacks) against vectors from gguf-py.
//!
//! Why these vectors are trustworthy: `testdata/gguf_py_vectors.json` is written by
//! `testdata/gen_vectors.py` from gguf-py's `gguf.quants`, the numpy implementation llama.cpp
//! publishes and maintains beside ggml (`gguf-py/gguf/quants.py`, checked in llama.cpp's CI
//! against ggml's C functions). It shares no code with this crate: a bug here cannot also be
//! in the file. Floats are stored as their exact bytes, so the comparison is bit for bit.
//! Regenerate with `python3 kernels/testdata/gen_vectors.py` (needs `pip install gguf numpy`).

use kernels::quant::{dequantize, quantize, GgmlType};
use serde_json::Value;

const VECTORS: &str = include_str!("../testdata/gguf_py_vectors.json");

fn vectors() -> Value {
    match serde_json::from_str(VECTORS) {
        Ok(v) => v,
        Err(e) => panic!("testdata/gguf_py_vectors.json: {e}"),
    }
}

fn hex_bytes(v: &Value, path: &str) -> Vec<u8> {
    let s = match v.pointer(path).and_then(Value::as_str) {
        Some(s) => s,
        None => panic!("vector file: expected a hex string at {path}, found none"),
    };
    (0..s.len() / 2)
        .map(|i| match u8::from_str_radix(&s[2 * i..2 * i + 2], 16) {
            Ok(b) => b,
            Err(e) => panic!("vector file {path}: bad hex at {i}: {e}"),
        })
        .collect()
}

fn hex_f32(v: &Value, path: &str) -> Vec<f32> {
    hex_bytes(v, path)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn check_dequantize(ty: GgmlType, key: &str) {
    let v = vectors();
    let blocks = hex_bytes(&v, &format!("/dequantize/{key}/blocks"));
    let want = hex_f32(&v, &format!("/dequantize/{key}/f32"));
    assert!(!want.is_empty(), "{key}: empty vector");
    let mut got = vec![0f32; want.len()];
    if let Err(e) = dequantize(ty, &blocks, &mut got) {
        panic!("{ty}: {e}");
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{ty} element {i} (block {}): ours {g:e}, gguf-py {w:e}",
            i / ty.block_size()
        );
    }
}

#[test]
fn iq4_nl_dequantize_matches_gguf_py() {
    check_dequantize(GgmlType::Iq4Nl, "iq4_nl");
}

#[test]
fn iq4_xs_dequantize_matches_gguf_py() {
    check_dequantize(GgmlType::Iq4Xs, "iq4_xs");
}

#[test]
fn mxfp4_dequantize_matches_gguf_py() {
    check_dequantize(GgmlType::Mxfp4, "mxfp4");
}

/// gguf-py implements a quantizer for MXFP4 only (not for IQ4_NL/IQ4_XS); it follows ggml's
/// `quantize_row_mxfp4_ref` (same exponent rule, first-minimum level choice).
#[test]
fn mxfp4_quantize_matches_gguf_py() {
    let v = vectors();
    let src = hex_f32(&v, "/quantize/mxfp4/f32");
    let want = hex_bytes(&v, "/quantize/mxfp4/blocks");
    let got = match quantize(GgmlType::Mxfp4, &src) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(got.len(), want.len());
    for (b, (g, w)) in got.chunks_exact(17).zip(want.chunks_exact(17)).enumerate() {
        assert_eq!(g, w, "mxfp4 block {b}");
    }
}
