//! Communicators: how tensor-parallel ranks exchange activations.
//!
//! One trait, [`Communicator`] (all-reduce sum, all-gather, barrier), and its implementations:
//!
//! - [`ShmGroup`] / [`ShmComm`] (`shm`): ranks are threads of one process on one host; buffers
//!   meet in shared memory. The sum is taken in rank order by every rank, so all ranks hold
//!   bitwise the same result (the replicated computations after a reduction stay identical).
//! - One CUDA device (`cuda-1dev`, so one GPU can run any degree: ranks as streams, the
//!   reduction a kernel over the ranks' device buffers) and NCCL through `cudarc::nccl` (several
//!   GPUs, `pcie` / `nvlink` topologies) belong in `tp/comm/cuda.rs` and `tp/comm/nccl.rs` on
//!   top of the CUDA backend, behind the `cuda` feature. They are not built yet:
//!   [`CommKind::for_topology`] says so instead of pretending.
//!
//! Every communicator counts its calls, the bytes each rank contributes, and the wall time spent
//! inside them ([`CommStats`]), which the cost model compares with its prediction.

use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::faults::{self, Fault};

/// A failed collective.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CommError {
    #[error("communicator: another rank failed, the collective was abandoned")]
    Aborted,
    #[error("all-reduce: rank {rank} has {found} values, rank 0 has {expected}")]
    Length {
        rank: usize,
        expected: usize,
        found: usize,
    },
    #[error("communicator {kind}: not built ({why})")]
    NotBuilt {
        kind: &'static str,
        why: &'static str,
    },
}

/// Counters of one rank's collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    pub all_reduce_calls: u64,
    /// Bytes this rank contributed to all-reduces (f32 values × 4).
    pub all_reduce_bytes: u64,
    pub all_reduce_time: Duration,
    pub all_gather_calls: u64,
    /// Bytes this rank contributed to all-gathers.
    pub all_gather_bytes: u64,
    pub all_gather_time: Duration,
}

/// The collectives a tensor-parallel forward pass needs.
pub trait Communicator: Send + Sync {
    /// `shm`, `cuda-1dev`, `nccl`.
    fn kind(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `buf = Σ_ranks buf`, elementwise. Every rank must pass the same length.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;
    /// `out = local_0 ‖ local_1 ‖ …` in rank order (lengths may differ); returns each rank's
    /// length.
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<Vec<usize>, CommError>;
    fn barrier(&self) -> Result<(), CommError>;
    /// This rank's counters so far.
    fn stats(&self) -> CommStats;
    /// Tell the other ranks that this one failed, so none waits forever.
    fn abort(&self);
}

/// Which communicator a topology uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommKind {
    Shm,
    CudaOneDevice,
    Nccl,
}

impl CommKind {
    /// The communicator of a verify topology (`shm`, `pcie`, `nvlink`) on a CPU (`cuda =
    /// false`) or CUDA backend.
    pub fn for_topology(topology: &str, cuda: bool) -> Result<CommKind, CommError> {
        match (topology, cuda) {
            ("shm", false) => Ok(CommKind::Shm),
            ("shm", true) => Err(CommError::NotBuilt {
                kind: "cuda-1dev",
                why: "ranks on one CUDA device need the CUDA backend's device buffers",
            }),
            (_, _) => Err(CommError::NotBuilt {
                kind: "nccl",
                why: "multi-GPU topologies need NCCL through cudarc on the CUDA backend",
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CommKind::Shm => "shm",
            CommKind::CudaOneDevice => "cuda-1dev",
            CommKind::Nccl => "nccl",
        }
    }
}

/// A barrier that a failing rank can break, so the others return [`CommError::Aborted`]
/// instead of waiting forever (std's `Barrier` cannot be broken).
struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
    n: usize,
}

struct GateState {
    waiting: usize,
    generation: u64,
    aborted: bool,
}

impl Gate {
    fn new(n: usize) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                waiting: 0,
                generation: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
            n,
        }
    }

    fn wait(&self) -> Result<(), CommError> {
        let mut s = self.state.lock().map_err(|_| CommError::Aborted)?;
        if s.aborted {
            return Err(CommError::Aborted);
        }
        let gen = s.generation;
        s.waiting += 1;
        if s.waiting == self.n {
            s.waiting = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.generation == gen && !s.aborted {
            s = self.cv.wait(s).map_err(|_| CommError::Aborted)?;
        }
        if s.generation == gen {
            return Err(CommError::Aborted);
        }
        Ok(())
    }

    fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted = true;
        }
        self.cv.notify_all();
    }
}

