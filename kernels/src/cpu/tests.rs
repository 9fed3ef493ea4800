//! Tests of the CPU matrix products.
//!
//! Oracles, from most to least independent:
//! - the f64 product of the weights dequantized by `kernels::quant` with the activations
//!   quantized *and dequantized* by `kernels::quant` to the `vec_dot_type`: what ggml's integer
//!   arithmetic computes, up to f32 rounding;
//! - the f64 product of the dequantized weights with the raw f32 activations, under
//!   test-backend-ops' NMSE bound for matrix products;
//! - for the SIMD kernels, their scalar twins (tight: they add the same exact integer block
//!   sums and differ only in the order of f32 operations).

use half::f16;
use rayon::ThreadPoolBuilder;

use super::*;
use crate::quant::{self, GgmlType, QK_K};

/// Every weight type with a CPU product.
const TYPES: [GgmlType; 18] = GgmlType::SUPPORTED;

/// SplitMix64: a small deterministic generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal: the sum of four uniforms, centred.
    fn normal(&mut self) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() + self.uniform() - 2.0) * 1.7
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// Random weights quantized to `ty` by `kernels::quant`, rows with different scales, and a few
/// outliers so that the k-quant mins and the sub-block scales vary.
fn weights(ty: GgmlType, n_rows: usize, k_dim: usize, seed: u64) -> (Vec<f32>, Vec<u8>) {
    let mut rng = Rng(seed);
    let mut f = Vec::with_capacity(n_rows * k_dim);
    for r in 0..n_rows {
        let scale = 0.02 * (1.0 + (r % 5) as f32);
        let mut row = rng.vec(k_dim, scale);
        for v in row.iter_mut().step_by(37) {
            *v *= 4.0;
        }
        if r % 3 == 1 {
            // A positively shifted row: exercises the k-quant mins.
            for v in row.iter_mut() {
                *v += scale;
            }
        }
        f.extend(row);
    }
    let bytes = match quant::quantize(ty, &f) {
        Ok(b) => b,
        Err(e) => panic!("quantizing test weights to {ty}: {e}"),
    };
    (f, bytes)
}

fn dequant(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    if let Err(e) = quant::dequantize(ty, bytes, &mut out) {
        panic!("dequantizing {ty}: {e}");
    }
    out
}

/// What the product is checked against, per output.
struct Oracle {
    /// f64 product of dequantized weights and dequantized quantized activations.
    exact: Vec<f64>,
    /// f64 product of dequantized weights and the raw f32 activations.
    raw: Vec<f64>,
    /// Σ_k blockmax|W[r, ·]| · |x_q[t, k]|: bounds every intermediate of the block arithmetic.
    scale: Vec<f64>,
    /// Extra error budget for the Q8_1 `s` shortcut (see `check_against_oracle`).
    q8_1_slack: Vec<f64>,
}

fn oracle(
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    k_dim: usize,
    x: &[f32],
    n_tokens: usize,
) -> Oracle {
    let wd = dequant(ty, w, n_rows * k_dim);
    let act = vec_dot_type(ty).unwrap_or(GgmlType::F32);
    let xq = match quant::quantize(act, x) {
        Ok(b) => dequant(act, &b, x.len()),
        Err(e) => panic!("quantizing activations to {act}: {e}"),
    };
    let bs = if ty.block_size() == 1 {
        32
    } else {
        ty.block_size()
    };
    let mut o = Oracle {
        exact: vec![0.0; n_rows * n_tokens],
        raw: vec![0.0; n_rows * n_tokens],
        scale: vec![0.0; n_rows * n_tokens],
        q8_1_slack: vec![0.0; n_rows * n_tokens],
    };
    for t in 0..n_tokens {
        let xr = &x[t * k_dim..(t + 1) * k_dim];
        let xqr = &xq[t * k_dim..(t + 1) * k_dim];
        for r in 0..n_rows {
            let wr = &wd[r * k_dim..(r + 1) * k_dim];
            let (mut e, mut raw, mut s, mut slack) = (0f64, 0f64, 0f64, 0f64);
            for b in 0..k_dim / bs {
                let range = b * bs..(b + 1) * bs;
                let bmax = wr[range.clone()]
                    .iter()
                    .fold(0f64, |m, v| m.max(f64::from(v.abs())));
                let xabs: f64 = xqr[range.clone()].iter().map(|v| f64::from(v.abs())).sum();
                s += bmax * xabs;
                slack += bmax * xabs;
                for k in range {
                    e += f64::from(wr[k]) * f64::from(xqr[k]);
                    raw += f64::from(wr[k]) * f64::from(xr[k]);
                }
            }
            let i = t * n_rows + r;
            o.exact[i] = e;
            o.raw[i] = raw;
            o.scale[i] = s;
            o.q8_1_slack[i] = slack;
        }
    }
    o
}

