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

    /// Tensor parallelism, for verification: a tap every rank holds whole (replicated after an
    /// all-reduce, or all-gathered) whose bits on `d.rank` differ from rank 0's, which is the
    /// one [`Self::tap`] saw. Replicated computations must stay bit-identical across ranks (the
    /// communicator sums in one order on every rank); values within a tolerance are not enough,
    /// ranks that drift apart compute different things later. The default ignores it.
    fn ranks_disagree(&mut self, _d: RankDisagreement) {}
}

/// A replicated tap whose bits differ between rank 0 and another rank.
#[derive(Debug, Clone, PartialEq)]
pub struct RankDisagreement {
    pub tap: String,
    pub rank: usize,
    /// Values whose bits differ, of `len` (a shape that differs: every value).
    pub differ: usize,
    pub len: usize,
    /// The first differing value: its index, rank 0's value and this rank's.
    pub first: (usize, f32, f32),
}

impl RankDisagreement {
    /// Compare `other` (rank `rank`'s `tap`) with rank 0's `data` bit for bit; `None` when equal.
    pub fn between(tap: &str, rank: usize, data: &[f32], other: &[f32]) -> Option<Self> {
        let differs = |(a, b): (&f32, &f32)| a.to_bits() != b.to_bits();
        let mut pairs = data.iter().zip(other).enumerate();
        let (i, (a, b)) = match pairs.find(|(_, p)| differs(*p)) {
            Some((i, (a, b))) => (i, (*a, *b)),
            None if data.len() == other.len() => return None,
            None => (data.len().min(other.len()), (f32::NAN, f32::NAN)),
        };
        let differ = if data.len() == other.len() {
            data.iter().zip(other).filter(|p| differs(*p)).count()
        } else {
            data.len().max(other.len())
        };
        Some(RankDisagreement {
            tap: tap.to_owned(),
            rank,
            differ,
            len: data.len(),
            first: (i, a, b),
        })
    }
}

/// Collects every tap into memory: the simplest observer, for tests and dumps.
#[derive(Debug, Default, Clone)]
pub struct TapRecorder {
    pub taps: Vec<RecordedTap>,
    /// Replicated taps whose bits differ between ranks (tensor parallelism only).
    pub disagreements: Vec<RankDisagreement>,
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

    fn ranks_disagree(&mut self, d: RankDisagreement) {
        self.disagreements.push(d);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_disagreement_is_bitwise() {
        let a = [1.0f32, -0.0, f32::NAN, 2.0];
        assert_eq!(RankDisagreement::between("t", 1, &a, &a), None);
        // -0.0 against 0.0 is equal as a value and different as bits; one ulp is a difference.
        let b = [1.0f32, 0.0, f32::NAN, f32::from_bits(2.0f32.to_bits() + 1)];
        let d = RankDisagreement::between("t", 3, &a, &b).expect("differs");
        assert_eq!((d.rank, d.differ, d.len, d.first.0), (3, 2, 4, 1));
        // A rank without the tap (or another shape) differs everywhere.
        let d = RankDisagreement::between("t", 1, &a, &[]).expect("differs");
        assert_eq!((d.differ, d.first.0), (4, 0));
    }
}
