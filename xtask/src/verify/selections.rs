//! `glm-dsa`, selection-aware: where the engine's lightning indexer kept other positions for a
//! query than the reference's, report the flip with the reference's scores of the positions in
//! question, accept it only inside a tie margin, and compare the rest against the reference
//! following the engine's selection (as [`super::routes`] does for expert choices).
//!
//! An indexer keeps the `top_k` best of every visible position, so two positions whose scores
//! differ by rounding only can swap at the boundary; the attention then reads a different cell,
//! and every later tap of that token moves by far more than any rounding bound, with no bug
//! anywhere. The `indexer_top_k` tap (positions, not values) is therefore judged here, per
//! query, as a set: equal, or a near-tie swap.
//!
//! **Tie margin.** The scores see the errors of the indexer's queries and key as attention's
//! scores see Q's and K's: NMSE `b`, the bound of the `indexer_top_k` tap at that layer
//! (`tolerance::stages`), an error RMS of `√b·rms(row)` per score. Taking each of the two
//! positions' scores off by up to 4× that RMS, their gap moves by at most `8·√b·rms(row)`
//! (unlike a router's, the ranking has no gate to flatten it): a swap whose reference score gap
//! is within that is rounding; one past it is an indexer that is wrong.

use std::collections::BTreeSet;

use harness::gate::GateResult;
use harness::tap::{Tap, TapId, TapKind};
use reference::{ForcedSelections, IndexerScores};

use super::routes::{near_tie_gate, scored};

/// One query whose selected positions differ.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectionFlip {
    pub layer: usize,
    pub query: usize,
    /// The engine's whole selection (ascending), what the reference follows.
    pub engine: Vec<usize>,
    /// Positions only one side kept, each with the reference's score (`NaN` for a position the
    /// query cannot see).
    pub engine_only: Vec<(usize, f64)>,
    pub reference_only: Vec<(usize, f64)>,
    /// Reference score of the lowest position only it kept, less the highest only the engine
    /// kept (≥ 0: the reference ranked its own choice higher; `+∞` when the engine kept a
    /// position the query cannot see, or a selection of the wrong size).
    pub gap: f64,
    pub margin: f64,
}

impl SelectionFlip {
    pub fn within_margin(&self) -> bool {
        self.gap <= self.margin
    }
}

/// The positions of each row of an `indexer_top_k` tap (`[n, top_k]`, padded with −1).
fn selections(t: &Tap) -> Vec<BTreeSet<i64>> {
    let w = t.shape.last().copied().unwrap_or(1).max(1);
    t.data
        .chunks_exact(w)
        .map(|r| r.iter().filter(|&&p| p >= 0.0).map(|&p| p as i64).collect())
        .collect()
}

/// Whether any query of `engine`'s `indexer_top_k` taps (rows of queries `start..`) kept other
/// positions than `reference`'s: the scores [`flips`] needs cost a reference forward.
pub fn differ(engine: &[Tap], reference: &[Tap], start: usize) -> bool {
    engine
        .iter()
        .filter(|e| TapId::parse(&e.name).is_some_and(|id| id.kind == TapKind::IndexerTopK))
        .any(|e| {
            let Some(r) = reference.iter().find(|t| t.name == e.name) else {
                return false;
            };
            let theirs = selections(r);
            selections(e)
                .iter()
                .enumerate()
                .any(|(row, mine)| theirs.get(start + row).is_some_and(|t| t != mine))
        })
}

/// The selection flips of every full indexer layer in `engine` and `reference` (rows of
/// queries `start..`; `reference`'s taps and `scores` cover the whole sequence from 0), judged by
/// the reference's scores with `bound(layer)` the `indexer_top_k` tap's NMSE bound there.
pub fn flips(
    engine: &[Tap],
    reference: &[Tap],
    scores: &IndexerScores,
    start: usize,
    bound: &dyn Fn(usize) -> f64,
) -> Vec<SelectionFlip> {
    let mut out = Vec::new();
    for e in engine {
        let Some(layer) = TapId::parse(&e.name)
            .filter(|id| id.kind == TapKind::IndexerTopK)
            .and_then(|id| id.layer)
        else {
            continue;
        };
        let Some(r) = reference.iter().find(|t| t.name == e.name) else {
            continue;
        };
        let theirs = selections(r);
        for (row, mine) in selections(e).into_iter().enumerate() {
            let query = start + row;
            let Some(their) = theirs.get(query) else {
                continue;
            };
            if &mine == their {
                continue;
            }
            let row_scores = scores
                .get(&layer)
                .and_then(|s| s.get(query))
                .map_or(&[][..], |s| s.as_slice());
            let score = |p: i64| {
                usize::try_from(p)
                    .ok()
                    .and_then(|p| row_scores.get(p))
                    .copied()
                    .unwrap_or(f64::NAN)
            };
            let only = |a: &BTreeSet<i64>, b: &BTreeSet<i64>| -> Vec<(usize, f64)> {
                a.difference(b)
                    .map(|&p| (p.max(0) as usize, score(p)))
                    .collect()
            };
            let engine_only = only(&mine, their);
            let reference_only = only(their, &mine);
            let low_ref = reference_only
                .iter()
                .map(|&(_, s)| s)
                .fold(f64::INFINITY, f64::min);
            let high_eng = engine_only
                .iter()
                .map(|&(_, s)| s)
                .fold(f64::NEG_INFINITY, f64::max);
            let well_formed = mine.len() == their.len()
                && engine_only.iter().all(|&(_, s)| s.is_finite())
                && !row_scores.is_empty();
            let gap = if well_formed {
                low_ref - high_eng
            } else {
                f64::INFINITY
            };
            let rms = (row_scores.iter().map(|x| x * x).sum::<f64>()
                / row_scores.len().max(1) as f64)
                .sqrt();
            out.push(SelectionFlip {
                layer,
                query,
                engine: mine.iter().map(|&p| p.max(0) as usize).collect(),
                engine_only,
                reference_only,
                gap,
                margin: 8.0 * bound(layer).sqrt() * rms,
            });
        }
    }
    out
}

