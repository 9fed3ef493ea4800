//! The serving case (`…/serve`): start `plumbline serve` on loopback with the case's backend,
//! wait for `/ready` (a real generation through the request path), then send requests at once
//! so that the server runs them in one ragged batch, each judged against the reference:
//!
//! - the greedy coherence gate through HTTP: the reference's greedy prompt ids in, greedy ids
//!   out (vLLM's `return_tokens_as_token_ids`), compared with the reference's greedy
//!   continuation under the same near-tie rule as the offline cases;
//! - beside it, prefixes of the teacher-forced text of different lengths (two of the same length,
//!   so two sequences sit at the same positions), each asking for one token, which must be the
//!   reference's argmax at that position or a near-tie under the same rule (`concurrent` gate).
//!   A cell of one sequence read by another, a row handed to the wrong request, or positions
//!   shifted by a neighbour's prompt changes those tokens; one request alone never shows it;
//! - then the greedy request again with a stop string that spans a token boundary in the middle
//!   of the first answer (`stop` gate): its text must be the first answer's up to the stop
//!   string, with `finish_reason` `stop` (a stop string split over two tokens, a held-back
//!   prefix lost or sent, text after the stop string: each changes it).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use engine::model::Model;
use harness::cases::Case;
use harness::coherence::{self, GreedyRows};
use harness::gate::GateResult;
use harness::report::{CaseResult, Figure};
use serde_json::{json, Value};

use super::common::CaseEnv;
use super::reference_runs::{RefSource, ReferenceCache};
use crate::serve_bench;

/// Alternatives asked per token: enough to hold the reference's token at a near-tie (the tie
/// rule needs its engine log-probability; a token outside the top 5 is no near-tie).
const TOP: usize = 5;
/// Text-prefix requests sent beside the greedy one.
const PREFIXES: usize = 4;

pub fn run(case: &Case, env: &CaseEnv<'_>, refs: &mut ReferenceCache) -> Result<CaseResult> {
    let name = case.name();
    let started = Instant::now();
    let Some(isa) = super::common::isa_of(case.backend) else {
        return Ok(CaseResult::skipped(
            &name,
            "the server runs on CPU backends only",
        ));
    };
    let budget = env.budget;
    let model = Model::load(env.path).with_context(|| format!("loading {}", env.path.display()))?;
    let n_vocab = model.config().n_vocab;
    drop(model);
    let reference = refs.get(RefSource::File(env.path), budget, env.real)?;

    let bin = serve_bench::build_plumbline()?;
    let extra: Vec<String> = vec![
        "--isa".into(),
        isa.name().into(),
        "--threads".into(),
        env.threads.to_string(),
        "--max-batch".into(),
        (1 + PREFIXES).to_string(),
    ];
    let t_start = Instant::now();
    let (server, base) = serve_bench::start(&bin, env.path, &extra)?;
    serve_bench::wait_ready(&base, Duration::from_secs(300))?;
    let ready_s = t_start.elapsed().as_secs_f64();

    let n = budget.n_greedy;
    let prefixes = prefix_lengths(reference.tokens.len());
    // Every request at once: the scheduler admits them together, so their prompts prefill in
    // shared batches and the greedy request decodes beside the others' prefills.
    let (greedy, served) = std::thread::scope(|s| {
        let greedy = s.spawn(|| complete(&base, &reference.prompt, n, None, n_vocab));
        let others: Vec<_> = prefixes
            .iter()
            .map(|&k| {
                let (base, prompt) = (&base, &reference.tokens[..k]);
                s.spawn(move || complete(base, prompt, 1, None, n_vocab))
            })
            .collect();
        let join = |h: std::thread::ScopedJoinHandle<'_, Result<Answer>>| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a request thread panicked")))
        };
        let served: Vec<_> = others.into_iter().map(join).collect();
        (join(greedy), served)
    });
    let greedy = greedy.context("the greedy request")?;
    let stop = match stop_string(&greedy) {
        Some(s) => {
            let answer = complete(&base, &reference.prompt, n, Some(&s), n_vocab)
                .context("the greedy request with a stop string")?;
            stop_gate(&greedy, &s, &answer)
        }
        None => GateResult::at_most(
            "stop",
            1.0,
            0.0,
            format!(
                "the greedy answer ({:?}) is too short to hold a stop string across a token \
                 boundary",
                greedy.text
            ),
        ),
    };
    drop(server);
    let (ids, rows) = (greedy.ids, greedy.rows);
    let served = served
        .into_iter()
        .zip(&prefixes)
        .map(|(r, k)| {
            r.map(|a| (a.ids, a.rows))
                .with_context(|| format!("the request for the text's first {k} tokens"))
        })
        .collect::<Result<Vec<_>>>()?;
    let concurrent = concurrent_gate(&prefixes, &served, reference.logits(), n_vocab);

    let gate = coherence::greedy_prefix_or_tie(
        &ids,
        &reference.greedy,
        n,
        &GreedyRows {
            engine: &rows,
            golden: &reference.greedy_rows,
            n_vocab,
        },
        // The offline cases' margin (teacher_forced.rs): 0.5 nats on each side admits the Q8
        // activation flips seen on the real model, not a bug's whole-unit shifts.
        0.5,
    );
    let ready_gate = GateResult::at_most(
        "served_tokens",
        (n as f64 - ids.len() as f64).abs(),
        0.0,
        format!("{} of {n} tokens came back", ids.len()),
    );
    Ok(CaseResult::judged(
        &name,
        None,
        // `concurrent` before the greedy gate: each prefix's one token is the plainest view of
        // that sequence's own positions and cells in the shared batch, and which request the
        // scheduler put first in a batch varies from run to run.
        vec![ready_gate, concurrent, gate, stop],
        vec![Figure::new("ready_s", ready_s, "s")],
    )
    .with_duration(started.elapsed().as_secs_f64()))
}

