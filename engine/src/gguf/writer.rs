//! Writing GGUF v3, as one file or as a gguf-split set.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use kernels::quant::GgmlType;

use super::error::GgufError;
use super::reader::{DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use super::split::{
    parse_split_path, split_path, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT,
};
use super::value::{Metadata, MetadataValue, ValueType};
use super::Gguf;

/// llama.cpp refuses tensor names of `GGML_MAX_NAME` (64) bytes or more.
pub const MAX_TENSOR_NAME: usize = 63;

const KEY_ALIGNMENT: &str = "general.alignment";

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// Builds a GGUF v3 file in memory and writes it whole or split.
///
/// Metadata keeps insertion order (re-adding a key replaces its value in place). Tensors are laid
/// out in insertion order, each at a multiple of the alignment, zero-padded as ggml pads them.
pub struct GgufWriter {
    alignment: u32,
    metadata: Metadata,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT as u32,
            metadata: Metadata::new(),
            tensors: Vec::new(),
        }
    }

    /// A writer holding a copy of an opened model: shard 0's metadata minus the `split.*` keys,
    /// every tensor with its bytes, and the first shard's alignment.
    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let mut w = GgufWriter::new();
        if let Some(s) = g.shards().first() {
            w.alignment = u32::try_from(s.alignment).unwrap_or(u32::MAX);
        }
        for (k, v) in g.metadata() {
            if !is_split_key(k) {
                w.metadata.insert(k, v.clone());
            }
        }
        for t in g.tensors() {
            w.add_tensor(&t.name, t.ggml_type, &t.dims, g.tensor_data(t).to_vec())?;
        }
        Ok(w)
    }

    /// Alignment of the data section and of every tensor; must be a power of two (checked by
    /// [`GgufWriter::write`]). Written as `general.alignment` when it is not 32.
    pub fn set_alignment(&mut self, a: u32) {
        self.alignment = a;
    }

    /// Sets a metadata key. `general.alignment` with an integer value also sets the alignment.
    pub fn add_metadata(&mut self, key: impl Into<String>, v: MetadataValue) -> &mut Self {
        let key = key.into();
        if key == KEY_ALIGNMENT {
            if let Some(a) = v.as_integer().and_then(|i| u32::try_from(i).ok()) {
                self.alignment = a;
            }
        }
        self.metadata.insert(key, v);
        self
    }

    /// Adds a tensor. `dims` are in ggml order (`ne0` first); `data` must be exactly the bytes
    /// `ty` needs for that many elements.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let invalid = |expected: &str, found: String| GgufError::InvalidWrite {
            what: format!("tensor {name:?}"),
            expected: expected.to_string(),
            found,
        };
        if name.is_empty() || name.len() > MAX_TENSOR_NAME {
            return Err(invalid(
                "a name of 1 to 63 bytes",
                format!("{} bytes", name.len()),
            ));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid("a name not added before", "a duplicate".into()));
        }
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(
                "at most 4 dimensions",
                format!("{} dimensions", dims.len()),
            ));
        }
        if dims.contains(&0) {
            return Err(invalid("dimensions > 0", format!("{dims:?}")));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| invalid("an element count that fits in u64", format!("{dims:?}")))?;
        let expected = ty.bytes_for(n_elements).ok_or_else(|| {
            invalid(
                "a whole number of blocks",
                format!(
                    "{n_elements} elements of {ty} (blocks of {})",
                    ty.block_size()
                ),
            )
        })?;
        if data.len() as u64 != expected {
            return Err(GgufError::DataLength {
                tensor: name,
                expected,
                found: data.len() as u64,
            });
        }
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data,
        });
        Ok(self)
    }

    /// Writes one GGUF v3 file.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let md = self.file_metadata(None)?;
        let tensors: Vec<&PendingTensor> = self.tensors.iter().collect();
        write_file(path, &md, &tensors, self.alignment)
    }

    /// The file [`GgufWriter::write`] would write, in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let md = self.file_metadata(None)?;
        let tensors: Vec<&PendingTensor> = self.tensors.iter().collect();
        let mut out = Vec::new();
        encode(&mut out, &md, &tensors, u64::from(self.alignment))
            .map_err(|e| GgufError::io(Path::new("<memory>"), "encoding", e))?;
        Ok(out)
    }

    /// Writes a gguf-split set of at most `max_tensors_per_shard` tensors per shard, named
    /// `PREFIX-00001-of-0000N.gguf` …, where PREFIX is `first_path` without `.gguf` (or without
    /// its `-NNNNN-of-NNNNN.gguf` tail). Shard 0 carries all metadata; every shard carries
    /// `split.no`, `split.count`, `split.tensors.count` (and `general.alignment` when it is not
    /// 32). A model with no tensors is written as one shard. Returns the paths in shard order.
    pub fn write_split(
        &self,
        first_path: impl AsRef<Path>,
        max_tensors_per_shard: usize,
    ) -> Result<Vec<PathBuf>, GgufError> {
        let first_path = first_path.as_ref();
        if max_tensors_per_shard == 0 {
            return Err(GgufError::InvalidWrite {
                what: "max_tensors_per_shard".into(),
                expected: "at least 1".into(),
                found: "0".into(),
            });
        }
        let prefix = match parse_split_path(first_path) {
            Some((prefix, _, _)) => prefix,
            None if first_path.extension().is_some_and(|e| e == "gguf") => {
                first_path.with_extension("")
            }
            None => first_path.to_path_buf(),
        };
        let n_shards = self.tensors.len().div_ceil(max_tensors_per_shard).max(1);
        let count = u16::try_from(n_shards).map_err(|_| GgufError::InvalidWrite {
            what: "split.count".into(),
            expected: "at most 65535 shards".into(),
            found: format!("{n_shards}"),
        })?;
        let total = i32::try_from(self.tensors.len()).map_err(|_| GgufError::InvalidWrite {
            what: "split.tensors.count".into(),
            expected: "at most 2147483647 tensors".into(),
            found: format!("{}", self.tensors.len()),
        })?;
        let mut paths = Vec::with_capacity(n_shards);
        for no in 0..count {
            let lo = usize::from(no) * max_tensors_per_shard;
            let hi = (lo + max_tensors_per_shard).min(self.tensors.len());
            let tensors: Vec<&PendingTensor> = self.tensors[lo..hi].iter().collect();
            let md = self.file_metadata(Some((no, count, total)))?;
            let p = split_path(&prefix, no, count);
            write_file(&p, &md, &tensors, self.alignment)?;
            paths.push(p);
        }
        Ok(paths)
    }

    /// The metadata of one output file: everything (or, for shards after the first, only what
    /// a shard needs), with the split keys first for a shard and `general.alignment` made to
    /// agree with the alignment the data is laid out with.
    fn file_metadata(&self, split: Option<(u16, u16, i32)>) -> Result<Metadata, GgufError> {
        if !self.alignment.is_power_of_two() {
            return Err(GgufError::InvalidWrite {
                what: KEY_ALIGNMENT.into(),
                expected: "a non-zero power of two".into(),
                found: format!("{}", self.alignment),
            });
        }
        let mut md = Metadata::new();
        if let Some((no, count, total)) = split {
            md.insert(KEY_SPLIT_NO, MetadataValue::U16(no));
            md.insert(KEY_SPLIT_COUNT, MetadataValue::U16(count));
            md.insert(KEY_SPLIT_TENSORS_COUNT, MetadataValue::I32(total));
        }
        let all = split.is_none_or(|(no, _, _)| no == 0);
        for (k, v) in &self.metadata {
            if split.is_some() && is_split_key(k) {
                continue;
            }
            if all || k == KEY_ALIGNMENT {
                check_value(k, v)?;
                md.insert(k, v.clone());
            }
        }
        if md.contains_key(KEY_ALIGNMENT) || u64::from(self.alignment) != DEFAULT_ALIGNMENT {
            md.insert(KEY_ALIGNMENT, MetadataValue::U32(self.alignment));
        }
        Ok(md)
    }
}

