//! `cargo run --release -p kernels --example small_batch [-- THREADS]`: how the cost of a
//! quantized matrix product grows with the number of activation rows (1 … 16, the sizes of a
//! speculative verify or a small decode batch), per weight type, on the shapes of Gemma 3 270M.
//! Prints, per type and row count, the time relative to one row and the weight bytes read per
//! second. A product that is bound by reading the weights costs about the same for every row
//! count; one bound by compute grows with it.

mod common;

use std::time::Instant;

use kernels::cpu::CpuKernels;
use kernels::quant::{quantize, GgmlType};

fn main() {
    let threads = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let k = CpuKernels::detect();
    println!("isa {:?}, {threads} threads", k.isa());
    // (type, rows, k): ffn gate/up (Q5_0, 640 → 2048), ffn down (Q4_K/Q6_K, 2048 → 640), the
    // output head cut to 32k rows (Q8_0, 640).
    let cases = [
        (GgmlType::Q5_0, 2048, 640),
        (GgmlType::Q4K, 640, 2048),
        (GgmlType::Q6K, 640, 2048),
        (GgmlType::Q8_0, 32768, 640),
    ];
    let mut rand = common::signal();
    for (ty, n_rows, k_dim) in cases {
        let wf: Vec<f32> = (0..n_rows * k_dim).map(|_| rand()).collect();
        let w = quantize(ty, &wf).expect("quantize");
        let mut base = 0.0;
        print!("{ty:?} {n_rows}x{k_dim}:");
        for n in [1usize, 2, 4, 8, 12, 16] {
            let x: Vec<f32> = (0..n * k_dim).map(|_| rand()).collect();
            let mut out = vec![0f32; n * n_rows];
            let reps = (200_000_000 / w.len()).max(20);
            let secs = pool.install(|| {
                for _ in 0..3 {
                    k.matmul(ty, &w, n_rows, k_dim, &x, n, &mut out)
                        .expect("matmul");
                }
                let t = Instant::now();
                for _ in 0..reps {
                    k.matmul(ty, &w, n_rows, k_dim, &x, n, &mut out)
                        .expect("matmul");
                }
                t.elapsed().as_secs_f64() / reps as f64
            });
            if n == 1 {
                base = secs;
            }
            print!(
                "  n={n} {:.2}× ({:.1} GB/s)",
                secs / base,
                w.len() as f64 / secs / 1e9
            );
        }
        println!();
    }
}
