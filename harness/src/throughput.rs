//! Throughput: medians, same-run calibrations, the roofline fraction, and baselines.
//!
//! No absolute tokens/s is ever compared across runs or machines. Each figure is divided by a
//! calibration measured in the same run, interleaved with the engine's own runs so that both see
//! the same load:
//!
//! - **decode** (memory-bound: each token reads every weight once) by the memory-read bandwidth
//!   ([`measure_memory_bandwidth_with`]): `decode_ratio = decode tok/s ÷ (bandwidth ÷ weight
//!   bytes)`, the fraction of the memory roofline reached;
//! - **prefill** (compute-bound) by an f32 multiply-add rate ([`measure_compute_with`]):
//!   `prefill_ratio = prefill tok/s ÷ (FMA/s ÷ (2 × weight elements))`.
//!
//! The ratios are gated against `ci/baselines.json` with a noise margin; a case without a baseline
//! is "not judged" (never a pass). Performance is never asserted by a timed test.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Result};
use crate::float::fmt_sig;
use crate::gate::GateResult;

/// Median of `runs` (mean of the two middle values for an even count); `None` when empty or when
/// any value is NaN.
pub fn median(runs: &[f64]) -> Option<f64> {
    if runs.is_empty() || runs.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut v = runs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// A memory-bandwidth measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bandwidth {
    /// Median over passes, bytes per second.
    pub bytes_per_s: f64,
    /// Best pass, bytes per second.
    pub best_bytes_per_s: f64,
    pub buffer_bytes: usize,
    pub passes: usize,
    pub threads: usize,
}

impl Bandwidth {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes_per_s / 1e9
    }
}

/// 256 MiB: larger than the last-level cache of any current CPU (up to ~96 MiB of L3 on desktop
/// parts; server parts share more but per-CCD slices stay well below this), so every pass streams
/// from DRAM as decode does.
pub const DEFAULT_BANDWIDTH_BUFFER: usize = 256 << 20;
/// Passes after one warm-up pass: the median of 5 is robust to one disturbed pass.
pub const DEFAULT_BANDWIDTH_PASSES: usize = 5;

/// Stream a [`DEFAULT_BANDWIDTH_BUFFER`] buffer [`DEFAULT_BANDWIDTH_PASSES`] times with every
/// available thread and report the read bandwidth. Takes about a second.
pub fn measure_memory_bandwidth() -> Result<Bandwidth> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    measure_memory_bandwidth_with(DEFAULT_BANDWIDTH_BUFFER, DEFAULT_BANDWIDTH_PASSES, threads)
}

