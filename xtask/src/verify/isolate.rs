//! Layer-isolated runs: the engine's forward pass with its residual stream replaced, at every
//! layer boundary (`embed`, `blk.{i}.out`), by the reference's values, so that every layer runs on
//! the reference's input to that layer and the error of its taps is its own, not the sum of
//! everything before it (engine hook: `engine::taps::TapObserver::replace`).

use std::collections::HashMap;

use engine::taps::TapObserver;
use harness::tap::Tap;

/// Records the engine's taps and hands back the reference's residual stream (with no reference
/// taps it only records).
pub struct Isolating<'r> {
    /// The reference's `embed` and `blk.{i}.out` taps by name.
    inputs: HashMap<&'r str, &'r [f32]>,
    pub taps: Vec<Tap>,
}

impl<'r> Isolating<'r> {
    pub fn new(reference: &'r [Tap]) -> Isolating<'r> {
        let rows = reference.first().and_then(|t| t.shape.first()).copied();
        Isolating::rows(reference, 0..rows.unwrap_or(0))
    }

    /// For a forward call over the tokens at positions `rows` (a chunk of a prefill, or one
    /// decode step): the reference's residual stream for those rows only.
    pub fn rows(reference: &'r [Tap], rows: std::ops::Range<usize>) -> Isolating<'r> {
        let inputs = reference
            .iter()
            .filter(|t| is_boundary(&t.name))
            .filter_map(|t| {
                let width = t.shape.last().copied().unwrap_or(1);
                let slice = t.data.get(rows.start * width..rows.end * width)?;
                Some((t.name.as_str(), slice))
            })
            .collect();
        Isolating {
            inputs,
            taps: Vec::new(),
        }
    }
}

/// Whether `name` is a residual-stream tap between layers.
fn is_boundary(name: &str) -> bool {
    name == "embed" || (name.starts_with("blk.") && name.ends_with(".out"))
}

impl TapObserver for Isolating<'_> {
    fn tap(&mut self, name: &str, shape: &[usize], data: &[f32]) {
        self.taps
            .push(Tap::new(name, shape.to_vec(), data.to_vec()));
    }

    fn replace(&mut self, name: &str) -> Option<&[f32]> {
        self.inputs.get(name).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_residual_boundaries_are_replaced() {
        let taps = vec![
            Tap::new("embed", vec![2, 1], vec![1.0, 2.0]),
            Tap::new("blk.0.attn_norm", vec![2, 1], vec![3.0, 4.0]),
            Tap::new("blk.0.out", vec![2, 1], vec![5.0, 6.0]),
            Tap::new("blk.0.attn_out", vec![2, 1], vec![7.0, 8.0]),
        ];
        let mut iso = Isolating::new(&taps);
        assert_eq!(iso.replace("embed"), Some(&[1.0f32, 2.0][..]));
        assert_eq!(iso.replace("blk.0.out"), Some(&[5.0f32, 6.0][..]));
        assert_eq!(iso.replace("blk.0.attn_norm"), None);
        assert_eq!(iso.replace("blk.0.attn_out"), None);
        assert_eq!(iso.replace("blk.1.out"), None);
        // One decode step at position 1: the second row only.
        let mut iso = Isolating::rows(&taps, 1..2);
        assert_eq!(iso.replace("embed"), Some(&[2.0f32][..]));
        assert_eq!(iso.replace("blk.0.out"), Some(&[6.0f32][..]));
        // Rows past the reference's are not handed out.
        let mut iso = Isolating::rows(&taps, 1..3);
        assert_eq!(iso.replace("embed"), None);
    }
}