/// The shared memory of `n` ranks on one host.
pub struct ShmGroup {
    slots: Vec<RwLock<Vec<f32>>>,
    gate: Gate,
}

impl ShmGroup {
    /// A group of `n` ranks and one communicator per rank (hand `comms[r]` to rank `r`'s
    /// thread).
    pub fn create(n: usize) -> Vec<ShmComm> {
        let n = n.max(1);
        let group = Arc::new(ShmGroup {
            slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
            gate: Gate::new(n),
        });
        (0..n)
            .map(|rank| ShmComm {
                rank,
                group: Arc::clone(&group),
                stats: Mutex::new(CommStats::default()),
            })
            .collect()
    }
}

/// One rank's handle on a [`ShmGroup`].
pub struct ShmComm {
    rank: usize,
    group: Arc<ShmGroup>,
    stats: Mutex<CommStats>,
}

impl ShmComm {
    fn publish(&self, data: &[f32]) -> Result<(), CommError> {
        let mut slot = self.group.slots[self.rank]
            .write()
            .map_err(|_| CommError::Aborted)?;
        slot.clear();
        slot.extend_from_slice(data);
        Ok(())
    }

    fn record(&self, f: impl FnOnce(&mut CommStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    fn reduce_into(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.group.slots.len();
        // The fault: each rank starts from its own partial and goes round (a ring's order), so
        // from three ranks on the sums differ in their last bits from rank to rank.
        let first = if faults::is_active(Fault::TpReduceOwnOrder) {
            self.rank
        } else {
            0
        };
        for k in 0..n {
            let r = (first + k) % n;
            let slot = &self.group.slots[r];
            let s = slot.read().map_err(|_| CommError::Aborted)?;
            if s.len() != buf.len() {
                return Err(CommError::Length {
                    rank: r,
                    expected: buf.len(),
                    found: s.len(),
                });
            }
            if k == 0 {
                buf.copy_from_slice(&s);
            } else {
                buf.iter_mut().zip(s.iter()).for_each(|(b, v)| *b += v);
            }
        }
        Ok(())
    }
}

impl Communicator for ShmComm {
    fn kind(&self) -> &'static str {
        "shm"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.slots.len()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let t = Instant::now();
        if self.size() > 1 {
            self.publish(buf)?;
            self.group.gate.wait()?;
            // Every rank sums in rank order, so every rank gets the same bits.
            let r = self.reduce_into(buf);
            // Nobody may overwrite a slot before every rank has read it.
            self.group.gate.wait()?;
            r?;
        }
        let bytes = (buf.len() * 4) as u64;
        self.record(|s| {
            s.all_reduce_calls += 1;
            s.all_reduce_bytes += bytes;
            s.all_reduce_time += t.elapsed();
        });
        Ok(())
    }

    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<Vec<usize>, CommError> {
        let t = Instant::now();
        out.clear();
        let mut lens = Vec::with_capacity(self.size());
        self.publish(local)?;
        self.group.gate.wait()?;
        let mut r = Ok(());
        for slot in &self.group.slots {
            match slot.read() {
                Ok(s) => {
                    lens.push(s.len());
                    out.extend_from_slice(&s);
                }
                Err(_) => r = Err(CommError::Aborted),
            }
        }
        self.group.gate.wait()?;
        r?;
        let bytes = (local.len() * 4) as u64;
        self.record(|s| {
            s.all_gather_calls += 1;
            s.all_gather_bytes += bytes;
            s.all_gather_time += t.elapsed();
        });
        Ok(lens)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.group.gate.wait()
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn abort(&self) {
        self.group.gate.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `f(rank, comm)` on `n` threads and collect the results in rank order.
    fn on_ranks<T: Send>(n: usize, f: impl Fn(usize, &ShmComm) -> T + Sync) -> Vec<T> {
        let comms = ShmGroup::create(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let f = &f;
                    s.spawn(move || f(r, c))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| panic!("rank panicked")))
                .collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_every_rank_agrees() {
        for n in [1, 2, 3, 4, 8] {
            let out = on_ranks(n, |r, c| {
                let mut v: Vec<f32> = (0..5).map(|i| (r * 10 + i) as f32 + 0.1).collect();
                c.all_reduce_sum(&mut v).map(|()| v)
            });
            let want: Vec<f32> = (0..5)
                .map(|i| (0..n).fold(0f32, |a, r| a + ((r * 10 + i) as f32 + 0.1)))
                .collect();
            for got in out {
                assert_eq!(got.as_deref().ok(), Some(want.as_slice()), "n = {n}");
            }
        }
    }

    #[test]
    fn repeated_collectives_do_not_mix_rounds() {
        let out = on_ranks(4, |r, c| {
            let mut last = Vec::new();
            for round in 0..50 {
                let mut v = vec![(r + round) as f32; 3];
                c.all_reduce_sum(&mut v)?;
                let mut g = Vec::new();
                c.all_gather(&[r as f32, round as f32], &mut g)?;
                last = vec![v[0], g[6], g[7]];
                if v[0] != (6 + 4 * round) as f32 || g[6] != 3.0 || g[7] != round as f32 {
                    return Err(CommError::Aborted);
                }
            }
            c.barrier()?;
            Ok(last)
        });
        assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
    }

    #[test]
    fn all_gather_concatenates_uneven_parts() {
        let out = on_ranks(3, |r, c| {
            let mut g = Vec::new();
            let local: Vec<f32> = (0..=r).map(|i| (r * 100 + i) as f32).collect();
            c.all_gather(&local, &mut g).map(|lens| (lens, g))
        });
        for o in out {
            let (lens, g) = o.unwrap_or_default();
            assert_eq!(lens, vec![1, 2, 3]);
            assert_eq!(g, vec![0.0, 100.0, 101.0, 200.0, 201.0, 202.0]);
        }
    }

    #[test]
    fn mismatched_lengths_and_aborts_are_errors_not_hangs() {
        let out = on_ranks(2, |r, c| {
            let mut v = vec![1.0; 2 + r];
            c.all_reduce_sum(&mut v)
        });
        assert!(out
            .iter()
            .any(|o| matches!(o, Err(CommError::Length { .. }))));
        let out = on_ranks(3, |r, c| {
            if r == 1 {
                c.abort();
                return Err(CommError::Aborted);
            }
            let mut v = vec![1.0; 2];
            c.all_reduce_sum(&mut v)
        });
        assert!(out.iter().all(|o| o.is_err()), "{out:?}");
    }

    #[test]
    fn stats_count_calls_and_bytes() {
        let out = on_ranks(2, |_, c| {
            let mut v = vec![0.0; 10];
            c.all_reduce_sum(&mut v)?;
            c.all_reduce_sum(&mut v)?;
            let mut g = Vec::new();
            c.all_gather(&v[..3], &mut g)?;
            Ok::<_, CommError>(c.stats())
        });
        for s in out.into_iter().flatten() {
            assert_eq!((s.all_reduce_calls, s.all_reduce_bytes), (2, 80));
            assert_eq!((s.all_gather_calls, s.all_gather_bytes), (1, 12));
        }
    }

    #[test]
    fn topologies_choose_shm_or_say_what_is_missing() {
        assert_eq!(CommKind::for_topology("shm", false), Ok(CommKind::Shm));
        assert!(matches!(
            CommKind::for_topology("pcie", true),
            Err(CommError::NotBuilt { kind: "nccl", .. })
        ));
        assert!(matches!(
            CommKind::for_topology("shm", true),
            Err(CommError::NotBuilt {
                kind: "cuda-1dev",
                ..
            })
        ));
    }
}
