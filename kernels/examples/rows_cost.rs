//! `cargo run --release -p kernels --example rows_cost`: the one-token (decode) product on one
//! thread, per weight type, for a matrix that stays in L2 (1024 rows), one in L3 (16384 rows) and
//! one streamed from memory (131072 rows, 45–90 MB): GB/s of weights and ns per row, best of 40
//! timings. A kernel whose in-cache figure is not far above the memory figure is compute-bound
//! in decode; this is how the decode kernels' instruction choices were measured.

mod common;

use std::time::Instant;

use kernels::cpu::CpuKernels;
use kernels::quant::{quantize, GgmlType};

fn main() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool");
    let k = CpuKernels::detect();
    println!("isa {:?}, 1 thread", k.isa());
    let mut rand = common::signal();
    // The row widths of Gemma 3 270M: 640 for the head and the Q5_0 projections, 2048 for ffn_down.
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4K, GgmlType::Q6K] {
        let k_dim = if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
            2048
        } else {
            640
        };
        let tile: Vec<f32> = (0..1024 * k_dim).map(|_| rand()).collect();
        let tile = quantize(ty, &tile).expect("quantize");
        print!("{ty:?}:");
        for n_rows in [1024usize, 16384, 131072] {
            let w = tile.repeat(n_rows / 1024);
            let x: Vec<f32> = (0..k_dim).map(|_| rand()).collect();
            let mut out = vec![0f32; n_rows];
            let reps = (20_000_000 / w.len()).max(1);
            let mut best = f64::MAX;
            pool.install(|| {
                for _ in 0..3 {
                    k.matmul(ty, &w, n_rows, k_dim, &x, 1, &mut out)
                        .expect("matmul");
                }
                for _ in 0..40 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        k.matmul(ty, &w, n_rows, k_dim, &x, 1, &mut out)
                            .expect("matmul");
                    }
                    best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                }
            });
            print!(
                "  {n_rows} rows: {:.1} GB/s {:.2} ns/row",
                w.len() as f64 / best / 1e9,
                best * 1e9 / n_rows as f64
            );
        }
        println!();
    }
}
