//! Reading a GGUF file for the reference: metadata and dequantized weights.
//!
//! The header is read by candle-core's own reader (`gguf_file::Content`) and tensors are
//! dequantized by candle's `QTensor::dequantize`. candle 0.11 rejects the whole file when one tensor
//! has a type it does not know (IQ4_NL, IQ4_XS, MXFP4); only then does [`fallback_header`] read the
//! header itself, into candle's own `Value`/`TensorInfo` types where it can, so that every tensor of
//! a type candle knows is still read and dequantized by candle.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};

use crate::dequant::ExtraType;
use crate::error::ReferenceError;
use crate::numerics::ActQuant;

/// Where one tensor's data is and how to decode it.
enum Entry {
    /// A type candle reads and dequantizes.
    Candle(TensorInfo),
    /// A type only [`crate::dequant`] knows; `dims` outermost first (candle's order).
    Extra {
        kind: ExtraType,
        dims: Vec<usize>,
        offset: u64,
    },
}

impl Entry {
    fn dims(&self) -> &[usize] {
        match self {
            Entry::Candle(info) => info.shape.dims(),
            Entry::Extra { dims, .. } => dims,
        }
    }

    /// Offset of the tensor's data from the start of its file's data section.
    fn offset(&self) -> u64 {
        match self {
            Entry::Candle(info) => info.offset,
            Entry::Extra { offset, .. } => *offset,
        }
    }

    /// `(values per block, bytes per block)` of the tensor's type.
    fn block(&self) -> (usize, usize) {
        match self {
            Entry::Candle(info) => (info.ggml_dtype.block_size(), info.ggml_dtype.type_size()),
            Entry::Extra { kind, .. } => (kind.block_size(), kind.type_size()),
        }
    }
}

/// One file of the model (the only one, or one shard of a split set) and its reader.
struct ShardFile {
    path: PathBuf,
    reader: BufReader<File>,
    file_size: u64,
    data_offset: u64,
}

/// A tensor of the directory: which shard holds it, and where.
struct Located {
    shard: usize,
    entry: Entry,
}

/// An open GGUF model: metadata, tensor directory, and a reader for tensor data of each of its
/// files. A split set (`PREFIX-NNNNN-of-NNNNN.gguf`) is read in place, shard by shard: the
/// metadata is shard 0's (the one whose `split.no` is 0), each tensor is read from the shard that
/// holds it.
pub(crate) struct GgufFile {
    shards: Vec<ShardFile>,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, Located>,
}

/// One file's header: metadata, tensor directory, data section offset.
type FileHeader = (HashMap<String, Value>, HashMap<String, Entry>, u64);

impl GgufFile {
    /// Open `path`. A shard of a split set (a file whose `split.count` is above 1) opens the whole
    /// set from the same directory, found by the `-NNNNN-of-NNNNN.gguf` naming convention.
    pub fn open(path: &Path) -> Result<Self, ReferenceError> {
        let (shard, header) = read_one(path)?;
        let count = split_key(&header.0, path, "split.count")?;
        if count.is_none_or(|c| c <= 1) {
            return Self::assemble(vec![(shard, header)]);
        }
        let count = count.unwrap_or(1);
        let (prefix, _) = parse_shard_name(path).ok_or_else(|| ReferenceError::Gguf {
            path: path.to_path_buf(),
            message: format!(
                "split.count is {count}, but the file name does not end in -NNNNN-of-{count:05}.gguf, \
                 so its other shards cannot be found"
            ),
        })?;
        let paths: Vec<PathBuf> = (1..=count)
            .map(|no| shard_path(&prefix, no, count))
            .collect();
        if let Some(missing) = paths.iter().find(|p| !p.exists()) {
            return Err(ReferenceError::Gguf {
                path: path.to_path_buf(),
                message: format!(
                    "a shard of the split set is missing: {} does not exist (split.count {count})",
                    missing.display()
                ),
            });
        }
        let mut files = vec![(shard, header)];
        for p in paths.iter().filter(|p| p.as_path() != path) {
            files.push(read_one(p)?);
        }
        Self::assemble(files)
    }

