//! Files written by `GgufWriter` read back identically by our reader and by candle-core's, whole
//! and split; the real gemma-3 270M file reads as llama.cpp describes it.

mod gguf_common;

use std::collections::BTreeSet;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value as CV};
use engine::gguf::{GgmlType, Gguf, GgufError, GgufWriter, MetadataValue as V, WeightPages};
use gguf_common::*;

fn open(p: &Path) -> Gguf {
    match Gguf::open(p) {
        Ok(g) => g,
        Err(e) => panic!("opening {}: {e}", p.display()),
    }
}

/// Our value and candle's are the same value of the same type.
fn same(ours: &V, theirs: &CV) -> bool {
    match (ours, theirs) {
        (V::U8(a), CV::U8(b)) => a == b,
        (V::I8(a), CV::I8(b)) => a == b,
        (V::U16(a), CV::U16(b)) => a == b,
        (V::I16(a), CV::I16(b)) => a == b,
        (V::U32(a), CV::U32(b)) => a == b,
        (V::I32(a), CV::I32(b)) => a == b,
        (V::U64(a), CV::U64(b)) => a == b,
        (V::I64(a), CV::I64(b)) => a == b,
        (V::F32(a), CV::F32(b)) => a.to_bits() == b.to_bits(),
        (V::F64(a), CV::F64(b)) => a.to_bits() == b.to_bits(),
        (V::Bool(a), CV::Bool(b)) => a == b,
        (V::String(a), CV::String(b)) => a == b,
        (V::Array(a), CV::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same(x, y))
        }
        _ => false,
    }
}

/// Candle reads `path` to the same metadata, tensor infos and tensor bytes as `g`'s shard `shard`.
fn check_candle(g: &Gguf, shard: usize) {
    let path = &g.shards()[shard].path;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => panic!("{}: {e}", path.display()),
    };
    let c = match Content::read(&mut f) {
        Ok(c) => c,
        Err(e) => panic!("candle reading {}: {e}", path.display()),
    };
    assert_eq!(c.tensor_data_offset, g.shards()[shard].data_offset);
    if shard == 0 {
        assert_eq!(c.metadata.len(), g.metadata().len());
        for (k, v) in g.metadata() {
            let theirs = c.metadata.get(k);
            assert!(
                theirs.is_some_and(|t| same(v, t)),
                "{k}: ours {v:?}, candle {theirs:?}"
            );
        }
    }
    let ours: Vec<_> = g.tensors().iter().filter(|t| t.shard == shard).collect();
    assert_eq!(c.tensor_infos.len(), ours.len());
    for t in ours {
        let Some(ct) = c.tensor_infos.get(&t.name) else {
            panic!("candle lacks tensor {}", t.name)
        };
        assert_eq!(
            format!("{:?}", ct.ggml_dtype),
            format!("{:?}", t.ggml_type),
            "{}",
            t.name
        );
        let mut rev: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        rev.reverse();
        assert_eq!(ct.shape.dims(), rev.as_slice(), "{}", t.name);
        assert_eq!(c.tensor_data_offset + ct.offset, t.offset, "{}", t.name);
        let mut buf = vec![0u8; t.n_bytes as usize];
        let read = f
            .seek(SeekFrom::Start(t.offset))
            .and_then(|_| f.read_exact(&mut buf));
        assert!(read.is_ok(), "{}: {read:?}", t.name);
        assert_eq!(buf.as_slice(), g.tensor_data(t), "{}", t.name);
        let q = c.tensor(&mut f, &t.name, &candle_core::Device::Cpu);
        assert!(q.is_ok(), "candle loading {}: {:?}", t.name, q.err());
    }
}

/// `g` holds exactly the sample metadata (plus `extra` keys) and sample tensors.
fn check_sample(g: &Gguf, extra: &[&str]) {
    let md = sample_metadata();
    let keys: Vec<&str> = g.metadata().keys().filter(|k| !extra.contains(k)).collect();
    let want: Vec<&str> = md.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, want, "metadata keys in order");
    for (k, v) in &md {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    let tensors = sample_tensors();
    assert_eq!(g.tensors().len(), tensors.len());
    for (i, (name, ty, dims)) in tensors.iter().enumerate() {
        let Some(t) = g.tensor(name) else {
            panic!("missing {name}")
        };
        assert_eq!((t.ggml_type, &t.dims), (*ty, dims), "{name}");
        assert_eq!(Some(t.n_bytes), ty.bytes_for(t.n_elements()));
        assert_eq!(
            g.tensor_data(t),
            bytes(t.n_bytes as usize, i as u64 + 1),
            "{name}"
        );
        let shard = &g.shards()[t.shard];
        assert_eq!(t.offset % shard.alignment, 0, "{name} aligned");
    }
}

