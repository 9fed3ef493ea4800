//! GGUF files: reading (memory-mapped, validated, split sets) and writing.
//!
//! [`Gguf::open`] maps a file (or every shard of a gguf-split set, whichever shard is named),
//! checks every count, offset, shape and type against the file before using it, and hands out
//! tensor bytes as slices of the maps. [`GgufWriter`] writes GGUF v3, whole or split.
//!
//! Invariants: no panic and no allocation sized by an untrusted count on any input; every error
//! is a [`GgufError`] naming the file, the field or tensor, and the byte offset. Block geometry
//! comes from [`kernels::quant::GgmlType`]; this module defines no types of its own.
//!
//! Files: `reader.rs` (one file), `split.rs` (sets), `value.rs` (metadata), `writer.rs`,
//! `error.rs`.

mod error;
mod reader;
mod split;
mod value;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use kernels::quant::GgmlType;

pub use error::GgufError;
pub use reader::{DEFAULT_ALIGNMENT, MAX_ARRAY_NESTING, MAX_DIMS};
pub use split::{
    parse_split_path, split_path, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT,
};
pub use value::{Metadata, MetadataValue, ValueType};
pub use writer::GgufWriter;

use reader::Backing;

/// Where an opened model's tensor bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPages {
    /// The file's memory map: nothing copied, pages read from the page cache on first touch
    /// (what `inspect` and the file tools want, and any model larger than memory).
    Map,
    /// A private copy in anonymous memory advised for transparent huge pages: decode streams
    /// every weight once per token, and streams faster over huge pages (see `Backing::resident`).
    Resident,
    /// [`WeightPages::Resident`] when the files take at most half of the memory the system
    /// reports available (`MemAvailable`), else [`WeightPages::Map`].
    #[default]
    Auto,
}

impl std::str::FromStr for WeightPages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "map" => Ok(WeightPages::Map),
            "resident" => Ok(WeightPages::Resident),
            "auto" => Ok(WeightPages::Auto),
            other => Err(format!(
                "unknown weight pages {other:?}: expected map, resident or auto"
            )),
        }
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes (None where there is no such file).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// One tensor of the model: where its bytes are and how to read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// ggml order: `ne0` (the contiguous dimension) first, as stored in the file.
    pub dims: Vec<u64>,
    /// Index into [`Gguf::shards`].
    pub shard: usize,
    /// Absolute byte offset of the data in its shard file.
    pub offset: u64,
    /// Exact size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Product of the dimensions (validated not to overflow when the file was read).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// One file of a model (the only one, or one shard of a split set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub path: PathBuf,
    /// GGUF version, 2 or 3.
    pub version: u32,
    /// `general.alignment`, or 32.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub file_size: u64,
    pub n_tensors: usize,
}

/// An opened model: the maps of all its files, the merged tensor list, shard 0's metadata.
pub struct Gguf {
    shards: Vec<ShardInfo>,
    maps: Vec<Backing>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("shards", &self.shards)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Opens a GGUF file. If it is a shard of a gguf-split set (any shard, named
    /// `PREFIX-NNNNN-of-NNNNN.gguf`), opens and checks the whole set from the same directory.
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, GgufError> {
        Gguf::from_files(split::load_set(path.as_ref())?)
    }

    /// Opens a split set from its shard files listed in any order (a directory scan, a
    /// manifest): each is placed by its own `split.no`, not by its place in the list, and the
    /// set is checked as [`Gguf::open`] checks it (complete, no duplicates, one `split.count`).
    pub fn open_listed<P: AsRef<Path>>(paths: &[P]) -> Result<Gguf, GgufError> {
        Gguf::from_files(split::load_listed(paths)?)
    }

    fn from_files(files: Vec<reader::ParsedFile>) -> Result<Gguf, GgufError> {
        let mut shards = Vec::with_capacity(files.len());
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        let mut metadata = None;
        for (i, f) in files.into_iter().enumerate() {
            tensors.extend(f.tensors.into_iter().map(|t| TensorInfo { shard: i, ..t }));
            shards.push(f.info);
            maps.push(f.bytes);
            if metadata.is_none() {
                metadata = Some(f.metadata);
            }
        }
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Gguf {
            shards,
            maps,
            metadata: metadata.unwrap_or_default(),
            tensors,
            by_name,
        })
    }

