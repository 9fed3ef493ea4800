//! `cargo xtask bench`: plumbline beside llama.cpp's `llama-bench` in one run, on the same model
//! file and thread counts, with llama-bench's definitions of its tests:
//!
//! - `pp512`: 512 prompt tokens (BOS, then random ids) in one batch into an empty f16 KV cache,
//!   logits of the last token only; tokens/s = 512 / time;
//! - `tg128`: 128 single-token steps from an empty f16 cache (BOS first, then random ids);
//!   tokens/s = 128 / time.
//!
//! Each side is warmed up first (plumbline: one untimed run of each test; llama-bench: its own
//! warm-up inside every invocation), then the repetitions alternate peer / plumbline so that a
//! disturbance of the shared machine hits both. Reported: mean ± sample sd of each, the ratio of
//! the means, the machine's read bandwidth at each thread count (measured in the same run), the
//! bytes of weights a decoded token reads, and decode's roofline fraction. Writes
//! `target/bench/report.{json,md}`.

mod peer;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::exec::{self, AnyEngine, Device, Session, Topology};
use engine::model::Model;
use engine::runtime::KvDtype;
use harness::throughput::{self, Bandwidth};
use kernels::cpu::Isa;
use serde::Serialize;

use crate::fetch_model;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// The GGUF model (default: the cached gemma3-270m Q4_K_M)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Thread counts, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Timed repetitions of each test on each side (after the warm-up)
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Prompt tokens of the prefill test
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    /// Generated tokens of the decode test
    #[arg(long, default_value_t = 128)]
    pub tg: usize,
    /// plumbline's instruction set (default: the widest this CPU has)
    #[arg(long)]
    pub isa: Option<String>,
    /// plumbline's device: cpu (default), cuda, cuda:N or cuda-emu. On a CUDA device the
    /// thread counts do not apply (one pass) and llama.cpp (a CPU build) is not run
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Run plumbline alone (no llama.cpp build or run)
    #[arg(long)]
    pub no_peer: bool,
    /// On a CUDA device (real or emulated): the contexts at which the device counters are
    /// measured (a prefill of that many tokens into an empty cache, then decode steps)
    #[arg(long, value_delimiter = ',', default_value = "64,512,4096")]
    pub counters_ctx: Vec<usize>,
    /// On a CUDA device: decode steps counted after each prefill (the first warms the
    /// backend's buffer pool; the later ones are the steady state)
    #[arg(long, default_value_t = 4)]
    pub counters_decode: usize,
    /// On a CUDA device: only the counters, no timed tests (the emulator takes seconds per
    /// real-model decode step)
    #[arg(long)]
    pub counters_only: bool,
    /// Where the reports go
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
}

/// Mean and sample standard deviation of a set of tokens/s figures.
#[derive(Debug, Clone, Serialize)]
pub struct Stat {
    pub mean: f64,
    pub sd: f64,
    pub samples: Vec<f64>,
}

impl Stat {
    fn new(samples: Vec<f64>) -> Stat {
        let n = samples.len() as f64;
        let mean = samples.iter().sum::<f64>() / n.max(1.0);
        let var = if samples.len() > 1 {
            samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        Stat {
            mean,
            sd: var.sqrt(),
            samples,
        }
    }

    fn show(&self) -> String {
        format!("{:.2} ± {:.2}", self.mean, self.sd)
    }
}

/// One test at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub test: String,
    pub threads: usize,
    pub plumbline: Stat,
    pub llama_cpp: Option<Stat>,
    /// plumbline / llama.cpp, of the means.
    pub ratio: Option<f64>,
    /// Decode only: weight bytes per token ÷ bandwidth ÷ seconds per token.
    pub roofline: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub isa: String,
    pub peer: Option<String>,
    pub reps: usize,
    /// Weight bytes one decoded token reads (every matrix of the forward and the output head;
    /// the embedding is a one-row gather).
    pub bytes_per_token: u64,
    pub bandwidth: Vec<Bandwidth>,
    pub rows: Vec<Row>,
    /// On a CUDA device: the device counters per prefill and per decoded token at each
    /// context, beside the model's own weight bytes per decoded token.
    pub counters: Vec<CounterRow>,
    /// The model's own weight bytes per decoded token (what `counters` compares with).
    pub model_decode_bytes: u64,
}

