//! The kernel sources (`kernels/cuda/*.cu`), compiled into the binary so that a deployment
//! needs no source tree. Each file is one NVRTC program: the shared prelude (`common.cuh`,
//! `quant.cuh`) followed by the file.

use sha2::{Digest, Sha256};

macro_rules! src {
    ($f:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../kernels/cuda/", $f))
    };
}

const COMMON: &str = src!("common.cuh");
const QUANT: &str = src!("quant.cuh");

/// One kernel file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFile {
    /// `mmv.cu`
    pub name: &'static str,
    body: &'static str,
}

/// Every kernel file, in the order the backend loads them.
pub const FILES: [KernelFile; 8] = [
    KernelFile {
        name: "quantize.cu",
        body: src!("quantize.cu"),
    },
    KernelFile {
        name: "mmv.cu",
        body: src!("mmv.cu"),
    },
    KernelFile {
        name: "dequant.cu",
        body: src!("dequant.cu"),
    },
    KernelFile {
        name: "norm_rope.cu",
        body: src!("norm_rope.cu"),
    },
    KernelFile {
        name: "attention.cu",
        body: src!("attention.cu"),
    },
    KernelFile {
        name: "elementwise.cu",
        body: src!("elementwise.cu"),
    },
    KernelFile {
        name: "moe.cu",
        body: src!("moe.cu"),
    },
    KernelFile {
        name: "sample.cu",
        body: src!("sample.cu"),
    },
];

impl KernelFile {
    /// A file with this body (tests compile deliberately broken kernels through it).
    pub const fn custom(name: &'static str, body: &'static str) -> KernelFile {
        KernelFile { name, body }
    }

    /// The program NVRTC compiles: prelude, then the file.
    pub fn program(&self) -> String {
        format!(
            "// ---- common.cuh\n{COMMON}\n// ---- quant.cuh\n{QUANT}\n// ---- {}\n{}",
            self.name, self.body
        )
    }

    /// SHA-256 of [`Self::program`], hex.
    pub fn hash(&self) -> String {
        let d = Sha256::digest(self.program().as_bytes());
        d.iter().map(|b| format!("{b:02x}")).collect()
    }
}
