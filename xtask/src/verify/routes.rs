//! MoE, route-aware: where the engine and the reference choose different experts for a token,
//! report the flip with both sides' router scores, accept it only inside a tie margin, and
//! compare that layer with the reference following the engine's choice.
//!
//! In the layer-isolated exact comparison both sides' routers read the same input, so their
//! logits differ by rounding only (the `router` tap's flat bound), and a different choice is
//! possible only where two experts' selection scores are that close. Both choices are computed
//! by the reference's own routing ([`reference::Routing`]: gating, bias, top-k) from each side's
//! `blk.{i}.router` tap, so a flip means the router logits moved the choice, not that the
//! engine's top-k kernel is wrong (a wrong top-k is caught at `ffn_out` as before).
//!
//! **Tie margin.** The router tap may differ by NMSE `b` (its exact bound), an error RMS of
//! `√b·rms(row)` per logit. Taking each of the two experts' logits off by up to 4× that RMS and
//! the gate's slope at its steepest (1/4 for a sigmoid, and `p(1−p) ≤ 1/4` for a softmax), their
//! score gap moves by at most `2 · 4 · √b · rms / 4 = 2√b·rms`: a flip whose reference score gap
//! is within that is rounding; one past it is a router that is wrong.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result};
use harness::gate::GateResult;
use harness::tap::{Tap, TapId, TapKind};
use reference::{ForcedRoutes, ForcedSelections, IndexerScores, ReferenceModel, Routing};

/// One token whose experts differ.
#[derive(Debug, Clone, PartialEq)]
pub struct Flip {
    pub layer: usize,
    pub token: usize,
    /// The experts each side chose (rank order) and their selection scores on that side.
    pub engine: Vec<(usize, f64)>,
    pub reference: Vec<(usize, f64)>,
    /// Reference score of the lowest expert only it chose, less the highest only the engine
    /// chose (≥ 0: the reference ranked its own choice higher).
    pub gap: f64,
    pub margin: f64,
}

impl Flip {
    pub fn within_margin(&self) -> bool {
        self.gap <= self.margin
    }
}

/// Rows of a `[n, width]` tap.
fn rows(t: &Tap) -> impl Iterator<Item = Vec<f64>> + '_ {
    let w = t.shape.last().copied().unwrap_or(1).max(1);
    t.data
        .chunks_exact(w)
        .map(|r| r.iter().map(|&x| x as f64).collect())
}

/// The flips of every MoE layer: `routing` by layer, the engine's and the reference's taps
/// (layer-isolated in exact numerics, or end to end), and the `router` tap's NMSE bound at a
/// layer (flat in the layer-isolated comparison, growing with depth end to end).
pub fn flips(
    routing: &BTreeMap<usize, Routing>,
    engine: &[Tap],
    reference: &[Tap],
    router_nmse_max: &dyn Fn(usize) -> f64,
) -> Vec<Flip> {
    let find = |taps: &'_ [Tap], name: &str| taps.iter().find(|t| t.name == name).cloned();
    let mut out = Vec::new();
    for (&layer, r) in routing {
        let name = format!("blk.{layer}.router");
        let (Some(e), Some(rf)) = (find(engine, &name), find(reference, &name)) else {
            continue;
        };
        for (token, (el, rl)) in rows(&e).zip(rows(&rf)).enumerate() {
            let (ec, rc) = (r.choose(&el), r.choose(&rl));
            let mut es = ec.clone();
            let mut rs = rc.clone();
            es.sort_unstable();
            rs.sort_unstable();
            if es == rs {
                continue;
            }
            let (e_scores, r_scores) = (r.scores(&el), r.scores(&rl));
            let only_ref = rc.iter().filter(|x| !ec.contains(x));
            let only_eng = ec.iter().filter(|x| !rc.contains(x));
            let low_ref = only_ref.map(|&x| r_scores[x]).fold(f64::INFINITY, f64::min);
            let high_eng = only_eng
                .map(|&x| r_scores[x])
                .fold(f64::NEG_INFINITY, f64::max);
            let rms = (rl.iter().map(|x| x * x).sum::<f64>() / rl.len().max(1) as f64).sqrt();
            out.push(Flip {
                layer,
                token,
                engine: ec.iter().map(|&x| (x, e_scores[x])).collect(),
                reference: rc.iter().map(|&x| (x, r_scores[x])).collect(),
                gap: low_ref - high_eng,
                margin: 2.0 * router_nmse_max(layer).sqrt() * rms,
            });
        }
    }
    out
}