/// The device counters of one phase at one context, per token.
#[derive(Debug, Clone, Serialize)]
pub struct CounterRow {
    pub ctx: usize,
    /// `prefill` (per prompt token), `decode first` (the first step after the prefill) or
    /// `decode steady` (the mean of the later steps).
    pub phase: String,
    /// Tokens the figures are averaged over.
    pub tokens: usize,
    /// `(counter, value per token)`, in [`engine::runtime::DeviceCounters::fields`] order.
    pub per_token: Vec<(String, f64)>,
    /// Weight bytes read per token ÷ the model's weight bytes per decoded token.
    pub weights_ratio: f64,
}

/// xorshift64*: the random token ids of the tests (llama-bench uses `rand() % n_vocab`; only
/// their being arbitrary matters).
struct Ids(u64);

impl Ids {
    fn next(&mut self, n_vocab: usize) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as u32 % n_vocab.max(1) as u32
    }

    fn tokens(&mut self, bos: Option<u32>, n: usize, n_vocab: usize) -> Vec<u32> {
        let mut v: Vec<u32> = bos.into_iter().collect();
        while v.len() < n {
            v.push(self.next(n_vocab));
        }
        v.truncate(n);
        v
    }
}

fn pp_once(engine: &AnyEngine<'_>, tokens: &[u32]) -> Result<f64> {
    let mut s = Session::with_cache(engine, tokens.len() + 1, KvDtype::F16)?;
    let t = Instant::now();
    s.forward(tokens, None).context("plumbline prefill")?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

fn tg_once(engine: &AnyEngine<'_>, tokens: &[u32]) -> Result<f64> {
    let mut s = Session::with_cache(engine, tokens.len() + 1, KvDtype::F16)?;
    let t = Instant::now();
    for &id in tokens {
        s.forward(&[id], None).context("plumbline decode step")?;
    }
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

fn default_model() -> Result<PathBuf> {
    fetch_model::cached_path("gemma3-270m")?
        .context("model not fetched: run cargo xtask fetch-model gemma3-270m, or pass --model")
}

pub fn run(args: Args) -> Result<()> {
    if args.reps == 0 || args.threads.is_empty() || args.threads.contains(&0) {
        bail!("expected --reps ≥ 1 and thread counts ≥ 1");
    }
    let path = match &args.model {
        Some(p) => p.clone(),
        None => default_model()?,
    };
    let isa = match &args.isa {
        Some(name) => Isa::from_name(name)
            .with_context(|| format!("unknown ISA {name:?}; expected scalar, avx2 or avx512"))?,
        None => Isa::detect(),
    };
    let on_cpu = matches!(args.device, Device::Cpu { .. });
    let thread_counts: Vec<usize> = if on_cpu {
        args.threads.clone()
    } else {
        vec![1]
    };
    let peer = if args.no_peer || !on_cpu {
        None
    } else {
        Some(peer::llama_bench()?)
    };
    let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let tok =
        engine::tokenizer::Tokenizer::from_gguf(model.gguf()).context("loading the tokenizer")?;
    let bos = tok.add_bos().then(|| tok.bos()).flatten();
    let n_vocab = model.config().n_vocab;
    let bytes_per_token: u64 = model
        .weights()
        .iter()
        .skip(1) // the token embedding: one row gathered per token
        .map(|w| (w.n_mats * w.n_rows * w.row_bytes) as u64)
        .sum();

    let mut ids = Ids(0x005E_ED0F_B3AC);
    let decode_bytes = crate::device_counters::decode_weight_bytes(&model);
    let mut counters = Vec::new();
    if !on_cpu {
        let engine = exec::open(&model, &args.device, &Topology::single())
            .with_context(|| format!("opening the model on {}", args.device))?;
        for &ctx in &args.counters_ctx {
            eprintln!(
                "bench: device counters at context {ctx} (+{} decode steps)",
                args.counters_decode
            );
            let tokens = ids.tokens(bos, ctx + args.counters_decode, n_vocab);
            if let Some(m) = crate::device_counters::measure(&engine, &tokens, ctx)? {
                counters.extend(counter_rows(&m, decode_bytes));
            }
        }
    }
    let thread_counts = if args.counters_only && !on_cpu {
        Vec::new()
    } else {
        thread_counts
    };
    let mut rows = Vec::new();
    let mut bandwidth = Vec::new();
    for &threads in &thread_counts {
        eprintln!("bench: read bandwidth at {threads} thread(s)");
        let bw = throughput::measure_memory_bandwidth_with(
            throughput::DEFAULT_BANDWIDTH_BUFFER,
            throughput::DEFAULT_BANDWIDTH_PASSES,
            threads,
        )
        .context("measuring read bandwidth")?;
        let device = if on_cpu {
            Device::cpu_with(Some(isa), Some(threads))
        } else {
            args.device.clone()
        };
        let engine = exec::open(&model, &device, &Topology::single())
            .with_context(|| format!("opening the model on {device}"))?;
        let pp_tokens = ids.tokens(bos, args.pp, n_vocab);
        let tg_tokens = ids.tokens(bos, args.tg, n_vocab);
        eprintln!("bench: warm-up at {threads} thread(s)");
        pp_once(&engine, &pp_tokens)?;
        tg_once(&engine, &tg_tokens)?;
        let tests = [
            (format!("pp{}", args.pp), peer::Test::Prompt(args.pp)),
            (format!("tg{}", args.tg), peer::Test::Gen(args.tg)),
        ];
        for (name, test) in tests {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for rep in 0..args.reps {
                eprintln!("bench: {name} t{threads} rep {}/{}", rep + 1, args.reps);
                if let Some(bin) = &peer {
                    theirs.push(peer::run_once(bin, &path, test, threads)?);
                }
                ours.push(match test {
                    peer::Test::Prompt(_) => pp_once(&engine, &pp_tokens)?,
                    peer::Test::Gen(_) => tg_once(&engine, &tg_tokens)?,
                });
            }
            let plumbline = Stat::new(ours);
            let llama_cpp = peer.as_ref().map(|_| Stat::new(theirs));
            let ratio = llama_cpp.as_ref().map(|l| plumbline.mean / l.mean);
            // The CPU's read bandwidth bounds a CPU's decode only.
            let roofline = (on_cpu && matches!(test, peer::Test::Gen(_)))
                .then(|| {
                    throughput::roofline_fraction(
                        bytes_per_token as f64,
                        bw.bytes_per_s,
                        1.0 / plumbline.mean,
                    )
                })
                .flatten();
            rows.push(Row {
                test: name,
                threads,
                plumbline,
                llama_cpp,
                ratio,
                roofline,
            });
        }
        bandwidth.push(bw);
    }
    let report = Report {
        model: path.display().to_string(),
        isa: if on_cpu {
            format!("cpu-{}", isa.name())
        } else {
            args.device.to_string()
        },
        peer: peer.map(|p| {
            format!(
                "llama.cpp (llama-cpp-python {} sdist, built {}) {}",
                peer::VERSION,
                peer::BUILT_FOR,
                p.display()
            )
        }),
        reps: args.reps,
        bytes_per_token,
        bandwidth,
        rows,
        counters,
        model_decode_bytes: decode_bytes,
    };
    let md = markdown(&report);
    print!("{md}");
    write_reports(&args.out, &report, &md)
}

fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# cargo xtask bench\n");
    s.push_str(&counters_markdown(&r.counters, r.model_decode_bytes));
    let _ = writeln!(
        s,
        "model `{}`, plumbline on {}, {} alternating reps after warm-up; tok/s mean ± sd\n",
        r.model, r.isa, r.reps
    );
    let _ = writeln!(
        s,
        "| test | threads | plumbline tok/s | llama.cpp tok/s | ratio | roofline |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for row in &r.rows {
        let peer = row.llama_cpp.as_ref().map_or("-".to_owned(), Stat::show);
        let ratio = row.ratio.map_or("-".to_owned(), |x| format!("{x:.2}×"));
        let roof = row
            .roofline
            .map_or("-".to_owned(), |x| format!("{:.0}%", 100.0 * x));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            row.test,
            row.threads,
            row.plumbline.show(),
            peer,
            ratio,
            roof
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "weights read per decoded token: {:.1} MB",
        r.bytes_per_token as f64 / 1e6
    );
    for bw in &r.bandwidth {
        let _ = writeln!(
            s,
            "read bandwidth, {} thread(s): {:.1} GB/s (median of {} passes over {} MiB, best {:.1})",
            bw.threads,
            bw.gb_per_s(),
            bw.passes,
            bw.buffer_bytes >> 20,
            bw.best_bytes_per_s / 1e9
        );
    }
    if let Some(p) = &r.peer {
        let _ = writeln!(s, "peer: {p}");
    }
    s
}

/// The per-token rows of one measurement: the prefill, the first decode step, and the mean
/// of the later decode steps.
fn counter_rows(m: &crate::device_counters::Measured, model_bytes: u64) -> Vec<CounterRow> {
    use crate::device_counters::{mean, per_token};
    let row = |phase: &str, tokens: usize, v: [(&'static str, f64); 7]| {
        let read = v
            .iter()
            .find(|(n, _)| *n == "weight_bytes_read")
            .map_or(0.0, |x| x.1);
        CounterRow {
            ctx: m.ctx,
            phase: phase.to_owned(),
            tokens,
            per_token: v.iter().map(|(n, x)| ((*n).to_owned(), *x)).collect(),
            weights_ratio: read / model_bytes.max(1) as f64,
        }
    };
    let mut out = vec![row(
        "prefill",
        m.ctx,
        m.prefill.fields().map(|(n, v)| (n, per_token(v, m.ctx))),
    )];
    if let Some(first) = m.decode.first() {
        out.push(row("decode first", 1, mean(std::slice::from_ref(first))));
    }
    if m.decode.len() > 1 {
        out.push(row(
            "decode steady",
            m.decode.len() - 1,
            mean(&m.decode[1..]),
        ));
    }
    out
}

fn counters_markdown(rows: &[CounterRow], model_bytes: u64) -> String {
    let mut s = String::new();
    if rows.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "## device counters per token\n\nthe model's weight bytes per decoded token: {model_bytes} \
         ({:.2} MB)\n",
        model_bytes as f64 / 1e6
    );
    let _ = writeln!(
        s,
        "| ctx | phase | tokens | launches | allocs | alloc B | H→D B | D→H B | KV moved B | \
         weights read B | read ÷ model |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let cells: Vec<String> = r.per_token.iter().map(|(_, v)| fmt_count(*v)).collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.3} |",
            r.ctx,
            r.phase,
            r.tokens,
            cells.join(" | "),
            r.weights_ratio
        );
    }
    let _ = writeln!(s);
    s
}

