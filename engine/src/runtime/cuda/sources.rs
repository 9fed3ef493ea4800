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

/// The entry point that marks a program (and an emulator) built with `fault`'s define.
pub fn fault_marker(fault: crate::faults::Fault) -> String {
    format!("plumbline_fault_{}", fault.name().replace(['-', '.'], "_"))
}

/// The source of [`fault_marker`]'s kernel (an empty `extern "C" __global__` function).
pub fn fault_marker_source(fault: crate::faults::Fault) -> String {
    format!(
        "extern \"C\" __global__ void {}() {{}}\n",
        fault_marker(fault)
    )
}

/// What a program starts with: nothing, unless a CUDA source fault is active (fault-injection
/// builds only; see [`KernelFile::program`]).
fn fault_prelude(file: &str) -> String {
    let Some(fault) = crate::faults::active_cuda_source_fault() else {
        return String::new();
    };
    let define = fault.cuda_define().unwrap_or_default();
    let mut s = format!("// ---- fault {fault} (fault-injection build)\n#define {define} 1\n");
    if file == "quantize.cu" {
        s.push_str(&fault_marker_source(fault));
    }
    s
}

impl KernelFile {
    /// A file with this body (tests compile deliberately broken kernels through it).
    pub const fn custom(name: &'static str, body: &'static str) -> KernelFile {
        KernelFile { name, body }
    }

    /// The program NVRTC compiles: prelude, then the file. In a fault-injection build with a
    /// fault planted in the kernel sources active ([`crate::faults::Fault::cuda_define`]), the
    /// program starts with that fault's `#define` (so its hash, and its cubin cache entry, differ
    /// from the clean program's), and `quantize.cu` gets an extra entry point named after the
    /// fault, which only an emulator built with the same fault has: a fault cubin never runs
    /// on a clean emulator's host code unnoticed (the backend fails to load it).
    pub fn program(&self) -> String {
        format!(
            "{}// ---- common.cuh\n{COMMON}\n// ---- quant.cuh\n{QUANT}\n// ---- {}\n{}",
            fault_prelude(self.name),
            self.name,
            self.body
        )
    }

    /// SHA-256 of [`Self::program`], hex.
    pub fn hash(&self) -> String {
        let d = Sha256::digest(self.program().as_bytes());
        d.iter().map(|b| format!("{b:02x}")).collect()
    }
}