    /// Open a split set from its shard files listed in any order; each is placed by its own
    /// `split.no`, never by its place in the list.
    pub fn open_listed(paths: &[PathBuf]) -> Result<Self, ReferenceError> {
        let files = paths
            .iter()
            .map(|p| read_one(p))
            .collect::<Result<Vec<_>, _>>()?;
        Self::assemble(files)
    }

    /// Put the files in `split.no` order, check the set is whole, and merge the directories.
    fn assemble(files: Vec<(ShardFile, FileHeader)>) -> Result<Self, ReferenceError> {
        let n = files.len() as u64;
        let mut numbered = Vec::with_capacity(files.len());
        for (shard, header) in files {
            let no = if n == 1 {
                split_key(&header.0, &shard.path, "split.no")?.unwrap_or(0)
            } else {
                split_key(&header.0, &shard.path, "split.no")?.ok_or_else(|| {
                    ReferenceError::Gguf {
                        path: shard.path.clone(),
                        message: "a shard of a split set has no `split.no`".to_string(),
                    }
                })?
            };
            let count = split_key(&header.0, &shard.path, "split.count")?.unwrap_or(1);
            if count != n {
                return Err(ReferenceError::Gguf {
                    path: shard.path.clone(),
                    message: format!("split.count is {count}, but the set has {n} files"),
                });
            }
            numbered.push((no, shard, header));
        }
        numbered.sort_by_key(|(no, _, _)| *no);
        let mut shards = Vec::with_capacity(numbered.len());
        let mut metadata = HashMap::new();
        let mut tensors: HashMap<String, Located> = HashMap::new();
        for (i, (no, shard, (md, entries, _))) in numbered.into_iter().enumerate() {
            if no != i as u64 {
                return Err(ReferenceError::Gguf {
                    path: shard.path.clone(),
                    message: format!(
                        "expected shard {i} of {n} (split.no {i}), found split.no {no}: a shard is \
                         missing or listed twice"
                    ),
                });
            }
            if i == 0 {
                metadata = md;
            }
            for (name, entry) in entries {
                if tensors.contains_key(&name) {
                    return Err(ReferenceError::Gguf {
                        path: shard.path.clone(),
                        message: format!("tensor `{name}` is in more than one shard"),
                    });
                }
                tensors.insert(name, Located { shard: i, entry });
            }
            shards.push(shard);
        }
        Ok(Self {
            shards,
            metadata,
            tensors,
        })
    }

