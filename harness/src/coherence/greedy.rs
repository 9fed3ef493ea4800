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

/// Logit rows of both sides at each greedy step (row `i` is the distribution that chose token
/// `i`), for [`greedy_prefix_or_tie`].
pub struct GreedyRows<'a> {
    pub engine: &'a [f32],
    pub golden: &'a [f32],
    pub n_vocab: usize,
}

/// [`greedy_prefix`], except that a first mismatch at a near-tie passes: each side's own token
/// leads the other's by at most `margin` nats of log-probability on *both* sides (vLLM's
/// `check_logprobs_close` accepts a divergence the same way; the sequences are compared no
/// further, since their prefixes now differ). A bug moves a logit by whole units and loses this
/// excuse; the teacher-forced logit gates judge the positions after the divergence.
pub fn greedy_prefix_or_tie(
    engine: &[u32],
    golden: &[u32],
    n: usize,
    rows: &GreedyRows<'_>,
    margin: f64,
) -> GateResult {
    let plain = greedy_prefix(engine, golden, n);
    let m = common_prefix(engine, golden);
    if plain.passed || m >= engine.len() {
        return plain;
    }
    let row = |data: &[f32]| {
        data.get(m * rows.n_vocab..(m + 1) * rows.n_vocab)
            .map(super::logits::log_softmax)
    };
    let (Some(e), Some(g)) = (row(rows.engine), row(rows.golden)) else {
        return plain;
    };
    let (te, tg) = (engine[m] as usize, golden[m] as usize);
    let (Some(&e_own), Some(&e_other), Some(&g_own), Some(&g_other)) =
        (e.get(te), e.get(tg), g.get(tg), g.get(te))
    else {
        return plain;
    };
    let (engine_gap, golden_gap) = (e_own - e_other, g_own - g_other);
    if engine_gap <= margin && golden_gap <= margin {
        let required = n.min(golden.len());
        GateResult::at_least(
            "greedy_prefix",
            required as f64,
            required as f64,
            format!(
                "first {m} tokens match, then a near-tie at position {m}: engine id {te} leads \
                 id {tg} by {engine_gap:.3} nats, the reference's by {golden_gap:.3} \
                 (margin {margin})"
            ),
        )
    } else {
        GateResult {
            detail: format!(
                "{}; not a near-tie: engine gap {engine_gap:.3} nats, reference gap \
                 {golden_gap:.3} (margin {margin})",
                plain.detail
            ),
            ..plain
        }
    }
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

    fn tie(engine_row: [f32; 3], golden_row: [f32; 3], margin: f64) -> GateResult {
        // Two steps: step 0 agrees (token 0), step 1 engine picks 1, reference picks 2.
        let mut e = vec![5.0, 0.0, 0.0];
        e.extend(engine_row);
        let mut g = vec![5.0, 0.0, 0.0];
        g.extend(golden_row);
        let rows = GreedyRows {
            engine: &e,
            golden: &g,
            n_vocab: 3,
        };
        greedy_prefix_or_tie(&[0, 1], &[0, 2], 2, &rows, margin)
    }

    #[test]
    fn a_near_tie_divergence_passes_and_says_so() {
        let g = tie([0.0, 1.05, 1.0], [0.0, 0.97, 1.0], 0.1);
        assert!(g.passed, "{}", g.detail);
        assert!(g.detail.contains("near-tie at position 1"), "{}", g.detail);
    }

    #[test]
    fn a_clear_divergence_fails_on_either_side() {
        // Engine prefers its token by 0.5 nats: not a tie, although the reference's gap is small.
        let g = tie([0.0, 1.5, 1.0], [0.0, 0.97, 1.0], 0.1);
        assert!(!g.passed);
        assert_eq!(
            g.detail,
            "first mismatch at position 1: engine id 1, golden id 2; not a near-tie: engine gap \
             0.500 nats, reference gap 0.030 (margin 0.1)"
        );
        // The reference prefers its token by 2 nats.
        assert!(!tie([0.0, 1.05, 1.0], [0.0, 1.0, 3.0], 0.1).passed);
    }
}
