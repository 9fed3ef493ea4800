//! The reference's own dequantizers (for the types candle-core lacks) agree bit for bit with
//! `kernels::quant` on data quantized by `kernels::quant`. The two were written separately from
//! ggml's description; agreement on random blocks is evidence both read the format right (each
//! also has hand-worked test vectors of its own).

use golden::rng::SplitMix64;
use kernels::quant::{dequantize, quantize, GgmlType};
use reference::dequant::ExtraType;

#[test]
fn types_candle_lacks_agree_with_kernels() {
    for (ty, extra) in [
        (GgmlType::Q8_1, ExtraType::Q8_1),
        (GgmlType::Q8K, ExtraType::Q8K),
        (GgmlType::Iq4Nl, ExtraType::Iq4Nl),
        (GgmlType::Iq4Xs, ExtraType::Iq4Xs),
        (GgmlType::Mxfp4, ExtraType::Mxfp4),
    ] {
        assert_eq!(Some(extra), ExtraType::from_id(ty.id()));
        assert_eq!(extra.block_size(), ty.block_size());
        assert_eq!(extra.type_size(), ty.type_size());
        let mut rng = SplitMix64::new(0x5eed ^ u64::from(ty.id()));
        // 16 super-blocks of varied magnitude, including an all-zero block
        let mut values: Vec<f32> = (0..16 * 256)
            .map(|i| rng.next_signed() * (1 + i / 256) as f32)
            .collect();
        values[..256].iter_mut().for_each(|v| *v = 0.0);
        let bytes = quantize(ty, &values).expect("quantize");
        let mut want = vec![0f32; values.len()];
        dequantize(ty, &bytes, &mut want).expect("dequantize");
        let got = extra.dequantize(&bytes);
        assert_eq!(got.len(), want.len(), "{ty}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ty} element {i}: {g} vs {w}");
        }
    }
}
