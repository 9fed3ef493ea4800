//! The streaming reference (weights read layer by layer from the open file) against the eager one
//! (every weight dequantized at load): the same taps and logits, bit for bit, on every fixture and
//! precision; split sets read in place, in any listing order, equal to the single file; a missing
//! shard named; the footprint figures against the engine's own tensor directory.

use std::path::{Path, PathBuf};

use golden::fixtures;
use golden::vocab;
use reference::{Precision, ReferenceError, ReferenceModel, Residency};

/// Every tap `(name, shape, bits)` and the logits' bits.
type Run = (Vec<(String, Vec<usize>, Vec<u32>)>, Vec<u32>);

fn run(model: &ReferenceModel, tokens: &[u32]) -> Run {
    let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let mut taps = Vec::new();
    let logits = model
        .forward(tokens, &mut |name, shape, data| {
            taps.push((name.to_string(), shape.to_vec(), bits(data)))
        })
        .unwrap_or_else(|e| panic!("forward: {e}"));
    (taps, bits(&logits))
}

/// `a` and `b` are the same bits; the message names the first tap that is not.
fn assert_same(what: &str, a: &Run, b: &Run) {
    assert_eq!(a.0.len(), b.0.len(), "{what}: tap count");
    for (ta, tb) in a.0.iter().zip(&b.0) {
        assert_eq!(
            (&ta.0, &ta.1),
            (&tb.0, &tb.1),
            "{what}: tap order and shapes"
        );
        let differ = ta.2.iter().zip(&tb.2).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "{what}: {} differs in {differ} values", ta.0);
    }
    assert!(a.1 == b.1, "{what}: logits differ");
}

fn open(path: &Path, precision: Precision, residency: Residency) -> ReferenceModel {
    ReferenceModel::open(path, precision, residency)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn streaming_equals_eager_bit_for_bit_on_every_fixture() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = vocab::sample_tokens();
    for spec in fixtures::all() {
        let path = fixtures::write(&spec, dir.path()).expect("write fixture");
        for precision in [Precision::F32, Precision::Exact, Precision::F64] {
            let what = format!("{} {precision:?}", spec.name);
            let eager = open(&path, precision, Residency::Eager);
            let streaming = open(&path, precision, Residency::Streaming);
            assert_eq!(streaming.residency(), Residency::Streaming);
            assert_same(&what, &run(&eager, &tokens), &run(&streaming, &tokens));
            // The head in 7-row chunks (the fixtures' vocabularies fit one default chunk): a
            // streaming pass reads and multiplies each chunk from the file, and still matches.
            let eager = eager.with_head_chunk_rows(7);
            let streaming = streaming.with_head_chunk_rows(7);
            assert_same(
                &format!("{what}, 7-row head chunks"),
                &run(&eager, &tokens),
                &run(&streaming, &tokens),
            );
        }
    }
}

/// `spec` written as a single file and as a split set by layer under `dir`.
fn single_and_split(name: &str, dir: &Path) -> (PathBuf, Vec<PathBuf>) {
    let spec = fixtures::by_name(name).expect("fixture");
    let single = fixtures::write(&spec, dir).expect("write fixture");
    let shards = golden::split::write_by_layer(&single, &dir.join("split").join(name))
        .expect("write split set");
    assert!(shards.len() >= 3, "{name}: globals + at least two layers");
    (single, shards)
}

#[test]
fn split_sets_are_read_in_place_equal_to_the_single_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = vocab::sample_tokens();
    for name in ["llama-q8_0", "gemma3-q4_k_m", "deepseek2-q4_k"] {
        let (single, shards) = single_and_split(name, dir.path());
        let want = run(&open(&single, Precision::F32, Residency::Eager), &tokens);
        // any shard of the set opens the whole set, found beside it by name
        for (i, shard) in shards.iter().enumerate() {
            let m = open(shard, Precision::F32, Residency::Streaming);
            assert_eq!(m.footprint().n_files, shards.len());
            assert_same(
                &format!("{name} opened at shard {i}"),
                &want,
                &run(&m, &tokens),
            );
        }
        // listed in reverse: placed by split.no, not by the listing
        let reversed: Vec<PathBuf> = shards.iter().rev().cloned().collect();
        for residency in [Residency::Eager, Residency::Streaming] {
            let m = ReferenceModel::open_listed(&reversed, Precision::F32, residency)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_same(
                &format!("{name} listed in reverse, {residency:?}"),
                &want,
                &run(&m, &tokens),
            );
        }
    }
}

#[test]
fn a_missing_shard_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_, shards) = single_and_split("llama-q8_0", dir.path());
    std::fs::remove_file(&shards[1]).expect("remove shard 2");
    for residency in [Residency::Eager, Residency::Streaming] {
        match ReferenceModel::open(&shards[0], Precision::F32, residency) {
            Err(ReferenceError::Gguf { message, .. }) => {
                let missing = shards[1].display().to_string();
                assert!(message.contains(&missing), "{message}");
                assert!(message.contains("missing"), "{message}");
            }
            other => panic!("expected a Gguf error naming the shard, found {other:?}"),
        }
    }
    // A listing without it is refused too, naming the gap.
    let listed = [shards[0].clone(), shards[2].clone()];
    match ReferenceModel::open_listed(&listed, Precision::F32, Residency::Streaming) {
        Err(ReferenceError::Gguf { message, .. }) => {
            assert!(message.contains("split.count"), "{message}")
        }
        other => panic!("expected a Gguf error, found {other:?}"),
    }
}

#[test]
fn footprint_sums_every_tensor_as_the_engine_counts_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    for spec in fixtures::all() {
        let path = fixtures::write(&spec, dir.path()).expect("write fixture");
        // Independent count: the engine's GGUF reader's tensor directory.
        let g = engine::gguf::Gguf::open(&path).expect("engine reads the fixture");
        let total: u64 = g.tensors().iter().map(|t| t.n_elements() * 4).sum();
        let mut per_layer = std::collections::BTreeMap::<usize, u64>::new();
        for t in g.tensors() {
            if let Some(i) = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, _)| i.parse::<usize>().ok())
            {
                *per_layer.entry(i).or_default() += t.n_elements() * 4;
            }
        }
        let largest = per_layer.values().copied().max();
        let f = open(&path, Precision::F32, Residency::Streaming)
            .footprint()
            .clone();
        assert_eq!(f.total_f32_bytes, total, "{}", spec.name);
        assert_eq!(f.largest_layer.map(|(_, b)| b), largest, "{}", spec.name);
        assert_eq!(f.n_files, 1);
        assert!(f.largest_global.is_some(), "{}", spec.name);
    }
}
