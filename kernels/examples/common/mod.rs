//! What the kernel microbenchmarks share.

/// Uniform values in [-0.5, 0.5) from a fixed xorshift stream: the same matrices every run.
pub fn signal() -> impl FnMut() -> f32 {
    let mut seed = 0x9E37_79B9_u32;
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) - 0.5
    }
}