/// A per-token count: whole numbers as such, fractions with one decimal (three below 1, so a
/// prefill's few allocations do not read as none).
fn fmt_count(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v < 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

fn write_reports(dir: &Path, r: &Report, md: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_string_pretty(r).context("serializing the bench report")?;
    let jp = dir.join("report.json");
    std::fs::write(&jp, json).with_context(|| format!("writing {}", jp.display()))?;
    let mp = dir.join("report.md");
    std::fs::write(&mp, md).with_context(|| format!("writing {}", mp.display()))?;
    eprintln!("bench: wrote {} and {}", jp.display(), mp.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Ids, Stat};

    #[test]
    fn stat_is_mean_and_sample_sd() {
        // {1, 2, 3}: mean 2, sample variance ((1 + 0 + 1) / 2) = 1.
        let s = Stat::new(vec![1.0, 2.0, 3.0]);
        assert_eq!((s.mean, s.sd), (2.0, 1.0));
        assert_eq!(Stat::new(vec![4.0]).sd, 0.0);
    }

    #[test]
    fn tokens_start_with_bos_and_stay_in_the_vocabulary() {
        let mut ids = Ids(7);
        let t = ids.tokens(Some(2), 64, 10);
        assert_eq!(t.len(), 64);
        assert_eq!(t[0], 2);
        assert!(t.iter().all(|&x| x < 10));
        // Not constant: a generator stuck at one id would make a degenerate prompt.
        assert!(t[1..].iter().any(|&x| x != t[1]));
        assert_eq!(ids.tokens(None, 3, 10).len(), 3);
    }
}