#[test]
fn round_trip_through_ours_and_candle() {
    for alignment in [32u32, 64, 1, 4096] {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("m.gguf");
        let mut w = sample_writer();
        w.set_alignment(alignment);
        assert!(w.write(&p).is_ok());
        let g = open(&p);
        let extra: &[&str] = if alignment == 32 {
            &[]
        } else {
            &["general.alignment"]
        };
        check_sample(&g, extra);
        assert_eq!(g.shards().len(), 1);
        assert_eq!(g.shards()[0].version, 3);
        assert_eq!(g.shards()[0].alignment, u64::from(alignment));
        assert_eq!(g.architecture().ok(), Some("llama"));
        assert_eq!(g.tensors()[0].name, "token_embd.weight", "file order kept");
        check_candle(&g, 0);
        // Writing what we read gives the same bytes.
        let again = GgufWriter::from_gguf(&g).and_then(|w| w.to_bytes());
        assert_eq!(again.ok(), std::fs::read(&p).ok());
    }
}

#[test]
fn known_but_unsupported_types_read_fine() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("iq.gguf");
    let mut w = GgufWriter::new();
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let n = ty.block_size() as u64 * 2;
        let data = bytes(ty.bytes_for(n).unwrap_or(0) as usize, i as u64);
        assert!(w
            .add_tensor(format!("t{i}.{}", ty.name()), ty, &[n], data)
            .is_ok());
    }
    assert!(w.write(&p).is_ok());
    let g = open(&p);
    let types: Vec<GgmlType> = g.tensors().iter().map(|t| t.ggml_type).collect();
    assert_eq!(types, GgmlType::ALL.to_vec());
    assert!(g
        .tensor("t14.iq2_xxs")
        .is_some_and(|t| !t.ggml_type.is_supported()));
}

#[test]
fn version_2_reads_like_version_3() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("v2.gguf");
    let mut b = sample_writer().to_bytes().unwrap_or_else(|e| panic!("{e}"));
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert!(std::fs::write(&p, &b).is_ok());
    let g = open(&p);
    assert_eq!(g.shards()[0].version, 2);
    check_sample(&g, &[]);
}

#[test]
fn resident_weights_are_the_mapped_bytes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let paths = sample_writer()
        .write_split(dir.path().join("m.gguf"), 3)
        .unwrap_or_else(|e| panic!("{e}"));
    let mapped = open(&paths[0]);
    let mut g = open(&paths[0]);
    assert!(!g.is_resident(), "open maps");
    assert_eq!(g.set_weight_pages(WeightPages::Map).ok(), Some(false));
    assert_eq!(g.set_weight_pages(WeightPages::Resident).ok(), Some(true));
    assert!(g.is_resident());
    for t in mapped.tensors() {
        assert_eq!(g.tensor_data(t), mapped.tensor_data(t), "{}", t.name);
    }
    check_sample(&g, &["split.no", "split.count", "split.tensors.count"]);
    // Asking again changes nothing; `map` after `resident` keeps the copy.
    assert_eq!(g.set_weight_pages(WeightPages::Resident).ok(), Some(true));
    assert_eq!(g.set_weight_pages(WeightPages::Map).ok(), Some(true));
    // A small file fits in any machine's available memory: `auto` copies it.
    let mut a = open(&paths[1]);
    assert_eq!(a.set_weight_pages(WeightPages::Auto).ok(), Some(true));
    let parsed: Vec<Result<WeightPages, String>> = ["auto", "map", "resident", "huge"]
        .iter()
        .map(|s| s.parse())
        .collect();
    assert_eq!(
        parsed[..3],
        [
            Ok(WeightPages::Auto),
            Ok(WeightPages::Map),
            Ok(WeightPages::Resident)
        ]
    );
    assert!(parsed[3]
        .as_ref()
        .is_err_and(|e| e.contains("huge") && e.contains("resident")));
}

#[test]
fn split_round_trip_from_any_shard() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let w = sample_writer();
    let paths = w
        .write_split(dir.path().join("m.gguf"), 3)
        .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<String> = paths
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    assert_eq!(
        names,
        [
            "m-00001-of-00003.gguf",
            "m-00002-of-00003.gguf",
            "m-00003-of-00003.gguf"
        ]
    );
    let split_keys = ["split.no", "split.count", "split.tensors.count"];
    for p in paths.iter().rev() {
        let g = open(p);
        check_sample(&g, &split_keys);
        assert_eq!(g.shards().len(), 3);
        let per_shard: Vec<usize> = g.shards().iter().map(|s| s.n_tensors).collect();
        assert_eq!(per_shard, [3, 3, 2]);
        assert_eq!(g.get_u32("split.count").ok(), Some(3));
        assert_eq!(g.get_u32("split.no").ok(), Some(0), "metadata is shard 0's");
        assert_eq!(g.get_i32("split.tensors.count").ok(), Some(8));
        for (i, s) in g.shards().iter().enumerate() {
            assert_eq!(&s.path, &paths[i]);
            check_candle(&g, i);
        }
    }
    // Shards after the first carry only the split keys, as gguf-split writes them.
    let mut f = std::fs::File::open(&paths[1]).unwrap_or_else(|e| panic!("{e}"));
    let c = Content::read(&mut f).unwrap_or_else(|e| panic!("{e}"));
    let mut keys: Vec<&String> = c.metadata.keys().collect();
    keys.sort();
    assert_eq!(keys, ["split.count", "split.no", "split.tensors.count"]);
    assert!(matches!(c.metadata.get("split.no"), Some(CV::U16(1))));
    assert!(matches!(
        c.metadata.get("split.tensors.count"),
        Some(CV::I32(8))
    ));
}