/// The routing of every layer of `model` with a `router` tap in `taps`.
pub fn routing_of(model: &ReferenceModel, taps: &[Tap]) -> Result<BTreeMap<usize, Routing>> {
    let mut routing = BTreeMap::new();
    for t in taps {
        let layer = TapId::parse(&t.name)
            .filter(|id| id.kind == TapKind::Router)
            .and_then(|id| id.layer);
        if let Some(layer) = layer {
            if let Some(r) = model
                .routing(layer)
                .with_context(|| format!("the reference's routing of layer {layer}"))?
            {
                routing.insert(layer, r);
            }
        }
    }
    Ok(routing)
}

/// Shift the flips of a forward call over the positions starting at `start` to whole-sequence
/// token numbers.
pub fn at_offset(mut flips: Vec<Flip>, start: usize) -> Vec<Flip> {
    for f in &mut flips {
        f.token += start;
    }
    flips
}

/// What the reference is made to follow: the engine's expert choices (MoE) and the engine's
/// indexer selections (`glm-dsa`, [`super::selections`]) at near-ties.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Following {
    pub routes: ForcedRoutes,
    pub selections: ForcedSelections,
}

impl Following {
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty() && self.selections.is_empty()
    }

    fn layers(&self) -> BTreeSet<usize> {
        self.routes
            .keys()
            .chain(self.selections.keys())
            .map(|&(l, _)| l)
            .collect()
    }

    /// The part of `self` at `layer`.
    fn at(&self, layer: usize) -> Following {
        let mine = |m: &BTreeMap<(usize, usize), Vec<usize>>| {
            m.iter()
                .filter(|((l, _), _)| *l == layer)
                .map(|(k, v)| (*k, v.clone()))
                .collect()
        };
        Following {
            routes: mine(&self.routes),
            selections: mine(&self.selections),
        }
    }
}

/// One layer's forced run of [`forced_runs`]: its taps, and whether it followed a selection
/// (then everything of the layer from the indexer on is the forced run's).
pub struct LayerRun {
    pub taps: Vec<Tap>,
    pub selection: bool,
}

/// The reference's taps over `tokens` following `what` (the engine's choices inside the
/// margin), one forced run per layer (layer-isolated: each run forces one layer, so every other
/// layer sees the unforced reference's input), by layer. Empty when nothing is followed.
pub fn forced_runs(
    model: &ReferenceModel,
    tokens: &[u32],
    what: &Following,
) -> Result<BTreeMap<usize, LayerRun>> {
    let mut per_layer = BTreeMap::new();
    for layer in what.layers() {
        let mine = what.at(layer);
        let mut taps = Vec::new();
        model
            .forward_hidden_selected(
                tokens,
                &mine.routes,
                &mine.selections,
                &mut |name, shape, data| taps.push(Tap::new(name, shape.to_vec(), data.to_vec())),
            )
            .with_context(|| {
                format!("the reference following the engine's choices at layer {layer}")
            })?;
        let selection = !mine.selections.is_empty();
        per_layer.insert(layer, LayerRun { taps, selection });
    }
    Ok(per_layer)
}

/// The reference following the engine end to end ([`follow_end_to_end`]): its taps, logits
/// included, and how many expert choices and indexer selections it followed.
pub struct FollowedRun {
    pub taps: Vec<Tap>,
    pub routes: usize,
    pub selections: usize,
}

