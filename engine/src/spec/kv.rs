//! KV compaction after a verify forward: the cells of the accepted root-to-node path stay, in
//! path order, moved into the lowest free cells (so the sequence is laid out as plain decoding
//! lays it out); every other node's cells are dropped. The drafter's own cache keeps a sliding
//! window instead ([`crate::runtime::KvCache::forget_before`], used by
//! [`super::proposer::ModelProposer`]).

use crate::exec::BatchEngine;
use crate::faults::{self, Fault};
use crate::runtime::SeqCache;

use super::SpecError;

/// Keep the pending cells of the tree nodes `path` (a root-to-node path, batch indices of the
/// verify forward) and drop the rest.
pub fn keep_path<E: BatchEngine + ?Sized>(
    engine: &E,
    cache: &mut E::Cache,
    path: &[usize],
) -> Result<(), SpecError> {
    let mut keep = path.to_vec();
    if faults::is_active(Fault::CompactKeepsWrongRow) && keep.len() >= 2 {
        // Keeps a sibling's (or the next node's) row in place of the last accepted node's.
        let n = cache.pending().len();
        let last = keep[keep.len() - 1];
        if let Some(other) = (0..n).rev().find(|i| !keep.contains(i) && *i != last) {
            let at = keep.len() - 1;
            keep[at] = other;
        }
    }
    engine.compact(cache, &keep)?;
    Ok(())
}
