//! `kernels::quant` against candle-core 0.11.1, an independent Rust port of ggml's reference
//! (de)quantizers, for every type candle implements.
//!
//! - Dequantization must be identical bit for bit: on blocks of random bytes with sane scales,
//!   and on blocks candle quantized itself.
//! - Quantization must give identical bytes wherever candle follows ggml's reference quantizer.
//!   Where candle departs from ggml (listed in [`CANDLE_DEPARTS`] with the reason), our bytes
//!   cannot match, so the test checks instead that our error is no worse than candle's.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use half::{bf16, f16};
use kernels::quant::accuracy::{random_data, rmse, test_signal};
use kernels::quant::{dequantize, quantize, GgmlType};

/// Every type candle-core 0.11.1 (de)quantizes, with its candle name.
const CANDLE_TYPES: [(GgmlType, GgmlDType); 15] = [
    (GgmlType::F32, GgmlDType::F32),
    (GgmlType::F16, GgmlDType::F16),
    (GgmlType::BF16, GgmlDType::BF16),
    (GgmlType::Q4_0, GgmlDType::Q4_0),
    (GgmlType::Q4_1, GgmlDType::Q4_1),
    (GgmlType::Q5_0, GgmlDType::Q5_0),
    (GgmlType::Q5_1, GgmlDType::Q5_1),
    (GgmlType::Q8_0, GgmlDType::Q8_0),
    (GgmlType::Q8_1, GgmlDType::Q8_1),
    (GgmlType::Q2K, GgmlDType::Q2K),
    (GgmlType::Q3K, GgmlDType::Q3K),
    (GgmlType::Q4K, GgmlDType::Q4K),
    (GgmlType::Q5K, GgmlDType::Q5K),
    (GgmlType::Q6K, GgmlDType::Q6K),
    (GgmlType::Q8K, GgmlDType::Q8K),
];

/// Types whose candle quantizer is not ggml's reference, so byte equality is not expected.
const CANDLE_DEPARTS: [(GgmlType, &str); 5] = [
    // candle computes `s` as f16(sum) * f16(d) in f16; ggml as f16(sum * d) in f32.
    (GgmlType::Q8_1, "candle rounds s = sum*d in f16 arithmetic"),
    // ggml's quantize_row_q{2,4,5}_K_ref use make_qkx2_quants; candle uses make_qkx1_quants.
    (
        GgmlType::Q2K,
        "candle searches scales with make_qkx1_quants",
    ),
    (
        GgmlType::Q4K,
        "candle searches scales with make_qkx1_quants",
    ),
    (
        GgmlType::Q5K,
        "candle searches scales with make_qkx1_quants",
    ),
    // ggml's make_qx_quants searches 18 scales around nmax/max; candle's is the 2023 version
    // (three fixed-point refinements).
    (
        GgmlType::Q6K,
        "candle's make_qx_quants is ggml's 2023 version",
    ),
];

fn departs(ty: GgmlType) -> bool {
    CANDLE_DEPARTS.iter().any(|(t, _)| *t == ty)
}

/// A small deterministic byte generator (SplitMix64).
struct Bytes(u64);
impl Bytes {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next() as u8;
        }
    }
    /// A sane scale: magnitude 2^-14 .. 2^2, either sign.
    fn scale(&mut self) -> f32 {
        let r = self.next();
        let exp = (r % 17) as i32 - 14;
        let mant = 1.0 + ((r >> 8) % 1024) as f32 / 1024.0;
        let sign = if (r >> 20) & 1 == 1 { -1.0 } else { 1.0 };
        sign * mant * 2f32.powi(exp)
    }
}

/// Byte offsets of the scale fields of each block (f16 unless marked f32): overwritten with sane
/// values so random blocks decode to finite numbers.
fn scale_fields(ty: GgmlType) -> &'static [(usize, bool)] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[(0, false)],
        Q4_1 | Q5_1 | Q8_1 | Q4K | Q5K => &[(0, false), (2, false)],
        Q2K => &[(80, false), (82, false)],
        Q3K => &[(108, false)],
        Q6K => &[(208, false)],
        Q8K => &[(0, true)],
        _ => &[],
    }
}

fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
    let ts = ty.type_size();
    let mut g = Bytes(seed);
    let mut bytes = vec![0u8; n_blocks * ts];
    match ty {
        GgmlType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                c.copy_from_slice(&g.scale().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in bytes.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(g.scale()).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in bytes.chunks_exact_mut(2) {
                // Any finite bf16 pattern: random bits with the exponent kept below all-ones.
                let bits = (g.next() as u16) & 0xbfff;
                c.copy_from_slice(&bf16::from_bits(bits).to_le_bytes());
            }
        }
        _ => {
            g.fill(&mut bytes);
            for block in bytes.chunks_exact_mut(ts) {
                for &(off, is_f32) in scale_fields(ty) {
                    if is_f32 {
                        block[off..off + 4].copy_from_slice(&g.scale().to_le_bytes());
                    } else {
                        let h = f16::from_f32(g.scale()).to_le_bytes();
                        block[off..off + 2].copy_from_slice(&h);
                    }
                }
            }
        }
    }
    bytes
}