    /// Number of files the model is read from (1, or the shards of a split set).
    pub fn n_files(&self) -> usize {
        self.shards.len()
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor's name and element count.
    pub fn tensor_sizes(&self) -> impl Iterator<Item = (&str, u64)> {
        self.tensors.iter().map(|(name, t)| {
            let elems = t.entry.dims().iter().map(|&d| d as u64).product();
            (name.as_str(), elems)
        })
    }

    /// Shape of a tensor, outermost dimension first (the reverse of GGUF's `ne` order).
    pub fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|t| t.entry.dims().to_vec())
    }

    /// How a matrix product with tensor `name` reads its activations (ggml's `vec_dot_type` of
    /// the tensor's type); `None` when there is no such tensor.
    pub fn act_quant(&self, name: &str) -> Option<ActQuant> {
        self.tensors.get(name).map(|t| match &t.entry {
            Entry::Candle(info) => ActQuant::for_candle(info.ggml_dtype),
            Entry::Extra { kind, .. } => ActQuant::for_extra(*kind),
        })
    }

    /// Read and dequantize a tensor, convert it to `dtype`, and check its shape.
    pub fn tensor(
        &mut self,
        name: &str,
        expected: &[usize],
        dtype: DType,
    ) -> Result<Tensor, ReferenceError> {
        let outer = expected.first().copied().unwrap_or(1);
        self.tensor_outer(name, expected, 0..outer, dtype)
    }

    /// Check that tensor `name` has shape `expected` and that its data lies inside its file,
    /// without reading it.
    pub fn check(&self, name: &str, expected: &[usize]) -> Result<(), ReferenceError> {
        let outer = expected.first().copied().unwrap_or(1);
        Self::locate(&self.tensors, &self.shards, name, expected, 0..outer).map(|_| ())
    }

    /// Read and dequantize `rows` of the outermost dimension of tensor `name` (whose whole shape
    /// must be `expected`): one expert of an expert tensor, a range of rows of a matrix. The
    /// values are exactly those of the same rows of the whole tensor: dequantization works block
    /// by block, and a row range must start and end on a block boundary (checked).
    pub fn tensor_outer(
        &mut self,
        name: &str,
        expected: &[usize],
        rows: std::ops::Range<usize>,
        dtype: DType,
    ) -> Result<Tensor, ReferenceError> {
        let (located, start, size, dims) =
            Self::locate(&self.tensors, &self.shards, name, expected, rows.clone())?;
        if size == 0 {
            // Nothing to read (and candle's reader cannot take an empty buffer: it casts the
            // byte vector's dangling pointer to f32).
            return Ok(Tensor::zeros(dims.as_slice(), dtype, &Device::Cpu)?);
        }
        let data_err = |message: String| ReferenceError::TensorData {
            name: name.to_string(),
            message,
        };
        let file = &mut self.shards[located.shard];
        let io = |source| ReferenceError::Io {
            path: file.path.clone(),
            source,
        };
        let tensor = match &located.entry {
            Entry::Candle(info) => {
                // candle reads `shape`'s worth of blocks at data_offset + offset
                let part = TensorInfo {
                    ggml_dtype: info.ggml_dtype,
                    shape: candle_core::Shape::from(dims.clone()),
                    offset: start - file.data_offset,
                };
                part.read(&mut file.reader, file.data_offset, &Device::Cpu)
                    .and_then(|q| q.dequantize(&Device::Cpu))
                    .map_err(|e| data_err(first_line(&e)))?
            }
            Entry::Extra { kind, .. } => {
                let mut raw = vec![0u8; size as usize];
                file.reader
                    .seek(SeekFrom::Start(start))
                    .and_then(|_| file.reader.read_exact(&mut raw))
                    .map_err(io)?;
                Tensor::from_vec(kind.dequantize(&raw), dims.as_slice(), &Device::Cpu)?
            }
        };
        Ok(tensor.to_dtype(dtype)?)
    }

    /// Where rows `rows` of tensor `name` lie: `(its directory entry, absolute start in its
    /// shard, bytes, shape of the part)`, after checking the shape, the block alignment and the
    /// file's size. (Over the directory and the shards rather than `self`, so that a caller can
    /// then read from its shard.)
    fn locate<'t>(
        tensors: &'t HashMap<String, Located>,
        shards: &[ShardFile],
        name: &str,
        expected: &[usize],
        rows: std::ops::Range<usize>,
    ) -> Result<(&'t Located, u64, u64, Vec<usize>), ReferenceError> {
        let located = tensors
            .get(name)
            .ok_or_else(|| ReferenceError::MissingTensor {
                name: name.to_string(),
            })?;
        let found = located.entry.dims();
        if found != expected {
            return Err(ReferenceError::TensorShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: found.to_vec(),
            });
        }
        let data_err = |message: String| ReferenceError::TensorData {
            name: name.to_string(),
            message,
        };
        let outer = found.first().copied().unwrap_or(1);
        if rows.start > rows.end || rows.end > outer {
            return Err(data_err(format!(
                "rows {}..{} asked of a tensor with {outer}",
                rows.start, rows.end
            )));
        }
        let inner: u64 = found.iter().skip(1).map(|&d| d as u64).product();
        let (block, type_size) = located.entry.block();
        let (block, type_size) = (block as u64, type_size as u64);
        if !inner.is_multiple_of(block) {
            return Err(data_err(format!(
                "rows of {inner} elements are not a whole number of {block}-element blocks"
            )));
        }
        let row_bytes = inner / block * type_size;
        let file = &shards[located.shard];
        let tensor_start = file.data_offset.saturating_add(located.entry.offset());
        let tensor_end = tensor_start.saturating_add((outer as u64).saturating_mul(row_bytes));
        if tensor_end > file.file_size {
            return Err(data_err(format!(
                "needs bytes {tensor_start}..{tensor_end} of {}, which has {} bytes",
                file.path.display(),
                file.file_size
            )));
        }
        let start = tensor_start + rows.start as u64 * row_bytes;
        let size = (rows.end - rows.start) as u64 * row_bytes;
        let mut dims = found.to_vec();
        if let Some(d) = dims.first_mut() {
            *d = rows.end - rows.start;
        }
        Ok((located, start, size, dims))
    }
}

