//! The GGML tensor types: ids as GGUF stores them, block geometry, names.

use std::fmt;

/// Every tensor type ggml defines, by its GGUF type id.
///
/// The reader recognises all of them (so it can size and bound-check any real file); only those
/// for which [`GgmlType::is_supported`] is true can be dequantized and computed with here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    Iq2Xxs = 16,
    Iq2Xs = 17,
    Iq3Xxs = 18,
    Iq1S = 19,
    Iq4Nl = 20,
    Iq3S = 21,
    Iq2S = 22,
    Iq4Xs = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    Iq1M = 29,
    BF16 = 30,
    Tq1_0 = 34,
    Tq2_0 = 35,
    Mxfp4 = 39,
}

/// Elements per super-block of the k-quants (ggml's `QK_K`).
pub const QK_K: usize = 256;

impl GgmlType {
    /// All types, in id order.
    pub const ALL: [GgmlType; 32] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q8K,
        Self::Iq2Xxs,
        Self::Iq2Xs,
        Self::Iq3Xxs,
        Self::Iq1S,
        Self::Iq4Nl,
        Self::Iq3S,
        Self::Iq2S,
        Self::Iq4Xs,
        Self::I8,
        Self::I16,
        Self::I32,
        Self::I64,
        Self::F64,
        Self::Iq1M,
        Self::BF16,
        Self::Tq1_0,
        Self::Tq2_0,
        Self::Mxfp4,
    ];

    /// The weight types plumbline dequantizes, quantizes and computes with.
    pub const SUPPORTED: [GgmlType; 18] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q8K,
        Self::Iq4Nl,
        Self::Iq4Xs,
        Self::Mxfp4,
    ];

    /// The type with GGUF id `id`, or `None` for an id ggml does not define.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The type named `name` (ggml's lower-case spelling, e.g. `q4_K`, case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// GGUF type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Iq4Nl | Mxfp4 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq2Xxs | Iq2Xs | Iq3Xxs | Iq1S | Iq3S | Iq2S
            | Iq4Xs | Iq1M | Tq1_0 | Tq2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            Iq2Xxs => 66,
            Iq2Xs => 74,
            Iq3Xxs => 98,
            Iq1S => 50,
            Iq4Nl => 18,
            Iq3S => 110,
            Iq2S => 82,
            Iq4Xs => 136,
            Iq1M => 56,
            Tq1_0 => 54,
            Tq2_0 => 66,
            Mxfp4 => 17,
        }
    }

    /// ggml's name for the type (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            BF16 => "bf16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2K => "q2_K",
            Q3K => "q3_K",
            Q4K => "q4_K",
            Q5K => "q5_K",
            Q6K => "q6_K",
            Q8K => "q8_K",
            Iq2Xxs => "iq2_xxs",
            Iq2Xs => "iq2_xs",
            Iq3Xxs => "iq3_xxs",
            Iq1S => "iq1_s",
            Iq4Nl => "iq4_nl",
            Iq3S => "iq3_s",
            Iq2S => "iq2_s",
            Iq4Xs => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            Iq1M => "iq1_m",
            Tq1_0 => "tq1_0",
            Tq2_0 => "tq2_0",
            Mxfp4 => "mxfp4",
        }
    }

    /// Whether plumbline can dequantize, quantize and compute with this type.
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }

    /// Bytes needed for `n_elements` elements, or `None` when `n_elements` is not a whole number
    /// of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None, "4 was Q4_2, removed from ggml");
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn bytes_for_whole_blocks_only() {
        assert_eq!(GgmlType::Q4K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(3), Some(12));
        assert_eq!(GgmlType::Q8_0.bytes_for(u64::MAX - 31), None);
    }
}