fn is_split_key(k: &str) -> bool {
    k == KEY_SPLIT_NO || k == KEY_SPLIT_COUNT || k == KEY_SPLIT_TENSORS_COUNT
}

/// GGUF arrays hold one element type; nested arrays are checked level by level.
fn check_value(key: &str, v: &MetadataValue) -> Result<(), GgufError> {
    if let MetadataValue::Array(items) = v {
        if let Some(first) = items.first() {
            let ty = first.value_type();
            for (i, item) in items.iter().enumerate() {
                if item.value_type() != ty {
                    return Err(GgufError::InvalidWrite {
                        what: format!("metadata {key:?} element {i}"),
                        expected: format!("{} like element 0", ty.name()),
                        found: item.value_type().name().to_string(),
                    });
                }
                check_value(key, item)?;
            }
        }
    }
    Ok(())
}

fn write_file(
    path: &Path,
    md: &Metadata,
    tensors: &[&PendingTensor],
    alignment: u32,
) -> Result<(), GgufError> {
    let file = File::create(path).map_err(|e| GgufError::io(path, "creating", e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    encode(&mut w, md, tensors, u64::from(alignment))
        .map_err(|e| GgufError::io(path, "writing", e))?;
    w.into_inner()
        .map_err(|e| GgufError::io(path, "writing", e.into_error()))?;
    Ok(())
}

fn encode(
    w: &mut impl Write,
    md: &Metadata,
    tensors: &[&PendingTensor],
    alignment: u64,
) -> std::io::Result<()> {
    // The header (metadata and tensor infos) is built in memory: it is small next to the data,
    // and its length decides the padding before the data section.
    let mut h = Vec::new();
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    h.extend_from_slice(&(md.len() as u64).to_le_bytes());
    for (k, v) in md {
        put_str(&mut h, k);
        h.extend_from_slice(&v.value_type().id().to_le_bytes());
        put_value(&mut h, v);
    }
    let mut rel = 0u64;
    for t in tensors {
        put_str(&mut h, &t.name);
        h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            h.extend_from_slice(&d.to_le_bytes());
        }
        h.extend_from_slice(&t.ty.id().to_le_bytes());
        h.extend_from_slice(&rel.to_le_bytes());
        rel = (rel + t.data.len() as u64).next_multiple_of(alignment);
    }
    let padded = (h.len() as u64).next_multiple_of(alignment) as usize;
    h.resize(padded, 0);
    w.write_all(&h)?;
    let zeros = vec![0u8; alignment as usize];
    for t in tensors {
        w.write_all(&t.data)?;
        let len = t.data.len() as u64;
        let pad = (len.next_multiple_of(alignment) - len) as usize;
        w.write_all(&zeros[..pad])?;
    }
    Ok(())
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &MetadataValue) {
    match v {
        MetadataValue::U8(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I8(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::Bool(x) => h.push(u8::from(*x)),
        MetadataValue::String(s) => put_str(h, s),
        MetadataValue::Array(items) => {
            // An empty array has no element to take the type from; u8 is as good as any, and
            // reads back as the same empty array.
            let ty = items
                .first()
                .map(MetadataValue::value_type)
                .unwrap_or(ValueType::U8);
            h.extend_from_slice(&ty.id().to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(h, item);
            }
        }
    }
}