    /// Where the tensor bytes live from now on (see [`WeightPages`]); returns whether they are
    /// now a resident copy. Errors only when [`WeightPages::Resident`] was asked for and the copy
    /// could not be made; [`WeightPages::Auto`] keeps the maps then.
    pub fn set_weight_pages(&mut self, pages: WeightPages) -> Result<bool, GgufError> {
        let total: u64 = self.shards.iter().map(|s| s.file_size).sum();
        let copy = match pages {
            WeightPages::Map => false,
            WeightPages::Resident => true,
            WeightPages::Auto => {
                mem_available().is_some_and(|avail| total.saturating_mul(2) <= avail)
            }
        };
        if !copy {
            return Ok(self.is_resident());
        }
        for (map, shard) in self.maps.iter_mut().zip(&self.shards) {
            if map.is_resident() {
                continue;
            }
            match map.resident(&shard.path) {
                Ok(r) => *map = r,
                Err(e) if pages == WeightPages::Resident => return Err(e),
                Err(e) => {
                    tracing::warn!("keeping the weights mapped from the file: {e}");
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Whether every shard's bytes are a resident copy ([`Gguf::set_weight_pages`]).
    pub fn is_resident(&self) -> bool {
        !self.maps.is_empty() && self.maps.iter().all(Backing::is_resident)
    }

    /// Shard 0's metadata, in file order (`split.*` keys included).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// All tensors: shard order, then file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes: exactly `t.n_bytes` bytes of its shard's map. Offsets were checked
    /// when the file was opened; a `TensorInfo` that did not come from this `Gguf` (or was
    /// edited) and points outside it gets an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let Some(map) = self.maps.get(t.shard) else {
            return &[];
        };
        let range = usize::try_from(t.offset).ok().and_then(|start| {
            let end = start.checked_add(usize::try_from(t.n_bytes).ok()?)?;
            Some(start..end)
        });
        range.and_then(|r| map.get(r)).unwrap_or(&[])
    }

    /// The files, in shard order.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.metadata.get_str("general.architecture")
    }

    /// See [`Metadata::get_u32`].
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.metadata.get_u32(key)
    }
    /// See [`Metadata::get_u64`].
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.metadata.get_u64(key)
    }
    /// See [`Metadata::get_i32`].
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        self.metadata.get_i32(key)
    }
    /// See [`Metadata::get_f32`].
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.metadata.get_f32(key)
    }
    /// See [`Metadata::get_bool`].
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.metadata.get_bool(key)
    }
    /// See [`Metadata::get_str`].
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.metadata.get_str(key)
    }
    /// See [`Metadata::get_str_array`].
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.metadata.get_str_array(key)
    }
    /// See [`Metadata::get_f32_array`].
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.metadata.get_f32_array(key)
    }
    /// See [`Metadata::get_i32_array`].
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.metadata.get_i32_array(key)
    }
    /// See [`Metadata::get_u32_array`].
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        self.metadata.get_u32_array(key)
    }
    /// See [`Metadata::get_u32_opt`].
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.metadata.get_u32_opt(key)
    }
    /// See [`Metadata::get_u64_opt`].
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.metadata.get_u64_opt(key)
    }
    /// See [`Metadata::get_i32_opt`].
    pub fn get_i32_opt(&self, key: &str) -> Result<Option<i32>, GgufError> {
        self.metadata.get_i32_opt(key)
    }
    /// See [`Metadata::get_f32_opt`].
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.metadata.get_f32_opt(key)
    }
    /// See [`Metadata::get_bool_opt`].
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.metadata.get_bool_opt(key)
    }
    /// See [`Metadata::get_str_opt`].
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.metadata.get_str_opt(key)
    }
    /// See [`Metadata::get_str_array_opt`].
    pub fn get_str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.metadata.get_str_array_opt(key)
    }
    /// See [`Metadata::get_f32_array_opt`].
    pub fn get_f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.metadata.get_f32_array_opt(key)
    }
    /// See [`Metadata::get_i32_array_opt`].
    pub fn get_i32_array_opt(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.metadata.get_i32_array_opt(key)
    }
    /// See [`Metadata::get_u32_array_opt`].
    pub fn get_u32_array_opt(&self, key: &str) -> Result<Option<Vec<u32>>, GgufError> {
        self.metadata.get_u32_array_opt(key)
    }
}
