//! Instruction-set selection: what the CPU offers, detected once.

use std::fmt;

/// The instruction sets the CPU kernels are written for.
///
/// `Avx2` needs AVX2 and FMA (and F16C for the F16 kernels, which every AVX2 CPU has);
/// `Avx512` needs AVX-512 F, BW and VL on top of that.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// Every ISA, from the plainest to the widest.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The widest ISA this CPU supports.
    pub fn detect() -> Isa {
        Self::available().into_iter().max().unwrap_or(Isa::Scalar)
    }

    /// Every ISA this CPU supports, plainest first. Always contains [`Isa::Scalar`].
    pub fn available() -> Vec<Isa> {
        Self::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// Whether this CPU can run kernels for `self`.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// The name used in backend names and on the command line: `scalar`, `avx2`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The ISA called `name` (as [`Isa::name`] spells it, case-insensitive).
    pub fn from_name(name: &str) -> Option<Isa> {
        Self::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }

    /// The CPU features this ISA needs, as `is_x86_feature_detected!` names them.
    pub fn required_features(self) -> &'static [&'static str] {
        match self {
            Isa::Scalar => &[],
            Isa::Avx2 => &["avx2", "fma", "f16c"],
            Isa::Avx512 => &["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"],
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
