//! On the real model (Gemma 3 270M Q4_K_M; skipped when not fetched): greedy over HTTP equals
//! `plumbline generate`, and chat goes through the chat template (this GGUF has none: the
//! Gemma fallback, which `/v1/models` names) into the ids of Gemma's turn format.

use serde_json::{json, Value};

use crate::support::{self, Server};

#[test]
fn real_model_greedy_equals_generate_and_chat() {
    let Some(model) = support::real_model() else {
        engine::testing::model_absent("the real model");
        return;
    };
    let mut server = Server::start(&model, &[], None);
    server.wait_ready();
    let prompt = "The capital of France is";
    let (text, n) = support::generate(&model, prompt, 16);
    let (status, v) = support::post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], text.as_str());
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(n as u64));

    let (status, models) =
        support::get(&server.url("/v1/models")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap_or(Value::Null);
    assert!(
        models["data"][0]["chat_template"]
            .as_str()
            .is_some_and(|t| t.starts_with("fallback:gemma")),
        "{models}"
    );
    // This GGUF is the base model (general.name "Gemma 3 270m", no chat template), so its chat
    // answers are not judged; the prompt is: Gemma's turn format, special tokens parsed, one BOS:
    // <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n = 10 tokens.
    let (status, v) = support::post_json(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 10, "{v}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(!answer.contains("<start_of_turn>"), "{answer:?}");
}

/// On the real model with `--spec tree` (n-gram drafter, fixed budget 8, so every round drafts):
/// greedy answers over HTTP, alone and two at once (their trees in one batch), equal plain
/// `plumbline generate`, and on repetitive text drafts were accepted.
#[test]
fn real_model_speculative_serving_equals_plain_generate() {
    let Some(model) = support::real_model() else {
        engine::testing::model_absent("the real model");
        return;
    };
    let mut server = Server::start(
        &model,
        &["--spec", "tree", "--budget", "8", "--fixed-budget"],
        None,
    );
    server.wait_ready();
    let prompts = [
        "Monday: wake up, run, work, read, sleep.\nTuesday: wake up, run, work, read, sleep.\nWednesday:",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    ];
    let n = 24;
    let plain: Vec<(String, usize)> = prompts
        .iter()
        .map(|p| support::generate(&model, p, n))
        .collect();
    let ask = |prompt: &str| {
        support::post_json(
            &server.url("/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": n, "temperature": 0}),
        )
    };
    for (p, (text, count)) in prompts.iter().zip(&plain) {
        let (status, v) = ask(p);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], text.as_str(), "alone: {p:?}");
        assert_eq!(
            v["usage"]["completion_tokens"].as_u64(),
            Some(*count as u64)
        );
    }
    let together: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| ask(p))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    });
    for ((status, v), (p, (text, _))) in together.iter().zip(prompts.iter().zip(&plain)) {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], text.as_str(), "together: {p:?}");
    }
    assert!(server.metric("plumbline_spec_rounds_total") > 0.0);
    assert!(
        server.metric("plumbline_spec_accepted_tokens_total") > 0.0,
        "no draft token was accepted on repetitive text"
    );
}
