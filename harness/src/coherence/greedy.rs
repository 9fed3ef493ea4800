//! Greedy-prefix match against golden token ids.

use crate::gate::GateResult;

/// Length of the common prefix of two id sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The engine's greedy ids must equal the golden ids for the first `n` tokens (or all golden ids
/// when there are fewer than `n`). `value` is the matched prefix length, `threshold` the required
/// one; `detail` names the first mismatch position and both ids.
pub fn greedy_prefix(engine: &[u32], golden: &[u32], n: usize) -> GateResult {
    let required = n.min(golden.len());
    let matched = common_prefix(engine, golden);
    let detail = if matched >= required {
        format!("first {required} tokens match")
    } else if matched == engine.len() {
        format!(
            "engine stopped after {} tokens; golden continues with id {}",
            engine.len(),
            golden[matched]
        )
    } else {
        format!(
            "first mismatch at position {matched}: engine id {}, golden id {}",
            engine[matched], golden[matched]
        )
    };
    GateResult::at_least(
        "greedy_prefix",
        matched.min(required) as f64,
        required as f64,
        detail,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(engine: &[u32], golden: &[u32], n: usize, passed: bool, value: f64, detail: &str) {
        let g = greedy_prefix(engine, golden, n);
        assert_eq!(
            (g.passed, g.value, g.detail.as_str()),
            (passed, value, detail)
        );
    }

    #[test]
    fn equal_prefix_passes() {
        check(
            &[1, 2, 3, 9],
            &[1, 2, 3, 4],
            3,
            true,
            3.0,
            "first 3 tokens match",
        );
        check(&[1, 2], &[1, 2], 16, true, 2.0, "first 2 tokens match");
    }

    #[test]
    fn reports_the_first_mismatch() {
        check(
            &[1, 5, 3],
            &[1, 2, 3],
            3,
            false,
            1.0,
            "first mismatch at position 1: engine id 5, golden id 2",
        );
        check(
            &[7],
            &[1],
            1,
            false,
            0.0,
            "first mismatch at position 0: engine id 7, golden id 1",
        );
    }

    #[test]
    fn a_short_engine_output_fails() {
        check(
            &[1, 2],
            &[1, 2, 3],
            3,
            false,
            2.0,
            "engine stopped after 2 tokens; golden continues with id 3",
        );
        check(
            &[],
            &[4],
            1,
            false,
            0.0,
            "engine stopped after 0 tokens; golden continues with id 4",
        );
    }
}