/// Open one file and read its header: by candle-core's reader, or by [`fallback_header`] when
/// candle rejects a tensor type.
fn read_one(path: &Path) -> Result<(ShardFile, FileHeader), ReferenceError> {
    let io = |source| ReferenceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_size = file.metadata().map_err(io)?.len();
    let mut reader = BufReader::new(file);
    let header = match Content::read(&mut reader) {
        Ok(content) => {
            let tensors = content
                .tensor_infos
                .into_iter()
                .map(|(name, info)| {
                    // candle parses these two but its tensor loader refuses them
                    let extra = match info.ggml_dtype {
                        GgmlDType::Q8_1 => Some(ExtraType::Q8_1),
                        GgmlDType::Q8K => Some(ExtraType::Q8K),
                        _ => None,
                    };
                    let entry = match extra {
                        Some(kind) => Entry::Extra {
                            kind,
                            dims: info.shape.dims().to_vec(),
                            offset: info.offset,
                        },
                        None => Entry::Candle(info),
                    };
                    (name, entry)
                })
                .collect();
            (content.metadata, tensors, content.tensor_data_offset)
        }
        Err(candle_err) => {
            reader.seek(SeekFrom::Start(0)).map_err(io)?;
            fallback_header(&mut reader, file_size).map_err(|message| ReferenceError::Gguf {
                path: path.to_path_buf(),
                message: format!("{message} (candle-core's reader said: {candle_err})"),
            })?
        }
    };
    let data_offset = header.2;
    Ok((
        ShardFile {
            path: path.to_path_buf(),
            reader,
            file_size,
            data_offset,
        },
        header,
    ))
}

/// `split.no` / `split.count` of one file, `None` when absent.
fn split_key(
    md: &HashMap<String, Value>,
    path: &Path,
    key: &str,
) -> Result<Option<u64>, ReferenceError> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => as_u64(v).map(Some).ok_or_else(|| ReferenceError::Gguf {
            path: path.to_path_buf(),
            message: format!("`{key}` is {v:?}, expected an unsigned integer"),
        }),
    }
}

/// `(PREFIX, count)` of a shard named `PREFIX-NNNNN-of-MMMMM.gguf` (gguf-split's convention).
pub(crate) fn parse_shard_name(path: &Path) -> Option<(PathBuf, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    let count: u64 = count.parse().ok()?;
    Some((path.with_file_name(prefix), count))
}

/// The path of shard `no` (1-based) of `count`, `PREFIX-NNNNN-of-MMMMM.gguf`.
pub(crate) fn shard_path(prefix: &Path, no: u64, count: u64) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(format!("-{no:05}-of-{count:05}.gguf"));
    PathBuf::from(s)
}

