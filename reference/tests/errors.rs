//! Bad input gets a typed error naming what is wrong, never a panic. GGUF bytes are assembled by
//! hand here (the reference may not use the engine's writer).

use std::io::Write;

use reference::{Precision, ReferenceError, ReferenceModel};

/// A GGUF v3 file with string metadata `kv` and tensors `(name, ne dims, type id)` whose data
/// is zeros.
fn gguf(kv: &[(&str, &str)], tensors: &[(&str, &[u64], u32, usize)]) -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        b.extend(8u32.to_le_bytes());
        s(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(std::iter::repeat_n(0u8, offset as usize));
    b
}

fn load(bytes: &[u8]) -> Result<ReferenceModel, ReferenceError> {
    let mut f = tempfile_in_target();
    f.1.write_all(bytes).expect("write temp file");
    ReferenceModel::load(&f.0, Precision::F32)
}

/// A fresh file under the target directory (no tempfile dependency needed).
fn tempfile_in_target() -> (std::path::PathBuf, std::fs::File) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("reference-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{}.gguf", N.fetch_add(1, Ordering::Relaxed)));
    let file = std::fs::File::create(&path).expect("create");
    (path, file)
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let e = ReferenceModel::load(std::path::Path::new("/no/such/model.gguf"), Precision::F32);
    match e {
        Err(ReferenceError::Io { path, .. }) => {
            assert_eq!(path.to_str(), Some("/no/such/model.gguf"))
        }
        other => panic!("expected Io, found {other:?}"),
    }
}

#[test]
fn garbage_is_a_gguf_error() {
    match load(b"not a gguf file at all, just some bytes") {
        Err(ReferenceError::Gguf { message, .. }) => {
            assert!(message.contains("magic"), "{message}")
        }
        other => panic!("expected Gguf, found {other:?}"),
    }
}

#[test]
fn unknown_architecture_is_named() {
    match load(&gguf(&[("general.architecture", "mamba")], &[])) {
        Err(ReferenceError::UnsupportedArchitecture(a)) => assert_eq!(a, "mamba"),
        other => panic!("expected UnsupportedArchitecture, found {other:?}"),
    }
}

#[test]
fn missing_metadata_key_is_named() {
    match load(&gguf(&[("general.architecture", "llama")], &[])) {
        Err(ReferenceError::MissingKey { key }) => assert_eq!(key, "llama.embedding_length"),
        other => panic!("expected MissingKey, found {other:?}"),
    }
}

#[test]
fn a_type_no_one_dequantizes_is_named_with_its_tensor() {
    // IQ2_XXS (16): neither candle nor the reference's own dequantizers read it
    let bytes = gguf(
        &[("general.architecture", "llama")],
        &[("blk.0.attn_q.weight", &[256, 1], 16, 66)],
    );
    match load(&bytes) {
        Err(ReferenceError::Gguf { message, .. }) => {
            assert!(
                message.contains("blk.0.attn_q.weight") && message.contains("16"),
                "{message}"
            )
        }
        other => panic!("expected Gguf, found {other:?}"),
    }
}

#[test]
fn a_huge_declared_count_is_refused_before_allocating() {
    let mut b = gguf(&[], &[]);
    // tensor count field (bytes 8..16) claims 2^40 tensors
    b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(load(&b), Err(ReferenceError::Gguf { .. })));
}
