//! `plumbline inspect FILE [--json]`: metadata, then every tensor with its type, shape, bytes, shard
//! and offset, then totals per type. Types that plumbline cannot compute with are reported up front.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kernels::quant::GgmlType;
use serde_json::{json, Value};

use engine::gguf::{Gguf, MetadataValue, TensorInfo};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file (any shard of a split set loads the whole set)
    pub file: PathBuf,
    /// Print JSON instead of tables
    #[arg(long)]
    pub json: bool,
}

/// Arrays longer than this are summarized: their length, element type and first elements.
const ARRAY_PREVIEW: usize = 8;

pub fn run(args: Args) -> Result<()> {
    let gguf =
        Gguf::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let out = if args.json {
        serde_json::to_string_pretty(&to_json(&gguf))? + "\n"
    } else {
        to_text(&gguf)
    };
    print!("{out}");
    Ok(())
}

fn to_text(gguf: &Gguf) -> String {
    let mut s = String::new();
    for (i, shard) in gguf.shards().iter().enumerate() {
        let _ = writeln!(
            s,
            "shard {i}: {} (GGUF v{}, {} tensors, alignment {}, data at {}, {} bytes)",
            shard.path.display(),
            shard.version,
            shard.n_tensors,
            shard.alignment,
            shard.data_offset,
            shard.file_size
        );
    }
    let _ = writeln!(s, "\nmetadata ({} keys):", gguf.metadata().len());
    for (key, value) in gguf.metadata().iter() {
        let _ = writeln!(s, "  {key:<44} {}", summarize(value));
    }

    let tensors = gguf.tensors();
    let name_w = tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(s, "\ntensors ({}):", tensors.len());
    let _ = writeln!(
        s,
        "  {:<name_w$}  {:<8}  {:<22}  {:>12}  {:>5}  {:>12}",
        "name", "type", "shape", "bytes", "shard", "offset"
    );
    for t in tensors {
        let _ = writeln!(
            s,
            "  {:<name_w$}  {:<8}  {:<22}  {:>12}  {:>5}  {:>12}",
            t.name,
            t.ggml_type.name(),
            shape(t),
            t.n_bytes,
            t.shard,
            t.offset
        );
    }

    let _ = writeln!(s, "\ntotals by type:");
    let _ = writeln!(
        s,
        "  {:<8}  {:>7}  {:>14}  {:>14}  {:>6}",
        "type", "tensors", "elements", "bytes", "bpw"
    );
    let totals = totals(tensors);
    let (mut n, mut e, mut b) = (0usize, 0u64, 0u64);
    for (ty, t) in &totals {
        let _ = writeln!(
            s,
            "  {:<8}  {:>7}  {:>14}  {:>14}  {:>6.2}",
            ty.name(),
            t.count,
            t.elements,
            t.bytes,
            bits_per_weight(t.bytes, t.elements)
        );
        n += t.count;
        e += t.elements;
        b += t.bytes;
    }
    let _ = writeln!(
        s,
        "  {:<8}  {:>7}  {:>14}  {:>14}  {:>6.2}",
        "all",
        n,
        e,
        b,
        bits_per_weight(b, e)
    );

    let unsupported: Vec<_> = totals.keys().filter(|t| !t.is_supported()).collect();
    if unsupported.is_empty() {
        let _ = writeln!(s, "\nevery tensor type is supported by plumbline's kernels");
    } else {
        let names: Vec<_> = unsupported.iter().map(|t| t.name()).collect();
        let _ = writeln!(
            s,
            "\nwarning: no kernel for tensor types {}; these tensors cannot be computed with",
            names.join(", ")
        );
    }
    s
}

fn to_json(gguf: &Gguf) -> Value {
    let shards: Vec<Value> = gguf
        .shards()
        .iter()
        .map(|sh| {
            json!({
                "path": sh.path.display().to_string(), "version": sh.version, "n_tensors": sh.n_tensors,
                "alignment": sh.alignment, "data_offset": sh.data_offset, "file_size": sh.file_size,
            })
        })
        .collect();
    let metadata: serde_json::Map<String, Value> = gguf
        .metadata()
        .iter()
        .map(|(k, v)| (k.to_string(), value_json(v)))
        .collect();
    let tensors: Vec<Value> = gguf
        .tensors()
        .iter()
        .map(|t| {
            json!({
                "name": t.name, "type": t.ggml_type.name(), "shape": t.dims, "n_bytes": t.n_bytes,
                "shard": t.shard, "offset": t.offset, "supported": t.ggml_type.is_supported(),
            })
        })
        .collect();
    let totals: serde_json::Map<String, Value> = totals(gguf.tensors())
        .into_iter()
        .map(|(ty, t)| {
            let v = json!({"tensors": t.count, "elements": t.elements, "bytes": t.bytes,
                           "supported": ty.is_supported()});
            (ty.name().to_string(), v)
        })
        .collect();
    json!({ "shards": shards, "metadata": metadata, "tensors": tensors, "totals_by_type": totals })
}

