//! Peak resident memory of one phase of this process (Linux): the kernel's high-water mark
//! (`VmHWM` in `/proc/self/status`) after resetting it to the current resident size by writing
//! `5` to `/proc/self/clear_refs` (proc(5)). Where the reset is refused the figure is the peak
//! since the process started, and says so.

use std::time::Instant;

use anyhow::{Context, Result};

/// One phase's memory, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct PhasePeak {
    /// Highest resident size during the phase (anonymous memory and file pages mapped in).
    pub peak: u64,
    /// Resident size when the phase began (what the process held already).
    pub start: u64,
    /// Whether the high-water mark was reset at the start; `false`: `peak` is since the process
    /// started, an upper bound for the phase.
    pub reset: bool,
    pub seconds: f64,
}

/// A phase being measured.
pub struct Phase {
    start: u64,
    reset: bool,
    began: Instant,
}

/// `VmRSS` / `VmHWM` lines of `/proc/self/status`, in bytes.
fn status_kb(field: &str) -> Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    parse_kb(&status, field)
}

fn parse_kb(status: &str, field: &str) -> Result<u64> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .with_context(|| format!("/proc/self/status has no {field} line"))?;
    let kb = line
        .trim()
        .strip_suffix("kB")
        .map(str::trim)
        .with_context(|| format!("{field}: expected a size in kB, found {line:?}"))?;
    let kb: u64 = kb
        .parse()
        .with_context(|| format!("{field}: expected a number of kB, found {kb:?}"))?;
    Ok(kb * 1024)
}

impl Phase {
    /// Reset the high-water mark and note the resident size now.
    pub fn begin() -> Result<Phase> {
        let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        Ok(Phase {
            start: status_kb("VmRSS")?,
            reset,
            began: Instant::now(),
        })
    }

    /// The phase's peak so far.
    pub fn end(&self) -> Result<PhasePeak> {
        Ok(PhasePeak {
            peak: status_kb("VmHWM")?,
            start: self.start,
            reset: self.reset,
            seconds: self.began.elapsed().as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_fields() {
        let s = "Name:\txtask\nVmHWM:\t  123456 kB\nVmRSS:\t    2048 kB\n";
        assert_eq!(parse_kb(s, "VmHWM").expect("VmHWM"), 123456 * 1024);
        assert_eq!(parse_kb(s, "VmRSS").expect("VmRSS"), 2048 * 1024);
        assert!(parse_kb(s, "VmPeak").is_err());
        assert!(parse_kb("VmHWM:\t12 MB\n", "VmHWM").is_err());
    }

    #[test]
    fn a_phase_that_allocates_sees_it_in_its_peak() {
        let phase = Phase::begin().expect("begin");
        // 64 MiB written page by page, then freed: the high-water mark keeps it.
        let mut v = vec![0u8; 64 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        drop(v);
        let p = phase.end().expect("end");
        assert!(p.peak >= p.start + (60 << 20), "{p:?}");
    }
}
