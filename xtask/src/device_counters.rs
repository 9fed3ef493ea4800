//! The device counters of a forward pass ([`engine::runtime::DeviceCounters`]: launches,
//! allocations, host↔device bytes, KV bytes moved, weight bytes read), measured per prefill
//! token and per decoded token at a given context, and the model's own weight bytes per
//! decoded token to compare them with. Used by `cargo xtask bench` (which prints them) and by
//! `cargo xtask verify` (which gates them, `verify/counters.rs`).

use anyhow::{bail, Context, Result};
use engine::exec::{AnyEngine, Session};
use engine::model::Model;
use engine::runtime::{DeviceCounters, KvDtype};

/// The counters of one prefill of `ctx` tokens into an empty cache and of each of the decode
/// steps after it.
#[derive(Clone, Debug)]
pub struct Measured {
    pub ctx: usize,
    /// The whole prefill (divide by `ctx` for a per-token figure).
    pub prefill: DeviceCounters,
    /// Each decode step, in order (one token each).
    pub decode: Vec<DeviceCounters>,
}

/// Prefill `tokens[..ctx]` into a new f16 cache, then decode `tokens[ctx..]` one at a time,
/// counting each forward. `None` where the engine's device counts nothing (the CPU).
pub fn measure(engine: &AnyEngine<'_>, tokens: &[u32], ctx: usize) -> Result<Option<Measured>> {
    if ctx == 0 || ctx > tokens.len() {
        bail!(
            "counters: expected a context of 1..={} tokens, found {ctx}",
            tokens.len()
        );
    }
    let Some(mut last) = engine.device_counters() else {
        return Ok(None);
    };
    let mut s = Session::with_cache(engine, tokens.len() + 1, KvDtype::F16)?;
    let mut step = |s: &mut Session<'_, AnyEngine<'_>>, t: &[u32]| -> Result<DeviceCounters> {
        s.forward(t, None).context("counted forward")?;
        let now = engine
            .device_counters()
            .context("the device stopped counting")?;
        let d = now.since(&last);
        last = now;
        Ok(d)
    };
    let prefill = step(&mut s, &tokens[..ctx])?;
    let mut decode = Vec::with_capacity(tokens.len() - ctx);
    for &t in &tokens[ctx..] {
        decode.push(step(&mut s, &[t])?);
    }
    Ok(Some(Measured {
        ctx,
        prefill,
        decode,
    }))
}

/// The bytes of weights a decoded token must read: every matrix of the forward pass once (the
/// output head included, tied or not), one row of the token embedding, and of each stack of
/// routed experts the `n_expert_used` matrices a token is routed to.
pub fn decode_weight_bytes(model: &Model) -> u64 {
    let used = model.config().moe.as_ref().map(|m| m.n_expert_used);
    let ws = model.weights();
    let mut total = ws.first().map_or(0, |e| e.row_bytes as u64);
    for w in ws.iter().skip(1) {
        let mats = if w.n_mats > 1 {
            used.unwrap_or(w.n_mats).min(w.n_mats)
        } else {
            1
        };
        total += (mats * w.n_rows * w.row_bytes) as u64;
    }
    total
}

/// `x / n` as a per-token figure.
pub fn per_token(x: u64, n: usize) -> f64 {
    x as f64 / n.max(1) as f64
}

/// The mean of each counter over `steps`, per step.
pub fn mean(steps: &[DeviceCounters]) -> [(&'static str, f64); 7] {
    let mut total = DeviceCounters::default();
    for s in steps {
        total = total.plus(s);
    }
    total.fields().map(|(n, v)| (n, per_token(v, steps.len())))
}
