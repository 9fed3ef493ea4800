//! The API as clients see it: the official `openai` Python client (completions, chat,
//! streaming, stop strings, seeds, log-probabilities, errors), greedy output over HTTP equal to
//! `plumbline generate`, and concurrent requests in one batch equal to each alone.

use std::process::Command;

use serde_json::{json, Value};

use crate::support::{self, Server};

const PROMPT: &str = "The quick brown fox";

fn openai_client(server: &Server, model: &str) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/serve/openai_client.py");
    let out = Command::new("python3")
        .args([script, &server.base, model, PROMPT])
        .output()
        .unwrap_or_else(|e| panic!("running python3 {script}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the openai Python package is required: python3 -m pip install openai (ci/cpu.sh installs it)"
    );
    assert!(
        out.status.success(),
        "{script} failed:\n{stderr}\nserver stderr:\n{}",
        server.stderr()
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("client output: {e}"))
}

fn model_id() -> String {
    support::fixture()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[test]
fn openai_python_client() {
    let mut server = Server::start(&support::fixture(), &[], None);
    server.wait_ready();
    let r = openai_client(&server, &model_id());
    eprintln!("openai client {}", r["openai_version"]);

    // Completions: greedy text, its stream equal to it, usage adds up.
    let c = &r["completion"];
    assert_eq!(c["object"], "text_completion");
    let text = c["text"].as_str().unwrap_or_default();
    let usage = &c["usage"];
    let n_gen = usage["completion_tokens"].as_u64().unwrap_or(0);
    assert!((1..=12).contains(&n_gen), "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap_or(0) + n_gen)
    );
    let expect_finish = if n_gen == 12 { "length" } else { "stop" };
    assert_eq!(c["finish_reason"], expect_finish);
    assert_eq!(r["completion_stream"]["text"], text, "stream ≠ non-stream");
    assert_eq!(r["completion_stream"]["finish_reason"], expect_finish);
    assert!(r["completion_stream"]["chunks"].as_u64().unwrap_or(0) >= 2);

    // Stop string: the text up to (not including) the stop string's first occurrence.
    if let Some(stop) = r["stop"]["stop"].as_str() {
        let at = text
            .find(stop)
            .unwrap_or_else(|| panic!("{stop:?} comes from {text:?}"));
        assert_eq!(r["stop"]["text"], &text[..at]);
        assert_eq!(r["stop"]["finish_reason"], "stop");
        assert_eq!(r["stop"]["stream_text"], &text[..at]);
    } else {
        panic!("greedy text {text:?} too short to cut a stop string from");
    }

    // Seeds: the same seed gives the same text; the seed is used (another seed differs for at
    // least one of four: 16 tokens at temperature 1 on a random fixture repeat with
    // vanishing probability).
    let s = &r["seeded"];
    assert_eq!(s["a"], s["b"], "seed 42 twice");
    let others: Vec<&Value> = s["others"]
        .as_array()
        .map(|v| v.iter().collect())
        .unwrap_or_default();
    assert!(
        others.iter().any(|o| *o != &s["a"]),
        "every seed gave {}",
        s["a"]
    );

    // Chat, plain and streamed.
    let ch = &r["chat"];
    assert_eq!(ch["object"], "chat.completion");
    assert_eq!(ch["role"], "assistant");
    assert_eq!(r["chat_stream"]["content"], ch["content"]);
    assert_eq!(r["chat_stream"]["roles"], json!(["assistant"]));
    assert_eq!(r["chat_stream"]["finish_reason"], ch["finish_reason"]);
    assert_eq!(r["chat_stream"]["usage"], ch["usage"]);

    // Log-probabilities: one entry per generated token, top 3 in descending order, the greedy
    // choice is the most likely, every value a log-probability.
    let lp = &r["chat_logprobs"];
    let tokens = lp["tokens"].as_array().cloned().unwrap_or_default();
    assert_eq!(Some(tokens.len() as u64), lp["completion_tokens"].as_u64());
    for t in &tokens {
        let top = t["top"].as_array().cloned().unwrap_or_default();
        assert_eq!(top.len(), 3, "{t}");
        let lps: Vec<f64> = top.iter().map(|x| x[1].as_f64().unwrap_or(1.0)).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{t}");
        assert!(lps.iter().all(|&l| l <= 0.0), "{t}");
        assert_eq!(
            t["logprob"].as_f64(),
            Some(lps[0]),
            "greedy picks the top token: {t}"
        );
    }
    let clp = &r["completion_logprobs"];
    assert_eq!(
        clp["tokens"].as_array().map(Vec::len),
        clp["token_logprobs"].as_array().map(Vec::len)
    );
    assert_eq!(
        clp["top_logprobs"][0].as_object().map(|m| m.len()),
        Some(2),
        "{clp}"
    );

    // Errors come back as the client's typed exceptions.
    let e = &r["errors"];
    assert_eq!(e["n2"]["status"], 400, "{e}");
    assert_eq!(e["n2"]["type"], "BadRequestError");
    assert_eq!(e["unknown_model"]["status"], 404, "{e}");
    assert_eq!(e["unknown_model"]["type"], "NotFoundError");
    assert_eq!(e["max_tokens0"]["status"], 400, "{e}");
    assert_eq!(r["models"], json!([model_id()]));
}

/// Greedy `/v1/completions` = `plumbline generate` (same tokenization, same sampling, same
/// forward), streamed and not.
#[test]
fn greedy_over_http_equals_generate() {
    let model = support::fixture();
    let mut server = Server::start(&model, &[], None);
    server.wait_ready();
    for prompt in [PROMPT, "Once upon a time", "a"] {
        let (text, n) = support::generate(&model, prompt, 24);
        let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
        let (status, v) = support::post_json(&server.url("/v1/completions"), &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], text.as_str(), "prompt {prompt:?}");
        assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(n as u64));
        let mut s = body.clone();
        s["stream"] = json!(true);
        let (status, events) = support::post_stream(&server.url("/v1/completions"), &s);
        assert_eq!(status, 200);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let streamed: String = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, text, "streamed, prompt {prompt:?}");
    }
}

/// Requests that share batches (continuous batching: they join while others decode) get what
/// each gets alone.
#[test]
fn concurrent_requests_equal_sequential() {
    let mut server = Server::start(&support::fixture(), &["--max-batch", "4"], None);
    server.wait_ready();
    let prompts: Vec<String> = (0..6).map(|i| format!("Request number {i} says")).collect();
    let url = server.url("/v1/completions");
    let one = |p: &str, max: u64| {
        let (status, v) = support::post_json(
            &url,
            &json!({"prompt": p, "max_tokens": max, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let alone: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| one(p, 8 + i as u64 * 3))
        .collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let one = &one;
                s.spawn(move || one(p, 8 + i as u64 * 3))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| panic!("request thread panicked"))
            })
            .collect()
    });
    assert_eq!(together, alone);
    assert!(server.metric("plumbline_generated_tokens_total") >= 2.0 * (6.0 * 8.0 + 45.0));
}
