//! Layer-isolated runs: the engine's forward pass with its residual stream replaced, at every
//! layer boundary (`embed`, `blk.{i}.out`), by the reference's values, so that every layer runs on
//! the reference's input to that layer and the error of its taps is its own, not the sum of
//! everything before it (engine hook: `engine::taps::TapObserver::replace`).

use std::collections::HashMap;

use engine::taps::TapObserver;
use harness::tap::Tap;

/// Records the engine's taps and hands back the reference's residual stream.
pub struct Isolating<'r> {
    /// The reference's `embed` and `blk.{i}.out` taps by name.
    inputs: HashMap<&'r str, &'r [f32]>,
    pub taps: Vec<Tap>,
}

impl<'r> Isolating<'r> {
    pub fn new(reference: &'r [Tap]) -> Isolating<'r> {
        let inputs = reference
            .iter()
            .filter(|t| is_boundary(&t.name))
            .map(|t| (t.name.as_str(), t.data.as_slice()))
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
            Tap::new("embed", vec![1, 2], vec![1.0, 2.0]),
            Tap::new("blk.0.attn_norm", vec![1, 2], vec![3.0, 4.0]),
            Tap::new("blk.0.out", vec![1, 2], vec![5.0, 6.0]),
            Tap::new("blk.0.attn_out", vec![1, 2], vec![7.0, 8.0]),
        ];
        let mut iso = Isolating::new(&taps);
        assert_eq!(iso.replace("embed"), Some(&[1.0f32, 2.0][..]));
        assert_eq!(iso.replace("blk.0.out"), Some(&[5.0f32, 6.0][..]));
        assert_eq!(iso.replace("blk.0.attn_norm"), None);
        assert_eq!(iso.replace("blk.0.attn_out"), None);
        assert_eq!(iso.replace("blk.1.out"), None);
    }
}