/// Lengths of the text prefixes sent beside the greedy request, for a text of `n` tokens:
/// different lengths, and one length twice.
fn prefix_lengths(n: usize) -> Vec<usize> {
    let at = |f: usize| (n * f / 4).clamp(2, n.max(2));
    let v = vec![at(1), at(2), at(2), n.max(2) - 1];
    debug_assert_eq!(v.len(), PREFIXES);
    v
}

/// One completion's answer.
struct Answer {
    /// The tokens and, per token, a row of the top alternatives' log-probabilities ([`parse`]).
    ids: Vec<u32>,
    rows: Vec<f32>,
    text: String,
    /// Where each token's text starts in `text` (bytes).
    offsets: Vec<usize>,
    finish: String,
}

/// POST one greedy completion of `max_tokens` after `prompt` (token ids), ending at `stop` if
/// given, with the top alternatives' log-probabilities.
fn complete(
    base: &str,
    prompt: &[u32],
    max_tokens: usize,
    stop: Option<&str>,
    n_vocab: usize,
) -> Result<Answer> {
    let mut body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "logprobs": TOP,
        "return_tokens_as_token_ids": true,
    });
    if let Some(s) = stop {
        body["stop"] = json!([s]);
    }
    let mut r = serve_bench::agent()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .context("POST /v1/completions")?;
    let status = r.status().as_u16();
    let text = r
        .body_mut()
        .read_to_string()
        .context("reading the answer")?;
    if status != 200 {
        bail!("/v1/completions answered {status}: {text}");
    }
    let v: Value = serde_json::from_str(&text).context("the answer is not JSON")?;
    let choice = &v["choices"][0];
    let (ids, rows) = parse(&choice["logprobs"], n_vocab)?;
    let offsets = choice["logprobs"]["text_offset"]
        .as_array()
        .context("logprobs.text_offset missing")?
        .iter()
        .map(|o| {
            o.as_u64()
                .map(|o| o as usize)
                .context("a text offset is not a number")
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Answer {
        ids,
        rows,
        text: choice["text"]
            .as_str()
            .context("choices[0].text missing")?
            .to_owned(),
        offsets,
        finish: choice["finish_reason"].as_str().unwrap_or("").to_owned(),
    })
}

