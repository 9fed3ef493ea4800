//! The harness's typed errors.

use std::path::PathBuf;

/// Everything the harness can refuse. Messages say what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(
        "unknown weight type `{0}`: expected f32, f16, bf16 or a quantized type such as q8_0, q4_k_m, iq4_nl, mxfp4"
    )]
    UnknownWeightType(String),
    #[error(
        "unknown backend `{0}`: expected cpu-scalar, cpu-avx2, cpu-avx512 or cuda-smNN (sm80, sm86, sm89, sm90, sm100, sm120)"
    )]
    UnknownBackend(String),
    #[error("unknown topology `{0}`: expected shm, pcie or nvlink")]
    UnknownTopology(String),
    #[error("unknown speculation mode `{0}`: expected off or tree-bBkK (e.g. tree-b8k4); chunked, decode and serve are paths (path=…)")]
    UnknownSpec(String),
    #[error("unknown path `{0}` (expected prefill, chunked, decode or serve)")]
    UnknownPath(String),
    #[error("unknown KV cache type `{0}` (expected f32 or f16)")]
    UnknownKvCache(String),
    #[error(
        "malformed case name `{name}`: {why} (expected arch/weights/backend/tpN-topology/spec, or …/path for a path other than prefill, ending in -kvf16 with an f16 KV cache)"
    )]
    CaseName { name: String, why: String },
    #[error("malformed --only `{0}`: expected AXIS=VALUE with AXIS one of model, weights, backend, tp, topology, path, spec, kv")]
    OnlyFilter(String),
    #[error("{what}: expected {expected} values, found {found}")]
    Length {
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("{what}: expected at least {expected}, found {found}")]
    TooFew {
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("invalid parameter {name}: {why}")]
    Parameter { name: &'static str, why: String },
    #[error("reading or writing {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing JSON in {path}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;
