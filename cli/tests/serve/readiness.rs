//! `/ready`: 503 before the first generation and through a deliberately slow warm-up, 200 only
//! after a token came out of the request path, and 503 again when generation breaks while the
//! process stays up (the "active but not serving" failure), by re-probe and by a failed request.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{self, Server};

#[test]
fn not_ready_through_slow_warmup_then_ready() {
    let warmup = Duration::from_millis(1500);
    let t0 = Instant::now();
    let mut server = Server::start(
        &support::fixture(),
        &[],
        Some(&format!("warmup-delay-ms={}", warmup.as_millis())),
    );
    let before = server.wait_ready();
    let ready_after = t0.elapsed();
    // Health answers from the start; readiness waited for the warm-up generation.
    let (status, _) = support::get(&server.url("/health")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200);
    assert!(
        ready_after >= warmup,
        "ready after {ready_after:?}, before the {warmup:?} warm-up ended"
    );
    assert!(!before.is_empty(), "/ready was never 503 before 200");
    assert!(before.iter().all(|(s, _)| *s == 503), "{before:?}");
    let warming: Vec<_> = before
        .iter()
        .filter(|(_, v)| {
            v["reason"]
                .as_str()
                .is_some_and(|r| r.contains("warming up"))
        })
        .collect();
    assert!(
        !warming.is_empty(),
        "no 'warming up' reason among {before:?}"
    );
    // The 200 came from a real generation: one probe token counted.
    assert!(server.metric("plumbline_ready_probes_ok_total") >= 1.0);
    assert_eq!(server.metric("plumbline_ready"), 1.0);
    // Requests before the model is loaded are 503, not hangs; after, 200.
    let (status, v) = support::post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn broken_generation_turns_ready_503_and_back() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let flag = dir.path().join("break");
    let mut server = Server::start(
        &support::fixture(),
        &["--ready-idle-secs", "1"],
        Some(&format!("break-file={}", flag.display())),
    );
    server.wait_ready();

    // Broken with no traffic: the idle re-probe finds it.
    std::fs::write(&flag, b"").unwrap_or_else(|e| panic!("{e}"));
    let v = server.wait_ready_state(Duration::from_secs(20), |s, v| {
        s == 503
            && v["reason"]
                .as_str()
                .is_some_and(|r| r.contains("probe failed"))
    });
    assert!(
        v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("generation broken")),
        "{v}"
    );
    // The process is up and says so; requests fail with a 500 error object, not a hang.
    let (status, _) = support::get(&server.url("/health")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 200);
    assert!(server.alive());
    let (status, v) = support::post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(status, 500, "{v}");
    assert_eq!(support::error_of(&v).0, "server_error");

    // Repaired: the next probe makes it ready again.
    std::fs::remove_file(&flag).unwrap_or_else(|e| panic!("{e}"));
    server.wait_ready_state(Duration::from_secs(20), |s, _| s == 200);

    // Broken under traffic: the failed request itself turns /ready 503 at once.
    std::fs::write(&flag, b"").unwrap_or_else(|e| panic!("{e}"));
    let (status, _) = support::post_json(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(status, 500);
    let (status, body) = support::get(&server.url("/ready")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("generation broken"), "{body}");
    assert_eq!(server.metric("plumbline_ready"), 0.0);
    assert!(server.metric("plumbline_ready_probes_failed_total") >= 1.0);
}
