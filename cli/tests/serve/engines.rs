//! The server on other engines than the plain one: `--tp 2` (ranks as threads) and `--spec tree`
//! (per-sequence draft trees inside the running batch). Both must answer exactly what the plain
//! server answers: tensor parallelism equals TP 1 up to summation order, and speculation is
//! lossless (greedy and seeded sampling alike); greedy answers stay the same when several
//! requests share batches.

use serde_json::{json, Value};

use crate::support::{self, Server};

/// Prompts, token limits and sampling settings that each request of the comparison uses.
fn requests() -> Vec<Value> {
    let mut out = Vec::new();
    for (i, p) in [
        "The capital of France is",
        "one two three one two three one two",
        "Once upon a time",
        "a",
    ]
    .iter()
    .enumerate()
    {
        out.push(
            json!({"prompt": p, "max_tokens": 12 + 5 * i, "temperature": 0, "ignore_eos": true}),
        );
        out.push(json!({
            "prompt": p, "max_tokens": 10 + 3 * i, "temperature": 0.9, "top_p": 0.95,
            "seed": 11 + i, "ignore_eos": true
        }));
    }
    out
}

fn text_of(server: &Server, body: &Value) -> String {
    let (status, v) = support::post_json(&server.url("/v1/completions"), body);
    assert_eq!(status, 200, "{body} -> {v}");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Every request alone, in order.
fn alone(server: &Server) -> Vec<String> {
    requests().iter().map(|b| text_of(server, b)).collect()
}

/// Every request at once (they share batches).
fn together(server: &Server) -> Vec<String> {
    let reqs = requests();
    std::thread::scope(|s| {
        let hs: Vec<_> = reqs
            .iter()
            .map(|b| s.spawn(move || text_of(server, b)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| panic!("request thread panicked"))
            })
            .collect()
    })
}

fn plain_answers() -> Vec<String> {
    let mut plain = Server::start(&support::fixture(), &["--max-batch", "8"], None);
    plain.wait_ready();
    alone(&plain)
}

/// The greedy answers of [`requests`]' (every other one). Batched forwards tile differently
/// from lone ones (summation order, ≤ 1e-5 of the largest logit, `engine/tests/core.rs`), which
/// greedy decoding absorbs on these prompts; a seeded draw near a top-p boundary may not, so
/// sampled requests are compared alone only.
fn greedy(answers: Vec<String>) -> Vec<String> {
    answers.into_iter().step_by(2).collect()
}

#[test]
fn speculation_answers_what_plain_decoding_answers() {
    let want = plain_answers();
    for args in [
        &["--spec", "tree", "--fixed-budget", "--budget", "0"][..],
        &["--spec", "tree", "--fixed-budget", "--budget", "1"][..],
        &["--spec", "tree", "--fixed-budget", "--budget", "6"][..],
        &[
            "--spec",
            "tree",
            "--draft",
            "self:1",
            "--fixed-budget",
            "--budget",
            "4",
        ][..],
        &["--spec", "tree"][..],
    ] {
        let mut a = vec!["--max-batch", "8"];
        a.extend_from_slice(args);
        let mut server = Server::start(&support::fixture(), &a, None);
        server.wait_ready();
        // The probe made the server ready through a speculative round.
        assert!(
            server.metric("plumbline_spec_rounds_total") >= 1.0,
            "{args:?}"
        );
        assert_eq!(alone(&server), want, "alone, {args:?}");
        assert_eq!(
            greedy(together(&server)),
            greedy(want.clone()),
            "together, {args:?}"
        );
        if args.contains(&"--fixed-budget") && !args.ends_with(&["0"]) {
            // Fixed budgets draft at every round, and some drafts are accepted.
            assert!(
                server.metric("plumbline_spec_draft_tokens_total") > 0.0,
                "{args:?}"
            );
            assert!(
                server.metric("plumbline_spec_accepted_tokens_total") > 0.0,
                "{args:?}"
            );
            assert!(
                server.metric("plumbline_spec_acceptance_length") > 1.0,
                "{args:?}"
            );
        }
    }
}

#[test]
fn tensor_parallel_answers_what_generate_tp_answers() {
    let model = support::fixture();
    let mut server = Server::start(&model, &["--tp", "2", "--max-batch", "4"], None);
    server.wait_ready();
    for prompt in ["The capital of France is", "Once upon a time"] {
        let (text, n) = support::generate_with(&model, prompt, 16, &["--tp", "2"]);
        let (status, v) = support::post_json(
            &server.url("/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], text.as_str(), "prompt {prompt:?}");
        assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(n as u64));
    }
    // Shared batches on the ranks answer what each request gets alone there.
    assert_eq!(greedy(together(&server)), greedy(alone(&server)));
}

#[test]
fn bad_engine_settings_are_refused_before_loading() {
    for (args, says) in [
        (&["--tp", "0"][..], "--tp must be at least 1"),
        (
            &["--spec", "tree", "--draft", "nonsense"][..],
            "--draft expects",
        ),
        (
            &["--spec", "tree", "--budget", "4", "--tree-top-k", "0"][..],
            "top-k",
        ),
        (
            &["--spec", "tree", "--head-rows", "chain"][..],
            "--head-rows",
        ),
    ] {
        let out = std::process::Command::new(support::bin())
            .arg("serve")
            .arg("--model")
            .arg(support::fixture())
            .args(["--port", "0"])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running plumbline serve: {e}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
