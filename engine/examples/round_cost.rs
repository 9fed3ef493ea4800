//! `cargo run --release -p engine --example round_cost -- MODEL.gguf [THREADS]`: the cost of one
//! decode step through each layer of the speculative path, so that a plain round of speculation
//! (budget 0, or a policy that fell back) can be held to the cost of plain decoding. Five ways of
//! decoding one token, interleaved step by step on five caches in one process (a busy machine
//! disturbs them alike): `Engine::forward`; `forward_hidden` then `head`; the same with a tree
//! batch; `spec::verify` and its logits, committed; and with `keep_path` as a round does.
//! Prints each one's mean and median milliseconds per token.
//!
//! It found a plain round 1.4 ms (12%) dearer than a decode step on Gemma 3 270M at 2 threads:
//! the verify copied the 1 MiB logits row twice (into its map, then out to the walk). Rows are
//! now shared, and the five agree within 2%.

use engine::exec::Engine;
use engine::model::Model;
use engine::runtime::{Batch, CpuBackend, KvDtype};
use engine::spec::{self, HeadRows, Tree, SEQ};
use std::time::Instant;
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: round_cost MODEL.gguf [THREADS]")?;
    let threads: usize = std::env::args().nth(2).map_or(Ok(2), |s| s.parse())?;
    let model = Model::load(&path)?;
    let be = CpuBackend::new(None, Some(threads))?;
    let e = Engine::new(&model, &be)?;
    let prompt: Vec<u32> = (0..40u32).map(|i| 100 + i * 37).collect();
    const M: usize = 5;
    let mut tot = [0f64; M];
    let mut all = vec![Vec::new(); M];
    for _round in 0..4 {
        let mut caches = Vec::new();
        for _ in 0..M {
            let mut cache = e.new_cache(400, KvDtype::F32)?;
            e.forward(&mut cache, &Batch::chain(SEQ, 0, &prompt, false), None)?;
            cache.commit();
            caches.push(cache);
        }
        let mut tok = 7u32;
        for _step in 0..150 {
            for mode in 0..M {
                let cache = &mut caches[mode];
                let t = Instant::now();
                match mode {
                    0 => {
                        let pos = cache.next_pos(SEQ);
                        let l = e.forward(cache, &Batch::chain(SEQ, pos, &[tok], false), None)?;
                        cache.commit();
                        tok = 3 + (l.last()[5] > 0.0) as u32;
                    }
                    1 => {
                        let pos = cache.next_pos(SEQ);
                        let h = e.forward_hidden(cache, &Batch::chain(SEQ, pos, &[tok], false))?;
                        let l = e.head(&h, &[0])?;
                        cache.commit();
                        tok = 3 + (l.row(0)[5] > 0.0) as u32;
                    }
                    2 => {
                        let tree = Tree::root(tok);
                        let pos = cache.next_pos(SEQ);
                        let h =
                            e.forward_hidden(cache, &spec::verify::tree_batch(&tree, SEQ, pos))?;
                        let l = e.head(&h, &[0])?;
                        cache.commit();
                        tok = 3 + (l.row(0)[5] > 0.0) as u32;
                    }
                    3 => {
                        let tree = Tree::root(tok);
                        let mut v = spec::verify::verify(&e, cache, &tree, SEQ, HeadRows::Visited)?;
                        let l = v.logits(&e, 0)?;
                        drop(v);
                        cache.commit();
                        tok = 3 + (l[5] > 0.0) as u32;
                    }
                    _ => {
                        let tree = Tree::root(tok);
                        let mut v = spec::verify::verify(&e, cache, &tree, SEQ, HeadRows::Visited)?;
                        let l = v.logits(&e, 0)?;
                        drop(v);
                        spec::kv::keep_path(&e, cache, &[0])?;
                        tok = 3 + (l[5] > 0.0) as u32;
                    }
                }
                let dt = t.elapsed().as_secs_f64();
                tot[mode] += dt;
                all[mode].push(dt);
            }
        }
    }
    let names = [
        "forward (chain)",
        "hidden+head (chain)",
        "hidden+head (tree batch)",
        "verify+logits+commit",
        "verify+logits+keep_path",
    ];
    for m in 0..M {
        let mut v = all[m].clone();
        v.sort_by(f64::total_cmp);
        println!(
            "{:>26}: mean {:.3} ms, median {:.3} ms",
            names[m],
            tot[m] * 1e3 / v.len() as f64,
            v[v.len() / 2] * 1e3
        );
    }
    Ok(())
}
