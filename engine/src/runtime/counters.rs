//! [`DeviceCounters`]: what a device backend did, counted as it does it — kernel launches,
//! device allocations, host↔device bytes, KV-cache bytes moved and weight bytes read by the
//! kernels. These are the GPU efficiency figures that need no GPU: the CUDA backend counts
//! them the same way on a real device and on the emulator, so `cargo xtask bench` reports them
//! and `cargo xtask verify` gates them on every machine.
//!
//! A backend keeps running totals ([`AtomicCounters`]); callers take a [`snapshot`] before
//! and after the work they want to measure and subtract ([`DeviceCounters::since`]), so two
//! readers never disturb each other. The CPU backend has none ([`crate::runtime::Backend::counters`]
//! answers `None`).
//!
//! [`snapshot`]: AtomicCounters::snapshot

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of device work (running totals, or the difference of two snapshots).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Kernel launches (`cuLaunchKernel`).
    pub launches: u64,
    /// Device memory allocations that reached the driver (`cuMemAllocAsync`); a buffer taken
    /// from the backend's pool of freed buffers is not one.
    pub allocs: u64,
    /// Bytes of those allocations.
    pub alloc_bytes: u64,
    /// Bytes copied from the host to the device (weights at load included).
    pub htod_bytes: u64,
    /// Bytes copied from the device to the host (logits, sampled ids).
    pub dtoh_bytes: u64,
    /// Bytes of existing KV-cache contents copied: growing a cache layer into a new allocation
    /// (the old cells copied over), and compaction moves. Writing new cells is not counted.
    pub kv_bytes_moved: u64,
    /// Bytes of prepared weights (the file's GGML blocks) read by kernels, computed from each
    /// launch's shape and the weight's type: a matrix-vector launch over `n` outputs reads the
    /// matrix `n` times, a dequantization once, an embedding one row per token.
    pub weight_bytes_read: u64,
}

impl DeviceCounters {
    /// The work done between `earlier` and `self` (two snapshots of the same backend).
    pub fn since(&self, earlier: &DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            launches: self.launches.saturating_sub(earlier.launches),
            allocs: self.allocs.saturating_sub(earlier.allocs),
            alloc_bytes: self.alloc_bytes.saturating_sub(earlier.alloc_bytes),
            htod_bytes: self.htod_bytes.saturating_sub(earlier.htod_bytes),
            dtoh_bytes: self.dtoh_bytes.saturating_sub(earlier.dtoh_bytes),
            kv_bytes_moved: self.kv_bytes_moved.saturating_sub(earlier.kv_bytes_moved),
            weight_bytes_read: self
                .weight_bytes_read
                .saturating_sub(earlier.weight_bytes_read),
        }
    }

    /// The sum of two counts (the ranks of a tensor-parallel engine).
    pub fn plus(&self, o: &DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            launches: self.launches + o.launches,
            allocs: self.allocs + o.allocs,
            alloc_bytes: self.alloc_bytes + o.alloc_bytes,
            htod_bytes: self.htod_bytes + o.htod_bytes,
            dtoh_bytes: self.dtoh_bytes + o.dtoh_bytes,
            kv_bytes_moved: self.kv_bytes_moved + o.kv_bytes_moved,
            weight_bytes_read: self.weight_bytes_read + o.weight_bytes_read,
        }
    }

    /// Every counter as `(name, value)`, in a fixed order (reports and tables).
    pub fn fields(&self) -> [(&'static str, u64); 7] {
        [
            ("launches", self.launches),
            ("allocs", self.allocs),
            ("alloc_bytes", self.alloc_bytes),
            ("htod_bytes", self.htod_bytes),
            ("dtoh_bytes", self.dtoh_bytes),
            ("kv_bytes_moved", self.kv_bytes_moved),
            ("weight_bytes_read", self.weight_bytes_read),
        ]
    }
}

/// Running totals a backend updates from `&self` (its ops take `&self` and may run on any
/// thread).
#[derive(Debug, Default)]
pub struct AtomicCounters {
    launches: AtomicU64,
    allocs: AtomicU64,
    alloc_bytes: AtomicU64,
    htod_bytes: AtomicU64,
    dtoh_bytes: AtomicU64,
    kv_bytes_moved: AtomicU64,
    weight_bytes_read: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl AtomicCounters {
    pub fn launch(&self) {
        add(&self.launches, 1);
    }

    pub fn alloc(&self, bytes: usize) {
        add(&self.allocs, 1);
        add(&self.alloc_bytes, bytes as u64);
    }

    pub fn htod(&self, bytes: usize) {
        add(&self.htod_bytes, bytes as u64);
    }

    pub fn dtoh(&self, bytes: usize) {
        add(&self.dtoh_bytes, bytes as u64);
    }

    pub fn kv_moved(&self, bytes: usize) {
        add(&self.kv_bytes_moved, bytes as u64);
    }

    pub fn weights_read(&self, bytes: usize) {
        add(&self.weight_bytes_read, bytes as u64);
    }

    /// The totals now.
    pub fn snapshot(&self) -> DeviceCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DeviceCounters {
            launches: g(&self.launches),
            allocs: g(&self.allocs),
            alloc_bytes: g(&self.alloc_bytes),
            htod_bytes: g(&self.htod_bytes),
            dtoh_bytes: g(&self.dtoh_bytes),
            kv_bytes_moved: g(&self.kv_bytes_moved),
            weight_bytes_read: g(&self.weight_bytes_read),
        }
    }

    /// Every total back to zero.
    pub fn reset(&self) {
        for c in [
            &self.launches,
            &self.allocs,
            &self.alloc_bytes,
            &self.htod_bytes,
            &self.dtoh_bytes,
            &self.kv_bytes_moved,
            &self.weight_bytes_read,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_of_snapshots_is_the_work_between_them() {
        let c = AtomicCounters::default();
        c.launch();
        c.alloc(100);
        let before = c.snapshot();
        c.launch();
        c.launch();
        c.htod(12);
        c.dtoh(8);
        c.kv_moved(64);
        c.weights_read(1000);
        let d = c.snapshot().since(&before);
        assert_eq!(
            d,
            DeviceCounters {
                launches: 2,
                allocs: 0,
                alloc_bytes: 0,
                htod_bytes: 12,
                dtoh_bytes: 8,
                kv_bytes_moved: 64,
                weight_bytes_read: 1000,
            }
        );
        assert_eq!(d.plus(&d).launches, 4);
        c.reset();
        assert_eq!(c.snapshot(), DeviceCounters::default());
        // An earlier snapshot after a reset counts nothing rather than wrapping around.
        assert_eq!(DeviceCounters::default().since(&before).launches, 0);
    }
}
