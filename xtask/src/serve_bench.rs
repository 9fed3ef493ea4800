//! `cargo xtask serve-bench`: start `plumbline serve` on loopback, wait for `/ready`, drive a
//! bounded streaming load at each concurrency, and report time to first token, inter-token
//! latency (p50/p99), tokens/s and requests/s, and whether every request got exactly one
//! complete answer (none lost, none duplicated).
//!
//! Every concurrency level sends the same requests (request `i` has prompt `i`, greedy,
//! `ignore_eos`, a fixed number of tokens), so the answers are also compared with the
//! concurrency-1 answers: batching must not change what a request gets. Timings on a shared
//! machine are noisy; compare the rows of one run with each other, not with another run.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model to serve (default: the fetched Gemma 3 270M Q4_K_M)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Concurrency levels, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency level
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Tokens generated per request
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Engine threads of the server (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
    /// One more argument for `plumbline serve`, repeatable and passed through unchanged
    /// (`--server-arg=--spec --server-arg=tree`, `--server-arg=--tp --server-arg=2`)
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    pub server_args: Vec<String>,
    /// Serve with this `plumbline` binary instead of building the workspace's (a before/after
    /// comparison: build the other commit into its own target directory and pass its binary)
    #[arg(long)]
    pub bin: Option<PathBuf>,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    concurrency: usize,
    requests: usize,
    complete: usize,
    lost: usize,
    duplicated: usize,
    /// Answers whose text differs from the same request's at concurrency 1.
    differ_from_c1: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    itl_p50_ms: f64,
    itl_p99_ms: f64,
    tokens_per_s: f64,
    requests_per_s: f64,
    wall_s: f64,
}

/// One streamed answer.
#[derive(Debug, Default)]
struct Answer {
    id: String,
    text: String,
    ttft: Option<Duration>,
    itl: Vec<Duration>,
    completion_tokens: u64,
    finish_reason: String,
    done: bool,
}

/// The server child process, killed when dropped.
pub(crate) struct ServerProc(Child);

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(args: Args) -> Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) || args.requests == 0 {
        bail!("--concurrency needs levels of at least 1 and --requests at least 1");
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => crate::fetch_model::cached_path("gemma3-270m")?
            .context("the real model is not fetched: run cargo xtask fetch-model gemma3-270m, or pass --model")?,
    };
    let bin = match &args.bin {
        Some(b) if b.is_file() => b.clone(),
        Some(b) => bail!("--bin {}: no such file", b.display()),
        None => build_plumbline()?,
    };
    let max_c = args.concurrency.iter().copied().max().unwrap_or(1);
    let mut extra: Vec<String> = vec![
        "--max-batch".into(),
        max_c.to_string(),
        "--queue".into(),
        args.requests.to_string(),
        // No idle re-probe in the middle of a level.
        "--ready-idle-secs".into(),
        "3600".into(),
    ];
    if let Some(t) = args.threads {
        extra.extend(["--threads".into(), t.to_string()]);
    }
    extra.extend(args.server_args.iter().cloned());
    let (server, base) = start(&bin, &model, &extra)?;
    wait_ready(&base, Duration::from_secs(300))?;
    tracing::info!(%base, model = %model.display(), "server ready; driving load");

    let mut rows = Vec::new();
    let mut c1_texts: Option<Vec<String>> = None;
    for &c in &args.concurrency {
        let (row, texts) = level(
            &base,
            c,
            args.requests,
            args.max_tokens,
            c1_texts.as_deref(),
        )?;
        tracing::info!(
            concurrency = c,
            tokens_per_s = row.tokens_per_s,
            "level done"
        );
        if c == 1 && c1_texts.is_none() {
            c1_texts = Some(texts);
        }
        rows.push(row);
    }
    drop(server);

    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": model.display().to_string(),
                "requests_per_level": args.requests,
                "max_tokens": args.max_tokens,
                "max_batch": max_c,
                "server_args": args.server_args,
                "rows": rows,
            }))?
        );
    } else {
        println!(
            "model {} · {} requests per level · {} tokens each (greedy, ignore_eos) · server --max-batch {}{}",
            model.display(),
            args.requests,
            args.max_tokens,
            max_c,
            args.server_args.iter().fold(String::new(), |acc, a| acc + " " + a)
        );
        println!("| concurrency | complete | lost | duplicated | differ from c=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s | req/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {}/{} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
                r.concurrency,
                r.complete,
                r.requests,
                r.lost,
                r.duplicated,
                r.differ_from_c1,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.itl_p50_ms,
                r.itl_p99_ms,
                r.tokens_per_s,
                r.requests_per_s
            );
        }
    }
    let bad: Vec<String> = rows
        .iter()
        .filter(|r| r.lost > 0 || r.duplicated > 0)
        .map(|r| {
            format!(
                "concurrency {}: {} lost, {} duplicated",
                r.concurrency, r.lost, r.duplicated
            )
        })
        .collect();
    if !bad.is_empty() {
        bail!("incomplete answers: {}", bad.join("; "));
    }
    Ok(())
}

/// `cargo build --release -p plumbline`; the binary's path. From the fault-injection xtask
/// (`verify --faults`), the server's own fault hooks are built too (`plumbline-faults`, beside
/// the plain binary: crate::release_build), so a serve fault reaches the server it names.
pub(crate) fn build_plumbline() -> Result<PathBuf> {
    if cfg!(feature = "fault-injection") {
        crate::release_build::with_faults("plumbline", "plumbline")
    } else {
        crate::release_build::plain("plumbline", "plumbline")
    }
}