fn candle_dequantize(dtype: GgmlDType, bytes: &[u8], n: usize) -> Vec<f32> {
    let run = || -> candle_core::Result<Vec<f32>> {
        let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype)?;
        QTensor::new(storage, (n,))?
            .dequantize(&Device::Cpu)?
            .to_vec1::<f32>()
    };
    match run() {
        Ok(v) => v,
        Err(e) => panic!("candle dequantize {dtype:?}: {e}"),
    }
}

fn candle_quantize(dtype: GgmlDType, src: &[f32]) -> Vec<u8> {
    let run = || -> candle_core::Result<Vec<u8>> {
        let t = Tensor::from_slice(src, (src.len(),), &Device::Cpu)?;
        Ok(QTensor::quantize(&t, dtype)?.data()?.into_owned())
    };
    match run() {
        Ok(v) => v,
        Err(e) => panic!("candle quantize {dtype:?}: {e}"),
    }
}

fn ours_dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    if let Err(e) = dequantize(ty, bytes, &mut out) {
        panic!("dequantize {ty}: {e}");
    }
    out
}

fn ours_quantize(ty: GgmlType, src: &[f32]) -> Vec<u8> {
    match quantize(ty, src) {
        Ok(b) => b,
        Err(e) => panic!("quantize {ty}: {e}"),
    }
}

/// Bit-for-bit equality, naming the first differing element.
fn assert_same_bits(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    if let Some(i) = (0..ours.len()).find(|&i| ours[i].to_bits() != theirs[i].to_bits()) {
        panic!(
            "{what}: element {i} differs: ours {:e} ({:#010x}), candle {:e} ({:#010x})",
            ours[i],
            ours[i].to_bits(),
            theirs[i],
            theirs[i].to_bits()
        );
    }
}

fn check_dequant_random(ty: GgmlType, dtype: GgmlDType) {
    // Several super-blocks' worth of elements, whatever the block size.
    let n_blocks = 2048 / ty.block_size(); // 8 super-blocks of 256, 64 blocks of 32, ...
    let bytes = random_blocks(ty, n_blocks, 0x5eed ^ ty.id() as u64);
    let n = n_blocks * ty.block_size();
    assert_same_bits(
        &format!("{ty} dequantize random blocks"),
        &ours_dequantize(ty, &bytes, n),
        &candle_dequantize(dtype, &bytes, n),
    );
}

fn signals() -> Vec<(&'static str, Vec<f32>)> {
    vec![
        ("ggml signal", test_signal(0.0, 4096)),
        ("random", random_data(42, 4096, 2.1)),
        ("small random", random_data(7, 4096, 1e-3)),
    ]
}

fn check_quantize(ty: GgmlType, dtype: GgmlDType) {
    for (name, src) in signals() {
        let ours = ours_quantize(ty, &src);
        let theirs = candle_quantize(dtype, &src);
        assert_eq!(ours.len(), theirs.len(), "{ty} {name}: byte length");
        // Whatever produced the blocks, both dequantizers agree bit for bit.
        assert_same_bits(
            &format!("{ty} dequantize candle-quantized {name}"),
            &ours_dequantize(ty, &theirs, src.len()),
            &candle_dequantize(dtype, &theirs, src.len()),
        );
        let ours_back = ours_dequantize(ty, &ours, src.len());
        let theirs_back = ours_dequantize(ty, &theirs, src.len());
        if departs(ty) && name == "small random" {
            // Tiny values make the f16 super-block scale subnormal; which search then lands
            // better is luck, not quality, so only byte-exact types are compared here.
            continue;
        } else if departs(ty) {
            let (e_ours, e_theirs) = (rmse(&src, &ours_back), rmse(&src, &theirs_back));
            // Our search (ggml's) is the finer one: allow 1% slack for blocks where the
            // coarser search happens to land better.
            assert!(
                e_ours <= e_theirs * 1.01,
                "{ty} {name}: our RMSE {e_ours} is worse than candle's {e_theirs}"
            );
        } else if ours != theirs {
            let ts = ty.type_size();
            let b = (0..ours.len()).find(|&i| ours[i] != theirs[i]).unwrap_or(0) / ts;
            panic!(
                "{ty} {name}: quantized block {b} differs\n ours   {:02x?}\n candle {:02x?}",
                &ours[b * ts..(b + 1) * ts],
                &theirs[b * ts..(b + 1) * ts]
            );
        }
    }
}

#[test]
fn dequantize_random_blocks_matches_candle_bit_for_bit() {
    for (ty, dtype) in CANDLE_TYPES {
        check_dequant_random(ty, dtype);
    }
}

#[test]
fn quantize_matches_candle_where_candle_follows_ggml() {
    for (ty, dtype) in CANDLE_TYPES {
        check_quantize(ty, dtype);
    }
}

#[test]
fn q8_1_departure_is_only_the_sum_field() {
    // Q8_1: d and qs follow ggml in both; only s (bytes 2..4) is computed differently.
    let src = random_data(3, 1024, 2.1);
    let ours = ours_quantize(GgmlType::Q8_1, &src);
    let theirs = candle_quantize(GgmlDType::Q8_1, &src);
    for (b, (o, t)) in ours
        .chunks_exact(36)
        .zip(theirs.chunks_exact(36))
        .enumerate()
    {
        assert_eq!(o[..2], t[..2], "block {b}: d");
        assert_eq!(o[4..], t[4..], "block {b}: qs");
    }
}
