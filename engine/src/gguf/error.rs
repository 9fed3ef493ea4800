//! The one error type of [`crate::gguf`]: every failure names the file, the field or tensor, and
//! where it can the byte offset at which the reader found the problem.

use std::path::{Path, PathBuf};

use kernels::quant::GgmlType;

/// Everything that can go wrong reading, validating or writing a GGUF file or split set.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The operating system refused an operation (open, stat, map, create, write, rename).
    #[error("{}: {op}: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("{}: magic at offset 0: expected \"GGUF\", found {}", .path.display(), show_bytes(.found))]
    BadMagic { path: PathBuf, found: Vec<u8> },

    /// A version this reader does not handle (1 is the pre-2023 format with 32-bit counts).
    #[error("{}: version at offset 4: expected 2 or 3, found {version}", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },

    /// The version reads byte-swapped: the file was written big-endian.
    #[error(
        "{}: version at offset 4: expected 2 or 3 little-endian, found {raw:#010x} (version {swapped} byte-swapped): the file is big-endian, only little-endian GGUF is supported",
        .path.display()
    )]
    BigEndian {
        path: PathBuf,
        raw: u32,
        swapped: u32,
    },

    /// A fixed-size field runs past the end of the file.
    #[error("{}: {field} at offset {offset}: expected {needed} bytes, found {available} left in the file", .path.display())]
    Truncated {
        path: PathBuf,
        field: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    /// A count or length that the rest of the file cannot possibly hold.
    #[error(
        "{}: {field} at offset {offset}: count {count} needs at least {needed} bytes, found {available} left in the file",
        .path.display()
    )]
    CountTooLarge {
        path: PathBuf,
        field: String,
        offset: u64,
        count: u64,
        needed: u64,
        available: u64,
    },

    /// A key, tensor name or string value that is not UTF-8.
    #[error("{}: {field} at offset {offset}: expected UTF-8, found an invalid sequence after {valid_up_to} bytes", .path.display())]
    InvalidUtf8 {
        path: PathBuf,
        field: String,
        offset: u64,
        valid_up_to: usize,
    },

    /// A metadata value type id outside 0..=12.
    #[error("{}: {field} at offset {offset}: expected a value type id 0..=12, found {type_id}", .path.display())]
    UnknownValueType {
        path: PathBuf,
        field: String,
        offset: u64,
        type_id: u32,
    },

    /// A bool stored as something other than 0 or 1.
    #[error("{}: {field} at offset {offset}: expected a bool (0 or 1), found {value}", .path.display())]
    InvalidBool {
        path: PathBuf,
        field: String,
        offset: u64,
        value: u8,
    },

    /// Arrays of arrays nested deeper than the reader allows (bounds its recursion).
    #[error("{}: {field} at offset {offset}: expected arrays nested at most {max} deep, found deeper", .path.display())]
    NestingTooDeep {
        path: PathBuf,
        field: String,
        offset: u64,
        max: usize,
    },

    /// The same metadata key twice in one file.
    #[error("{}: metadata key {key:?} at offset {offset}: expected unique keys, found a duplicate", .path.display())]
    DuplicateKey {
        path: PathBuf,
        key: String,
        offset: u64,
    },

    /// `general.alignment` that is not a non-zero power of two (or not an integer).
    #[error("{}: general.alignment at offset {offset}: expected a non-zero power of two, found {found}", .path.display())]
    BadAlignment {
        path: PathBuf,
        offset: u64,
        found: String,
    },

    /// More than ggml's `GGML_MAX_DIMS` (4) dimensions.
    #[error("{}: tensor {tensor:?} n_dims at offset {offset}: expected at most 4, found {n_dims}", .path.display())]
    TooManyDims {
        path: PathBuf,
        tensor: String,
        offset: u64,
        n_dims: u32,
    },

    /// A zero dimension.
    #[error("{}: tensor {tensor:?} dimension {index} at offset {offset}: expected > 0, found 0", .path.display())]
    ZeroDim {
        path: PathBuf,
        tensor: String,
        offset: u64,
        index: usize,
    },

    /// Dimensions whose product (or byte size) overflows 64 bits.
    #[error("{}: tensor {tensor:?} dims at offset {offset}: expected an element count that fits in u64, found dims {dims:?}", .path.display())]
    ShapeOverflow {
        path: PathBuf,
        tensor: String,
        offset: u64,
        dims: Vec<u64>,
    },

    /// A tensor type id that ggml does not define.
    #[error("{}: tensor {tensor:?} type at offset {offset}: expected a ggml type id, found unknown id {type_id}", .path.display())]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    /// An element count that is not a whole number of the type's blocks.
    #[error(
        "{}: tensor {tensor:?} at offset {offset}: expected a multiple of {block_size} elements for {ggml_type}, found {n_elements}",
        .path.display()
    )]
    PartialBlock {
        path: PathBuf,
        tensor: String,
        offset: u64,
        ggml_type: GgmlType,
        n_elements: u64,
        block_size: usize,
    },

    /// A tensor data offset that is not a multiple of the file's alignment.
    #[error(
        "{}: tensor {tensor:?} data offset field at offset {offset}: expected a multiple of {alignment}, found {tensor_offset}",
        .path.display()
    )]
    MisalignedTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
        tensor_offset: u64,
        alignment: u64,
    },

    /// A tensor whose bytes do not lie inside the file.
    #[error(
        "{}: tensor {tensor:?} data offset field at offset {offset}: expected bytes {start}..{end} inside the file, found a file of {file_size} bytes",
        .path.display()
    )]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        offset: u64,
        start: u64,
        end: u64,
        file_size: u64,
    },

    /// Two tensors whose bytes overlap.
    #[error(
        "{}: tensor {second:?} at byte {second_start}: expected it to start at or after byte {first_end}, where tensor {first:?} ends, found an overlap",
        .path.display()
    )]
    TensorsOverlap {
        path: PathBuf,
        first: String,
        first_end: u64,
        second: String,
        second_start: u64,
    },

    /// The same tensor name twice in one file.
    #[error("{}: tensor {tensor:?} at offset {offset}: expected unique tensor names, found a duplicate", .path.display())]
    DuplicateTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
    },

    /// The aligned start of the data section lies past the end of a file that has tensors.
    #[error("{}: data section: expected it to start inside the file, found start {data_offset} in a file of {file_size} bytes", .path.display())]
    DataOffsetOutOfBounds {
        path: PathBuf,
        data_offset: u64,
        file_size: u64,
    },

    /// A split file whose name does not follow gguf-split's `PREFIX-NNNNN-of-NNNNN.gguf`.
    #[error("{}: split file name: expected {expected}, found {found}", .path.display())]
    SplitName {
        path: PathBuf,
        expected: String,
        found: String,
    },

    /// A shard of a split set that is not on disk.
    #[error("{}: shard {} of {count}: expected the file to exist, found nothing", .path.display(), .no + 1)]
    ShardMissing { path: PathBuf, no: u16, count: u16 },

    /// Two shard files that both claim the same `split.no`.
    #[error(
        "{}: split.no: expected a shard number of its own, found {no} (0-based), already claimed by {}",
        .path.display(), .other.display()
    )]
    ShardDuplicate {
        path: PathBuf,
        other: PathBuf,
        no: u16,
    },

    /// A shard whose `split.no` disagrees with its position in the set (its file name).
    #[error("{}: split.no: expected {expected} (from the file name), found {found}", .path.display())]
    ShardOutOfOrder {
        path: PathBuf,
        expected: u16,
        found: u16,
    },

    /// A shard that belongs to another set (disagrees on `split.count` or `split.tensors.count`,
    /// or lacks the split keys).
    #[error("{}: {key}: expected {expected} as in the rest of the set, found {found} (foreign shard)", .path.display())]
    ShardForeign {
        path: PathBuf,
        key: &'static str,
        expected: String,
        found: String,
    },

    /// A tensor that appears in two shards of a set.
    #[error(
        "{}: tensor {tensor:?}: expected each tensor in one shard, found it also in {}",
        .second.display(), .first.display()
    )]
    SplitDuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    /// The shards together hold a different number of tensors than `split.tensors.count` says.
    #[error("{}: split.tensors.count: expected {expected} tensors across the set, found {found}", .path.display())]
    SplitTensorCount {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    /// A typed metadata accessor found the key absent or of another type.
    #[error("metadata {key:?}: expected {expected}, found {found}")]
    Metadata {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// [`crate::gguf::GgufWriter::add_tensor`] got a data buffer of the wrong size.
    #[error("tensor {tensor:?} data: expected {expected} bytes, found {found}")]
    DataLength {
        tensor: String,
        expected: u64,
        found: u64,
    },

    /// [`crate::gguf::GgufWriter`] was asked to write something GGUF (or llama.cpp) cannot hold.
    #[error("{what}: expected {expected}, found {found}")]
    InvalidWrite {
        what: String,
        expected: String,
        found: String,
    },
}

impl GgufError {
    pub(crate) fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }

    /// The file the error is about, when it is about one file.
    pub fn path(&self) -> Option<&Path> {
        use GgufError::*;
        match self {
            Io { path, .. }
            | BadMagic { path, .. }
            | UnsupportedVersion { path, .. }
            | BigEndian { path, .. }
            | Truncated { path, .. }
            | CountTooLarge { path, .. }
            | InvalidUtf8 { path, .. }
            | UnknownValueType { path, .. }
            | InvalidBool { path, .. }
            | NestingTooDeep { path, .. }
            | DuplicateKey { path, .. }
            | BadAlignment { path, .. }
            | TooManyDims { path, .. }
            | ZeroDim { path, .. }
            | ShapeOverflow { path, .. }
            | UnknownTensorType { path, .. }
            | PartialBlock { path, .. }
            | MisalignedTensor { path, .. }
            | TensorOutOfBounds { path, .. }
            | TensorsOverlap { path, .. }
            | DuplicateTensor { path, .. }
            | DataOffsetOutOfBounds { path, .. }
            | SplitName { path, .. }
            | ShardMissing { path, .. }
            | ShardDuplicate { path, .. }
            | ShardOutOfOrder { path, .. }
            | ShardForeign { path, .. }
            | SplitTensorCount { path, .. } => Some(path),
            SplitDuplicateTensor { second, .. } => Some(second),
            Metadata { .. } | DataLength { .. } | InvalidWrite { .. } => None,
        }
    }
}

/// Bytes as an escaped string, so a bad magic reads as what it is (`"GGML"`, `"\0\0\0\0"`).
fn show_bytes(b: &[u8]) -> String {
    format!("\"{}\"", b.escape_ascii())
}
