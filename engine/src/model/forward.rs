//! The forward pass of every architecture, on any [`Backend`].
//!
//! One function for all: the layer structure is llama's (norm → attention → residual, norm →
//! FFN → residual) and the differences come from the configuration (embedding scale, RoPE
//! style and bases, sliding window, soft-capping) and from which weights a layer has (QK-norm,
//! post-norms, biases, MLA, MoE). Taps are emitted in `docs/TAPS.md` order.

use crate::faults::{self, Fault};
use crate::runtime::{AttnParams, Backend, KvCache, MatRef, RuntimeError};
use crate::taps::{blk, Taps};

use super::{
    Attention, DenseFfn, Ffn, Gating, MlaAttention, Model, ModelConfig, MoeConfig, MoeFfn,
    StdAttention, Weight,
};

fn mat<'m>(m: &'m Model, w: &'m Weight) -> MatRef<'m> {
    MatRef {
        name: w.name(),
        ty: w.ty,
        data: m.data(w),
        n_rows: w.n_rows,
        k_dim: w.k_dim,
    }
}

/// Matrix `e` of a stack of expert matrices.
fn expert_mat<'m>(m: &'m Model, w: &'m Weight, e: usize) -> MatRef<'m> {
    let size = w.mat_bytes();
    let e = match m.data(w).len().checked_div(size) {
        // A loader that laid out the 3-D expert tensor in the wrong order.
        Some(n_exp) if n_exp > 0 && faults::is_active(Fault::PermutedExperts) => (e + 1) % n_exp,
        _ => e,
    };
    MatRef {
        name: w.name(),
        ty: w.ty,
        data: m.data(w).get(e * size..(e + 1) * size).unwrap_or(&[]),
        n_rows: w.n_rows,
        k_dim: w.k_dim,
    }
}

/// `x · wᵀ` for `n` rows, into a new buffer.
fn matmul(be: &dyn Backend, w: MatRef<'_>, x: &[f32], n: usize) -> Result<Vec<f32>, RuntimeError> {
    let mut out = vec![0f32; n * w.n_rows];
    be.matmul(&w, x, n, &mut out)?;
    Ok(out)
}

fn add_bias(x: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            for (a, &c) in row.iter_mut().zip(b) {
                *a += c;
            }
        }
    }
}

/// Run `tokens` at positions `cache.len()..`, appending their keys and values to `cache`
/// (uncommitted). Returns the logits (all rows, or the last only) and their row count.
pub(crate) fn forward(
    m: &Model,
    be: &dyn Backend,
    cache: &mut KvCache,
    tokens: &[u32],
    taps: &mut Taps<'_>,
    logits_all: bool,
) -> Result<(Vec<f32>, usize), RuntimeError> {
    let c = m.config();
    let n = tokens.len();
    let d = c.n_embd;
    let pos0 = cache.len();

    let mut x = vec![0f32; n * d];
    for (&tok, row) in tokens.iter().zip(x.chunks_exact_mut(d)) {
        m.embedding_row(tok, row)?;
    }
    if let Some(s) = c.embed_scale {
        be.scale(&mut x, s);
    }
    taps.emit(|| "embed".into(), n, d, &x);

    let mut h = vec![0f32; n * d];
    for (il, layer) in m.layers.iter().enumerate() {
        be.rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h)?;
        taps.emit(|| blk(il, "attn_norm"), n, d, &h);

        let attn = match &layer.attn {
            Attention::Std(a) => std_attention(m, be, cache, a, il, &h, pos0, taps)?,
            Attention::Mla(a) => mla_attention(m, be, cache, a, il, &h, pos0, taps)?,
        };
        taps.emit(|| blk(il, "attn"), n, c.n_head * c.head_dim_v, &attn);

        let mut o = matmul(be, mat(m, &layer.wo), &attn, n)?;
        if let Some(w) = &layer.post_attn_norm {
            be.rms_norm_inplace(&mut o, w, c.rms_eps)?;
        }
        taps.emit(|| blk(il, "attn_out"), n, d, &o);
        if faults::is_active(Fault::SkipResidualAdd) && il == 0 {
            x.copy_from_slice(&o);
        } else {
            be.add(&mut x, &o)?;
        }

        be.rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
        taps.emit(|| blk(il, "ffn_norm"), n, d, &h);
        let mut f = match &layer.ffn {
            Ffn::Dense(ffn) => dense_ffn(m, be, c, ffn, &h, n)?,
            Ffn::Moe(ffn) => {
                let moe = c.moe.ok_or(RuntimeError::Shape {
                    op: "MoE layer without MoE configuration",
                    expected: 1,
                    found: 0,
                })?;
                moe_ffn(m, be, c, &moe, ffn, il, &h, n, taps)?
            }
        };
        if let Some(w) = &layer.post_ffn_norm {
            be.rms_norm_inplace(&mut f, w, c.rms_eps)?;
        }
        taps.emit(|| blk(il, "ffn_out"), n, d, &f);
        be.add(&mut x, &f)?;
        taps.emit(|| blk(il, "out"), n, d, &x);
    }

    // Only the rows whose logits are wanted go through the head (all of them for taps).
    let first = if logits_all || taps.enabled() {
        0
    } else {
        n - 1
    };
    let rows = n - first;
    let mut xn = vec![0f32; rows * d];
    be.rms_norm(&x[first * d..], &m.output_norm, c.rms_eps, &mut xn)?;
    taps.emit(|| "output_norm".into(), rows, d, &xn);
    let mut logits = matmul(be, mat(m, &m.output), &xn, rows)?;
    if let Some(cap) = c.final_logit_softcap {
        be.softcap(&mut logits, cap);
    }
    taps.emit(|| "logits".into(), rows, c.n_vocab, &logits);
    if !logits_all && rows > 1 {
        logits.drain(..(rows - 1) * c.n_vocab);
        return Ok((logits, 1));
    }
    Ok((logits, rows))
}