/// End to end, route- and selection-aware: the reference's taps over `tokens` (logits
/// included) following the engine's choice at every expert flip inside the margin of
/// `router_bound` (the `router` tap's end-to-end NMSE bound at a layer) and at every indexer
/// selection flip inside the margin of `indexer_bound` (the `indexer_top_k` tap's); `None`
/// when both sides chose alike everywhere. Unlike [`forced_runs`], one run forces every flip
/// at once, since end to end a layer's input is what the layers before it chose; a forced
/// layer changes the layers after it, so the flips are found again on the forced run (with its
/// own indexer scores) until no new one appears.
pub fn follow_end_to_end(
    model: &ReferenceModel,
    tokens: &[u32],
    routing: &BTreeMap<usize, Routing>,
    engine: &[Tap],
    reference: &[Tap],
    router_bound: &dyn Fn(usize) -> f64,
    indexer_bound: &dyn Fn(usize) -> f64,
) -> Result<Option<FollowedRun>> {
    let indexed = engine
        .iter()
        .filter(|t| TapId::parse(&t.name).is_some_and(|id| id.kind == TapKind::IndexerTopK))
        .count();
    // The unforced run's indexer scores, only where some selection differs at all.
    let mut scores = if super::selections::differ(engine, reference, 0) {
        model
            .forward_hidden_scored(
                tokens,
                &ForcedRoutes::new(),
                &ForcedSelections::new(),
                &mut |_, _, _| {},
            )
            .context("the reference's indexer scores")?
            .1
    } else {
        IndexerScores::new()
    };
    let mut all = Following::default();
    let mut current: Option<Vec<Tap>> = None;
    for _ in 0..=routing.len() + indexed {
        let against = current.as_deref().unwrap_or(reference);
        let routes: ForcedRoutes = forced(&flips(routing, engine, against, router_bound))
            .into_iter()
            .filter(|(k, _)| !all.routes.contains_key(k))
            .collect();
        let selections: ForcedSelections = super::selections::forced(&super::selections::flips(
            engine,
            against,
            &scores,
            0,
            indexer_bound,
        ))
        .into_iter()
        .filter(|(k, _)| !all.selections.contains_key(k))
        .collect();
        if routes.is_empty() && selections.is_empty() {
            break;
        }
        all.routes.extend(routes);
        all.selections.extend(selections);
        let mut taps = Vec::new();
        let (normed, run_scores) = model
            .forward_hidden_scored(
                tokens,
                &all.routes,
                &all.selections,
                &mut |name, shape, data| taps.push(Tap::new(name, shape.to_vec(), data.to_vec())),
            )
            .context("the reference following the engine's choices end to end")?;
        scores = run_scores;
        let logits = model
            .logits_of(&normed)
            .context("the head of the reference following the engine's choices")?;
        let n_vocab = logits.len() / tokens.len().max(1);
        taps.push(Tap::new("logits", vec![tokens.len(), n_vocab], logits));
        current = Some(taps);
    }
    Ok(current.map(|taps| FollowedRun {
        taps,
        routes: all.routes.len(),
        selections: all.selections.len(),
    }))
}

/// The engine's choices of the flips inside the margin, for the reference to follow.
pub fn forced(flips: &[Flip]) -> ForcedRoutes {
    flips
        .iter()
        .filter(|f| f.within_margin())
        .map(|f| {
            (
                (f.layer, f.token),
                f.engine.iter().map(|&(e, _)| e).collect(),
            )
        })
        .collect()
}

/// The `routes` gate: the number of flips outside the tie margin must be 0; the detail lists the
/// flips (at most 4, those past the margin first) with both sides' experts and scores.
pub fn gate(flips: &[Flip]) -> GateResult {
    let described = flips.iter().map(|f| {
        let what = format!(
            "blk.{} token {}: engine [{}], reference [{}]",
            f.layer,
            f.token,
            scored(&f.engine),
            scored(&f.reference)
        );
        (what, f.gap, f.margin)
    });
    near_tie_gate(
        "routes",
        described,
        "both sides choose the same experts for every token",
    )
}