/// Start `bin serve --model model --port 0 extra…` (test hooks off); the server and its base URL.
pub(crate) fn start(bin: &Path, model: &Path, extra: &[String]) -> Result<(ServerProc, String)> {
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0"])
        .args(extra)
        .env_remove("PLUMBLINE_SERVE_TEST_HOOKS")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("the server's stdout")?;
    let server = ServerProc(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(l)) = lines.next() {
            let _ = tx.send(l);
        }
        for _ in lines {}
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .context("the server printed no address within 60 s")?;
    let base = line
        .strip_prefix("listening on ")
        .with_context(|| format!("unexpected first line from the server: {line:?}"))?
        .to_string();
    Ok((server, base))
}

pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into()
}

/// Poll `/ready` until 200, at most `limit`.
pub(crate) fn wait_ready(base: &str, limit: Duration) -> Result<()> {
    let t0 = Instant::now();
    let a = agent();
    let mut last = String::new();
    while t0.elapsed() < limit {
        if let Ok(mut r) = a.get(format!("{base}/ready")).call() {
            if r.status().as_u16() == 200 {
                return Ok(());
            }
            last = r.body_mut().read_to_string().unwrap_or_default();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the server was not ready within {limit:?}; last /ready answer: {last}")
}

fn prompt(i: usize) -> String {
    format!("Story {i}: once upon a time, in a village by the sea,")
}

/// One streamed request.
fn one(base: &str, i: usize, max_tokens: usize) -> Result<Answer> {
    let body = json!({
        "prompt": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let t0 = Instant::now();
    let r = agent()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .with_context(|| format!("request {i}"))?;
    if r.status().as_u16() != 200 {
        bail!("request {i}: HTTP {}", r.status());
    }
    let mut a = Answer::default();
    let mut last = None;
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        let line = line.with_context(|| format!("reading the stream of request {i}"))?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            a.done = true;
            break;
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("request {i}: event {data}"))?;
        if v.get("error").is_some() {
            bail!("request {i}: {data}");
        }
        if let Some(id) = v["id"].as_str() {
            a.id = id.to_string();
        }
        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
            a.completion_tokens = u;
        }
        if let Some(c) = v["choices"].get(0) {
            if let Some(f) = c["finish_reason"].as_str() {
                a.finish_reason = f.to_string();
            }
            let t = c["text"].as_str().unwrap_or("");
            if !t.is_empty() {
                let now = Instant::now();
                match last {
                    None => a.ttft = Some(now - t0),
                    Some(p) => a.itl.push(now - p),
                }
                last = Some(now);
                a.text.push_str(t);
            }
        }
    }
    Ok(a)
}

fn level(
    base: &str,
    c: usize,
    n: usize,
    max_tokens: usize,
    c1: Option<&[String]>,
) -> Result<(Row, Vec<String>)> {
    let next = AtomicUsize::new(0);
    let answers: Mutex<Vec<(usize, Result<Answer>)>> = Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..c {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let a = one(base, i, max_tokens);
                if let Ok(mut v) = answers.lock() {
                    v.push((i, a));
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let answers = answers.into_inner().unwrap_or_default();

    let mut texts = vec![String::new(); n];
    let mut seen_idx = HashSet::new();
    let mut seen_ids = HashSet::new();
    let (mut complete, mut duplicated, mut differ) = (0, 0, 0);
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut tokens = 0u64;
    for (i, a) in answers {
        let a = match a {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("request {i} failed: {e:#}");
                continue;
            }
        };
        if !seen_idx.insert(i) || (!a.id.is_empty() && !seen_ids.insert(a.id.clone())) {
            duplicated += 1;
            continue;
        }
        let ok = a.done && a.finish_reason == "length" && a.completion_tokens == max_tokens as u64;
        if !ok {
            tracing::warn!(
                "request {i} incomplete: done {}, finish {:?}, {} of {max_tokens} tokens",
                a.done,
                a.finish_reason,
                a.completion_tokens
            );
            continue;
        }
        complete += 1;
        tokens += a.completion_tokens;
        if let Some(t) = a.ttft {
            ttft.push(t.as_secs_f64() * 1e3);
        }
        itl.extend(a.itl.iter().map(|d| d.as_secs_f64() * 1e3));
        if let Some(reference) = c1.and_then(|t| t.get(i)) {
            if *reference != a.text {
                differ += 1;
            }
        }
        texts[i] = a.text;
    }
    let row = Row {
        concurrency: c,
        requests: n,
        complete,
        lost: n.saturating_sub(complete),
        duplicated,
        differ_from_c1: differ,
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p99_ms: percentile(&mut ttft, 99.0),
        itl_p50_ms: percentile(&mut itl, 50.0),
        itl_p99_ms: percentile(&mut itl, 99.0),
        tokens_per_s: tokens as f64 / wall.max(f64::MIN_POSITIVE),
        requests_per_s: complete as f64 / wall.max(f64::MIN_POSITIVE),
        wall_s: wall,
    };
    Ok((row, texts))
}

/// Nearest-rank percentile (NaN for no samples).
fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut [3.0, 1.0, 2.0], 50.0), 2.0);
        assert!(percentile(&mut [], 50.0).is_nan());
    }
}