/// A stop string for the greedy answer: its two characters before the boundary of the middle
/// token and three after, so the string is split over two tokens; `None` when no token boundary
/// has that much text on both sides.
fn stop_string(a: &Answer) -> Option<String> {
    let t = &a.text;
    let mut bounds: Vec<usize> = a.offsets.clone();
    let mid = bounds.len() / 2;
    // The middle boundary first, then the others outward.
    bounds.sort_by_key(|&b| b.abs_diff(a.offsets.get(mid).copied().unwrap_or(0)));
    let at = |b: usize| {
        let start = t.get(..b)?.char_indices().rev().nth(1)?.0;
        let end = b + t.get(b..)?.char_indices().nth(3).map(|(i, _)| i)?;
        let s = t.get(start..end)?;
        (!s.trim().is_empty()).then(|| (start, s.to_owned()))
    };
    // Rather one with text before it, so the answer has some to send.
    let candidates: Vec<(usize, String)> = bounds.into_iter().filter_map(at).collect();
    candidates
        .iter()
        .find(|(start, _)| *start > 0)
        .or(candidates.first())
        .map(|(_, s)| s.clone())
}

/// The `stop` gate: the answer with stop string `s` is the greedy answer up to the first `s`,
/// ending with `finish_reason` `stop`. Where the two answers' tokens part before it (the second
/// request prefilled alone, not in a shared batch), only a near-tie makes that legitimate, and the
/// text is not comparable: the gate says so and passes.
fn stop_gate(greedy: &Answer, s: &str, answer: &Answer) -> GateResult {
    let Some(at) = greedy.text.find(s) else {
        return GateResult::at_most("stop", 1.0, 0.0, format!("{s:?} is not in the greedy text"));
    };
    let want = &greedy.text[..at];
    // The tokens that decide the stopped answer: those whose text starts before the stop
    // string ends (the last of them holds the stop string's end; a near-tie there changes
    // whether the stop string appears at all).
    let needed = greedy.offsets.iter().filter(|&&o| o < at + s.len()).count();
    let parted = greedy
        .ids
        .iter()
        .zip(&answer.ids)
        .take(needed)
        .position(|(a, b)| a != b);
    if let Some(k) = parted {
        let n_vocab = greedy.rows.len() / greedy.ids.len().max(1);
        fn row(a: &Answer, k: usize, n_vocab: usize) -> &[f32] {
            a.rows.get(k * n_vocab..(k + 1) * n_vocab).unwrap_or(&[])
        }
        let tie = coherence::greedy_prefix_or_tie(
            &answer.ids[k..k + 1],
            &greedy.ids[k..k + 1],
            1,
            &GreedyRows {
                engine: row(answer, k, n_vocab),
                golden: row(greedy, k, n_vocab),
                n_vocab,
            },
            0.5,
        );
        return GateResult::at_most(
            "stop",
            if tie.passed { 0.0 } else { 1.0 },
            0.0,
            format!(
                "with stop {s:?} the tokens part from the greedy answer's at {k} ({}): the text \
                 is not comparable",
                tie.detail
            ),
        );
    }
    let bad = (answer.text != want) as u8 + (answer.finish != "stop") as u8;
    GateResult::at_most(
        "stop",
        bad as f64,
        0.0,
        format!(
            "stop {s:?} (split over two tokens): text {:?}, finish_reason {:?}; expected {want:?}, \
             \"stop\"",
            answer.text, answer.finish
        ),
    )
}

/// The `concurrent` gate: each prefix request's token is the reference's argmax after that
/// prefix (`logits`: the reference's teacher-forced rows) or a near-tie with it.
fn concurrent_gate(
    prefixes: &[usize],
    served: &[(Vec<u32>, Vec<f32>)],
    logits: &[f32],
    n_vocab: usize,
) -> GateResult {
    let mut bad = 0;
    let mut detail = Vec::new();
    for (&k, (ids, rows)) in prefixes.iter().zip(served) {
        let Some(row) = logits.get((k - 1) * n_vocab..k * n_vocab) else {
            bad += 1;
            detail.push(format!(
                "{k} tokens: the reference has no logits row {}",
                k - 1
            ));
            continue;
        };
        let want = super::common::argmax(row);
        let g = coherence::greedy_prefix_or_tie(
            ids,
            &[want],
            1,
            &GreedyRows {
                engine: rows,
                golden: row,
                n_vocab,
            },
            0.5,
        );
        if !g.passed {
            bad += 1;
        }
        detail.push(format!(
            "{k} tokens: served {:?}, reference {want} ({})",
            ids.first(),
            if g.passed { "ok" } else { g.detail.as_str() }
        ));
    }
    GateResult::at_most(
        "concurrent",
        bad as f64,
        0.0,
        format!(
            "{} text prefixes served beside the greedy request: {}",
            prefixes.len(),
            detail.join("; ")
        ),
    )
}