#[derive(Default)]
struct Total {
    count: usize,
    elements: u64,
    bytes: u64,
}

fn totals(tensors: &[TensorInfo]) -> BTreeMap<GgmlType, Total> {
    let mut totals: BTreeMap<GgmlType, Total> = BTreeMap::new();
    for t in tensors {
        let e = totals.entry(t.ggml_type).or_default();
        e.count += 1;
        e.elements += t.n_elements();
        e.bytes += t.n_bytes;
    }
    totals
}

fn bits_per_weight(bytes: u64, elements: u64) -> f64 {
    if elements == 0 {
        0.0
    } else {
        bytes as f64 * 8.0 / elements as f64
    }
}

fn shape(t: &TensorInfo) -> String {
    let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// One line for a metadata value; arrays longer than [`ARRAY_PREVIEW`] show their first elements.
fn summarize(v: &MetadataValue) -> String {
    match v {
        MetadataValue::Array(items) if items.len() > ARRAY_PREVIEW => {
            let head: Vec<String> = items[..ARRAY_PREVIEW].iter().map(summarize).collect();
            format!(
                "[{} × {}] [{}, ...]",
                items.len(),
                type_name(&items[0]),
                head.join(", ")
            )
        }
        MetadataValue::Array(items) => {
            let all: Vec<String> = items.iter().map(summarize).collect();
            format!("[{}]", all.join(", "))
        }
        MetadataValue::String(s) => format!("{s:?}"),
        other => scalar(other),
    }
}

fn scalar(v: &MetadataValue) -> String {
    match v {
        MetadataValue::U8(x) => x.to_string(),
        MetadataValue::I8(x) => x.to_string(),
        MetadataValue::U16(x) => x.to_string(),
        MetadataValue::I16(x) => x.to_string(),
        MetadataValue::U32(x) => x.to_string(),
        MetadataValue::I32(x) => x.to_string(),
        MetadataValue::U64(x) => x.to_string(),
        MetadataValue::I64(x) => x.to_string(),
        MetadataValue::F32(x) => x.to_string(),
        MetadataValue::F64(x) => x.to_string(),
        MetadataValue::Bool(x) => x.to_string(),
        MetadataValue::String(s) => format!("{s:?}"),
        MetadataValue::Array(items) => format!("[{} items]", items.len()),
    }
}

fn type_name(v: &MetadataValue) -> &'static str {
    match v {
        MetadataValue::U8(_) => "u8",
        MetadataValue::I8(_) => "i8",
        MetadataValue::U16(_) => "u16",
        MetadataValue::I16(_) => "i16",
        MetadataValue::U32(_) => "u32",
        MetadataValue::I32(_) => "i32",
        MetadataValue::U64(_) => "u64",
        MetadataValue::I64(_) => "i64",
        MetadataValue::F32(_) => "f32",
        MetadataValue::F64(_) => "f64",
        MetadataValue::Bool(_) => "bool",
        MetadataValue::String(_) => "string",
        MetadataValue::Array(_) => "array",
    }
}

/// Full JSON for a metadata value (arrays are not summarized: JSON is for scripts).
fn value_json(v: &MetadataValue) -> Value {
    match v {
        MetadataValue::U8(x) => json!(x),
        MetadataValue::I8(x) => json!(x),
        MetadataValue::U16(x) => json!(x),
        MetadataValue::I16(x) => json!(x),
        MetadataValue::U32(x) => json!(x),
        MetadataValue::I32(x) => json!(x),
        MetadataValue::U64(x) => json!(x),
        MetadataValue::I64(x) => json!(x),
        MetadataValue::F32(x) => json!(x),
        MetadataValue::F64(x) => json!(x),
        MetadataValue::Bool(x) => json!(x),
        MetadataValue::String(x) => json!(x),
        MetadataValue::Array(items) => Value::Array(items.iter().map(value_json).collect()),
    }
}
