//! Taps: named points of the forward pass where verification observes the engine.
//!
//! The names, order and shapes are the contract of `docs/TAPS.md`: `embed`, then per layer
//! `blk.{i}.attn_norm, q, k, v, attn, attn_out, ffn_norm, [router], ffn_out, out`, then
//! `output_norm`, `logits`. Every tap has shape `[n_tokens, width]` for the tokens of the current
//! `forward` call, row-major.
//!
//! Invariant: with no observer attached a tap costs nothing: no name is formatted and no data is
//! copied ([`Taps::emit`] takes the name as a closure and borrows the data).

use std::borrow::Cow;

/// Receives the taps of a forward pass, in forward order.
pub trait TapObserver {
    /// One tap: `name` (as in `docs/TAPS.md`), `shape` (`[n_tokens, width]`), `data` (row-major,
    /// `shape.iter().product()` values). The data is only borrowed for the call.
    fn tap(&mut self, name: &str, shape: &[usize], data: &[f32]);

    /// Layer isolation, for verification: right after the engine emits a residual-stream tap
    /// (`embed` or `blk.{i}.out`), the observer may return values (same shape) that the forward
    /// pass continues from instead of its own, so that each layer runs on a given input (the
    /// reference's) and its error is its own. `None` (the default) changes nothing.
    fn replace(&mut self, _name: &str) -> Option<&[f32]> {
        None
    }
}

/// Collects every tap into memory: the simplest observer, for tests and dumps.
#[derive(Debug, Default, Clone)]
pub struct TapRecorder {
    pub taps: Vec<RecordedTap>,
}

/// One tap as [`TapRecorder`] keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedTap {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl TapRecorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The tap called `name`, if it was emitted.
    pub fn get(&self, name: &str) -> Option<&RecordedTap> {
        self.taps.iter().find(|t| t.name == name)
    }

    /// Tap names in emission order.
    pub fn names(&self) -> Vec<&str> {
        self.taps.iter().map(|t| t.name.as_str()).collect()
    }
}

impl TapObserver for TapRecorder {
    fn tap(&mut self, name: &str, shape: &[usize], data: &[f32]) {
        self.taps.push(RecordedTap {
            name: name.to_owned(),
            shape: shape.to_vec(),
            data: data.to_vec(),
        });
    }
}

/// The forward pass's handle on an optional observer.
pub struct Taps<'a> {
    observer: Option<&'a mut dyn TapObserver>,
}

impl<'a> Taps<'a> {
    pub fn new(observer: Option<&'a mut dyn TapObserver>) -> Self {
        Taps { observer }
    }

    /// Whether an observer is attached (callers use it to skip work only taps need).
    #[inline]
    pub fn enabled(&self) -> bool {
        self.observer.is_some()
    }

    /// Emit `data` as `n_tokens` rows of `width`. `name` is only called when an observer is
    /// attached.
    #[inline]
    pub fn emit<'n>(
        &mut self,
        name: impl FnOnce() -> Cow<'n, str>,
        n_tokens: usize,
        width: usize,
        data: &[f32],
    ) {
        if let Some(obs) = self.observer.as_deref_mut() {
            debug_assert_eq!(data.len(), n_tokens * width, "tap data length");
            obs.tap(&name(), &[n_tokens, width], data);
        }
    }
}

impl Taps<'_> {
    /// The observer's replacement for the residual stream after tap `name` ([`TapObserver::replace`]);
    /// `None` without an observer. `name` is only called when one is attached.
    #[inline]
    pub fn replacement<'n>(&mut self, name: impl FnOnce() -> Cow<'n, str>) -> Option<&[f32]> {
        let obs = self.observer.as_deref_mut()?;
        obs.replace(&name())
    }
}

/// The name of a per-layer tap, `blk.{layer}.{what}`.
#[inline]
pub fn blk(layer: usize, what: &str) -> Cow<'static, str> {
    Cow::Owned(format!("blk.{layer}.{what}"))
}
