//! Parsing and validating one GGUF file (v2 or v3, little-endian) from its memory map.
//!
//! Every count read from the file is checked against the bytes left before anything is allocated
//! from it, so a hostile file costs at most about its own size in memory.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use kernels::quant::GgmlType;
use memmap2::Mmap;

use super::error::GgufError;
use super::value::{Metadata, MetadataValue, ValueType};
use super::{ShardInfo, TensorInfo};

/// `GGUF` read as a little-endian u32.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays in arrays the reader accepts (bounds its recursion).
pub const MAX_ARRAY_NESTING: usize = 8;

/// Fewest bytes a tensor info can take: name length, n_dims, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 4 + 8;
/// Fewest bytes a metadata pair can take: key length, value type, a one-byte value.
const MIN_KV: u64 = 8 + 4 + 1;

/// The bytes of a file: mapped, copied into anonymous memory ([`Backing::resident`]), or (for an
/// empty file, which cannot be mapped) nothing.
pub(crate) enum Backing {
    Map(Mmap),
    /// A private copy in anonymous memory advised for transparent huge pages; read-only.
    Resident(Mmap),
    Empty,
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) | Backing::Resident(m) => m,
            Backing::Empty => &[],
        }
    }
}

impl Backing {
    /// The same bytes copied into an anonymous mapping advised for transparent huge pages
    /// (`MADV_HUGEPAGE`), then made read-only. A decode step streams every weight once, and a
    /// one-thread stream over 4 KiB file pages runs slower than over 2 MiB pages: the Gemma 3
    /// head (178 MB of Q8_0) read at 16 GB/s from the file's map and 19–21 GB/s from a huge-page
    /// copy in the same process (Zen 4, `engine/examples/weight_pages.rs`). `path` is for errors.
    pub(crate) fn resident(&self, path: &Path) -> Result<Backing, GgufError> {
        let bytes: &[u8] = self;
        if bytes.is_empty() {
            return Ok(Backing::Empty);
        }
        let mut anon = memmap2::MmapMut::map_anon(bytes.len())
            .map_err(|e| GgufError::io(path, "allocating memory for the weights", e))?;
        // Advice only: a kernel without transparent huge pages keeps 4 KiB pages.
        #[cfg(target_os = "linux")]
        let _ = anon.advise(memmap2::Advice::HugePage);
        anon.copy_from_slice(bytes);
        let ro = anon
            .make_read_only()
            .map_err(|e| GgufError::io(path, "protecting the weights' copy", e))?;
        Ok(Backing::Resident(ro))
    }

    pub(crate) fn is_resident(&self) -> bool {
        matches!(self, Backing::Resident(_))
    }
}

/// One parsed, validated file.
pub(crate) struct ParsedFile {
    pub(crate) bytes: Backing,
    pub(crate) info: ShardInfo,
    pub(crate) metadata: Metadata,
    /// `shard` is 0 here; the split loader renumbers.
    pub(crate) tensors: Vec<TensorInfo>,
}

/// Maps and parses `path`.
pub(crate) fn read_file(path: &Path) -> Result<ParsedFile, GgufError> {
    let file = File::open(path).map_err(|e| GgufError::io(path, "opening", e))?;
    let len = file
        .metadata()
        .map_err(|e| GgufError::io(path, "reading the file size", e))?
        .len();
    let bytes = if len == 0 {
        Backing::Empty
    } else {
        // SAFETY: the map is read-only and private to this process. Another process truncating
        // or rewriting the file while it is mapped would break the slices handed out; that is
        // the documented contract of every memory-mapped model loader (llama.cpp, candle) and
        // the reason `Gguf` owns its maps rather than lending them out beyond its lifetime.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, "mapping", e))?;
        Backing::Map(map)
    };
    let (info, metadata, tensors) = parse(path, &bytes)?;
    Ok(ParsedFile {
        bytes,
        info,
        metadata,
        tensors,
    })
}