/// Position of the first new token as RoPE sees it.
fn rope_pos(pos0: usize) -> usize {
    if faults::is_active(Fault::RopePositionOffByOne) {
        pos0 + 1
    } else {
        pos0
    }
}

/// Attention over the cache of layer `il`, after appending the new `k`, `v`.
fn attend(
    be: &dyn Backend,
    c: &ModelConfig,
    cache: &mut KvCache,
    il: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
) -> Result<Vec<f32>, RuntimeError> {
    cache.append(il, k, v);
    let (kc, vc, n_kv) = cache.layer(il);
    let window = if c.is_swa_layer(il) {
        let extra = usize::from(faults::is_active(Fault::SlidingWindowOffByOne));
        c.sliding_window.map(|w| w + extra)
    } else {
        None
    };
    let p = AttnParams {
        n_tokens: n,
        n_kv,
        n_head: c.n_head,
        n_head_kv: c.n_head_kv,
        head_dim_k: c.head_dim_k,
        head_dim_v: c.head_dim_v,
        scale: c.attn_scale,
        window,
    };
    let mut out = vec![0f32; n * c.n_head * c.head_dim_v];
    be.attention(q, kc, vc, &p, &mut out)?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn std_attention(
    m: &Model,
    be: &dyn Backend,
    cache: &mut KvCache,
    a: &StdAttention,
    il: usize,
    h: &[f32],
    pos0: usize,
    taps: &mut Taps<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let c = m.config();
    let n = h.len() / c.n_embd;
    let mut q = matmul(be, mat(m, &a.wq), h, n)?;
    let mut k = matmul(be, mat(m, &a.wk), h, n)?;
    let mut v = matmul(be, mat(m, &a.wv), h, n)?;
    add_bias(&mut q, a.bq.as_ref());
    add_bias(&mut k, a.bk.as_ref());
    add_bias(&mut v, a.bv.as_ref());
    if let Some(w) = &a.q_norm {
        be.rms_norm_inplace(&mut q, w, c.rms_eps)?;
    }
    if let Some(w) = &a.k_norm {
        be.rms_norm_inplace(&mut k, w, c.rms_eps)?;
    }
    if faults::is_active(Fault::SwappedQkShards) && c.n_head.is_multiple_of(2) {
        let half = c.n_head / 2 * c.head_dim_k;
        for row in q.chunks_exact_mut(2 * half) {
            let (a0, a1) = row.split_at_mut(half);
            a0.swap_with_slice(a1);
        }
    }
    let rope = c.rope_for_layer(il);
    be.rope(&mut q, n, c.n_head, c.head_dim_k, rope_pos(pos0), rope)?;
    be.rope(&mut k, n, c.n_head_kv, c.head_dim_k, rope_pos(pos0), rope)?;
    taps.emit(|| blk(il, "q"), n, c.n_head * c.head_dim_k, &q);
    taps.emit(|| blk(il, "k"), n, c.n_head_kv * c.head_dim_k, &k);
    taps.emit(|| blk(il, "v"), n, c.n_head_kv * c.head_dim_v, &v);
    attend(be, c, cache, il, &q, &k, &v, n)
}

#[allow(clippy::too_many_arguments)]
fn mla_attention(
    m: &Model,
    be: &dyn Backend,
    cache: &mut KvCache,
    a: &MlaAttention,
    il: usize,
    h: &[f32],
    pos0: usize,
    taps: &mut Taps<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let c = m.config();
    let Some(mla) = c.mla else {
        return Err(RuntimeError::Shape {
            op: "MLA layer without MLA configuration",
            expected: 1,
            found: 0,
        });
    };
    let n = h.len() / c.n_embd;
    let nh = c.n_head;
    let (nope, rope_d, dv) = (mla.qk_nope, mla.qk_rope, mla.v_head_dim);
    let dqk = nope + rope_d;

    let mut q = match (&a.wq_a, &a.wq) {
        (Some((wa, norm, wb)), _) => {
            let mut qa = matmul(be, mat(m, wa), h, n)?;
            be.rms_norm_inplace(&mut qa, norm, c.rms_eps)?;
            matmul(be, mat(m, wb), &qa, n)?
        }
        (None, Some(wq)) => matmul(be, mat(m, wq), h, n)?,
        (None, None) => {
            return Err(RuntimeError::Shape {
                op: "MLA queries: attn_q_a/attn_q_b or attn_q",
                expected: 1,
                found: 0,
            })
        }
    };
    let kva = matmul(be, mat(m, &a.wkv_a_mqa), h, n)?;
    let kva_w = mla.kv_lora_rank + rope_d;
    let mut ckv = Vec::with_capacity(n * mla.kv_lora_rank);
    let mut kpe = Vec::with_capacity(n * rope_d);
    for row in kva.chunks_exact(kva_w) {
        ckv.extend_from_slice(&row[..mla.kv_lora_rank]);
        kpe.extend_from_slice(&row[mla.kv_lora_rank..]);
    }

    // Decoupled RoPE: the last `qk_rope` values of each query head, and the one shared k_pe.
    let rope = c.rope_for_layer(il);
    let mut qpe = Vec::with_capacity(n * nh * rope_d);
    for head in q.chunks_exact(dqk) {
        qpe.extend_from_slice(&head[nope..]);
    }
    be.rope(&mut qpe, n, nh, rope_d, rope_pos(pos0), rope)?;
    for (head, pe) in q.chunks_exact_mut(dqk).zip(qpe.chunks_exact(rope_d)) {
        head[nope..].copy_from_slice(pe);
    }
    be.rope(&mut kpe, n, 1, rope_d, rope_pos(pos0), rope)?;

    be.rms_norm_inplace(&mut ckv, &a.kv_a_norm, c.rms_eps)?;
    let kv = matmul(be, mat(m, &a.wkv_b), &ckv, n)?;
    let mut k = Vec::with_capacity(n * nh * dqk);
    let mut v = Vec::with_capacity(n * nh * dv);
    for (t, row) in kv.chunks_exact(nh * (nope + dv)).enumerate() {
        let pe = &kpe[t * rope_d..(t + 1) * rope_d];
        for head in row.chunks_exact(nope + dv) {
            k.extend_from_slice(&head[..nope]);
            k.extend_from_slice(pe);
            v.extend_from_slice(&head[nope..]);
        }
    }
    taps.emit(|| blk(il, "q"), n, nh * dqk, &q);
    taps.emit(|| blk(il, "k"), n, nh * dqk, &k);
    taps.emit(|| blk(il, "v"), n, nh * dv, &v);
    attend(be, c, cache, il, &q, &k, &v, n)
}

fn dense_ffn(
    m: &Model,
    be: &dyn Backend,
    c: &ModelConfig,
    f: &DenseFfn,
    h: &[f32],
    n: usize,
) -> Result<Vec<f32>, RuntimeError> {
    let mut g = matmul(be, mat(m, &f.gate), h, n)?;
    let u = matmul(be, mat(m, &f.up), h, n)?;
    be.gated_act(c.activation, &mut g, &u)?;
    matmul(be, mat(m, &f.down), &g, n)
}

/// One token's routing: expert ids in rank order and their weights.
pub(crate) fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    moe: &MoeConfig,
) -> (Vec<usize>, Vec<f32>) {
    let probs: Vec<f32> = match moe.gating {
        Gating::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f64 = e.iter().map(|&v| f64::from(v)).sum();
            let inv = (1.0 / sum) as f32;
            e.iter().map(|&v| v * inv).collect()
        }
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let select: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Descending by selection score; NaN last; ties keep the lower id first.
    order.sort_by(|&a, &b| {
        select[b]
            .partial_cmp(&select[a])
            .unwrap_or_else(|| select[a].is_nan().cmp(&select[b].is_nan()))
    });
    let k = moe.n_expert_used.min(order.len());
    let mut chosen: Vec<usize> = order[..k].to_vec();
    if faults::is_active(Fault::WrongRouterTopK) && order.len() > k && k > 0 {
        chosen[k - 1] = order[k];
    }
    let mut weights: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
    if moe.weights_norm {
        // llama.cpp clamps the sum at the smallest normal f16 before dividing.
        let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= moe.weights_scale);
    (chosen, weights)
}