#[test]
fn writer_refuses_what_gguf_cannot_hold() {
    fn check(r: Result<(), GgufError>, contains: &str) {
        match r {
            Err(e) => assert!(e.to_string().contains(contains), "{e}"),
            Ok(()) => panic!("expected an error containing {contains:?}"),
        }
    }
    let add = |ty, dims: &[u64], len| {
        GgufWriter::new()
            .add_tensor("t", ty, dims, vec![0; len])
            .map(|_| ())
    };
    check(add(GgmlType::F32, &[3], 11), "expected 12 bytes, found 11");
    check(add(GgmlType::Q4K, &[100], 0), "whole number of blocks");
    check(
        add(GgmlType::F32, &[1, 1, 1, 1, 1], 4),
        "at most 4 dimensions",
    );
    check(add(GgmlType::F32, &[0], 0), "dimensions > 0");
    check(add(GgmlType::F32, &[u64::MAX, 2], 0), "fits in u64");
    let long = "x".repeat(64);
    check(
        GgufWriter::new()
            .add_tensor(long, GgmlType::F32, &[1], vec![0; 4])
            .map(|_| ()),
        "1 to 63 bytes",
    );
    let mut w = GgufWriter::new();
    assert!(w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]).is_ok());
    check(
        w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4])
            .map(|_| ()),
        "duplicate",
    );
    w.set_alignment(48);
    check(w.to_bytes().map(|_| ()), "power of two, found 48");
    let mut w = GgufWriter::new();
    w.add_metadata("a", V::Array(vec![V::U8(1), V::I8(1)]));
    check(
        w.to_bytes().map(|_| ()),
        "metadata \"a\" element 1: expected u8 like element 0, found i8",
    );
    check(
        sample_writer().write_split("x.gguf", 0).map(|_| ()),
        "at least 1",
    );
}

#[test]
fn real_model() {
    let Some(path) = model_path("gemma-3-270m-q4_k_m.gguf") else {
        engine::testing::model_absent("the real model");
        return;
    };
    let t0 = std::time::Instant::now();
    let g = open(&path);
    println!("opened {} in {:?}", path.display(), t0.elapsed());
    assert_eq!(g.tensors().len(), 236);
    let types: BTreeSet<GgmlType> = g.tensors().iter().map(|t| t.ggml_type).collect();
    let want: BTreeSet<GgmlType> = [
        GgmlType::Q4K,
        GgmlType::Q5_0,
        GgmlType::Q6K,
        GgmlType::Q8_0,
        GgmlType::F32,
    ]
    .into();
    assert_eq!(types, want);
    assert_eq!(g.architecture().ok(), Some("gemma3"));
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap_or_default();
    let scores = g.get_f32_array("tokenizer.ggml.scores").unwrap_or_default();
    assert_eq!(tokens.len(), 262_144);
    assert_eq!(scores.len(), tokens.len());
    check_candle(&g, 0);

    // A split written by our writer reads back identical.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let w = GgufWriter::from_gguf(&g).unwrap_or_else(|e| panic!("{e}"));
    let paths = w
        .write_split(dir.path().join("gemma.gguf"), 100)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(paths.len(), 3);
    let s = open(&paths[2]);
    assert_eq!(s.shards().len(), 3);
    let md: Vec<_> = s
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("split."))
        .collect();
    let orig: Vec<_> = g.metadata().iter().collect();
    assert!(md == orig, "metadata differs after a split round trip");
    assert_eq!(s.tensors().len(), g.tensors().len());
    for (a, b) in g.tensors().iter().zip(s.tensors()) {
        assert_eq!(
            (&a.name, a.ggml_type, &a.dims),
            (&b.name, b.ggml_type, &b.dims)
        );
        assert!(
            g.tensor_data(a) == s.tensor_data(b),
            "{} data differs",
            a.name
        );
    }
    for i in 0..3 {
        check_candle(&s, i);
    }
}
