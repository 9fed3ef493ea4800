//! Malformed GGUF files and broken split sets: each gets the right typed error, naming the right
//! thing, and nothing panics (proptest over arbitrary and mutated bytes).

mod gguf_common;

use std::path::{Path, PathBuf};

use engine::gguf::{GgmlType, Gguf, GgufError, GgufWriter, MetadataValue as V};
use gguf_common::*;
use proptest::prelude::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"))
}

fn write(path: &Path, bytes: &[u8]) {
    if let Err(e) = std::fs::write(path, bytes) {
        panic!("{}: {e}", path.display());
    }
}

fn open_bytes(dir: &Path, bytes: &[u8]) -> Result<Gguf, GgufError> {
    let p = dir.join("x.gguf");
    write(&p, bytes);
    Gguf::open(&p)
}

/// Opening `bytes` fails with an error that `is` accepts and whose message contains every
/// string in `says` (and the file name).
fn check(bytes: &[u8], is: fn(&GgufError) -> bool, says: &[&str]) {
    let dir = tmp();
    match open_bytes(dir.path(), bytes) {
        Ok(g) => panic!("expected an error, opened {g:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(is(&e), "wrong variant: {e:?}");
            assert!(
                msg.contains("x.gguf"),
                "message does not name the file: {msg}"
            );
            for s in says {
                assert!(msg.contains(s), "message lacks {s:?}: {msg}");
            }
            assert!(!msg.ends_with('.'), "trailing period: {msg}");
        }
    }
}

/// A valid file: one metadata pair, one F32 tensor of `n` elements at offset 0.
fn one_tensor(n: u64) -> Raw {
    Raw::header(3, 1, 1)
        .kv_str("general.architecture", "llama")
        .tensor("w", &[n], 0, 0)
        .pad(32)
        .zeros(4 * n as usize)
}

#[test]
fn the_baseline_is_valid() {
    let dir = tmp();
    let g = open_bytes(dir.path(), &one_tensor(3).bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.tensor("w").map(|t| t.n_bytes), Some(12));
}

#[test]
fn header() {
    use GgufError as E;
    check(
        &[],
        |e| matches!(e, E::Truncated { offset: 0, .. }),
        &["magic", "expected 4 bytes, found 0"],
    );
    check(
        b"GGML\x03\0\0\0",
        |e| matches!(e, E::BadMagic { .. }),
        &["\"GGML\""],
    );
    check(
        b"\0\0\0\0",
        |e| matches!(e, E::BadMagic { .. }),
        &["\"\\x00\\x00\\x00\\x00\""],
    );
    let v = |v: u32| Raw::header(v, 0, 0).bytes;
    check(
        &v(1),
        |e| matches!(e, E::UnsupportedVersion { version: 1, .. }),
        &["expected 2 or 3, found 1"],
    );
    check(
        &v(4),
        |e| matches!(e, E::UnsupportedVersion { version: 4, .. }),
        &["found 4"],
    );
    check(
        &v(3u32.swap_bytes()),
        |e| matches!(e, E::BigEndian { swapped: 3, .. }),
        &["big-endian"],
    );
    check(
        &v(2u32.swap_bytes()),
        |e| matches!(e, E::BigEndian { swapped: 2, .. }),
        &["big-endian"],
    );
    check(
        &Raw::header(3, 0, 0).bytes[..20],
        |e| matches!(e, E::Truncated { offset: 16, .. }),
        &["metadata count"],
    );
    // Zero tensors, zero metadata: valid.
    let dir = tmp();
    assert!(open_bytes(dir.path(), &Raw::header(3, 0, 0).bytes).is_ok());
}