/// `index (score), …`.
pub fn scored(v: &[(usize, f64)]) -> String {
    v.iter()
        .map(|(i, s)| format!("{i} ({s:.4})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A gate over near-tie flips, each `(what, gap, margin)`: the number past the margin
/// (`gap > margin`) must be 0; the detail names the flips (at most 4, those past the margin
/// first), or says `none` when there are none.
pub fn near_tie_gate(
    name: &'static str,
    flips: impl Iterator<Item = (String, f64, f64)>,
    none: &str,
) -> GateResult {
    let mut flips: Vec<(String, f64, f64)> = flips.collect();
    let past =
        |&(_, gap, margin): &(String, f64, f64)| gap.partial_cmp(&margin).is_none_or(|o| o.is_gt());
    flips.sort_by_key(|f| !past(f));
    let outside = flips.iter().filter(|f| past(f)).count();
    let mut detail: Vec<String> = flips
        .iter()
        .take(4)
        .map(|f| {
            format!(
                "{}, reference score gap {:.2e} {} tie margin {:.2e}",
                f.0,
                f.1,
                if past(f) { "PAST" } else { "within" },
                f.2
            )
        })
        .collect();
    if flips.len() > 4 {
        detail.push(format!("… {} more", flips.len() - 4));
    }
    let detail = if flips.is_empty() {
        none.to_owned()
    } else {
        format!(
            "{} flip(s), {outside} past the tie margin; those within it are compared with the \
             reference following the engine's choice: {}",
            flips.len(),
            detail.join("; ")
        )
    };
    GateResult::at_most(name, outside as f64, 0.0, detail)
}

/// The taps of a layer a forced run replaces: from the indexer on after a followed selection,
/// the MoE output and the layer's output after followed experts.
const AFTER_EXPERTS: [&str; 2] = ["ffn_out", "out"];
pub(super) const AFTER_SELECTION: [&str; 7] = [
    "indexer_top_k",
    "attn",
    "attn_out",
    "ffn_norm",
    "router",
    "ffn_out",
    "out",
];

/// Replace the reference's taps of each layer with a followed choice by its forced run's (see
/// [`LayerRun`]; layer-isolated, each layer's input is the unforced reference's). A shared
/// indexer layer after a followed selection keeps the unforced reference's taps: its input in
/// the forced run is no longer the one the isolated engine layer read.
pub fn follow(reference: &[Tap], per_layer: &BTreeMap<usize, LayerRun>) -> Vec<Tap> {
    reference
        .iter()
        .map(|t| {
            let swap = per_layer.iter().find_map(|(layer, run)| {
                let own: &[&str] = if run.selection {
                    &AFTER_SELECTION
                } else {
                    &AFTER_EXPERTS
                };
                own.iter()
                    .any(|s| t.name == format!("blk.{layer}.{s}"))
                    .then(|| run.taps.iter().find(|f| f.name == t.name))
                    .flatten()
            });
            swap.unwrap_or(t).clone()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reference::Gating;

    fn routing() -> Routing {
        Routing {
            gating: Gating::Sigmoid,
            bias: vec![0.0; 4],
            n_expert_used: 2,
        }
    }

    fn router(rows: &[[f32; 4]]) -> Tap {
        Tap::new(
            "blk.1.router",
            vec![rows.len(), 4],
            rows.iter().flatten().copied().collect(),
        )
    }

    fn check(engine: &[[f32; 4]], reference: &[[f32; 4]], bound: f64) -> Vec<Flip> {
        let mut r = BTreeMap::new();
        r.insert(1, routing());
        flips(&r, &[router(engine)], &[router(reference)], &|_| bound)
    }

    #[test]
    fn same_choice_is_no_flip() {
        // Different logits, the same two experts (order aside).
        assert!(check(&[[3.0, 2.0, 0.0, 0.0]], &[[2.0, 3.0, 0.1, 0.0]], 1e-4).is_empty());
    }

    #[test]
    fn near_tie_flip_is_within_the_margin_and_followed() {
        // Experts 1 and 2 nearly tied on the reference side; the engine ranks 2 above 1.
        let f = check(
            &[[3.0, 1.0, 1.001, -2.0], [3.0, 2.0, 0.0, 0.0]],
            &[[3.0, 1.0005, 1.0, -2.0], [3.0, 2.0, 0.0, 0.0]],
            8.7e-5,
        );
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!((f[0].layer, f[0].token), (1, 0));
        assert_eq!(f[0].engine.iter().map(|e| e.0).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(
            f[0].reference.iter().map(|e| e.0).collect::<Vec<_>>(),
            [0, 1]
        );
        // sigmoid slope at 1 is 0.197: gap ≈ 1e-4; margin 2·√8.7e-5·rms(≈1.94) ≈ 0.036.
        assert!(f[0].within_margin(), "{f:?}");
        let forced = forced(&f);
        assert_eq!(forced.get(&(1, 0)), Some(&vec![0, 2]));
        let g = gate(&f);
        assert!(g.passed && g.detail.contains("within"), "{}", g.detail);
    }

    #[test]
    fn a_flip_past_the_margin_fails_the_gate() {
        // The engine's router put expert 3 first: far from any tie on the reference side.
        let f = check(&[[0.0, 1.0, 0.0, 4.0]], &[[3.0, 1.0, 0.0, -2.0]], 8.7e-5);
        assert_eq!(f.len(), 1);
        assert!(!f[0].within_margin(), "{f:?}");
        assert!(forced(&f).is_empty());
        let g = gate(&f);
        assert!(!g.passed && g.detail.contains("PAST"), "{}", g.detail);
    }

    #[test]
    fn following_replaces_only_the_flipped_layers_own_outputs() {
        let t = |n: &str, v: f32| Tap::new(n, vec![1, 1], vec![v]);
        let reference = vec![
            t("blk.1.router", 1.0),
            t("blk.1.ffn_out", 2.0),
            t("blk.1.out", 3.0),
            t("blk.2.ffn_out", 4.0),
        ];
        let mut per_layer = BTreeMap::new();
        per_layer.insert(
            1,
            LayerRun {
                taps: vec![
                    t("blk.1.router", 9.0),
                    t("blk.1.ffn_out", 20.0),
                    t("blk.1.out", 30.0),
                ],
                selection: false,
            },
        );
        let got: Vec<f32> = follow(&reference, &per_layer)
            .iter()
            .map(|t| t.data[0])
            .collect();
        assert_eq!(got, [1.0, 20.0, 30.0, 4.0]);
        // A followed selection replaces the layer from its indexer on, the router included.
        per_layer.get_mut(&1).expect("layer 1").selection = true;
        let got: Vec<f32> = follow(&reference, &per_layer)
            .iter()
            .map(|t| t.data[0])
            .collect();
        assert_eq!(got, [9.0, 20.0, 30.0, 4.0]);
    }
}