/// Parses and validates the whole of `buf` as the GGUF file `path`.
pub(crate) fn parse(
    path: &Path,
    buf: &[u8],
) -> Result<(ShardInfo, Metadata, Vec<TensorInfo>), GgufError> {
    let mut c = Cursor { buf, pos: 0, path };

    let magic = c.take(4, || "magic".into())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: magic.to_vec(),
        });
    }
    let version = c.u32(|| "version".into())?;
    match version {
        2 | 3 => {}
        // A big-endian writer stores 2 or 3 as 0x0200_0000 / 0x0300_0000: the low half is zero.
        v if v & 0xffff == 0 && v != 0 => {
            return Err(GgufError::BigEndian {
                path: path.to_path_buf(),
                raw: v,
                swapped: v.swap_bytes(),
            })
        }
        v => {
            return Err(GgufError::UnsupportedVersion {
                path: path.to_path_buf(),
                version: v,
            })
        }
    }

    let n_tensors = c.count(MIN_TENSOR_INFO, || "tensor count".into())?;
    // The tensor infos follow the metadata, so both counts share the same remaining bytes; this
    // bound is loose but sufficient: allocation stays proportional to the file.
    let n_kv = c.count(MIN_KV, || "metadata count".into())?;

    let mut metadata = Metadata::new();
    let mut alignment_at = None;
    for i in 0..n_kv {
        let key_at = c.pos as u64;
        let key = c.string(|| format!("metadata key #{i}"))?;
        let ty_at = c.pos as u64;
        let ty_id = c.u32(|| format!("metadata {key:?} value type"))?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| GgufError::UnknownValueType {
            path: path.to_path_buf(),
            field: format!("metadata {key:?} value type"),
            offset: ty_at,
            type_id: ty_id,
        })?;
        let value = c.value(ty, &key, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                path: path.to_path_buf(),
                key,
                offset: key_at,
            });
        }
        if key == "general.alignment" {
            alignment_at = Some(key_at);
        }
        metadata.insert(key, value);
    }

    let alignment = match (metadata.get("general.alignment"), alignment_at) {
        (Some(v), Some(at)) => {
            let a = v.as_integer().and_then(|i| u64::try_from(i).ok());
            match a {
                Some(a) if a.is_power_of_two() && a <= u64::from(u32::MAX) => a,
                _ => {
                    return Err(GgufError::BadAlignment {
                        path: path.to_path_buf(),
                        offset: at,
                        found: v.describe(),
                    })
                }
            }
        }
        _ => DEFAULT_ALIGNMENT,
    };

    struct Raw {
        name: String,
        ggml_type: GgmlType,
        dims: Vec<u64>,
        rel_offset: u64,
        offset_at: u64,
        n_bytes: u64,
    }
    let mut raws: Vec<Raw> = Vec::with_capacity(n_tensors as usize);
    let mut seen: HashMap<String, u64> = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let info_at = c.pos as u64;
        let name = c.string(|| format!("tensor #{i} name"))?;
        if seen.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: name,
                offset: info_at,
            });
        }
        let dims_at = c.pos as u64;
        let n_dims = c.u32(|| format!("tensor {name:?} n_dims"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                path: path.to_path_buf(),
                tensor: name,
                offset: dims_at,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims as usize {
            let at = c.pos as u64;
            let dim = c.u64(|| format!("tensor {name:?} dimension {d}"))?;
            if dim == 0 {
                return Err(GgufError::ZeroDim {
                    path: path.to_path_buf(),
                    tensor: name,
                    offset: at,
                    index: d,
                });
            }
            dims.push(dim);
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| GgufError::ShapeOverflow {
                path: path.to_path_buf(),
                tensor: name.clone(),
                offset: dims_at,
                dims: dims.clone(),
            })?;
        let type_at = c.pos as u64;
        let type_id = c.u32(|| format!("tensor {name:?} type"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            offset: type_at,
            type_id,
        })?;
        let bs = ggml_type.block_size() as u64;
        if n_elements % bs != 0 {
            return Err(GgufError::PartialBlock {
                path: path.to_path_buf(),
                tensor: name,
                offset: dims_at,
                ggml_type,
                n_elements,
                block_size: ggml_type.block_size(),
            });
        }
        let n_bytes = ggml_type
            .bytes_for(n_elements)
            .ok_or_else(|| GgufError::ShapeOverflow {
                path: path.to_path_buf(),
                tensor: name.clone(),
                offset: dims_at,
                dims: dims.clone(),
            })?;
        let offset_at = c.pos as u64;
        let rel_offset = c.u64(|| format!("tensor {name:?} data offset"))?;
        if rel_offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                path: path.to_path_buf(),
                tensor: name,
                offset: offset_at,
                tensor_offset: rel_offset,
                alignment,
            });
        }
        seen.insert(name.clone(), info_at);
        raws.push(Raw {
            name,
            ggml_type,
            dims,
            rel_offset,
            offset_at,
            n_bytes,
        });
    }
    drop(seen);

    let file_size = buf.len() as u64;
    let end_of_infos = c.pos as u64;
    // end_of_infos <= file_size < 2^63 in practice; the checked form keeps hostile sizes honest.
    let data_offset = end_of_infos
        .checked_next_multiple_of(alignment)
        .unwrap_or(u64::MAX);
    if !raws.is_empty() && data_offset > file_size {
        return Err(GgufError::DataOffsetOutOfBounds {
            path: path.to_path_buf(),
            data_offset,
            file_size,
        });
    }

    let mut tensors = Vec::with_capacity(raws.len());
    for r in raws {
        let start = data_offset.checked_add(r.rel_offset);
        let end = start.and_then(|s| s.checked_add(r.n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_size => tensors.push(TensorInfo {
                name: r.name,
                ggml_type: r.ggml_type,
                dims: r.dims,
                shard: 0,
                offset: start,
                n_bytes: r.n_bytes,
            }),
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    path: path.to_path_buf(),
                    tensor: r.name,
                    offset: r.offset_at,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_size,
                })
            }
        }
    }

    check_overlap(path, &tensors)?;

    let info = ShardInfo {
        path: path.to_path_buf(),
        version,
        alignment,
        data_offset,
        file_size,
        n_tensors: tensors.len(),
    };
    Ok((info, metadata, tensors))
}