/// A candle error's message without the backtrace candle appends when `RUST_BACKTRACE` is set.
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Read the GGUF header (v2 or v3) without candle, for files candle rejects because of a tensor
/// type. Every length and count is checked against the bytes left in the file before anything is
/// allocated from it.
fn fallback_header<R: Read + Seek>(r: &mut R, file_size: u64) -> Result<FileHeader, String> {
    let mut h = Header { r, file_size };
    let magic = h.u32()?;
    if magic != 0x4655_4747 {
        return Err(format!("expected magic GGUF, found {magic:#010x}"));
    }
    let version = h.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("expected GGUF version 2 or 3, found {version}"));
    }
    let n_tensors = h.u64()?;
    let n_kv = h.u64()?;
    // a metadata entry takes at least 8 + 4 + 1 bytes, a tensor entry at least 8 + 4 + 4 + 8
    h.check_room(n_kv, 13, "metadata entries")?;
    h.check_room(n_tensors, 24, "tensor entries")?;
    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let key = h.string()?;
        let ty = h.u32()?;
        let value = h
            .value(ty, 0)
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        metadata.insert(key, value);
    }
    let mut tensors = HashMap::new();
    for _ in 0..n_tensors {
        let name = h.string()?;
        let n_dims = h.u32()?;
        if n_dims > 4 {
            return Err(format!(
                "tensor `{name}` has {n_dims} dimensions, at most 4 allowed"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = h.u64()?;
            dims.push(usize::try_from(d).map_err(|_| format!("tensor `{name}`: dimension {d}"))?);
        }
        dims.reverse();
        let type_id = h.u32()?;
        let offset = h.u64()?;
        let entry = if let Some(kind) = ExtraType::from_id(type_id) {
            Entry::Extra { kind, dims, offset }
        } else {
            let dtype = candle_dtype(type_id).ok_or_else(|| {
                format!("tensor `{name}` has GGML type id {type_id}, which the reference cannot dequantize")
            })?;
            Entry::Candle(TensorInfo {
                ggml_dtype: dtype,
                shape: candle_core::Shape::from(dims),
                offset,
            })
        };
        tensors.insert(name, entry);
    }
    let alignment = match metadata.get("general.alignment") {
        Some(v) => as_u64(v).filter(|&a| a > 0).unwrap_or(32),
        None => 32,
    };
    let position = h.r.stream_position().map_err(|e| e.to_string())?;
    Ok((metadata, tensors, position.div_ceil(alignment) * alignment))
}

/// candle's type for a GGUF type id, for the ids candle 0.11 reads and dequantizes.
fn candle_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Any integer metadata value as u64 (negative values are `None`).
pub(crate) fn as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(u64::from(x)),
        Value::U16(x) => Some(u64::from(x)),
        Value::U32(x) => Some(u64::from(x)),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

/// Any numeric metadata value as f64.
pub(crate) fn as_f64(v: &Value) -> Option<f64> {
    match *v {
        Value::F32(x) => Some(f64::from(x)),
        Value::F64(x) => Some(x),
        Value::I8(x) => Some(f64::from(x)),
        Value::I16(x) => Some(f64::from(x)),
        Value::I32(x) => Some(f64::from(x)),
        Value::I64(x) => Some(x as f64),
        _ => as_u64(v).map(|x| x as f64),
    }
}

struct Header<'a, R> {
    r: &'a mut R,
    file_size: u64,
}

impl<R: Read + Seek> Header<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("header ends early: {e}"))?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn remaining(&mut self) -> Result<u64, String> {
        let pos = self.r.stream_position().map_err(|e| e.to_string())?;
        Ok(self.file_size.saturating_sub(pos))
    }
    fn check_room(&mut self, count: u64, min_size: u64, what: &str) -> Result<(), String> {
        let remaining = self.remaining()?;
        if count.saturating_mul(min_size) > remaining {
            return Err(format!(
                "{count} {what} need at least {} bytes, {remaining} left in the file",
                count.saturating_mul(min_size)
            ));
        }
        Ok(())
    }
    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        self.check_room(len, 1, "string bytes")?;
        let mut b = vec![0u8; len as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("header ends early: {e}"))?;
        String::from_utf8(b).map_err(|e| format!("string is not UTF-8: {e}"))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err("arrays nested more than 3 deep".to_string());
                }
                let elem_ty = self.u32()?;
                let count = self.u64()?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 | 8 => 8,
                    9 => 12,
                    other => return Err(format!("unknown array element type {other}")),
                };
                self.check_room(count, min, "array elements")?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

