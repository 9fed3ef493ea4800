//! The `plumbline inspect` and `plumbline dump` commands, run as a user runs them, on a small file
//! written by our GGUF writer. The inspect output is a reviewed snapshot.

use std::path::Path;
use std::process::Command;

use engine::gguf::{GgufWriter, MetadataValue};
use kernels::quant::GgmlType;

fn plumbline(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_plumbline"))
        .args(args)
        .output()
        .expect("the plumbline binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A ramp of half-integers in [-63.5, 63.5].
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 255) as f32 - 127.0) * 0.5).collect()
}

fn write_fixture(path: &Path) {
    let mut w = GgufWriter::new();
    w.add_metadata(
        "general.architecture",
        MetadataValue::String("llama".into()),
    )
    .add_metadata(
        "general.name",
        MetadataValue::String("inspect fixture".into()),
    )
    .add_metadata("llama.block_count", MetadataValue::U32(1))
    .add_metadata(
        "tokenizer.ggml.tokens",
        MetadataValue::Array(
            (0..20)
                .map(|i| MetadataValue::String(format!("t{i}")))
                .collect(),
        ),
    )
    .add_metadata(
        "tokenizer.ggml.scores",
        MetadataValue::Array(vec![MetadataValue::F32(-1.5), MetadataValue::F32(0.25)]),
    );
    let f32_data: Vec<u8> = ramp(64).iter().flat_map(|v| v.to_le_bytes()).collect();
    w.add_tensor("output_norm.weight", GgmlType::F32, &[64], f32_data)
        .expect("valid f32 tensor");
    let q8 = kernels::quant::quantize(GgmlType::Q8_0, &ramp(64 * 4)).expect("q8_0 quantizes");
    w.add_tensor("blk.0.attn_q.weight", GgmlType::Q8_0, &[64, 4], q8)
        .expect("valid q8_0 tensor");
    let q4k = kernels::quant::quantize(GgmlType::Q4K, &ramp(256 * 2)).expect("q4_K quantizes");
    w.add_tensor("blk.0.ffn_down.weight", GgmlType::Q4K, &[256, 2], q4k)
        .expect("valid q4_K tensor");
    // A type ggml defines but plumbline has no kernel for: inspect must say so up front.
    w.add_tensor(
        "blk.0.ffn_up.weight",
        GgmlType::Iq2Xxs,
        &[256],
        vec![0u8; 66],
    )
    .expect("valid iq2_xxs tensor");
    w.write(path).expect("fixture written");
}

#[test]
fn inspect_lists_every_tensor_and_flags_unsupported_types() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fixture.gguf");
    write_fixture(&path);
    let (ok, stdout, stderr) = plumbline(&["inspect", path.to_str().expect("utf-8 path")]);
    assert!(ok, "inspect failed: {stderr}");
    let stdout = stdout.replace(path.to_str().expect("utf-8 path"), "[FILE]");
    insta::assert_snapshot!(stdout);
}

#[test]
fn inspect_json_is_machine_readable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fixture.gguf");
    write_fixture(&path);
    let (ok, stdout, stderr) =
        plumbline(&["inspect", "--json", path.to_str().expect("utf-8 path")]);
    assert!(ok, "inspect --json failed: {stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("valid JSON");
    let tensors = v["tensors"].as_array().expect("tensors array");
    assert_eq!(tensors.len(), 4);
    assert_eq!(tensors[2]["type"], "q4_K");
    assert_eq!(tensors[3]["supported"], false);
    assert_eq!(
        v["metadata"]["tokenizer.ggml.tokens"]
            .as_array()
            .map(Vec::len),
        Some(20)
    );
}

#[test]
fn dump_writes_raw_f32_and_npy_in_gguf_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fixture.gguf");
    write_fixture(&path);
    let file = path.to_str().expect("utf-8 path");

    let raw = dir.path().join("q.bin");
    let (ok, _, stderr) = plumbline(&[
        "dump",
        file,
        "--tensor",
        "blk.0.attn_q.weight",
        "--out",
        raw.to_str().expect("utf-8"),
    ]);
    assert!(ok, "dump failed: {stderr}");
    let bytes = std::fs::read(&raw).expect("dump output");
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // Q8_0 rounds to the nearest multiple of d = amax/127 of its 32-block, so every value comes
    // back within half a step, plus |q|·(rounding of d to f16) ≤ amax·2⁻¹¹.
    let expect = ramp(256);
    assert_eq!(values.len(), expect.len());
    for (block, (got, want)) in values.chunks(32).zip(expect.chunks(32)).enumerate() {
        let amax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let step = amax / 127.0;
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= step / 2.0 + amax * 2f32.powi(-11),
                "block {block}: {g} vs {w}"
            );
        }
    }

    let npy = dir.path().join("q.npy");
    let (ok, _, stderr) = plumbline(&[
        "dump",
        file,
        "--tensor",
        "blk.0.attn_q.weight",
        "--out",
        npy.to_str().expect("utf-8"),
    ]);
    assert!(ok, "dump .npy failed: {stderr}");
    let npy_bytes = std::fs::read(&npy).expect("npy output");
    assert!(npy_bytes.starts_with(b"\x93NUMPY\x01\x00"));
    let header_len = u16::from_le_bytes([npy_bytes[8], npy_bytes[9]]) as usize;
    let header = String::from_utf8_lossy(&npy_bytes[10..10 + header_len]);
    assert!(header.contains("'shape': (4, 64)"), "{header}");
    assert_eq!(
        &npy_bytes[10 + header_len..],
        &bytes[..],
        "npy payload equals the raw dump"
    );
}

#[test]
fn dump_errors_name_the_problem() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fixture.gguf");
    write_fixture(&path);
    let file = path.to_str().expect("utf-8 path");
    let out = dir.path().join("x.bin");
    let out = out.to_str().expect("utf-8");

    let (ok, _, stderr) = plumbline(&["dump", file, "--tensor", "no.such.tensor", "--out", out]);
    assert!(!ok);
    assert!(
        stderr.contains("no tensor named \"no.such.tensor\""),
        "{stderr}"
    );

    let (ok, _, stderr) = plumbline(&[
        "dump",
        file,
        "--tensor",
        "blk.0.ffn_up.weight",
        "--out",
        out,
    ]);
    assert!(!ok);
    assert!(stderr.contains("iq2_xxs"), "{stderr}");

    let (ok, _, stderr) = plumbline(&["inspect", "/nonexistent/model.gguf"]);
    assert!(!ok);
    assert!(stderr.contains("/nonexistent/model.gguf"), "{stderr}");
}