#[test]
fn huge_counts_and_lengths() {
    use GgufError as E;
    let big = |e: &GgufError| matches!(e, E::CountTooLarge { .. });
    check(
        &Raw::header(3, u64::MAX, 0).bytes,
        big,
        &["tensor count", "offset 8", "count 18446744073709551615"],
    );
    check(
        &Raw::header(3, 0, u64::MAX).bytes,
        big,
        &["metadata count", "offset 16"],
    );
    check(
        &Raw::header(3, 0, 1).u64(1 << 40).b(b"abc").zeros(20).bytes,
        big,
        &["metadata key #0 length", "offset 24"],
    );
    let arr = |ty: u32| {
        Raw::header(3, 0, 1)
            .str("k")
            .u32(9)
            .u32(ty)
            .u64(u64::MAX / 2)
            .zeros(64)
            .bytes
    };
    for ty in [0, 4, 8, 9, 12] {
        check(&arr(ty), big, &["metadata \"k\" array count", "offset 41"]);
    }
    let s = Raw::header(3, 0, 1)
        .str("k")
        .u32(8)
        .u64(100)
        .b(b"short")
        .bytes;
    check(&s, big, &["metadata \"k\" value length", "count 100"]);
    let name = Raw::header(3, 1, 0).u64(u64::MAX).zeros(40).bytes;
    check(&name, big, &["tensor #0 name length"]);
}