/// The engine's selections of the flips inside the margin, for the reference to follow.
pub fn forced(flips: &[SelectionFlip]) -> ForcedSelections {
    flips
        .iter()
        .filter(|f| f.within_margin())
        .map(|f| ((f.layer, f.query), f.engine.clone()))
        .collect()
}

/// The `selections` gate: the number of flips outside the tie margin must be 0; the detail lists
/// the flips (at most 4, those past the margin first) with the positions only one side kept and
/// the reference's scores.
pub fn gate(flips: &[SelectionFlip]) -> GateResult {
    let described = flips.iter().map(|f| {
        let what = format!(
            "blk.{} query {}: only the engine kept [{}], only the reference [{}]",
            f.layer,
            f.query,
            scored(&f.engine_only),
            scored(&f.reference_only)
        );
        (what, f.gap, f.margin)
    });
    near_tie_gate(
        "selections",
        described,
        "both indexers keep the same positions for every query",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `indexer_top_k` tap of layer 1 with `top_k` 2.
    fn tap(rows: &[[f32; 2]]) -> Tap {
        Tap::new(
            "blk.1.indexer_top_k",
            vec![rows.len(), 2],
            rows.iter().flatten().copied().collect(),
        )
    }

    fn scores(rows: Vec<Vec<f64>>) -> IndexerScores {
        IndexerScores::from([(1, rows)])
    }

    /// Query 0 sees one position, query 1 two, query 2 three.
    fn reference_scores() -> IndexerScores {
        scores(vec![vec![1.0], vec![2.0, 1.0], vec![3.0, 1.0, 0.999]])
    }

    #[test]
    fn the_same_positions_are_no_flip() {
        let t = tap(&[[0.0, -1.0], [0.0, 1.0], [0.0, 1.0]]);
        let same = std::slice::from_ref(&t);
        assert!(flips(same, same, &reference_scores(), 0, &|_| 1e-4).is_empty());
    }

    #[test]
    fn a_near_tie_swap_is_within_the_margin_and_followed() {
        let engine = tap(&[[0.0, -1.0], [0.0, 1.0], [0.0, 2.0]]);
        let reference = tap(&[[0.0, -1.0], [0.0, 1.0], [0.0, 1.0]]);
        let f = flips(&[engine], &[reference], &reference_scores(), 0, &|_| 1e-4);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!((f[0].layer, f[0].query), (1, 2));
        assert_eq!(f[0].engine_only, vec![(2, 0.999)]);
        assert_eq!(f[0].reference_only, vec![(1, 1.0)]);
        // gap 1e-3; margin 8·1e-2·rms(3, 1, 0.999) ≈ 0.08·1.91.
        assert!(f[0].within_margin(), "{f:?}");
        assert_eq!(forced(&f).get(&(1, 2)), Some(&vec![0, 2]));
        let g = gate(&f);
        assert!(g.passed && g.detail.contains("within"), "{}", g.detail);
    }

    #[test]
    fn a_swap_past_the_margin_or_out_of_sight_fails_the_gate() {
        let reference = tap(&[[0.0, -1.0], [0.0, 1.0], [0.0, 1.0]]);
        // The engine dropped the best position (score 3 against 0.999): far from a tie.
        let far = tap(&[[0.0, -1.0], [0.0, 1.0], [1.0, 2.0]]);
        let f = flips(
            &[far],
            std::slice::from_ref(&reference),
            &reference_scores(),
            0,
            &|_| 1e-4,
        );
        assert_eq!(f.len(), 1);
        assert!(!f[0].within_margin(), "{f:?}");
        assert!(forced(&f).is_empty());
        let g = gate(&f);
        assert!(!g.passed && g.detail.contains("PAST"), "{}", g.detail);
        // A position after the query (a causality bug) has no score: never a tie.
        let future = tap(&[[0.0, -1.0], [0.0, 2.0], [0.0, 1.0]]);
        let f = flips(&[future], &[reference], &reference_scores(), 0, &|_| 1.0);
        assert_eq!(f.len(), 1);
        assert!(f[0].gap.is_infinite() && !f[0].within_margin(), "{f:?}");
    }

    #[test]
    fn rows_of_a_later_call_are_matched_at_their_positions() {
        // One call over query 2 only.
        let engine = tap(&[[0.0, 2.0]]);
        let reference = tap(&[[0.0, -1.0], [0.0, 1.0], [0.0, 1.0]]);
        let f = flips(&[engine], &[reference], &reference_scores(), 2, &|_| 1e-4);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].query, 2);
        assert!(f[0].within_margin());
    }
}