fn run_matmul(
    kernels: &CpuKernels,
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    k_dim: usize,
    x: &[f32],
    n_tokens: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; n_rows * n_tokens];
    if let Err(e) = kernels.matmul(ty, w, n_rows, k_dim, x, n_tokens, &mut out) {
        panic!("{} matmul of {ty}: {e}", kernels.isa());
    }
    out
}

fn backends() -> Vec<CpuKernels> {
    let mut v = Vec::new();
    for isa in Isa::available() {
        match CpuKernels::new(isa) {
            Ok(k) => v.push(k),
            Err(e) => panic!("{isa} is listed as available but: {e}"),
        }
    }
    for isa in Isa::ALL {
        if !isa.is_available() {
            eprintln!(
                "skipped {isa}: this CPU lacks {:?}",
                isa.required_features()
            );
        }
    }
    v
}

/// Shapes (n_rows, k_dim, n_tokens): one block, rows not a multiple of any tile, several token
/// tiles (TOK_TILE = 16), and a decode-sized product.
const SHAPES: [(usize, usize, usize); 5] = [
    (1, QK_K, 1),
    (7, 2 * QK_K, 3),
    (33, 512, 17),
    (70, 1024, 1),
    (19, 2048, 40),
];

/// Compare a backend's product with the exact oracle.
///
/// Tolerance: the kernels add at most k/32 block terms in f32 (plus a handful of products per
/// block), each intermediate bounded by 3 · blockmax|w| · Σ|x_q| (a k-quant value is
/// d·sc·q − dmin·m with both terms at most twice the block's largest weight), so the error is
/// at most (k/32 + 8) · 3 · ε_f32 · scale. Q4_1/Q5_1 also use ggml's shortcut `m · s` for the
/// min term, with `s = f16(d_f32 · Σq)` instead of Σ q · f16(d): two f16 roundings, at most
/// 2 · 2⁻¹¹ relative to |m| · Σ|x_q| ≤ blockmax · Σ|x_q|.
fn check_against_oracle(
    kernels: &CpuKernels,
    ty: GgmlType,
    shape: (usize, usize, usize),
    seed: u64,
) {
    let (n_rows, k_dim, n_tokens) = shape;
    let (_, w) = weights(ty, n_rows, k_dim, seed);
    let x = Rng(seed ^ 0xABCD).vec(n_tokens * k_dim, 1.0);
    let got = run_matmul(kernels, ty, &w, n_rows, k_dim, &x, n_tokens);
    let o = oracle(ty, &w, n_rows, k_dim, &x, n_tokens);
    let eps = f64::from(f32::EPSILON);
    let chain = (k_dim / 32 + 8) as f64;
    let uses_s = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
    for i in 0..got.len() {
        let mut tol = chain * 3.0 * eps * o.scale[i] + 1e-30;
        if uses_s {
            tol += 2.0 * 2f64.powi(-11) * o.q8_1_slack[i];
        }
        let err = (f64::from(got[i]) - o.exact[i]).abs();
        assert!(
            err <= tol,
            "{} {ty} shape {shape:?} output {i} (token {}, row {}): got {}, oracle {}, err {err:e} > tol {tol:e}",
            kernels.isa(),
            i / n_rows,
            i % n_rows,
            got[i],
            o.exact[i],
        );
    }
}

#[test]
fn every_type_every_isa_matches_the_dequantized_oracle() {
    for k in backends() {
        for (ti, ty) in TYPES.into_iter().enumerate() {
            for (si, shape) in SHAPES.into_iter().enumerate() {
                check_against_oracle(&k, ty, shape, (ti * 100 + si) as u64);
            }
        }
    }
}

/// Every token count from 1 to twice the largest token tile, on every ISA and weight type: the
/// small-batch path (up to `SMALL_BATCH`), the 16-token tiles and the 64-token panels, each with
/// every tail length, over 9 rows (no row tile divides it). A tail bug of one ISA shows here, not
/// only in a verify case that happens to run that ISA with that remainder.
#[test]
fn every_token_count_to_two_panel_tiles_on_every_isa_matches_the_oracle() {
    for k in backends() {
        for (ti, ty) in TYPES.into_iter().enumerate() {
            for n in 1..=2 * PANEL_TOK_TILE {
                check_against_oracle(&k, ty, (9, QK_K, n), (ti * 1000 + n) as u64);
            }
        }
    }
}

