//! The topology cost model: what a plan communicates per token, and how long that takes on an
//! interconnect this machine may not have.
//!
//! Per decoded token the plan all-reduces one residual row (`n_embd` f32 values) after every
//! split attention and every split FFN, and all-gathers the logits once. A ring all-reduce of
//! `B` bytes over `n` ranks moves `2(n−1)/n · B` bytes through each link in `2(n−1)` steps, an
//! all-gather `(n−1)/n · B_total` in `n−1` steps:
//!
//! ```text
//!   t_allreduce = base + 2(n−1)·α + 2(n−1)/n · B / BW
//!   t_allgather = base +  (n−1)·α +  (n−1)/n · B_total / BW
//! ```
//!
//! Constants ([`Link`]): `BW` is the per-direction link bandwidth from the vendors' figures; `α`
//! (per ring step) and `base` (per call) are NCCL's own model constants for the Ring algorithm
//! with the LL protocol, the one NCCL picks for messages this small (NVIDIA/nccl
//! `src/graph/tuning.cc`: `baseLat` Ring/LL 3.6 µs, `hwLat` Ring/LL NVLink 0.47 µs, PCI 1.0 µs).
//! NCCL's LL protocol also only reaches a quarter of the bus bandwidth for all-reduce (same
//! file); at a few KiB per message the latency terms dominate, so the model keeps the full
//! bandwidth and says so. Everything this model outputs is "modelled"; the `shm` times next to
//! it in a verify report are measured.

use super::comm::CommStats;
use super::plan::ShardPlan;
use crate::model::ModelConfig;

/// An interconnect: per-direction bandwidth and NCCL's latency constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub name: &'static str,
    /// Bytes per second, one direction.
    pub bandwidth: f64,
    /// Seconds per ring step.
    pub step_latency: f64,
    /// Seconds per collective call.
    pub base_latency: f64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// NCCL `baseLat` for Ring / LL (µs → s).
const NCCL_RING_LL_BASE: f64 = 3.6e-6;

/// PCIe Gen5 ×16: 32 GT/s per lane, 128b/130b encoding, 16 lanes: 63.0 GB/s per direction.
pub const PCIE_GEN5_X16: Link = Link {
    name: "pcie-gen5-x16",
    bandwidth: 32e9 * 16.0 * 128.0 / 130.0 / 8.0,
    step_latency: 1.0e-6,
    base_latency: NCCL_RING_LL_BASE,
    source: "PCI-SIG PCIe 5.0: 32 GT/s/lane, 128b/130b, x16 = 63.0 GB/s/direction; NCCL tuning.cc hwLat PCI Ring/LL 1.0 us, baseLat 3.6 us",
};

/// NVLink 4 (H100 SXM): 900 GB/s total per GPU, both directions: 450 GB/s per direction.
pub const NVLINK4: Link = Link {
    name: "nvlink4",
    bandwidth: 450e9,
    step_latency: 0.47e-6,
    base_latency: NCCL_RING_LL_BASE,
    source: "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional = 450 GB/s/direction; NCCL tuning.cc hwLat NVLink Ring/LL 0.47 us, baseLat 3.6 us",
};

/// NVLink 5 (B200): 1.8 TB/s total per GPU, both directions: 900 GB/s per direction.
pub const NVLINK5: Link = Link {
    name: "nvlink5",
    bandwidth: 900e9,
    step_latency: 0.47e-6,
    base_latency: NCCL_RING_LL_BASE,
    source: "NVIDIA Blackwell (B200) datasheet: NVLink 1.8 TB/s bidirectional = 900 GB/s/direction; NCCL tuning.cc hwLat NVLink Ring/LL 0.47 us (NVLink 4's; NCCL has no separate NVLink 5 figure), baseLat 3.6 us",
};

/// The links the report models.
pub const LINKS: [Link; 3] = [PCIE_GEN5_X16, NVLINK4, NVLINK5];