#[test]
fn bad_values() {
    use GgufError as E;
    let kv = |ty: u32, v: &[u8]| Raw::header(3, 0, 1).str("k").u32(ty).b(v).bytes;
    check(
        &kv(13, &[0; 8]),
        |e| {
            matches!(
                e,
                E::UnknownValueType {
                    type_id: 13,
                    offset: 33,
                    ..
                }
            )
        },
        &["found 13"],
    );
    check(
        &kv(7, &[2]),
        |e| matches!(e, E::InvalidBool { value: 2, .. }),
        &["\"k\"", "found 2"],
    );
    check(
        &kv(9, &[200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        |e| matches!(e, E::UnknownValueType { type_id: 200, .. }),
        &["array element type"],
    );
    let bad_key = Raw::header(3, 0, 1)
        .u64(2)
        .b(&[0xff, 0xfe])
        .u32(0)
        .u8(0)
        .bytes;
    check(
        &bad_key,
        |e| matches!(e, E::InvalidUtf8 { offset: 24, .. }),
        &["metadata key #0", "UTF-8"],
    );
    let bad_str = Raw::header(3, 0, 1).str("k").u32(8).u64(1).u8(0x80).bytes;
    check(
        &bad_str,
        |e| matches!(e, E::InvalidUtf8 { .. }),
        &["metadata \"k\" value"],
    );
    // Arrays nested 9 deep.
    let mut r = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..9 {
        r = r.u32(9).u64(1);
    }
    let r = r.u32(0).u64(0);
    check(
        &r.bytes,
        |e| matches!(e, E::NestingTooDeep { max: 8, .. }),
        &["\"deep\""],
    );
    let dup = Raw::header(3, 0, 2).kv_u32("a", 1).kv_u32("a", 2).bytes;
    check(
        &dup,
        |e| matches!(e, E::DuplicateKey { offset: 41, .. }),
        &["\"a\"", "duplicate"],
    );
}

#[test]
fn alignment() {
    use GgufError as E;
    let bad = |e: &GgufError| matches!(e, E::BadAlignment { offset: 24, .. });
    for (a, says) in [(48u32, "u32 48"), (0, "u32 0")] {
        check(
            &Raw::header(3, 0, 1).kv_u32("general.alignment", a).bytes,
            bad,
            &[says],
        );
    }
    check(
        &Raw::header(3, 0, 1).kv_str("general.alignment", "32").bytes,
        bad,
        &["string \"32\""],
    );
    // A 64-aligned file: data starts at 64, offsets are multiples of 64.
    let ok = Raw::header(3, 2, 1)
        .kv_u32("general.alignment", 64)
        .tensor("a", &[1], 0, 0)
        .tensor("b", &[1], 0, 64)
        .pad(64)
        .zeros(68);
    let dir = tmp();
    let g = open_bytes(dir.path(), &ok.bytes).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.shards()[0].alignment, 64);
    assert_eq!(
        g.tensor("b").map(|t| t.offset - g.shards()[0].data_offset),
        Some(64)
    );
}

#[test]
fn tensor_infos() {
    use GgufError as E;
    let t = |name: &str, dims: &[u64], ty: u32, off: u64| {
        Raw::header(3, 1, 0)
            .tensor(name, dims, ty, off)
            .pad(32)
            .zeros(4096)
            .bytes
    };
    check(
        &t("w", &[1; 5], 0, 0),
        |e| {
            matches!(
                e,
                E::TooManyDims {
                    n_dims: 5,
                    offset: 33,
                    ..
                }
            )
        },
        &["\"w\"", "at most 4, found 5"],
    );
    check(
        &t("w", &[4, 0], 0, 0),
        |e| {
            matches!(
                e,
                E::ZeroDim {
                    index: 1,
                    offset: 45,
                    ..
                }
            )
        },
        &["\"w\" dimension 1"],
    );
    check(
        &t("w", &[1 << 32, 1 << 32, 2], 0, 0),
        |e| matches!(e, E::ShapeOverflow { .. }),
        &["\"w\""],
    );
    check(
        &t("w", &[1 << 62, 2], 0, 0),
        |e| matches!(e, E::ShapeOverflow { .. }),
        &["\"w\""],
    );
    for id in [4u32, 5, 31, 40, 1000] {
        check(
            &t("blk.0.x", &[32], id, 0),
            |e| matches!(e, E::UnknownTensorType { .. }),
            &["\"blk.0.x\"", &format!("unknown id {id}")],
        );
    }
    check(
        &t("q", &[100], 12, 0),
        |e| {
            matches!(
                e,
                E::PartialBlock {
                    n_elements: 100,
                    ..
                }
            )
        },
        &["multiple of 256", "q4_K"],
    );
    check(
        &t("w", &[1], 0, 8),
        |e| {
            matches!(
                e,
                E::MisalignedTensor {
                    tensor_offset: 8,
                    alignment: 32,
                    ..
                }
            )
        },
        &["\"w\""],
    );
    check(
        &t("w", &[1], 0, 1 << 20),
        |e| matches!(e, E::TensorOutOfBounds { .. }),
        &["\"w\""],
    );
    check(
        &t("w", &[1], 0, u64::MAX - 31),
        |e| matches!(e, E::TensorOutOfBounds { .. }),
        &["\"w\""],
    );
    check(
        &t("w", &[2000], 0, 0),
        |e| matches!(e, E::TensorOutOfBounds { .. }),
        &["\"w\"", "bytes 64..8064"],
    );
    let two = |a: &str, b: &str, off_b: u64| {
        Raw::header(3, 2, 0)
            .tensor(a, &[16], 0, 0)
            .tensor(b, &[16], 0, off_b)
            .pad(32)
            .zeros(256)
            .bytes
    };
    check(
        &two("w", "w", 64),
        |e| matches!(e, E::DuplicateTensor { .. }),
        &["\"w\"", "duplicate"],
    );
    check(
        &two("a", "b", 32),
        |e| matches!(e, E::TensorsOverlap { .. }),
        &["\"a\"", "\"b\""],
    );
    let dir = tmp();
    assert!(open_bytes(dir.path(), &two("a", "b", 64)).is_ok());
    // Tensor infos end the file before the data section begins.
    let cut = Raw::header(3, 1, 0).tensor("w", &[1], 0, 0).bytes;
    check(
        &cut,
        |e| {
            matches!(
                e,
                E::DataOffsetOutOfBounds {
                    data_offset: 64,
                    ..
                }
            )
        },
        &["data section"],
    );
}

#[test]
fn truncated_at_every_byte() {
    let full = sample_writer().to_bytes().unwrap_or_else(|e| panic!("{e}"));
    let dir = tmp();
    let g = open_bytes(dir.path(), &full).unwrap_or_else(|e| panic!("{e}"));
    let data_end = g
        .tensors()
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap_or(0) as usize;
    for len in 0..full.len() {
        let r = open_bytes(dir.path(), &full[..len]);
        if len < data_end {
            match r {
                Ok(_) => panic!("truncated at {len} of {} opened", full.len()),
                Err(e) => assert!(
                    matches!(
                        e,
                        GgufError::Truncated { .. }
                            | GgufError::CountTooLarge { .. }
                            | GgufError::DataOffsetOutOfBounds { .. }
                            | GgufError::TensorOutOfBounds { .. }
                    ),
                    "truncated at {len}: {e:?}"
                ),
            }
        } else {
            // Only the padding after the last tensor is gone: still a whole model.
            assert!(
                r.is_ok(),
                "truncated at {len} (data ends at {data_end}): {:?}",
                r.err()
            );
        }
    }
}

// ---- split sets ----------------------------------------------------------------------------

/// The sample model split three ways (3, 3, 2 tensors) into `dir`.
fn split3(dir: &Path) -> Vec<PathBuf> {
    sample_writer()
        .write_split(dir.join("m.gguf"), 3)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A shard written by hand with the given split keys and tensors.
fn shard(path: &Path, no: u16, count: u16, total: i32, tensors: &[&str]) {
    let mut w = GgufWriter::new();
    w.add_metadata("split.no", V::U16(no))
        .add_metadata("split.count", V::U16(count))
        .add_metadata("split.tensors.count", V::I32(total));
    for t in tensors {
        if let Err(e) = w.add_tensor(*t, GgmlType::F32, &[2], vec![0; 8]) {
            panic!("{e}");
        }
    }
    if let Err(e) = w.write(path) {
        panic!("{e}");
    }
}

fn check_split(open: &Path, is: fn(&GgufError) -> bool, names: &str, says: &[&str]) {
    match Gguf::open(open) {
        Ok(g) => panic!("expected an error, opened {g:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(is(&e), "wrong variant: {e:?}");
            let named = e
                .path()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            assert!(
                named.ends_with(names),
                "error names {named}, expected {names}: {msg}"
            );
            assert!(msg.contains(names), "message does not name {names}: {msg}");
            for s in says {
                assert!(msg.contains(s), "message lacks {s:?}: {msg}");
            }
        }
    }
}

#[test]
fn split_missing_shard() {
    let dir = tmp();
    let p = split3(dir.path());
    assert!(std::fs::remove_file(&p[1]).is_ok());
    for open in [&p[0], &p[2]] {
        check_split(
            open,
            |e| {
                matches!(
                    e,
                    GgufError::ShardMissing {
                        no: 1,
                        count: 3,
                        ..
                    }
                )
            },
            "m-00002-of-00003.gguf",
            &["shard 2 of 3"],
        );
    }
}

#[test]
fn split_duplicated_shard() {
    let dir = tmp();
    let p = split3(dir.path());
    assert!(std::fs::copy(&p[1], &p[2]).is_ok());
    check_split(
        &p[0],
        |e| matches!(e, GgufError::ShardDuplicate { no: 1, .. }),
        "m-00003-of-00003.gguf",
        &["m-00002-of-00003.gguf"],
    );
}

#[test]
fn split_files_out_of_order() {
    let dir = tmp();
    let p = split3(dir.path());
    let t = dir.path().join("t");
    assert!(std::fs::rename(&p[0], &t).is_ok());
    assert!(std::fs::rename(&p[1], &p[0]).is_ok());
    assert!(std::fs::rename(&t, &p[1]).is_ok());
    check_split(
        &p[2],
        |e| {
            matches!(
                e,
                GgufError::ShardOutOfOrder {
                    expected: 0,
                    found: 1,
                    ..
                }
            )
        },
        "m-00001-of-00003.gguf",
        &["split.no"],
    );
}

#[test]
fn split_foreign_shard() {
    let dir = tmp();
    let p = split3(dir.path());
    // A shard of another 3-way split (of a 4-tensor model) dropped in as shard 2.
    shard(&p[1], 1, 3, 4, &["other.a", "other.b"]);
    check_split(
        &p[0],
        |e| {
            matches!(
                e,
                GgufError::ShardForeign {
                    key: "split.tensors.count",
                    ..
                }
            )
        },
        "m-00002-of-00003.gguf",
        &["expected 8", "i32 4"],
    );
    // A shard that says the set has 4 shards.
    let dir = tmp();
    let p = split3(dir.path());
    shard(&p[2], 2, 4, 8, &["blk.0.ffn_down.weight"]);
    check_split(
        &p[0],
        |e| {
            matches!(
                e,
                GgufError::ShardForeign {
                    key: "split.count",
                    ..
                }
            )
        },
        "m-00003-of-00003.gguf",
        &["u16 3", "u16 4"],
    );
    // A plain model under a shard's name.
    let dir = tmp();
    let p = split3(dir.path());
    assert!(sample_writer().write(&p[1]).is_ok());
    check_split(
        &p[1],
        |e| {
            matches!(
                e,
                GgufError::ShardForeign {
                    key: "split.count",
                    ..
                }
            )
        },
        "m-00002-of-00003.gguf",
        &["no such key"],
    );
}

#[test]
fn split_tensor_in_two_shards() {
    let dir = tmp();
    let p = split3(dir.path());
    // Shard 3 repeats a tensor of shard 1 in place of one of its own.
    shard(
        &p[2],
        2,
        3,
        8,
        &["blk.0.ffn_gate.weight", "token_embd.weight"],
    );
    check_split(
        &p[0],
        |e| matches!(e, GgufError::SplitDuplicateTensor { .. }),
        "m-00003-of-00003.gguf",
        &["\"token_embd.weight\"", "m-00001-of-00003.gguf"],
    );
}

#[test]
fn split_wrong_tensors_count() {
    let dir = tmp();
    let paths: Vec<PathBuf> = (0..3)
        .map(|i| engine::gguf::split_path(dir.path().join("m"), i, 3))
        .collect();
    shard(&paths[0], 0, 3, 7, &["a", "b"]);
    shard(&paths[1], 1, 3, 7, &["c", "d"]);
    shard(&paths[2], 2, 3, 7, &["e"]);
    check_split(
        &paths[1],
        |e| {
            matches!(
                e,
                GgufError::SplitTensorCount {
                    expected: 7,
                    found: 5,
                    ..
                }
            )
        },
        "m-00001-of-00003.gguf",
        &["expected 7 tensors", "found 5"],
    );
}

#[test]
fn split_names_and_counts() {
    // A shard whose file name lost its -NNNNN-of-NNNNN tail.
    let dir = tmp();
    let p = split3(dir.path());
    let renamed = dir.path().join("renamed.gguf");
    assert!(std::fs::rename(&p[0], &renamed).is_ok());
    check_split(
        &renamed,
        |e| matches!(e, GgufError::SplitName { .. }),
        "renamed.gguf",
        &["-NNNNN-of-NNNNN.gguf", "u16 3"],
    );
    // A one-shard set opens whatever its name.
    let dir = tmp();
    let one = sample_writer()
        .write_split(dir.path().join("solo"), 100)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(one.len(), 1);
    assert!(one[0].ends_with("solo-00001-of-00001.gguf"));
    assert!(Gguf::open(&one[0]).is_ok_and(|g| g.tensors().len() == 8));
    let plain = dir.path().join("plain.gguf");
    assert!(std::fs::rename(&one[0], &plain).is_ok());
    assert!(Gguf::open(&plain).is_ok_and(|g| g.shards().len() == 1));
}

// ---- no input panics -------------------------------------------------------------------------

/// Opens `bytes`; on success every tensor's bytes are exactly `n_bytes` long.
fn never_panics(dir: &Path, bytes: &[u8]) {
    if let Ok(g) = open_bytes(dir, bytes) {
        for t in g.tensors() {
            assert_eq!(g.tensor_data(t).len() as u64, t.n_bytes);
        }
        let _ = g.metadata().iter().count();
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512), v in 0u32..5, gguf in any::<bool>()) {
        let dir = tmp();
        let mut bytes = if gguf { Raw::header(v, 0, 0).bytes[..8].to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        never_panics(dir.path(), &bytes);
    }

    #[test]
    fn mutated_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let dir = tmp();
        let mut bytes = sample_writer().to_bytes().unwrap_or_else(|e| panic!("{e}"));
        // Mutate the header region mostly: that is where the parser's decisions are.
        let header = 1200.min(bytes.len());
        for (i, b) in edits {
            let at = i.index(header);
            bytes[at] = b;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        never_panics(dir.path(), &bytes);
    }
}
