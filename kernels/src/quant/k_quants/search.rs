//! ggml's scale searches for the k-quants (`make_qx_quants`, `make_q3_quants`,
//! `make_qkx2_quants` in `ggml-quants.c`), without importance weights.
//!
//! Each keeps ggml's operation order: these choose integer levels, and a different rounding of
//! one sum can pick a different level and so a different block.

use crate::quant::nearest_int;

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is all zero.
pub(super) const GROUP_MAX_EPS: f32 = 1e-15;

/// The element with the largest magnitude, sign kept (first one on ties), and that magnitude.
#[inline(always)]
pub(super) fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (max, amax)
}

/// `make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL)`: symmetric levels
/// `L - nmax ∈ [-nmax, nmax)`, weights `x²`, and a search over 18 nearby scales for the one
/// with the least weighted squared error. Returns the scale; `l` gets `level + nmax`.
pub(super) fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let clamp = |v: i32| v.min(nmax - 1).max(-nmax);
    let mut iscale = -nmaxf / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (li, &xi) in l.iter_mut().zip(x) {
        let q = clamp(nearest_int(iscale * xi));
        *li = (q + nmax) as i8;
        let w = xi * xi;
        sumlx += w * xi * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &xi in x {
            let q = clamp(nearest_int(iscale * xi)) as f32;
            let w = xi * xi;
            sumlx += w * xi * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &xi) in l.iter_mut().zip(x) {
                *li = (nmax + clamp(nearest_int(iscale * xi))) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants(n, nmax, x, L, do_rmse = true)`: symmetric levels in `[-nmax, nmax)` refined
/// one element at a time (up to 5 passes) with weights `x²`. Returns the scale; `l` gets
/// `level + nmax`.
pub(super) fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let clamp = |v: i32| v.min(nmax - 1).max(-nmax);
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (li, &xi) in l.iter_mut().zip(x) {
        let q = clamp(nearest_int(iscale * xi));
        *li = q as i8;
        let w = xi * xi;
        sumlx += w * xi * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (li, &xi) in l.iter_mut().zip(x) {
            let w = xi * xi;
            let cur = *li as f32;
            let mut slx = sumlx - w * xi * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = clamp(nearest_int(xi * sl2 / slx));
                if new_l != *li as i32 {
                    let nl = new_l as f32;
                    slx += w * xi * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for li in l.iter_mut() {
        *li += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `make_qkx2_quants`: asymmetric levels `L ∈ [0, nmax]` with `x ≈ scale·L − min`, searching
/// `nstep + 1` scales `(rmin + rdelta·is + nmax) / (max − min)` for the least weighted error
/// (absolute when `use_mad`, squared otherwise), refitting scale and min by least squares at
/// each. Returns `(scale, min)` with `min ≥ 0` the value subtracted.
pub(super) fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let laux = &mut laux[..n];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let q = q as f32;
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of Q4_K/Q5_K.
#[inline(always)]
pub(super) fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The inverse of [`get_scale_min_k4`] for all 8 sub-blocks (as `quantize_row_q4_K_ref` packs).
#[inline(always)]
pub(super) fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_k4_packing_round_trips() {
        let ls = [0, 1, 17, 63, 32, 5, 48, 63];
        let lm = [63, 0, 2, 40, 15, 16, 62, 1];
        let packed = pack_scale_min_k4(&ls, &lm);
        for j in 0..8 {
            assert_eq!(
                get_scale_min_k4(j, &packed),
                (ls[j], lm[j]),
                "sub-block {j}"
            );
        }
    }

    #[test]
    fn qx_quants_exact_on_grid() {
        // Values already on a symmetric grid come back exactly.
        let x: Vec<f32> = (0..16).map(|i| (i as f32 - 8.0) * 0.25).collect();
        let mut l = [0i8; 16];
        let scale = make_qx_quants(8, &x, &mut l);
        for (i, &xi) in x.iter().enumerate() {
            assert_eq!(scale * (l[i] as f32 - 8.0), xi, "element {i}");
        }
    }
}