/// Typed metadata look-ups with the key named in every error.
impl GgufFile {
    pub fn get_usize(&self, key: &str) -> Result<usize, ReferenceError> {
        let v = self
            .metadata(key)
            .ok_or_else(|| ReferenceError::MissingKey {
                key: key.to_string(),
            })?;
        as_u64(v)
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| ReferenceError::BadKey {
                key: key.to_string(),
                expected: "a non-negative integer",
                found: format!("{v:?}"),
            })
    }

    pub fn get_usize_or(&self, key: &str, default: usize) -> Result<usize, ReferenceError> {
        if self.metadata(key).is_some() {
            self.get_usize(key)
        } else {
            Ok(default)
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, ReferenceError> {
        let v = self
            .metadata(key)
            .ok_or_else(|| ReferenceError::MissingKey {
                key: key.to_string(),
            })?;
        as_f64(v).ok_or_else(|| ReferenceError::BadKey {
            key: key.to_string(),
            expected: "a number",
            found: format!("{v:?}"),
        })
    }

    pub fn get_f64_opt(&self, key: &str) -> Result<Option<f64>, ReferenceError> {
        if self.metadata(key).is_some() {
            self.get_f64(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool, ReferenceError> {
        match self.metadata(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ReferenceError::BadKey {
                key: key.to_string(),
                expected: "a bool",
                found: format!("{v:?}"),
            }),
        }
    }

    /// An array of booleans or integers as flags (non-zero is true).
    pub fn get_flags(&self, key: &str) -> Result<Vec<bool>, ReferenceError> {
        let bad = |v: &Value| ReferenceError::BadKey {
            key: key.to_string(),
            expected: "an array of booleans or integers",
            found: format!("{v:?}"),
        };
        match self.metadata(key) {
            None => Err(ReferenceError::MissingKey {
                key: key.to_string(),
            }),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    v => as_u64(v).map(|x| x != 0).ok_or_else(|| bad(v)),
                })
                .collect(),
            Some(v) => Err(bad(v)),
        }
    }

    pub fn get_string(&self, key: &str) -> Result<&str, ReferenceError> {
        match self.metadata(key) {
            None => Err(ReferenceError::MissingKey {
                key: key.to_string(),
            }),
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(ReferenceError::BadKey {
                key: key.to_string(),
                expected: "a string",
                found: format!("{v:?}"),
            }),
        }
    }

    /// The vocabulary pieces (`tokenizer.ggml.tokens`), empty when the file has none.
    pub fn token_pieces(&self) -> Result<Vec<String>, ReferenceError> {
        let key = "tokenizer.ggml.tokens";
        match self.metadata(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ReferenceError::BadKey {
                        key: key.to_string(),
                        expected: "an array of strings",
                        found: format!("an element {other:?}"),
                    }),
                })
                .collect(),
            Some(v) => Err(ReferenceError::BadKey {
                key: key.to_string(),
                expected: "an array of strings",
                found: format!("{:?}", v.value_type()),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 file with one F32 tensor `t` of `ne = [cols, rows]` holding `0, 1, 2, …`,
    /// and `extra` metadata `(key, type id, value bytes)`; `cut` bytes removed from the end.
    fn file(rows: u64, cols: u64, extra: &[(&str, u32, &[u8])], cut: usize) -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend((x.len() as u64).to_le_bytes());
            b.extend(x.as_bytes());
        };
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend((extra.len() as u64).to_le_bytes());
        for (k, ty, v) in extra {
            s(&mut b, k);
            b.extend(ty.to_le_bytes());
            b.extend(*v);
        }
        s(&mut b, "t");
        b.extend(2u32.to_le_bytes());
        b.extend(cols.to_le_bytes());
        b.extend(rows.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for i in 0..rows * cols {
            b.extend((i as f32).to_le_bytes());
        }
        b.truncate(b.len() - cut);
        b
    }

    fn open(bytes: &[u8]) -> (tempfile_dir::Dir, Result<GgufFile, ReferenceError>) {
        let dir = tempfile_dir::Dir::new();
        let path = dir.0.join("m.gguf");
        std::fs::write(&path, bytes).expect("write");
        let f = GgufFile::open(&path);
        (dir, f)
    }

    /// A directory removed on drop (the reference has no tempfile dependency).
    mod tempfile_dir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                static N: AtomicUsize = AtomicUsize::new(0);
                let p = std::env::temp_dir().join(format!(
                    "reference-gguf-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).expect("temp dir");
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn row_ranges_are_the_rows_of_the_whole_tensor() {
        let (_d, f) = open(&file(5, 3, &[], 0));
        let mut f = f.expect("open");
        let whole = f.tensor("t", &[5, 3], DType::F32).expect("whole");
        for (a, b) in [(0, 5), (0, 1), (2, 4), (4, 5), (3, 3)] {
            let part = f
                .tensor_outer("t", &[5, 3], a..b, DType::F32)
                .expect("rows");
            assert_eq!(part.dims(), &[b - a, 3]);
            let want = whole.narrow(0, a, b - a).expect("narrow");
            assert_eq!(
                part.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("part"),
                want.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("want"),
            );
        }
        match f.tensor_outer("t", &[5, 3], 4..6, DType::F32) {
            Err(ReferenceError::TensorData { name, message }) => {
                assert_eq!(name, "t");
                assert!(message.contains("rows 4..6"), "{message}");
            }
            other => panic!("expected TensorData, found {other:?}"),
        }
    }

    #[test]
    fn a_truncated_tensor_is_refused_by_check_before_any_read() {
        let (_d, f) = open(&file(5, 3, &[], 4));
        let f = f.expect("the header reads");
        match f.check("t", &[5, 3]) {
            Err(ReferenceError::TensorData { name, message }) => {
                assert_eq!(name, "t");
                assert!(message.contains("needs bytes"), "{message}");
            }
            other => panic!("expected TensorData, found {other:?}"),
        }
        assert!(matches!(
            f.check("t", &[3, 5]),
            Err(ReferenceError::TensorShape { .. })
        ));
        assert!(matches!(
            f.check("u", &[5, 3]),
            Err(ReferenceError::MissingTensor { .. })
        ));
    }

    #[test]
    fn shard_names_follow_gguf_split() {
        let p = Path::new("/m/Kimi-K2-Q4_K_M-00002-of-00013.gguf");
        let (prefix, count) = parse_shard_name(p).expect("a shard name");
        assert_eq!(prefix, Path::new("/m/Kimi-K2-Q4_K_M"));
        assert_eq!(count, 13);
        assert_eq!(
            shard_path(&prefix, 13, 13),
            Path::new("/m/Kimi-K2-Q4_K_M-00013-of-00013.gguf")
        );
        for not in ["/m/a.gguf", "/m/a-2-of-3.gguf", "/m/a-00002-of-00013.bin"] {
            assert_eq!(parse_shard_name(Path::new(not)), None, "{not}");
        }
    }

    #[test]
    fn a_shard_whose_name_hides_its_set_is_refused() {
        // split.count 2 (a u16, type 2) on a file named m.gguf: its other shard cannot be found
        let (_d, f) = open(&file(1, 3, &[("split.count", 2, &2u16.to_le_bytes())], 0));
        match f {
            Err(ReferenceError::Gguf { message, .. }) => {
                assert!(message.contains("split.count is 2"), "{message}")
            }
            other => panic!("expected Gguf, found {:?}", other.map(|_| ())),
        }
        // split.count 1 is a file of its own
        let (_d, f) = open(&file(1, 3, &[("split.count", 2, &1u16.to_le_bytes())], 0));
        assert_eq!(f.expect("a set of one").n_files(), 1);
    }
}
