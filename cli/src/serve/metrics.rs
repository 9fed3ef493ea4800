//! Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms.
//! Written out here: a handful of series do not need a metrics framework.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histograms: 1 ms to 60 s, roughly ×2.5 apart, as
/// vLLM's and TGI's latency buckets span.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, &b) in LATENCY_BUCKETS.iter().enumerate() {
            if v <= b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (i, &b) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", self.counts[i]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Everything `/metrics` reports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// (endpoint, HTTP status) → requests answered.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cancelled: AtomicU64,
    pub probes_ok: AtomicU64,
    pub probes_failed: AtomicU64,
    /// Requests accepted into the queue and not yet taken by the engine.
    pub queue_depth: AtomicUsize,
    /// Sequences in the running batch.
    pub running: AtomicUsize,
    /// Speculative rounds, draft nodes verified, and draft tokens accepted.
    pub spec_rounds: AtomicU64,
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
}

impl Metrics {
    pub fn request(&self, endpoint: &'static str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint, status)).or_insert(0) += 1;
        }
    }

    pub fn ttft(&self, secs: f64) {
        if let Ok(mut h) = self.ttft.lock() {
            h.observe(secs);
        }
    }

    pub fn itl(&self, secs: f64) {
        if let Ok(mut h) = self.itl.lock() {
            h.observe(secs);
        }
    }

    pub fn e2e(&self, secs: f64) {
        if let Ok(mut h) = self.e2e.lock() {
            h.observe(secs);
        }
    }

    /// The exposition text; `ready` is the readiness gauge's value.
    pub fn render(&self, ready: bool) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP plumbline_requests_total HTTP requests answered, by endpoint and status"
        );
        let _ = writeln!(out, "# TYPE plumbline_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "plumbline_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
                );
            }
        }
        counter(
            &mut out,
            "plumbline_prompt_tokens_total",
            "Prompt tokens prefilled",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "plumbline_generated_tokens_total",
            "Tokens generated",
            self.generated_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "plumbline_requests_cancelled_total",
            "Generations stopped because the client went away",
            self.cancelled.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "plumbline_ready_probes_ok_total",
            "Readiness probes (real generations through the request path) that produced a token",
            self.probes_ok.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "plumbline_ready_probes_failed_total",
            "Readiness probes that failed",
            self.probes_failed.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "plumbline_queue_depth",
            "Requests waiting for a slot in the running batch",
            self.queue_depth.load(Ordering::Relaxed) as u64,
        );
        gauge(
            &mut out,
            "plumbline_running_requests",
            "Sequences in the running batch",
            self.running.load(Ordering::Relaxed) as u64,
        );
        gauge(
            &mut out,
            "plumbline_ready",
            "1 when /ready answers 200",
            u64::from(ready),
        );
        let rounds = self.spec_rounds.load(Ordering::Relaxed);
        let accepted = self.spec_accepted.load(Ordering::Relaxed);
        counter(
            &mut out,
            "plumbline_spec_rounds_total",
            "Speculative rounds (one verified draft tree each; a root alone on a plain round)",
            rounds,
        );
        counter(
            &mut out,
            "plumbline_spec_draft_tokens_total",
            "Draft-tree nodes verified",
            self.spec_drafted.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "plumbline_spec_accepted_tokens_total",
            "Draft tokens accepted",
            accepted,
        );
        let _ = writeln!(
            out,
            "# HELP plumbline_spec_acceptance_length Mean tokens emitted per speculative round (accepted drafts + 1)"
        );
        let _ = writeln!(out, "# TYPE plumbline_spec_acceptance_length gauge");
        let tau = if rounds == 0 {
            0.0
        } else {
            (accepted + rounds) as f64 / rounds as f64
        };
        let _ = writeln!(out, "plumbline_spec_acceptance_length {tau}");
        if let Ok(h) = self.ttft.lock() {
            h.write(
                &mut out,
                "plumbline_time_to_first_token_seconds",
                "From the request entering the queue to its first generated token",
            );
        }
        if let Ok(h) = self.itl.lock() {
            h.write(
                &mut out,
                "plumbline_inter_token_latency_seconds",
                "Between consecutive generated tokens of one request",
            );
        }
        if let Ok(h) = self.e2e.lock() {
            h.write(
                &mut out,
                "plumbline_request_duration_seconds",
                "From the request entering the queue to its last token",
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.ttft(0.003);
        m.ttft(0.2);
        m.ttft(100.0);
        let text = m.render(true);
        assert!(text.contains("plumbline_time_to_first_token_seconds_bucket{le=\"0.001\"} 0"));
        assert!(text.contains("plumbline_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("plumbline_time_to_first_token_seconds_bucket{le=\"0.25\"} 2"));
        assert!(text.contains("plumbline_time_to_first_token_seconds_bucket{le=\"60\"} 2"));
        assert!(text.contains("plumbline_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("plumbline_time_to_first_token_seconds_count 3"));
        assert!(text.contains("plumbline_ready 1"));
    }
}
