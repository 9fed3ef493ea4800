//! A live `plumbline serve` child process on a free loopback port, and small HTTP clients for
//! it. Every wait is bounded: a hang fails the test with a message instead of stalling it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Longest any single HTTP exchange may take in these tests (the fixture model answers in
/// milliseconds; the real model's longest request here is 32 tokens, well under a second each).
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a server may take from spawn to `/ready` 200 (fixture: well under a second; real
/// model: loading and one token, a few seconds on two busy cores).
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_plumbline")
}

/// The fixture model the serve tests run on (Gemma 3 layout, Q4_K_M mix; written once per test
/// process into a temporary directory).
pub fn fixture() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir =
            DIR.get_or_init(|| tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}")));
        let spec =
            golden::by_name("gemma3-q4_k_m").unwrap_or_else(|| panic!("fixture gemma3-q4_k_m"));
        golden::write(&spec, dir.path()).unwrap_or_else(|e| panic!("writing the fixture: {e}"))
    })
    .clone()
}

/// The real model, when fetched.
pub fn real_model() -> Option<PathBuf> {
    golden::snapshot::real_model_path().filter(|p| p.exists())
}

pub struct Server {
    child: Child,
    pub base: String,
    pub addr: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    pub fn start(model: &Path, args: &[&str], hooks: Option<&str>) -> Server {
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--threads", "2"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("RUST_LOG", "info");
        match hooks {
            Some(h) => cmd.env("PLUMBLINE_SERVE_TEST_HOOKS", h),
            None => cmd.env_remove("PLUMBLINE_SERVE_TEST_HOOKS"),
        };
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {}: {e}", bin()));
        let stdout = child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("child stdout"));
        let stderr_pipe = child
            .stderr
            .take()
            .unwrap_or_else(|| panic!("child stderr"));
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = tx.send(first);
            }
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the server printed no address within 30 s; stderr:\n{}",
                    stderr.lock().map(|s| s.clone()).unwrap_or_default()
                );
            }
        };
        let base = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first stdout line {line:?}"))
            .to_string();
        let addr = base.trim_start_matches("http://").to_string();
        Server {
            child,
            base,
            addr,
            stderr,
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether the child is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Poll `/ready` until 200; every answer before it is returned (status, body).
    pub fn wait_ready(&mut self) -> Vec<(u16, Value)> {
        let t0 = Instant::now();
        let mut seen = Vec::new();
        loop {
            assert!(
                self.alive(),
                "the server exited before it was ready; stderr:\n{}",
                self.stderr()
            );
            if let Ok((status, body)) = get(&self.url("/ready")) {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                if status == 200 {
                    return seen;
                }
                seen.push((status, v));
            }
            assert!(
                t0.elapsed() < READY_TIMEOUT,
                "not ready within {READY_TIMEOUT:?}; last answers {:?}; stderr:\n{}",
                seen.last(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Poll `/ready` until `pred(status, body)` holds, within `limit`.
    pub fn wait_ready_state(
        &mut self,
        limit: Duration,
        pred: impl Fn(u16, &Value) -> bool,
    ) -> Value {
        let t0 = Instant::now();
        let mut last = None;
        while t0.elapsed() < limit {
            if let Ok((status, body)) = get(&self.url("/ready")) {
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                if pred(status, &v) {
                    return v;
                }
                last = Some((status, v));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "/ready never reached the expected state within {limit:?}; last {last:?}; stderr:\n{}",
            self.stderr()
        );
    }

    /// A metric's value from `/metrics` (first sample whose line starts with `name`).
    pub fn metric(&self, name: &str) -> f64 {
        let (status, text) = get(&self.url("/metrics")).unwrap_or_else(|e| panic!("/metrics: {e}"));
        assert_eq!(status, 200);
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} not in\n{text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(HTTP_TIMEOUT))
        .build()
        .into()
}

/// GET: (status, body).
pub fn get(url: &str) -> Result<(u16, String), String> {
    let mut r = agent().get(url).call().map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let body = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// POST JSON text: (status, parsed body or Null).
pub fn post(url: &str, body: &str) -> (u16, Value) {
    let mut r = agent()
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    let text = r
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| panic!("reading the answer to POST {url}: {e}"));
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

pub fn post_json(url: &str, body: &Value) -> (u16, Value) {
    post(url, &body.to_string())
}

/// POST with `stream: true`: every `data:` payload, in order (the last is `[DONE]`).
pub fn post_stream(url: &str, body: &Value) -> (u16, Vec<String>) {
    let r = agent()
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    let reader = BufReader::new(r.into_body().into_reader());
    let events = reader
        .lines()
        .map(|l| l.unwrap_or_else(|e| panic!("reading the stream: {e}")))
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    (status, events)
}

/// A raw HTTP/1.1 exchange on a fresh connection: write `request`, optionally half-close, and
/// read the status code of the answer (or `None` when the server closed without one).
pub fn raw(addr: &str, request: &[u8], half_close: bool) -> (Option<u16>, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(HTTP_TIMEOUT)).ok();
    s.set_write_timeout(Some(HTTP_TIMEOUT)).ok();
    // A write can fail when the server answers and closes early (413): still read the answer.
    let _ = s.write_all(request);
    if half_close {
        let _ = s.shutdown(Shutdown::Write);
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if let Some(head_end) = find(&out, b"\r\n\r\n") {
                    // Enough once the body announced by Content-Length is in.
                    let head = String::from_utf8_lossy(&out[..head_end]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok());
                    if let Some(len) = len {
                        if out.len() >= head_end + 4 + len {
                            break;
                        }
                    }
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok());
    (status, text)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The JSON body of a raw answer.
pub fn raw_body(answer: &str) -> Value {
    answer
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null)
}

/// A POST request's bytes with an exact body (and a Content-Length that may lie).
pub fn http_post(path: &str, body: &[u8], content_length: usize) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {content_length}\r\nConnection: close\r\n\r\n"
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// `plumbline generate --json` on `model`: (generated text, number of generated tokens).
pub fn generate(model: &Path, prompt: &str, max_tokens: usize) -> (String, usize) {
    generate_with(model, prompt, max_tokens, &[])
}

/// [`generate`] with more arguments (`--tp 2`).
pub fn generate_with(
    model: &Path,
    prompt: &str,
    max_tokens: usize,
    args: &[&str],
) -> (String, usize) {
    let out = Command::new(bin())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args([
            "--prompt",
            prompt,
            "--max-tokens",
            &max_tokens.to_string(),
            "--threads",
            "2",
            "--json",
        ])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running plumbline generate: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("generate --json: {e}"));
    (
        v["text"].as_str().unwrap_or_default().to_string(),
        v["n_generated"].as_u64().unwrap_or_default() as usize,
    )
}

/// The error object of an answer: (type, message).
pub fn error_of(v: &Value) -> (String, String) {
    let e = &v["error"];
    (
        e["type"].as_str().unwrap_or_default().to_string(),
        e["message"].as_str().unwrap_or_default().to_string(),
    )
}