/// Ring all-reduce of `bytes` over `n` ranks.
pub fn ring_allreduce_s(link: &Link, n: usize, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    link.base_latency
        + 2.0 * (n - 1.0) * link.step_latency
        + 2.0 * (n - 1.0) / n * bytes / link.bandwidth
}

/// Ring all-gather of `total_bytes` (all ranks' parts together) over `n` ranks.
pub fn ring_allgather_s(link: &Link, n: usize, total_bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    link.base_latency + (n - 1.0) * link.step_latency + (n - 1.0) / n * total_bytes / link.bandwidth
}

/// What one decoded token communicates under a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenComm {
    pub degree: usize,
    pub all_reduces: usize,
    /// Bytes of one all-reduce (each rank's contribution).
    pub all_reduce_bytes: u64,
    pub all_gathers: usize,
    /// Bytes of the gathered logits, all ranks together.
    pub all_gather_bytes: u64,
}

impl TokenComm {
    /// Per token for `c` under `plan` (f32 activations: this engine reduces in f32).
    pub fn of(c: &ModelConfig, plan: &ShardPlan) -> TokenComm {
        let d = &plan.decisions;
        let mut all_reduces = 0;
        for il in 0..c.n_layer {
            all_reduces += usize::from(d.attn_reduces());
            let moe_layer = c.moe.is_some_and(|m| il >= m.n_dense_lead);
            all_reduces += usize::from(if moe_layer {
                d.moe_reduces()
            } else {
                d.ffn_reduces()
            });
        }
        let gathers = usize::from(d.vocab_gathers());
        TokenComm {
            degree: d.degree,
            all_reduces,
            all_reduce_bytes: (c.n_embd * 4) as u64,
            all_gathers: gathers,
            all_gather_bytes: if gathers > 0 {
                (c.n_vocab * 4) as u64
            } else {
                0
            },
        }
    }

    /// Bytes per token through the collectives (all-reduce payloads + gathered logits).
    pub fn bytes(&self) -> u64 {
        self.all_reduces as u64 * self.all_reduce_bytes + self.all_gather_bytes
    }

    /// Modelled seconds per token on `link`.
    pub fn modelled_s(&self, link: &Link) -> f64 {
        self.all_reduces as f64 * ring_allreduce_s(link, self.degree, self.all_reduce_bytes as f64)
            + self.all_gathers as f64
                * ring_allgather_s(link, self.degree, self.all_gather_bytes as f64)
    }
}

/// Measured seconds per token from rank 0's counters over `tokens` decoded tokens (all-reduce,
/// all-gather).
pub fn measured_s_per_token(stats: &CommStats, tokens: usize) -> (f64, f64) {
    let t = tokens.max(1) as f64;
    (
        stats.all_reduce_time.as_secs_f64() / t,
        stats.all_gather_time.as_secs_f64() / t,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_formulas_match_hand_computation() {
        // TP 4 over NVLink 4, 2560 bytes (n_embd 640 × f32):
        // 3.6 + 6·0.47 µs + 1.5 · 2560 / 450e9 s = 6.42 µs + 8.5 ns.
        let t = ring_allreduce_s(&NVLINK4, 4, 2560.0);
        approx::assert_relative_eq!(
            t,
            3.6e-6 + 6.0 * 0.47e-6 + 1.5 * 2560.0 / 450e9,
            max_relative = 1e-12
        );
        // TP 1 communicates nothing.
        assert_eq!(ring_allreduce_s(&NVLINK4, 1, 1e9), 0.0);
        // PCIe Gen5 x16 is 63.0 GB/s per direction.
        approx::assert_relative_eq!(PCIE_GEN5_X16.bandwidth, 63.015e9, max_relative = 1e-4);
        // A 1 GiB all-gather: per-call latency + (n−1) ring steps + (n−1)/n · B / BW.
        let t = ring_allgather_s(&NVLINK5, 8, 1073741824.0);
        approx::assert_relative_eq!(
            t,
            3.6e-6 + 7.0 * 0.47e-6 + 7.0 / 8.0 * 1073741824.0 / 900e9,
            max_relative = 1e-9
        );
    }
}
