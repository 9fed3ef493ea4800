//! A malformed-request corpus against one live server: every bad input gets its 4xx and an
//! OpenAI error object and nothing else happens; truncated bodies and clients that vanish mid
//! request are absorbed (their generation is cancelled); the server serves normally afterwards.
//! Also: a full queue is answered 429 and a disconnect frees the slot for the next request.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::{self, Server};

const CTX: usize = 256;
const BODY_LIMIT: usize = 4096;

/// (name, path, body, expected status, expected `error.param` when one field is to blame).
fn corpus() -> Vec<(
    &'static str,
    &'static str,
    String,
    u16,
    Option<&'static str>,
)> {
    let c = "/v1/completions";
    let ch = "/v1/chat/completions";
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(BODY_LIMIT * 2));
    vec![
        ("invalid JSON", c, "{\"prompt\": ".into(), 400, None),
        ("not JSON at all", c, "prompt=hello".into(), 400, None),
        ("JSON array, not an object", c, "[1, 2]".into(), 400, None),
        ("empty body", c, String::new(), 400, None),
        ("missing prompt", c, json!({"max_tokens": 2}).to_string(), 400, None),
        ("prompt of the wrong type", c, json!({"prompt": 5}).to_string(), 400, Some("prompt")),
        ("max_tokens a string", c, json!({"prompt": "a", "max_tokens": "ten"}).to_string(), 400, Some("max_tokens")),
        ("temperature a string", ch, json!({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}).to_string(), 400, Some("temperature")),
        ("stream not a boolean", c, json!({"prompt": "a", "stream": "yes"}).to_string(), 400, Some("stream")),
        ("messages a string", ch, json!({"messages": "hi"}).to_string(), 400, Some("messages")),
        ("message content a number", ch, json!({"messages": [{"role": "user", "content": 3}]}).to_string(), 400, Some("messages[0].content")),
        ("unknown model", c, json!({"model": "gpt-4o", "prompt": "a"}).to_string(), 404, Some("model")),
        ("empty prompt", c, json!({"prompt": ""}).to_string(), 400, Some("prompt")),
        ("empty prompt list", c, json!({"prompt": []}).to_string(), 400, Some("prompt")),
        ("empty messages", ch, json!({"messages": []}).to_string(), 400, Some("messages")),
        ("only empty messages", ch, json!({"messages": [{"role": "user", "content": ""}]}).to_string(), 400, Some("messages")),
        ("unknown role", ch, json!({"messages": [{"role": "wizard", "content": "a"}]}).to_string(), 400, Some("messages[0].role")),
        ("roles out of order", ch, json!({"messages": [{"role": "assistant", "content": "a"}]}).to_string(), 400, Some("messages")),
        ("image content", ch, json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).to_string(), 400, Some("messages[0].content[0].type")),
        ("max_tokens 0", c, json!({"prompt": "a", "max_tokens": 0}).to_string(), 400, Some("max_tokens")),
        ("max_tokens negative", ch, json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}).to_string(), 400, Some("max_tokens")),
        ("prompt + max_tokens over the context", c, json!({"prompt": "a", "max_tokens": CTX}).to_string(), 400, Some("max_tokens")),
        ("prompt alone over the context", c, json!({"prompt": "word ".repeat(CTX * 2)}).to_string(), 400, Some("prompt")),
        ("token id outside the vocabulary", c, json!({"prompt": [1, 4_000_000]}).to_string(), 400, Some("prompt[1]")),
        ("n = 2", c, json!({"prompt": "a", "n": 2}).to_string(), 400, Some("n")),
        ("n = 1000", ch, json!({"messages": [{"role": "user", "content": "a"}], "n": 1000}).to_string(), 400, Some("n")),
        ("two prompts", c, json!({"prompt": ["a", "b"]}).to_string(), 400, Some("prompt")),
        ("temperature out of range", c, json!({"prompt": "a", "temperature": 3}).to_string(), 400, Some("temperature")),
        ("top_p 0", c, json!({"prompt": "a", "top_p": 0}).to_string(), 400, Some("top_p")),
        ("five stop strings", c, json!({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}).to_string(), 400, Some("stop")),
        ("logprobs 10 on completions", c, json!({"prompt": "a", "logprobs": 10}).to_string(), 400, Some("logprobs")),
        ("top_logprobs 50 on chat", ch, json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 50}).to_string(), 400, Some("top_logprobs")),
        ("frequency_penalty (unsupported)", c, json!({"prompt": "a", "frequency_penalty": 1.0}).to_string(), 400, Some("frequency_penalty")),
        ("body over the limit", c, big, 413, None),
    ]
}

