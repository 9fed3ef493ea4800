//! The fixtures' only source of randomness: splitmix64 (Steele, Lea & Flood, 2014), seeded per
//! tensor from the fixture seed and the tensor name, so that changing one tensor's type or shape
//! leaves every other tensor's values unchanged.

/// splitmix64: a 64-bit state advanced by the golden-ratio increment, output through a fixed mix.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [−1, 1), from the top 24 bits (exactly representable in f32).
    pub fn next_signed(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * u - 1.0
    }

    /// The stream for one tensor: the fixture seed mixed with the FNV-1a hash of the name.
    pub fn for_tensor(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut mix = Self::new(seed ^ h);
        Self::new(mix.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_published_sequence() {
        // First outputs for seed 1234567, from the reference C implementation
        // (prng.di.unimi.it/splitmix64.c), as listed in many ports' test suites.
        let mut r = SplitMix64::new(1_234_567);
        let want = [
            6_457_827_717_110_365_317u64,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
    }

    #[test]
    fn signed_values_stay_in_range_and_streams_differ_by_name() {
        let mut r = SplitMix64::for_tensor(7, "blk.0.attn_q.weight");
        for _ in 0..10_000 {
            let v = r.next_signed();
            assert!((-1.0..1.0).contains(&v));
        }
        let a = SplitMix64::for_tensor(7, "a").next_u64();
        let b = SplitMix64::for_tensor(7, "b").next_u64();
        assert_ne!(a, b);
    }
}