/// Refuses tensors whose byte ranges overlap (zero-size tensors cannot occur: dims are > 0).
fn check_overlap(path: &Path, tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_unstable_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        let a_end = a.offset + a.n_bytes;
        if b.offset < a_end {
            return Err(GgufError::TensorsOverlap {
                path: path.to_path_buf(),
                first: a.name.clone(),
                first_end: a_end,
                second: b.name.clone(),
                second_start: b.offset,
            });
        }
    }
    Ok(())
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn path(&self) -> PathBuf {
        self.path.to_path_buf()
    }

    fn take(&mut self, n: u64, field: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(GgufError::Truncated {
                path: self.path(),
                field: field(),
                offset: self.pos as u64,
                needed: n,
                available: self.left(),
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(
        &mut self,
        field: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array::<4>(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array::<8>(field).map(u64::from_le_bytes)
    }

    /// A u64 count of items each at least `min_size` bytes, checked against the bytes left.
    fn count(&mut self, min_size: u64, field: impl Fn() -> String) -> Result<u64, GgufError> {
        let at = self.pos as u64;
        let n = self.u64(&field)?;
        let needed = n.saturating_mul(min_size);
        if needed > self.left() {
            return Err(GgufError::CountTooLarge {
                path: self.path(),
                field: field(),
                offset: at,
                count: n,
                needed,
                available: self.left(),
            });
        }
        Ok(n)
    }

    fn string(&mut self, field: impl Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos as u64;
        let len = self.count(1, || format!("{} length", field()))?;
        let bytes = self.take(len, &field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidUtf8 {
                path: self.path(),
                field: field(),
                offset: at,
                valid_up_to: e.valid_up_to(),
            }),
        }
    }

    fn value(
        &mut self,
        ty: ValueType,
        key: &str,
        depth: usize,
    ) -> Result<MetadataValue, GgufError> {
        let field = || format!("metadata {key:?} value");
        Ok(match ty {
            ValueType::U8 => MetadataValue::U8(self.array::<1>(field)?[0]),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array::<1>(field)?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => MetadataValue::U32(u32::from_le_bytes(self.array(field)?)),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::U64 => MetadataValue::U64(u64::from_le_bytes(self.array(field)?)),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Bool => {
                let at = self.pos as u64;
                match self.array::<1>(field)?[0] {
                    0 => MetadataValue::Bool(false),
                    1 => MetadataValue::Bool(true),
                    b => {
                        return Err(GgufError::InvalidBool {
                            path: self.path(),
                            field: field(),
                            offset: at,
                            value: b,
                        })
                    }
                }
            }
            ValueType::String => MetadataValue::String(self.string(field)?),
            ValueType::Array => self.array_value(key, depth)?,
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<MetadataValue, GgufError> {
        let at = self.pos as u64;
        if depth >= MAX_ARRAY_NESTING {
            return Err(GgufError::NestingTooDeep {
                path: self.path(),
                field: format!("metadata {key:?} value"),
                offset: at,
                max: MAX_ARRAY_NESTING,
            });
        }
        let ty_id = self.u32(|| format!("metadata {key:?} array element type"))?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path(),
            field: format!("metadata {key:?} array element type"),
            offset: at,
            type_id: ty_id,
        })?;
        let n = self.count(ty.min_size(), || format!("metadata {key:?} array count"))?;
        let n = n as usize;
        // Fixed-size elements: one bounds check (done by `count`), then a tight decode loop.
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                const W: usize = std::mem::size_of::<$t>();
                let bytes = self.take((n * W) as u64, || format!("metadata {key:?} array"))?;
                bytes
                    .chunks_exact(W)
                    .map(|ch| {
                        let mut a = [0u8; W];
                        a.copy_from_slice(ch);
                        MetadataValue::$variant(<$t>::from_le_bytes(a))
                    })
                    .collect()
            }};
        }
        let items: Vec<MetadataValue> = match ty {
            ValueType::U8 => fixed!(U8, u8),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool | ValueType::String | ValueType::Array => {
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(ty, key, depth + 1)?);
                }
                items
            }
        };
        Ok(MetadataValue::Array(items))
    }
}
