//! `cargo run --release -p engine --example weight_pages -- MODEL.gguf [THREADS] [ROUNDS]`:
//! decode speed with the weights in the file's memory map against a resident copy in huge pages
//! ([`WeightPages`]), the two engines alternating in one process (tg128 as `cargo xtask bench`
//! runs it: 128 single-token steps of fixed ids), so that a busy machine disturbs both alike.
//! Prints each round's tok/s and, per side, the median and the best.

use std::time::Instant;

use engine::exec::{Engine, Session};
use engine::gguf::WeightPages;
use engine::model::Model;
use engine::runtime::{CpuBackend, KvDtype};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: weight_pages MODEL.gguf [THREADS] [ROUNDS]")?;
    let threads: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(8), |s| s.parse())?;
    let backend = CpuBackend::new(None, Some(threads))?;
    let mapped = Model::load_with(&path, WeightPages::Map)?;
    let resident = Model::load_with(&path, WeightPages::Resident)?;
    assert!(!mapped.gguf().is_resident() && resident.gguf().is_resident());
    let engines = [
        ("map", Engine::new(&mapped, &backend)?),
        ("resident", Engine::new(&resident, &backend)?),
    ];
    let n_vocab = mapped.config().n_vocab as u32;
    let tokens: Vec<u32> = (0..128u32)
        .map(|i| 2 + i.wrapping_mul(7919) % (n_vocab - 2))
        .collect();
    let tg = |engine: &Engine<'_, CpuBackend>| -> Result<f64, Box<dyn std::error::Error>> {
        let mut s = Session::with_cache(engine, tokens.len() + 1, KvDtype::F16)?;
        let t = Instant::now();
        for &id in &tokens {
            s.forward(&[id], None)?;
        }
        Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
    };
    for (_, e) in &engines {
        tg(e)?;
    }
    let mut runs = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        // Alternate which side goes first.
        for k in 0..2 {
            let i = (k + round) % 2;
            runs[i].push(tg(&engines[i].1)?);
        }
        println!(
            "round {round}: map {:.1} tok/s, resident {:.1} tok/s",
            runs[0][round], runs[1][round]
        );
    }
    for (i, (name, _)) in engines.iter().enumerate() {
        let mut r = runs[i].clone();
        r.sort_by(f64::total_cmp);
        println!(
            "{name}: median {:.1} tok/s, best {:.1} tok/s ({threads} thread(s))",
            r[r.len() / 2],
            r[r.len() - 1]
        );
    }
    Ok(())
}