#[allow(clippy::too_many_arguments)]
fn moe_ffn(
    m: &Model,
    be: &dyn Backend,
    c: &ModelConfig,
    moe: &MoeConfig,
    f: &MoeFfn,
    il: usize,
    h: &[f32],
    n: usize,
    taps: &mut Taps<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let d = c.n_embd;
    let ne = moe.n_expert;
    let router = matmul(be, mat(m, &f.gate_inp), h, n)?;
    taps.emit(|| blk(il, "router"), n, ne, &router);

    let k = moe.n_expert_used;
    // Per expert: (token, rank) pairs routed to it.
    let mut assigned: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ne];
    let mut weights = vec![0f32; n * k];
    let mut poisoned = None;
    for (t, row) in router.chunks_exact(ne).enumerate() {
        let (ids, w) = route(row, f.exp_probs_b.as_deref(), moe);
        if t == 0 && faults::is_active(Fault::NanInExpert) {
            poisoned = ids.first().copied();
        }
        for (r, (&e, &wt)) in ids.iter().zip(&w).enumerate() {
            assigned[e].push((t, r));
            weights[t * k + r] = wt;
        }
    }

    // Each expert runs once over all its tokens; outputs are kept per (token, rank) and summed
    // in rank order, as llama.cpp adds the selected experts' views.
    let mut per_rank = vec![0f32; n * k * d];
    let mut xs = Vec::new();
    for (e, routed) in assigned.iter().enumerate() {
        if routed.is_empty() {
            continue;
        }
        xs.clear();
        for &(t, _) in routed {
            xs.extend_from_slice(&h[t * d..(t + 1) * d]);
        }
        let nt = routed.len();
        let mut g = matmul(be, expert_mat(m, &f.gate_exps, e), &xs, nt)?;
        let u = matmul(be, expert_mat(m, &f.up_exps, e), &xs, nt)?;
        be.gated_act(c.activation, &mut g, &u)?;
        let mut y = matmul(be, expert_mat(m, &f.down_exps, e), &g, nt)?;
        if poisoned == Some(e) {
            y.fill(f32::NAN);
        }
        for (&(t, r), yr) in routed.iter().zip(y.chunks_exact(d)) {
            let wt = weights[t * k + r];
            let dst = &mut per_rank[(t * k + r) * d..(t * k + r + 1) * d];
            for (o, &v) in dst.iter_mut().zip(yr) {
                *o = v * wt;
            }
        }
    }
    let mut out = vec![0f32; n * d];
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        o.copy_from_slice(&per_rank[t * k * d..(t * k + 1) * d]);
        for r in 1..k {
            let src = &per_rank[(t * k + r) * d..(t * k + r + 1) * d];
            for (a, &b) in o.iter_mut().zip(src) {
                *a += b;
            }
        }
    }
    if let Some(shared) = &f.shared {
        let s = dense_ffn(m, be, c, shared, h, n)?;
        be.add(&mut out, &s)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(gating: Gating, norm: bool, scale: f32, k: usize) -> MoeConfig {
        MoeConfig {
            n_expert: 4,
            n_expert_used: k,
            n_expert_shared: 0,
            n_ff_exp: 8,
            n_dense_lead: 0,
            weights_scale: scale,
            weights_norm: norm,
            gating,
        }
    }

    #[test]
    fn softmax_router_picks_top_k_by_probability() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let (ids, w) = route(&logits, None, &moe(Gating::Softmax, false, 1.0, 2));
        assert_eq!(ids, [1, 2]);
        // softmax(2) and softmax(1) over {0, 2, 1, -1}, computed by hand in f64.
        let z: f64 = [0f64, 2.0, 1.0, -1.0].iter().map(|v| v.exp()).sum();
        approx::assert_relative_eq!(w[0], (2f64.exp() / z) as f32, max_relative = 1e-6);
        approx::assert_relative_eq!(w[1], (1f64.exp() / z) as f32, max_relative = 1e-6);
    }

    #[test]
    fn bias_changes_the_choice_but_not_the_weights() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let bias = [0.0, 0.0, 0.0, 5.0];
        let cfg = moe(Gating::Sigmoid, false, 1.0, 2);
        let (ids, w) = route(&logits, Some(&bias), &cfg);
        assert_eq!(ids, [3, 1]);
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert_eq!(w, [sig(-1.0), sig(2.0)]);
    }

    #[test]
    fn weights_are_normalized_then_scaled() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let (_, w) = route(&logits, None, &moe(Gating::Sigmoid, true, 2.5, 3));
        approx::assert_relative_eq!(w.iter().sum::<f32>(), 2.5, max_relative = 1e-6);
    }
}