/// Token ids (`token_id:{id}`) and, per step, a logits row holding the top alternatives'
/// log-probabilities (−∞ elsewhere: the tie rule compares two entries of a row, which a
/// normalization over fewer tokens leaves unchanged).
fn parse(lp: &Value, n_vocab: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let id_of = |s: &str| -> Result<u32> {
        s.strip_prefix("token_id:")
            .and_then(|d| d.parse().ok())
            .with_context(|| format!("expected token_id:N, found {s:?}"))
    };
    let tokens = lp["tokens"].as_array().context("logprobs.tokens missing")?;
    let tops = lp["top_logprobs"]
        .as_array()
        .context("logprobs.top_logprobs missing")?;
    let mut ids = Vec::with_capacity(tokens.len());
    let mut rows = vec![f32::NEG_INFINITY; tokens.len() * n_vocab];
    for (k, (t, top)) in tokens.iter().zip(tops).enumerate() {
        ids.push(id_of(t.as_str().context("a token is not a string")?)?);
        for (name, p) in top
            .as_object()
            .context("top_logprobs entry is not an object")?
        {
            let id = id_of(name)? as usize;
            if id < n_vocab {
                rows[k * n_vocab + id] = p.as_f64().unwrap_or(f64::NEG_INFINITY) as f32;
            }
        }
    }
    Ok((ids, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(pieces: &[&str], finish: &str) -> Answer {
        let mut text = String::new();
        let mut offsets = Vec::new();
        for p in pieces {
            offsets.push(text.len());
            text.push_str(p);
        }
        Answer {
            ids: (0..pieces.len() as u32).collect(),
            rows: vec![0.0; pieces.len()],
            text,
            offsets,
            finish: finish.to_owned(),
        }
    }

    #[test]
    fn the_stop_string_spans_the_middle_token_boundary() {
        let g = answer(&[" The", " cat", " sat", " on", " the", " mat"], "length");
        // Middle boundary: before " on" (offset 12); two characters before, three after.
        assert_eq!(stop_string(&g).as_deref(), Some("at on"));
    }

    #[test]
    fn the_stop_gate_wants_the_text_before_the_stop_string_and_finish_stop() {
        let g = answer(&[" The", " cat", " sat", " on", " the", " mat"], "length");
        let s = "at on";
        let good = answer(&[" The", " cat", " s"], "stop");
        assert!(stop_gate(&g, s, &good).passed);
        // The stop string itself sent, or the held-back "at" lost, or the wrong finish reason.
        for bad in [
            answer(&[" The", " cat", " sat on"], "stop"),
            answer(&[" The", " cat"], "stop"),
            answer(&[" The", " cat", " s"], "length"),
        ] {
            let gate = stop_gate(&g, s, &bad);
            assert!(!gate.passed, "{}", gate.detail);
        }
    }

    /// The answers part at the token that holds the stop string's end (" on" against " in"):
    /// the stop string never appears, which only a near-tie there makes legitimate.
    #[test]
    fn the_stop_gate_judges_a_parting_inside_the_stop_string_by_the_tie_rule() {
        let n_vocab = 8;
        let with = |pieces: &[&str], ids: Vec<u32>, rows: Vec<f32>| Answer {
            ids,
            rows,
            ..answer(pieces, "length")
        };
        let tied = vec![0.0; 4 * n_vocab];
        let g = with(
            &[" The", " cat", " sat", " on"],
            vec![0, 1, 2, 3],
            tied.clone(),
        );
        let parted = with(&[" The", " cat", " sat", " in"], vec![0, 1, 2, 4], tied);
        let gate = stop_gate(&g, "at on", &parted);
        assert!(gate.passed, "{}", gate.detail);
        assert!(gate.detail.contains("part"), "{}", gate.detail);
        // The same parting where the greedy token led by 5 nats is a bug, not a tie.
        let mut sharp = vec![0.0; 4 * n_vocab];
        sharp[3 * n_vocab + 3] = 5.0;
        let g = with(
            &[" The", " cat", " sat", " on"],
            vec![0, 1, 2, 3],
            sharp.clone(),
        );
        let parted = with(&[" The", " cat", " sat", " in"], vec![0, 1, 2, 4], sharp);
        let gate = stop_gate(&g, "at on", &parted);
        assert!(!gate.passed, "{}", gate.detail);
    }
}