/// ggml's test-backend-ops bound for matrix products: NMSE = Σ(a − b)² / Σb² ≤ 5e-4. Here `b`
/// is the product with the raw f32 activations, so the bound covers the activation
/// quantization that ggml's CPU backend does. The weights are the dequantized stored weights
/// (as in test-backend-ops, both sides see the same quantized weights).
#[test]
fn activation_quantization_stays_within_test_backend_ops_nmse() {
    for k in backends() {
        for (ti, ty) in TYPES.into_iter().enumerate() {
            let (n_rows, k_dim, n_tokens) = (48, 1024, 5);
            let (_, w) = weights(ty, n_rows, k_dim, 7 + ti as u64);
            let x = Rng(99 + ti as u64).vec(n_tokens * k_dim, 1.0);
            let got = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);
            let o = oracle(ty, &w, n_rows, k_dim, &x, n_tokens);
            let num: f64 = got
                .iter()
                .zip(&o.raw)
                .map(|(&a, &b)| (f64::from(a) - b).powi(2))
                .sum();
            let den: f64 = o.raw.iter().map(|b| b * b).sum();
            let nmse = num / den;
            assert!(nmse <= 5e-4, "{} {ty}: NMSE {nmse:e} > 5e-4", k.isa());
        }
    }
}

/// For the types that hold f32 weights (nearly) losslessly, the bound holds against the
/// un-quantized weights too: F32/F16/BF16 and Q8_0 (8 bits: relative error ≈ 1/254 per element).
#[test]
fn near_lossless_types_match_the_unquantized_product() {
    for k in backends() {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
            let (n_rows, k_dim, n_tokens) = (40, 512, 3);
            let (f, w) = weights(ty, n_rows, k_dim, 5);
            let x = Rng(6).vec(n_tokens * k_dim, 1.0);
            let got = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);
            let (mut num, mut den) = (0f64, 0f64);
            for t in 0..n_tokens {
                for r in 0..n_rows {
                    let b: f64 = (0..k_dim)
                        .map(|i| f64::from(f[r * k_dim + i]) * f64::from(x[t * k_dim + i]))
                        .sum();
                    num += (f64::from(got[t * n_rows + r]) - b).powi(2);
                    den += b * b;
                }
            }
            let nmse = num / den;
            assert!(nmse <= 5e-4, "{} {ty}: NMSE {nmse:e} > 5e-4", k.isa());
        }
    }
}

/// SIMD against its scalar twin, output by output. Both add the same exact i32 block sums;
/// they differ only in the order of the f32 block accumulation (8 or 16 lanes against one
/// chain; f64 in the scalar float kernels) and in the order of the two or three f32 products
/// per block. Each differs from the exact sum by at most (k/32 + 8) · 3 · ε · scale (see
/// `check_against_oracle`), so their difference is at most twice that: ≈ 1.7e-5 · scale at
/// k = 2048.
#[test]
fn simd_matches_scalar() {
    let scalar = match CpuKernels::new(Isa::Scalar) {
        Ok(k) => k,
        Err(e) => panic!("scalar backend: {e}"),
    };
    for k in backends().into_iter().filter(|k| k.isa() != Isa::Scalar) {
        for (ti, ty) in TYPES.into_iter().enumerate() {
            for shape in [(5, QK_K, 2), (37, 2048, 1), (16, 768, 9)] {
                let (n_rows, k_dim, n_tokens) = shape;
                let (_, w) = weights(ty, n_rows, k_dim, 1000 + ti as u64);
                let x = Rng(2000 + ti as u64).vec(n_tokens * k_dim, 1.0);
                let a = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);
                let b = run_matmul(&scalar, ty, &w, n_rows, k_dim, &x, n_tokens);
                let o = oracle(ty, &w, n_rows, k_dim, &x, n_tokens);
                let tol_factor = 2.0 * (k_dim / 32 + 8) as f64 * 3.0 * f64::from(f32::EPSILON);
                for i in 0..a.len() {
                    let tol = tol_factor * o.scale[i] + 1e-30;
                    let err = (f64::from(a[i]) - f64::from(b[i])).abs();
                    assert!(
                        err <= tol,
                        "{} vs scalar, {ty} shape {shape:?} output {i}: {} vs {}, err {err:e} > {tol:e}",
                        k.isa(),
                        a[i],
                        b[i]
                    );
                }
            }
        }
    }
}

