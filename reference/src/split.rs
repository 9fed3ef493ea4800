//! Split GGUF sets for the reference: a plain merge of the shard files into one ordinary GGUF
//! file, written by candle's own writer, which the reference then reads like any other file.
//!
//! Independent of the engine's GGUF reader on purpose (the reference never depends on
//! `engine`): each shard's header is read by candle-core (`gguf_file::Content`), the shards are
//! put in `split.no` order (never in the order they were listed), every tensor is read from the
//! shard that holds it, and the metadata is shard 0's minus the `split.*` keys and
//! `general.alignment` (candle writes 32-byte alignment).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::ReferenceError;

struct Shard {
    path: PathBuf,
    no: u64,
    count: u64,
    content: Content,
}

fn gguf_err(path: &Path, message: String) -> ReferenceError {
    ReferenceError::Gguf {
        path: path.to_path_buf(),
        message,
    }
}

fn key_u64(c: &Content, path: &Path, key: &str) -> Result<u64, ReferenceError> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| gguf_err(path, format!("shard has no `{key}`")))?;
    crate::gguf::as_u64(v).ok_or_else(|| gguf_err(path, format!("`{key}` is not an integer")))
}

/// Merge the shards `paths` (any order) into one GGUF file at `out`.
pub fn merge(paths: &[PathBuf], out: &Path) -> Result<(), ReferenceError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ReferenceError::Io { path, source }
    };
    let mut shards = Vec::with_capacity(paths.len());
    for p in paths {
        let mut r = BufReader::new(File::open(p).map_err(io(p))?);
        let content = Content::read(&mut r).map_err(|e| gguf_err(p, e.to_string()))?;
        shards.push(Shard {
            path: p.clone(),
            no: key_u64(&content, p, "split.no")?,
            count: key_u64(&content, p, "split.count")?,
            content,
        });
    }
    shards.sort_by_key(|s| s.no);
    let n = shards.len() as u64;
    for (i, s) in shards.iter().enumerate() {
        if s.no != i as u64 || s.count != n {
            return Err(gguf_err(
                &s.path,
                format!(
                    "expected shard {i} of {n}, found split.no {} of split.count {}",
                    s.no, s.count
                ),
            ));
        }
    }
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for s in &shards {
        let mut r = BufReader::new(File::open(&s.path).map_err(io(&s.path))?);
        let mut names: Vec<&String> = s.content.tensor_infos.keys().collect();
        names.sort_by_key(|n| s.content.tensor_infos[*n].offset);
        for name in names {
            let q = s.content.tensor_infos[name]
                .read(&mut r, s.content.tensor_data_offset, &Device::Cpu)
                .map_err(|e| gguf_err(&s.path, format!("tensor `{name}`: {e}")))?;
            tensors.push((name.clone(), q));
        }
    }
    let first = shards
        .first()
        .ok_or_else(|| gguf_err(out, "no shard files to merge".into()))?;
    let mut metadata: Vec<(&str, &Value)> = first
        .content
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("split.") && k.as_str() != "general.alignment")
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = File::create(out).map_err(io(out))?;
    gguf_file::write(&mut f, &metadata, &refs).map_err(|e| gguf_err(out, e.to_string()))?;
    Ok(())
}
