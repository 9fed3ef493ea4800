//! Fixtures are deterministic, shaped as specified, and pinned.

use std::collections::BTreeSet;

use golden::fixtures::{self, Dims};
use kernels::quant::GgmlType;
use sha2::{Digest, Sha256};

/// SHA-256 of every fixture file. A change here must be deliberate: it means the fixture spec,
/// the vocabulary, the PRNG, `kernels::quant::quantize` or `engine::gguf::GgufWriter` changed
/// what is written. Review the cause, then update the hash.
#[rustfmt::skip]
const PINNED: &[(&str, &str)] = &[
    ("llama-f16", "458208ce0220902e95b56e86a866d1b3ffc747a6b4e609825d9b673b5821f141"), // 414688 bytes
    ("llama-q8_0", "460bb3f741c093b3a6a5003403c7f97c26de5d6eebfd067a9c862ce8116e8244"), // 226208 bytes
    ("llama-q4_0", "418287e999c06d19d9661b8fe360c8542438bd9ea5d26d6dfe47e1420252322d"), // 110496 bytes
    ("llama-q4_k_m", "0783b529561797ec558126f2fe1da3e178a750d309008d8b825b36bd2fca8781"), // 1049760 bytes
    ("llama-mix-all", "83f965dbea6fe27514b5d432bfba40b6bf64038c9a7845be6c9646c03e6b7198"), // 2424640 bytes
    ("gemma3-q4_k_m", "e7fb88292c292b30e69f930c44ffdd128899daf4715ad86247e858963988f0b1"), // 7184576 bytes
    ("deepseek2-q4_k", "7b109ee857c8154f74798c277d8d1b3ac380695b16dcb122a588d5ff49b7219f"), // 5050688 bytes
    ("deepseek2-lite-q8_0", "044838c9216edb365aab4856cfa2d3ced809a8ef5b4570e709b17b92ef774ad6"), // 1021984 bytes
    ("glm-dsa-q8_0", "30c17b3b495b03ae6244c0b30855b4f06466aac670abb8209866d9b1eac36b2c"), // 14547680 bytes
    ("glm-dsa-q4_k", "6f263f7fe32389b231679057ca2e14caee0e2dcc31e2c5fdfcfee4a6e25a0303"), // 8073824 bytes
];

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn names_are_unique_and_lookup_works() {
    let all = fixtures::all();
    let names: BTreeSet<_> = all.iter().map(|f| f.name).collect();
    assert_eq!(names.len(), all.len());
    for f in &all {
        assert_eq!(fixtures::by_name(f.name).as_ref(), Some(f));
        assert!(f.name.starts_with(f.arch.name()), "{}", f.name);
    }
    assert_eq!(fixtures::by_name("no-such-fixture"), None);
}

#[test]
fn writing_twice_gives_identical_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    for spec in fixtures::all() {
        let a = fixtures::write(&spec, &dir.path().join("a")).expect("write a");
        let b = fixtures::write(&spec, &dir.path().join("b")).expect("write b");
        let a = std::fs::read(a).expect("read a");
        let b = std::fs::read(b).expect("read b");
        assert!(a == b, "{}: two writes differ", spec.name);
        assert!(
            a == spec.to_bytes().expect("to_bytes"),
            "{}: file != to_bytes",
            spec.name
        );
    }
}

#[test]
fn fixture_bytes_are_pinned() {
    let mut actual = Vec::new();
    for spec in fixtures::all() {
        let bytes = spec.to_bytes().expect("to_bytes");
        actual.push((spec.name, sha256_hex(&bytes), bytes.len()));
    }
    let listing: String = actual
        .iter()
        .map(|(n, h, len)| format!("    (\"{n}\", \"{h}\"), // {len} bytes\n"))
        .collect();
    assert_eq!(
        PINNED.len(),
        actual.len(),
        "pin every fixture; current hashes:\n{listing}"
    );
    for ((name, hash, _), (pin_name, pin_hash)) in actual.iter().zip(PINNED) {
        assert_eq!(
            name, pin_name,
            "fixture order changed; current hashes:\n{listing}"
        );
        assert_eq!(hash, pin_hash, "{name} changed; current hashes:\n{listing}");
    }
}

fn types_of(name: &str) -> BTreeSet<GgmlType> {
    fixtures::by_name(name)
        .expect("fixture")
        .tensor_types()
        .expect("tensor types")
        .into_iter()
        .map(|(_, t)| t)
        .collect()
}

#[test]
fn mix_all_uses_every_supported_type() {
    let used = types_of("llama-mix-all");
    for ty in GgmlType::SUPPORTED {
        assert!(used.contains(&ty), "llama-mix-all lacks {ty}");
    }
}

#[test]
fn q4_k_m_mixes_like_real_files() {
    for name in ["llama-q4_k_m", "gemma3-q4_k_m"] {
        let used = types_of(name);
        let want: BTreeSet<_> = [
            GgmlType::F32,
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
        ]
        .into();
        assert_eq!(used, want, "{name}");
    }
}

#[test]
fn k_quant_rows_are_whole_super_blocks() {
    // Every tensor's first dimension is a whole number of its type's blocks (the fallback rule
    // replaced the type otherwise), so every fixture quantizes.
    for spec in fixtures::all() {
        for (name, ty) in spec.tensor_types().expect("types") {
            assert!(
                ty.is_supported(),
                "{}: {name} has unsupported type {ty}",
                spec.name
            );
        }
        spec.to_bytes()
            .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    }
}

#[test]
fn shapes_match_the_brief() {
    for spec in fixtures::all() {
        match spec.dims {
            Dims::Dense(d) if spec.arch == golden::Arch::Gemma3 => {
                assert!(d.n_layer >= 6, "gemma3 needs a global layer (i % 6 == 5)");
                assert!(d.sliding_window > 0 && d.sliding_window < 20);
            }
            Dims::Dense(d) => assert!(d.n_layer >= 2 && d.n_head % d.n_head_kv == 0),
            Dims::MlaMoe(d) => {
                assert!(d.n_dense_lead >= 1 && d.n_dense_lead < d.n_layer);
                assert!((4..=8).contains(&d.n_expert) && d.n_expert_used == 2);
                assert_eq!(d.n_expert_shared, 1);
                if let Some(x) = d.dsa {
                    // The sparse path must bind within verify's 32 teacher-forced tokens, with
                    // a full and a shared indexer layer among both the dense prefix and the MoE
                    // layers, and NextN blocks kept after the trunk.
                    assert!(x.top_k < 32, "{}: top-k {}", spec.name, x.top_k);
                    assert_eq!(x.full.len(), d.n_layer);
                    let dense = &x.full[..d.n_dense_lead];
                    let moe = &x.full[d.n_dense_lead..];
                    assert!(x.full[0] && moe.contains(&true) && x.full.contains(&false));
                    assert!(!dense.is_empty() && moe.contains(&false));
                    assert!(x.n_nextn >= 1 && x.head_dim > d.qk_rope);
                }
            }
        }
    }
}