/// Weights at every byte offset modulo 4 give bit-identical results: the kernels read blocks
/// unaligned, as a GGUF mapping can place them.
#[test]
fn misaligned_weights_give_identical_results() {
    for k in backends() {
        for ty in TYPES {
            let (n_rows, k_dim, n_tokens) = (9, 512, 3);
            let (_, w) = weights(ty, n_rows, k_dim, 11);
            let x = Rng(12).vec(n_tokens * k_dim, 1.0);
            let base = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);
            for off in 1..4 {
                let mut buf = vec![0u8; w.len() + off];
                buf[off..].copy_from_slice(&w);
                let got = run_matmul(&k, ty, &buf[off..], n_rows, k_dim, &x, n_tokens);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    base.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{} {ty} at offset {off}",
                    k.isa()
                );
            }
        }
    }
}

/// The result does not depend on how the work is cut: every output is one dot call.
#[test]
fn thread_count_does_not_change_results() {
    let k = CpuKernels::detect();
    let (n_rows, k_dim, n_tokens) = (130, 512, 21);
    for ty in [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F16] {
        let (_, w) = weights(ty, n_rows, k_dim, 3);
        let x = Rng(4).vec(n_tokens * k_dim, 1.0);
        let mut results = Vec::new();
        for threads in [1, 3, 8] {
            let pool = match ThreadPoolBuilder::new().num_threads(threads).build() {
                Ok(p) => p,
                Err(e) => panic!("building a {threads}-thread pool: {e}"),
            };
            results.push(pool.install(|| run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens)));
        }
        for r in &results[1..] {
            assert_eq!(
                r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                results[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{ty}"
            );
        }
    }
}

/// `vec_dot`, `matmul_quantized` and `matmul_with_scratch` agree with `matmul` bit for bit,
/// including when the scratch is reused for another type and shape.
#[test]
fn entry_points_agree() {
    for k in backends() {
        let mut scratch = MatmulScratch::new();
        for (ti, ty) in TYPES.into_iter().enumerate() {
            let (n_rows, k_dim, n_tokens) = (6 + ti, 256 * (1 + ti % 3), 1 + ti % 4);
            let (_, w) = weights(ty, n_rows, k_dim, 50 + ti as u64);
            let x = Rng(60 + ti as u64).vec(n_tokens * k_dim, 1.0);
            let base = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);

            let mut out = vec![0f32; base.len()];
            let r =
                k.matmul_with_scratch(ty, &w, n_rows, k_dim, &x, n_tokens, &mut out, &mut scratch);
            assert_eq!(r, Ok(()));
            assert_eq!(out, base, "{} {ty} with scratch", k.isa());

            let mut acts = QuantizedActivations::new();
            assert_eq!(
                k.quantize_activations(ty, &x, n_tokens, k_dim, &mut acts),
                Ok(())
            );
            assert_eq!(acts.ty(), vec_dot_type(ty));
            let mut out = vec![0f32; base.len()];
            assert_eq!(k.matmul_quantized(ty, &w, n_rows, &acts, &mut out), Ok(()));
            assert_eq!(out, base, "{} {ty} quantized", k.isa());

            let row_bytes = w.len() / n_rows;
            for t in 0..n_tokens {
                for r in 0..n_rows {
                    let v = k.vec_dot(ty, &w[r * row_bytes..(r + 1) * row_bytes], &acts, t);
                    assert_eq!(v, Ok(base[t * n_rows + r]), "{} {ty} vec_dot", k.isa());
                }
            }
        }
    }
}

#[test]
fn quantized_activations_match_kernels_quant() {
    let x = Rng(8).vec(3 * 512, 1.0);
    for act in [
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q8K,
        GgmlType::F16,
        GgmlType::BF16,
    ] {
        let mut a = QuantizedActivations::new();
        assert_eq!(a.quantize(act, &x, 3, 512), Ok(()));
        let want = match quant::quantize(act, &x) {
            Ok(b) => b,
            Err(e) => panic!("{act}: {e}"),
        };
        let got: &[u8] = match a.slice() {
            Some(ActSlice::Q8_0(s)) => bytemuck::cast_slice(s),
            Some(ActSlice::Q8_1(s)) => bytemuck::cast_slice(s),
            Some(ActSlice::Q8K(s)) => bytemuck::cast_slice(s),
            Some(ActSlice::F16(s)) => bytemuck::cast_slice(s),
            Some(ActSlice::Bf16(s)) => bytemuck::cast_slice(s),
            Some(ActSlice::F32(s)) => bytemuck::cast_slice(s),
            None => panic!("{act}: no activations"),
        };
        assert_eq!(got, &want[..], "{act}");
    }
}