/// Read-only bandwidth: each pass sums a `bytes`-sized buffer of u64 split across `threads`
/// (decode reads weights and never writes them, so a read-only sum is the matching pattern).
pub fn measure_memory_bandwidth_with(
    bytes: usize,
    passes: usize,
    threads: usize,
) -> Result<Bandwidth> {
    if passes == 0 || threads == 0 {
        return Err(HarnessError::Parameter {
            name: "passes/threads",
            why: format!(
                "expected at least 1 of each, found {passes} passes and {threads} threads"
            ),
        });
    }
    let words = bytes / 8;
    if words < threads {
        return Err(HarnessError::Parameter {
            name: "bytes",
            why: format!(
                "expected at least 8 bytes per thread, found {bytes} bytes for {threads} threads"
            ),
        });
    }
    // Non-zero, non-constant contents so no page is shared zero memory and nothing folds away.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        .collect();
    let chunk = words.div_ceil(threads);
    let pass = || -> f64 {
        let start = Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|part| s.spawn(move || sum_words(part)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        start.elapsed().as_secs_f64()
    };
    pass(); // warm-up: page faults, thread start-up
    let rates: Vec<f64> = (0..passes)
        .map(|_| (words * 8) as f64 / pass().max(1e-9))
        .collect();
    Ok(Bandwidth {
        bytes_per_s: median(&rates).unwrap_or(0.0),
        best_bytes_per_s: rates.iter().copied().fold(0.0, f64::max),
        buffer_bytes: words * 8,
        passes,
        threads,
    })
}

/// Sum with four independent accumulators so the loop is limited by loads, not by one add chain.
fn sum_words(part: &[u64]) -> u64 {
    let mut acc = [0u64; 4];
    let mut it = part.chunks_exact(4);
    for c in &mut it {
        for k in 0..4 {
            acc[k] = acc[k].wrapping_add(c[k]);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, &x| a.wrapping_add(x));
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

/// Fraction of the memory roofline a decode reaches: the time reading the weights would take at
/// `bandwidth_bytes_per_s`, over the measured seconds per token. 1.0 is bandwidth-bound perfection;
/// `None` for non-positive inputs.
pub fn roofline_fraction(
    weight_bytes_per_token: f64,
    bandwidth_bytes_per_s: f64,
    secs_per_token: f64,
) -> Option<f64> {
    (weight_bytes_per_token > 0.0 && bandwidth_bytes_per_s > 0.0 && secs_per_token > 0.0)
        .then(|| (weight_bytes_per_token / bandwidth_bytes_per_s) / secs_per_token)
}

/// The figures of one case that are gated against a baseline: dimensionless ratios to the
/// same-run calibrations (module docs), never tokens/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    pub prefill_ratio: f64,
    pub decode_ratio: f64,
}

/// `ci/baselines.json`: case name → figures. Sorted by name so reviews see small diffs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Baselines(pub BTreeMap<String, Baseline>);

/// Where the baselines live, relative to the workspace root.
pub const BASELINES_PATH: &str = "ci/baselines.json";

/// A regression gate fires when a figure is more than this fraction below its baseline. Shared
/// 2-core CI runners see co-tenant load, frequency scaling and noisy neighbours on the memory bus.
/// Measured on one 2-core machine, same binary, three runs in one afternoon: the SIMD cases'
/// ratios moved by up to 9%, the scalar case's prefill calibration (an FMA burst) by 50%, and
/// baselines recorded in another session sat 30% away. At 25% correct engines failed. 40% still
/// fails the regressions the gate exists for: a lost SIMD path costs 3× or more, and an extra
/// pass over the weights in decode costs 2× (−50%). Medians of several runs remove single
/// outliers.
pub const DEFAULT_NOISE_MARGIN: f64 = 0.40;

impl Baselines {
    /// Read the baselines; a missing file is an empty set (every case then reports "no baseline").
    pub fn load(path: &Path) -> Result<Baselines> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|source| HarnessError::Json {
                path: path.to_owned(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Baselines::default()),
            Err(source) => Err(HarnessError::Io {
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// Write pretty JSON with a trailing newline.
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |source| HarnessError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut text = serde_json::to_string_pretty(self).map_err(|source| HarnessError::Json {
            path: path.to_owned(),
            source,
        })?;
        text.push('\n');
        std::fs::write(path, text).map_err(io)
    }

    /// `--update-baselines`: record `measured` as the baseline of `case`; returns the old one.
    pub fn update(&mut self, case: &str, measured: Baseline) -> Option<Baseline> {
        self.0.insert(case.to_owned(), measured)
    }

    pub fn get(&self, case: &str) -> Option<&Baseline> {
        self.0.get(case)
    }

    /// Gates `prefill_ratio` and `decode_ratio`: each fails when the measured ratio is below
    /// `baseline × (1 − margin)`. With no baseline for `case` each gate is "not judged".
    pub fn gates(&self, case: &str, measured: &Baseline, margin: f64) -> Vec<GateResult> {
        let b = self.get(case);
        let figures: [(&'static str, f64, Option<f64>); 2] = [
            (
                "prefill_ratio",
                measured.prefill_ratio,
                b.map(|b| b.prefill_ratio),
            ),
            (
                "decode_ratio",
                measured.decode_ratio,
                b.map(|b| b.decode_ratio),
            ),
        ];
        figures
            .into_iter()
            .map(|(gate, value, base)| match base {
                Some(base) => {
                    let floor = base * (1.0 - margin);
                    let change = if base > 0.0 {
                        value / base - 1.0
                    } else {
                        f64::NAN
                    };
                    GateResult::at_least(
                        gate,
                        value,
                        floor,
                        format!(
                            "baseline {}, {:+.1}% (fails below −{:.0}%)",
                            fmt_sig(base),
                            change * 100.0,
                            margin * 100.0
                        ),
                    )
                }
                None => GateResult::not_judged(
                    gate,
                    value,
                    format!("no baseline for this case in {BASELINES_PATH}; record one with --update-baselines"),
                ),
            })
            .collect()
    }
}

/// An f32 multiply-add rate measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Compute {
    /// Multiply-adds per second, all threads together.
    pub fma_per_s: f64,
    pub threads: usize,
}

/// Multiply-adds each thread does per measurement: ~0.1 s on one 2020s core, so that timer and
/// thread start-up are noise.
pub const DEFAULT_COMPUTE_FMAS: usize = 1 << 28;

/// The f32 multiply-add rate of `threads` threads, each running `fmas_per_thread` multiply-adds
/// on 16 independent accumulators (enough to fill the FMA pipes once the compiler vectorizes it)
/// over a 4 KiB, L1-resident vector: compute-bound, like a prefill's matrix products.
pub fn measure_compute_with(fmas_per_thread: usize, threads: usize) -> Result<Compute> {
    if threads == 0 || fmas_per_thread < 1024 {
        return Err(HarnessError::Parameter {
            name: "fmas_per_thread/threads",
            why: format!(
                "expected at least 1024 multiply-adds and 1 thread, found {fmas_per_thread} and {threads}"
            ),
        });
    }
    let x: Vec<f32> = (0..1024).map(|i| 1.0 + (i as f32) * 1e-6).collect();
    let rounds = fmas_per_thread / x.len();
    let start = Instant::now();
    let total = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| fma_rounds(&x, rounds)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(0.0))
            .sum::<f32>()
    });
    std::hint::black_box(total);
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    Ok(Compute {
        fma_per_s: (rounds * x.len() * threads) as f64 / secs,
        threads,
    })
}

fn fma_rounds(x: &[f32], rounds: usize) -> f32 {
    let mut acc = [0f32; 16];
    let w = std::hint::black_box(0.999_999f32);
    for _ in 0..rounds {
        for c in x.chunks_exact(16) {
            for k in 0..16 {
                // A plain multiply and add: `f32::mul_add` is a libm call unless the build
                // enables FMA, which would time a function call, not the arithmetic units.
                acc[k] = acc[k] * w + c[k];
            }
        }
    }
    acc.iter().sum()
}

/// Tokens/s a figure is divided by: what the calibration says the machine could do at most.
/// `decode`: bandwidth ÷ weight bytes; `prefill`: FMA/s ÷ (2 × weight elements) — one multiply-add
/// per weight per token, counted as two operations as matrix-product FLOPs are.
pub fn ratio(tokens_per_s: f64, calibration_tokens_per_s: f64) -> f64 {
    if calibration_tokens_per_s > 0.0 {
        tokens_per_s / calibration_tokens_per_s
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_bad_input() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn roofline_by_hand() {
        // 1 GB of weights at 50 GB/s is 20 ms; measured 40 ms per token → 50%.
        assert_eq!(roofline_fraction(1e9, 50e9, 0.04), Some(0.5));
        assert_eq!(roofline_fraction(0.0, 50e9, 0.04), None);
        assert_eq!(roofline_fraction(1e9, 50e9, 0.0), None);
    }

    #[test]
    fn sum_words_matches_a_plain_sum() {
        let v: Vec<u64> = (0..1001).collect();
        assert_eq!(sum_words(&v), 1000 * 1001 / 2);
    }

    #[test]
    fn bandwidth_measurement_is_positive() {
        // 4 MiB keeps the test fast on shared CI; the figure is cache bandwidth, only its sanity
        // is checked here.
        let bw = match measure_memory_bandwidth_with(4 << 20, 2, 2) {
            Ok(b) => b,
            Err(e) => panic!("{e}"),
        };
        assert!(bw.bytes_per_s.is_finite() && bw.bytes_per_s > 0.0);
        assert!(bw.best_bytes_per_s >= bw.bytes_per_s);
        assert_eq!((bw.buffer_bytes, bw.passes, bw.threads), (4 << 20, 2, 2));
        assert!(measure_memory_bandwidth_with(8, 1, 2).is_err());
        assert!(measure_memory_bandwidth_with(1 << 10, 0, 1).is_err());
    }

    fn fig(prefill_ratio: f64, decode_ratio: f64) -> Baseline {
        Baseline {
            prefill_ratio,
            decode_ratio,
        }
    }

    #[test]
    fn gates_against_baseline_with_margin() {
        let mut b = Baselines::default();
        b.update("c", fig(0.1, 0.8));
        // prefill −30% passes, decode −50% (an extra pass over the weights) fails.
        let g = b.gates("c", &fig(0.07, 0.4), DEFAULT_NOISE_MARGIN);
        let verdicts: Vec<(&str, bool)> = g.iter().map(|g| (g.gate, g.passed)).collect();
        assert_eq!(verdicts, [("prefill_ratio", true), ("decode_ratio", false)]);
        assert!((g[1].threshold - 0.48).abs() < 1e-12);
        assert_eq!(g[1].detail, "baseline 0.800, -50.0% (fails below −40%)");
    }

    #[test]
    fn missing_baseline_is_not_judged_not_passed() {
        let g = Baselines::default().gates("new/case", &fig(0.1, 0.5), DEFAULT_NOISE_MARGIN);
        assert!(g.iter().all(|g| !g.judged
            && g.label() == "NOT JUDGED"
            && g.detail.starts_with("no baseline")));
    }

    #[test]
    fn old_tokens_per_second_baselines_are_refused() {
        let old = r#"{"c": {"prefill_tps": 127.6, "decode_tps": 34.8, "roofline": 0.83}}"#;
        assert!(serde_json::from_str::<Baselines>(old).is_err());
    }

    #[test]
    fn compute_measurement_is_positive() {
        let c = match measure_compute_with(1 << 16, 2) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert!(c.fma_per_s.is_finite() && c.fma_per_s > 0.0);
        assert!(measure_compute_with(10, 1).is_err());
        assert!(ratio(5.0, 10.0) == 0.5 && ratio(5.0, 0.0).is_nan());
    }

    #[test]
    fn baselines_round_trip_through_a_file() {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        let path = dir.path().join("ci/baselines.json");
        assert_eq!(Baselines::load(&path).ok(), Some(Baselines::default()));
        let mut b = Baselines::default();
        assert_eq!(b.update("z/case", fig(0.1, 0.25)), None);
        b.update("a/case", fig(0.3, 0.5));
        assert!(b.save(&path).is_ok());
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(text.find("a/case") < text.find("z/case"), "{text}");
        assert!(text.ends_with("}\n"));
        assert_eq!(Baselines::load(&path).ok(), Some(b));
        std::fs::write(&path, "{\"a\": 1}").unwrap_or_default();
        assert!(matches!(
            Baselines::load(&path),
            Err(HarnessError::Json { .. })
        ));
    }
}
