//! Split sets written from a single GGUF file, as gguf-split lays them out (shard 0: the
//! metadata and the tensors outside the layers; shard k: layer k−1), named
//! `PREFIX-NNNNN-of-NNNNN.gguf`. Written with the engine's writer; what reads them back (the
//! engine's loader, the reference's own reader) is what the tests and verify cases check.

use std::path::{Path, PathBuf};

use engine::gguf::{split_path, Gguf, GgufError, GgufWriter, MetadataValue};

/// What can go wrong writing a split set.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    #[error("{0}")]
    Gguf(#[from] GgufError),
    #[error("cannot create {dir}: {source}")]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("{single}: {n} layers do not fit a split set (at most 65534)")]
    TooManyLayers { single: PathBuf, n: usize },
}

/// Write `single` as a split set by layer at `prefix` (`prefix-00001-of-0000N.gguf`, …); the
/// shard paths in shard order.
pub fn write_by_layer(single: &Path, prefix: &Path) -> Result<Vec<PathBuf>, SplitError> {
    let g = Gguf::open(single)?;
    let layer_of = |name: &str| -> Option<usize> {
        name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
    };
    let n_layers = g
        .tensors()
        .iter()
        .filter_map(|t| layer_of(&t.name))
        .max()
        .map_or(0, |l| l + 1);
    let too_many = || SplitError::TooManyLayers {
        single: single.to_path_buf(),
        n: n_layers,
    };
    let count = u16::try_from(n_layers + 1).map_err(|_| too_many())?;
    let total = i32::try_from(g.tensors().len()).map_err(|_| too_many())?;
    if let Some(dir) = prefix.parent() {
        std::fs::create_dir_all(dir).map_err(|source| SplitError::Io {
            dir: dir.to_path_buf(),
            source,
        })?;
    }
    let mut paths = Vec::new();
    for no in 0..count {
        let mut w = GgufWriter::new();
        w.add_metadata("split.no", MetadataValue::U16(no));
        w.add_metadata("split.count", MetadataValue::U16(count));
        w.add_metadata("split.tensors.count", MetadataValue::I32(total));
        if no == 0 {
            for (k, v) in g.metadata() {
                if !k.starts_with("split.") {
                    w.add_metadata(k, v.clone());
                }
            }
        }
        let want = if no == 0 {
            None
        } else {
            Some(usize::from(no) - 1)
        };
        for t in g.tensors().iter().filter(|t| layer_of(&t.name) == want) {
            w.add_tensor(&t.name, t.ggml_type, &t.dims, g.tensor_data(t).to_vec())?;
        }
        let p = split_path(prefix, no, count);
        w.write(&p)?;
        paths.push(p);
    }
    Ok(paths)
}