#[test]
fn empty_products_are_fine() {
    for k in backends() {
        let mut out = vec![];
        assert_eq!(
            k.matmul(GgmlType::Q4K, &[], 0, 256, &[0.0; 256], 1, &mut out),
            Ok(())
        );
        assert_eq!(
            k.matmul(GgmlType::Q4K, &[0; 144], 1, 256, &[], 0, &mut out),
            Ok(())
        );
    }
}

fn expect_err(r: Result<(), KernelError>, want: KernelError) {
    assert_eq!(r, Err(want));
}

#[test]
fn size_mismatches_are_errors() {
    let k = CpuKernels::detect();
    let ty = GgmlType::Q4K;
    let w = vec![0u8; 2 * 144];
    let x = vec![0f32; 256];
    let mut out = vec![0f32; 2];
    expect_err(
        k.matmul(ty, &w[1..], 2, 256, &x, 1, &mut out),
        KernelError::WeightLen {
            ty,
            n_rows: 2,
            k_dim: 256,
            expected: 288,
            found: 287,
        },
    );
    expect_err(
        k.matmul(ty, &w, 2, 200, &x[..200], 1, &mut out),
        KernelError::KDimNotBlockMultiple {
            ty,
            k_dim: 200,
            block_size: 256,
        },
    );
    expect_err(
        k.matmul(ty, &w, 2, 256, &x[..255], 1, &mut out),
        KernelError::InputLen {
            n_tokens: 1,
            k_dim: 256,
            expected: 256,
            found: 255,
        },
    );
    expect_err(
        k.matmul(ty, &w, 2, 256, &x, 1, &mut out[..1]),
        KernelError::OutputLen {
            n_tokens: 1,
            n_rows: 2,
            expected: 2,
            found: 1,
        },
    );
    expect_err(
        k.matmul(GgmlType::Iq2Xxs, &w, 2, 256, &x, 1, &mut out),
        KernelError::UnsupportedType {
            ty: GgmlType::Iq2Xxs,
        },
    );
    expect_err(
        k.matmul(ty, &w, usize::MAX, 256, &x, 1, &mut out),
        KernelError::Overflow {
            what: "weight bytes",
        },
    );

    let mut acts = QuantizedActivations::new();
    assert_eq!(
        k.quantize_activations(GgmlType::Q8_0, &x, 1, 256, &mut acts),
        Ok(())
    );
    expect_err(
        k.matmul_quantized(ty, &w, 2, &acts, &mut out),
        KernelError::ActivationType {
            weight: ty,
            expected: GgmlType::Q8K,
            found: Some(GgmlType::Q8_0),
        },
    );
    assert_eq!(
        k.vec_dot(GgmlType::Q8_0, &[0u8; 34 * 8], &acts, 1),
        Err(KernelError::TokenOutOfRange {
            token: 1,
            n_tokens: 1
        })
    );
    assert_eq!(
        k.vec_dot(GgmlType::Q8_0, &[0u8; 34], &acts, 0),
        Err(KernelError::WeightLen {
            ty: GgmlType::Q8_0,
            n_rows: 1,
            k_dim: 256,
            expected: 272,
            found: 34
        })
    );
}

#[test]
fn isa_names_round_trip_and_detection_is_consistent() {
    for isa in Isa::ALL {
        assert_eq!(Isa::from_name(isa.name()), Some(isa));
        assert_eq!(isa.to_string(), isa.name());
    }
    assert_eq!(Isa::from_name("AVX2"), Some(Isa::Avx2));
    assert_eq!(Isa::from_name("neon"), None);
    let avail = Isa::available();
    assert_eq!(avail.first(), Some(&Isa::Scalar));
    assert_eq!(avail.last(), Some(&Isa::detect()));
    assert_eq!(CpuKernels::detect().isa(), Isa::detect());
    for isa in Isa::ALL {
        match CpuKernels::new(isa) {
            Ok(k) => {
                assert!(avail.contains(&isa));
                assert_eq!(k.isa(), isa);
            }
            Err(KernelError::IsaUnavailable { isa: i, missing }) => {
                assert_eq!(i, isa);
                assert!(!avail.contains(&isa));
                assert!(
                    !missing.is_empty(),
                    "{isa}: unavailable but nothing missing"
                );
            }
            Err(e) => panic!("{isa}: unexpected error {e}"),
        }
    }
}