fn check_error_object(name: &str, v: &Value) {
    let (kind, message) = support::error_of(v);
    assert!(
        !kind.is_empty() && !message.is_empty(),
        "{name}: not an error object: {v}"
    );
}

#[test]
fn malformed_request_corpus() {
    let ctx = CTX.to_string();
    let limit = BODY_LIMIT.to_string();
    let mut server = Server::start(
        &support::fixture(),
        &[
            "--ctx",
            &ctx,
            "--max-body-bytes",
            &limit,
            "--body-timeout-secs",
            "2",
        ],
        Some("step-delay-ms=5"),
    );
    server.wait_ready();
    let mut table = vec![];
    for (name, path, body, status, param) in corpus() {
        let (got, answer) = support::raw(
            &server.addr,
            &support::http_post(path, body.as_bytes(), body.len()),
            false,
        );
        let v = support::raw_body(&answer);
        assert_eq!(got, Some(status), "{name}: {answer}");
        check_error_object(name, &v);
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{name}: {v}");
        }
        table.push(format!(
            "| {name} | {status} | {} |",
            v["error"]["message"].as_str().unwrap_or("")
        ));
    }

    // Wrong method and unknown path: error objects too.
    let (got, answer) = support::raw(
        &server.addr,
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        false,
    );
    assert_eq!(got, Some(405), "{answer}");
    check_error_object("GET /v1/completions", &support::raw_body(&answer));
    table.push("| GET /v1/completions | 405 | |".into());
    let (got, answer) = support::raw(
        &server.addr,
        b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        false,
    );
    assert_eq!(got, Some(404), "{answer}");
    check_error_object("unknown path", &support::raw_body(&answer));
    table.push("| GET /v2/nothing | 404 | |".into());

    // A truncated body: Content-Length promises more than arrives, then the client half-closes.
    let body = br#"{"prompt": "hello", "max_tok"#;
    let (got, answer) = support::raw(
        &server.addr,
        &support::http_post("/v1/completions", body, 200),
        true,
    );
    assert_eq!(got, Some(400), "truncated body: {answer}");
    table.push("| truncated body, client half-closes | 400 | |".into());
    // A truncated body whose client just stops sending: the body timeout answers.
    let (got, answer) = support::raw(
        &server.addr,
        &support::http_post("/v1/completions", body, 200),
        false,
    );
    assert_eq!(got, Some(408), "stalled body: {answer}");
    table.push("| truncated body, client stalls | 408 | |".into());
    // A body cut off and the connection dropped: nothing to answer; the server goes on.
    {
        let mut s = TcpStream::connect(&server.addr).unwrap_or_else(|e| panic!("{e}"));
        let _ = s.write_all(&support::http_post("/v1/completions", body, 200));
    }

    // Disconnects mid stream and mid request: the generations are cancelled.
    let cancelled0 = server.metric("plumbline_requests_cancelled_total");
    let stream_req =
        json!({"prompt": "a", "max_tokens": 50, "stream": true, "ignore_eos": true}).to_string();
    {
        let mut s = TcpStream::connect(&server.addr).unwrap_or_else(|e| panic!("{e}"));
        s.set_read_timeout(Some(support::HTTP_TIMEOUT)).ok();
        s.write_all(&support::http_post(
            "/v1/completions",
            stream_req.as_bytes(),
            stream_req.len(),
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let mut r = BufReader::new(s);
        let mut n_data = 0;
        let mut line = String::new();
        while n_data < 3 {
            line.clear();
            let n = r
                .read_line(&mut line)
                .unwrap_or_else(|e| panic!("reading the stream: {e}"));
            assert!(n > 0, "the stream ended before 3 events");
            if line.starts_with("data: ") {
                n_data += 1;
            }
        }
        // Dropping the reader closes the connection after 3 of 50 tokens.
    }
    table.push("| client disconnects mid stream | cancelled | |".into());
    let plain_req = json!({"prompt": "a", "max_tokens": 50, "ignore_eos": true}).to_string();
    {
        let mut s = TcpStream::connect(&server.addr).unwrap_or_else(|e| panic!("{e}"));
        s.write_all(&support::http_post(
            "/v1/completions",
            plain_req.as_bytes(),
            plain_req.len(),
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        // Wait until the generation runs, then go away without reading.
        wait_until(Duration::from_secs(10), || {
            server.metric("plumbline_running_requests") >= 1.0
        });
    }
    table.push("| client disconnects before the answer | cancelled | |".into());
    wait_until(Duration::from_secs(10), || {
        server.metric("plumbline_requests_cancelled_total") >= cancelled0 + 2.0
    });
    wait_until(Duration::from_secs(10), || {
        server.metric("plumbline_running_requests") == 0.0
    });
    // Cancelled, not finished: fewer tokens than the two requests' 100 were generated... each
    // ran at most a few 5 ms steps past its disconnect.
    assert!(
        server.alive(),
        "the server exited; stderr:\n{}",
        server.stderr()
    );

    // Still serving, still ready.
    let (status, v) = support::post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "hello", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = support::post_json(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, _) = support::get(&server.url("/ready")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200);
    assert!(!server.stderr().contains("panicked"), "{}", server.stderr());
    println!(
        "| request | status | message |\n|---|---|---|\n{}",
        table.join("\n")
    );
}

fn wait_until(limit: Duration, mut pred: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !pred() {
        assert!(
            t0.elapsed() < limit,
            "condition not reached within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One slot, one queue place: the third request is 429; disconnecting the running one cancels
/// it and lets the queued one through.
#[test]
fn full_queue_answers_429_and_disconnect_frees_the_slot() {
    let mut server = Server::start(
        &support::fixture(),
        &[
            "--max-batch",
            "1",
            "--queue",
            "1",
            "--ready-idle-secs",
            "600",
        ],
        Some("step-delay-ms=20"),
    );
    server.wait_ready();
    let url = server.url("/v1/completions");
    // A: streams 1000 tokens (20 s at 20 ms a step), holding the only slot.
    let a_req =
        json!({"prompt": "a", "max_tokens": 1000, "stream": true, "ignore_eos": true}).to_string();
    let a = TcpStream::connect(&server.addr).unwrap_or_else(|e| panic!("{e}"));
    a.set_read_timeout(Some(support::HTTP_TIMEOUT)).ok();
    (&a).write_all(&support::http_post(
        "/v1/completions",
        a_req.as_bytes(),
        a_req.len(),
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let mut a_reader = BufReader::new(a);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        let n = a_reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(n > 0, "A ended early");
    }
    // B: queued behind A.
    let b_url = url.clone();
    let b = std::thread::spawn(move || {
        support::post_json(&b_url, &json!({"prompt": "b", "max_tokens": 3}))
    });
    wait_until(Duration::from_secs(10), || {
        server.metric("plumbline_queue_depth") >= 1.0
    });
    // C: no room.
    let (status, v) = support::post_json(&url, &json!({"prompt": "c", "max_tokens": 3}));
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], "queue_full");
    // A goes away: its generation stops, B gets the slot and finishes.
    drop(a_reader);
    let (status, v) = b.join().unwrap_or_else(|_| panic!("B panicked"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert!(server.metric("plumbline_requests_cancelled_total") >= 1.0);
    // A did not run to its 1000 tokens.
    assert!(server.metric("plumbline_generated_tokens_total") < 1000.0);
}
