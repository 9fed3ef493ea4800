//! `plumbline dump FILE --tensor NAME --out PATH`: one tensor dequantized to f32.
//!
//! Raw little-endian f32 in GGUF element order (ne0 fastest), or `.npy` when PATH ends in `.npy`
//! (C order, shape `[ne_{n-1}, ..., ne1, ne0]`, which is the same element order).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use engine::gguf::Gguf;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file (any shard of a split set loads the whole set)
    pub file: PathBuf,
    /// Tensor name, e.g. blk.0.attn_q.weight
    #[arg(long)]
    pub tensor: String,
    /// Output path: raw little-endian f32, or NumPy when it ends in .npy
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: Args) -> Result<()> {
    let gguf =
        Gguf::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let Some(info) = gguf.tensor(&args.tensor) else {
        bail!(
            "{} has no tensor named {:?}",
            args.file.display(),
            args.tensor
        );
    };
    if !info.ggml_type.is_supported() {
        bail!(
            "tensor {} has type {}, which plumbline cannot dequantize",
            info.name,
            info.ggml_type
        );
    }
    let n = usize::try_from(info.n_elements()).context("tensor too large for this machine")?;
    let mut values = vec![0f32; n];
    kernels::quant::dequantize(info.ggml_type, gguf.tensor_data(info), &mut values)
        .with_context(|| format!("dequantizing {} ({})", info.name, info.ggml_type))?;
    let is_npy = args
        .out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("npy"));
    write(&args.out, &values, is_npy.then_some(&info.dims[..]))
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "{}: {} {:?} → {} f32 values in {}",
        info.name,
        info.ggml_type,
        info.dims,
        n,
        args.out.display()
    );
    Ok(())
}

fn write(path: &Path, values: &[f32], npy_dims: Option<&[u64]>) -> Result<()> {
    let mut w = BufWriter::new(File::create(path)?);
    if let Some(dims) = npy_dims {
        w.write_all(&npy_header(dims))?;
    }
    for v in values {
        w.write_all(&v.to_le_bytes())?;
    }
    w.flush()?;
    Ok(())
}

/// A NumPy v1.0 header for a little-endian f32 array in C order; GGUF dims are ne0-first, NumPy's
/// shape is slowest-first, so the dims are reversed.
fn npy_header(dims: &[u64]) -> Vec<u8> {
    let shape: Vec<String> = dims.iter().rev().map(u64::to_string).collect();
    let shape = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!("({})", shape.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    // magic (6) + version (2) + header length (2) + dict + '\n' is padded to a multiple of 64.
    let unpadded = 10 + dict.len() + 1;
    dict.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::npy_header;

    fn check(dims: &[u64], expect_shape: &str) {
        let h = npy_header(dims);
        assert_eq!(h.len() % 64, 0, "header must be 64-byte aligned");
        let text = String::from_utf8_lossy(&h[10..]);
        assert!(text.contains(&format!("'shape': {expect_shape}")), "{text}");
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn npy_shape_is_reversed_gguf_dims() {
        check(&[640], "(640,)");
        check(&[640, 1024], "(1024, 640)");
        check(&[4, 3, 2], "(2, 3, 4)");
    }
}