/// Known values, independent of `kernels::quant`: one Q8_0 block of weights 1..=32 (d = 1)
/// against activations of all 1s (d = 0.5) is 0.5 · Σ 1..=32 = 264.
#[test]
fn q8_0_hand_computed() {
    let mut w = vec![0u8; 34];
    w[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
    for i in 0..32 {
        w[2 + i] = (i as i8 + 1) as u8;
    }
    // x = 0.5 everywhere quantizes to q = 127, d = 0.5/127; the dot is d · 127 · 528 ≈ 264 up to
    // the f16 rounding of d.
    let x = vec![0.5f32; 32];
    for k in backends() {
        let mut out = [0f32; 1];
        assert_eq!(k.matmul(GgmlType::Q8_0, &w, 1, 32, &x, 1, &mut out), Ok(()));
        let d = f16::from_f32(0.5 / 127.0).to_f32();
        assert_eq!(out[0], (127 * 528) as f32 * d, "{}", k.isa());
        assert!((out[0] - 264.0).abs() < 0.1, "{}: {}", k.isa(), out[0]);
    }
}

/// A prefill product (tokens grouped four at a time through the four-row kernels where the ISA
/// has them) equals the same tokens multiplied one at a time, bit for bit: the four-row kernels
/// repeat the one-row kernel's f32 operations per row. Odd block counts exercise the 256-bit
/// tail of the 32-element types; token counts leave every remainder of four, 17 crosses a
/// token tile and 70 a panel kernel's.
#[test]
fn prefill_equals_token_by_token() {
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ];
    for k in backends() {
        for (ti, ty) in types.into_iter().enumerate() {
            let k_dims: &[usize] = if ty.block_size() == 32 {
                &[32, 96, 640]
            } else {
                &[QK_K, 3 * QK_K]
            };
            for &k_dim in k_dims {
                for n_tokens in [2, 3, 4, 5, 6, 7, 9, 16, 17, 35, 70] {
                    let n_rows = 11;
                    let (_, w) = weights(ty, n_rows, k_dim, 300 + ti as u64);
                    let x = Rng(400 + ti as u64 + n_tokens as u64).vec(n_tokens * k_dim, 1.0);
                    let all = run_matmul(&k, ty, &w, n_rows, k_dim, &x, n_tokens);
                    for t in 0..n_tokens {
                        let one =
                            run_matmul(&k, ty, &w, n_rows, k_dim, &x[t * k_dim..][..k_dim], 1);
                        let got: Vec<u32> = all[t * n_rows..(t + 1) * n_rows]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        let want: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got,
                            want,
                            "{} {ty} k {k_dim} n_tokens {n_tokens} token {t}",
                            k.isa()
                        );
                    }
                }
            }
        }
    }
}

/// A decode product (one activation row; rows four at a time through the decode kernels where
/// the ISA has them) equals the one-row kernel on every row, bit for bit. Odd block counts
/// exercise the 256-bit tail, row counts leave every remainder of four and cross task chunks.
#[test]
fn decode_rows_equal_vec_dot() {
    for k in backends() {
        for (ti, ty) in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0]
            .into_iter()
            .enumerate()
        {
            for k_dim in [32, 96, 640, 32 * 37] {
                for n_rows in [1, 3, 4, 5, 6, 7, 130] {
                    let (_, w) = weights(ty, n_rows, k_dim, 700 + ti as u64);
                    let x = Rng(800 + ti as u64 + k_dim as u64).vec(k_dim, 1.0);
                    let got = run_matmul(&k, ty, &w, n_rows, k_dim, &x, 1);
                    let mut acts = QuantizedActivations::new();
                    assert_eq!(k.quantize_activations(ty, &x, 1, k_dim, &mut acts), Ok(()));
                    let row_bytes = w.len() / n_rows;
                    for (r, g) in got.iter().enumerate() {
                        let v = k.vec_dot(ty, &w[r * row_bytes..(r + 1) * row_bytes], &acts, 0);
                        assert_eq!(
                            v.map(f32::to_bits),
                            Ok(g.to_bits()),
                            "{} {ty} k {k_dim} rows {n_rows} row {r}",
                            k.isa()
                        );
                    }
                }
            }
        }
    }
}
