//! Named faults for proving the verification harness (ARCHITECTURE.md: the fault suite).
//!
//! With the `fault-injection` feature, one fault may be active per process, chosen once from the
//! environment variable `PLUMBLINE_FAULT` (a [`Fault::name`]) or by [`install`] before the first
//! forward pass. Without the feature [`is_active`] is a constant `false` and every hook compiles
//! out.

use std::fmt;

/// The environment variable naming the active fault.
pub const ENV_VAR: &str = "PLUMBLINE_FAULT";

/// A deliberate, named bug. Each says where it lives and which tap should first show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// RoPE uses position `p + 1` for queries and keys (first seen at `blk.0.q`).
    RopePositionOffByOne,
    /// Layer 0 drops the residual add after attention (first seen at `blk.0.ffn_norm`, the first tap
    /// computed from the residual stream after that add).
    SkipResidualAdd,
    /// Sliding-window layers let a query see one key more than the window (first seen at the
    /// `attn` tap of a local layer, only once a sequence is longer than the window).
    SlidingWindowOffByOne,
    /// The top expert of the first token of every MoE layer outputs NaN (first seen at
    /// `blk.{first moe layer}.ffn_out`).
    NanInExpert,
    /// The router takes ranks `0..k-1` and `k` instead of `0..k` (first seen at the first MoE
    /// layer's `ffn_out`).
    WrongRouterTopK,
    /// The two halves of the query heads (two tensor-parallel shards) are swapped, as a loader
    /// that placed shards in the wrong order would do (first seen at `blk.0.q`).
    SwappedQkShards,
    /// The CPU backend's Q4_K matmul reads every block's super-block scale `d` as `d × 1.0625`
    /// (only Q4_K weights; first seen at the first tap computed by a Q4_K matmul).
    WrongDequantScale,
    /// Expert `e` of every MoE layer computes with expert `(e + 1) mod n`'s weights, as a loader
    /// that laid out the 3-D expert tensors in the wrong order would (first seen at the first MoE
    /// layer's `ffn_out`).
    PermutedExperts,
    /// The tokenizer omits BOS even where the model asks for it (`add_bos_token`). The reference
    /// tokenizes with its own tokenizer, so verify's `tokens` gate must see it.
    TokenizerDropsBos,
    /// `Gguf::open_listed` maps each shard's data in the order the files were listed instead of
    /// by `split.no`, so a shard's tensor table reads another shard's bytes (on a split set with
    /// one layer per shard and shards 1, 2 listed swapped: first seen at `blk.0.attn_norm`).
    SplitListingOrder,
    /// The shard plan gives rank r the query rows of rank r+1 (a loader with its q/k/v shards in
    /// the wrong order; first seen at `blk.0.q`, gathered from the ranks).
    TpQkvShardOrder,
    /// The all-reduce after the row-parallel attention output is skipped, so each rank keeps
    /// its partial sum (first seen at `blk.0.attn_out`).
    TpMissingAttnAllReduce,
    /// The vocabulary shards' logits are gathered in reverse rank order (first seen at
    /// `logits`).
    TpVocabGatherOrder,
    /// Expert-parallel ranks hold the weights of the next rank's experts while routing their
    /// own (first seen at the first MoE layer's `ffn_out`).
    TpExpertWrongRank,
    /// The shared-memory all-reduce sums on each rank from its own partial round the ring
    /// instead of in rank order on every rank (`tp/comm.rs`), so from three ranks on the
    /// replicated activations differ in their last bits between ranks: within every tolerance,
    /// yet the ranks compute on different inputs from then on. First seen at the TP cases'
    /// `tp.rank-agreement` gate (a TP 4 case: rank 1's `blk.0.attn_out`).
    TpReduceOwnOrder,
    /// The verify forward's tree mask lets each draft node also see its previous sibling
    /// (`runtime/batch.rs`; first seen at the `spec.tree-mask` gate).
    TreeMaskSeesSibling,
    /// Attention lets a query see a cell written by the same forward at its own position
    /// whatever the cell's sequence (`runtime/backend.rs`, `Mask::visible`): invisible while a
    /// batch holds one sequence, or sequences at different positions. First seen at the batched
    /// case's `batch.taps` gate (`blk.0.attn` of three sequences starting together).
    BatchSeesOtherSequence,
    /// The tree mask reads a cell's ancestor bit from the first word of the query's ancestor
    /// bit set whatever the cell's batch index, as a kernel that assumed at most 64 tree tokens
    /// would (`runtime/backend.rs`, `Mask::visible`). Invisible to trees of up to 63 drafts;
    /// first seen at the `spec.tree-shapes` gate, whose trees run past 64 tokens.
    TreeMaskFirstWordOnly,
    /// KV compaction after a verify keeps another node's cells in place of the last accepted
    /// node's (`spec/kv.rs`; first seen at the `spec.compact` gate).
    CompactKeepsWrongRow,
    /// The acceptance walk keeps walking into the drafted child after the target rejected it
    /// (`spec/acceptance.rs`; first seen at the `spec.accept-walk` gate).
    AcceptPastRejection,
    /// The acceptance walk accepts a drafted token the drafter is confident about although the
    /// target drew another (lossy; first seen at the `spec.accept-walk` gate).
    AcceptByDraftProbability,
    /// When sampling, the acceptance walk accepts a drafted token of target probability 0 (the
    /// `coin == 0` bug; first seen at the `spec.support` gate and by the exact-law proof).
    AcceptZeroProbability,
    /// The CPU backend's Q8_0 products read the last 8 of every 32-value block one quantum too
    /// high, as a kernel whose tail lanes load the wrong bytes would (planted where the backend
    /// prepares each Q8_0 matrix, `runtime/cpu.rs`; embedding lookups are not products and are
    /// spared). A weight error of NMSE ~1e-4, under the old full-precision layer-0 bound (3.3e-4)
    /// and far over the exact-numerics one: first seen at `blk.0.q` of a Q8_0 model.
    Q8_0BlockTail,
    /// A batched product of more than 64 tokens whose count is not a multiple of 64 scales the
    /// rows of its last, partial 64-token tile by 1 + 2⁻⁸, as a panel kernel with a wrong tail
    /// path would (`CpuBackend::matmul`). A token count that is a multiple of the tile, or of at
    /// most one tile, hides it; first seen at `blk.0.q` of the chunked case (chunk of 67).
    PrefillTileTail,
    /// The AVX2 backend only: a product of more than 16 tokens whose count is not a multiple of
    /// 16 gives the first token of its last, partial 16-token tile the previous token's
    /// outputs, as one ISA's tail path reading the wrong accumulator would (`CpuBackend::matmul`). The AVX-512 and scalar
    /// backends are right, so a machine's best backend never shows it; first seen at `blk.0.q`
    /// of a chunked case on `cpu-avx2`.
    Avx2TileTail,
    /// A decode step (one token, no tree) at a position past 300 attends as if it sat one
    /// position earlier, so its own newest KV cell is left out (`model/forward.rs`, the step's
    /// query positions). Invisible to prefills and to short decodes; first seen at `blk.0.attn`
    /// of the decode case.
    DecodeLateKvOffByOne,
    /// The routing weights of each token's first and second expert are swapped before the
    /// experts' outputs are mixed (`model/forward.rs`, `moe_ffn`); the router logits are right.
    /// First seen at the first MoE layer's `ffn_out`.
    MoeWeightsSwapped,
    /// The MLA variant of [`Fault::TpQkvShardOrder`]: the shard plan gives rank r the
    /// `attn_q_b` (or MLA `attn_q`) rows of rank r+1 (`tp/plan.rs`; first seen at `blk.0.q` of a
    /// deepseek2 TP case, gathered from the ranks).
    TpMlaShardOrder,
    /// CUDA only (kernels/cuda/quant.cuh, `deq_q6_k`): the second 128-value half of every Q6_K
    /// super-block reads its high bits from the first half's `qh` bytes, as an unpacker that
    /// forgot the half's offset would. The CPU path is right; every device path that
    /// dequantizes Q6_K (matrix-vector, prefill GEMM, embedding) is wrong. First seen at
    /// `blk.0.v` of llama-q4_k_m on the CUDA backend (attn_v of layer 0 is its first Q6_K
    /// matrix; q and k are Q4_K).
    CudaQ6KHighBitsHalf,
    /// CUDA only (kernels/cuda/attention.cu, `visible`): the causal test compares a cell with
    /// the query's position plus one, so every query also sees the next token's cell. First seen
    /// at `blk.0.attn` of a prefill on the CUDA backend.
    CudaCausalMaskOffByOne,
    /// CUDA only (kernels/cuda/dequant.cu, `gemm_f16_f32`): the barrier between storing a tile
    /// in shared memory and reading it is missing, so a thread reads entries other threads have
    /// not stored yet (the emulator runs a block's threads in turn, so the reads are stale for
    /// sure; a GPU would race). Only the prefill GEMM (≥ 16 tokens, F16 and quantized weights):
    /// first seen at `blk.0.q` of a 32-token prefill on the CUDA backend.
    CudaGemmMissingBarrier,
    /// CUDA only (engine/src/runtime/cuda/backend.rs, the `rope` launch): `freq_base` and
    /// `freq_scale` passed in each other's place (both f32, so the launch's argument check
    /// cannot see it). First seen at `blk.0.q` on the CUDA backend.
    CudaRopeArgsSwapped,
    /// CUDA only (engine/src/runtime/cuda/backend.rs, `kv_reserve`): a cache layer grows by
    /// exactly the cells asked for, as it did before issue 29, so every decode step reallocates
    /// each layer's K and V and copies every cell into the new allocation. The results are
    /// right; only the device counters see it: first seen at the `decode_kv_moved` gate of a
    /// CUDA case.
    CudaKvGrowsByTheNewCells,
    /// The lightning indexer's top-k taken over the wrong axis: each query ranks the scores of
    /// its column (every query's score for one cell) instead of its row, as a kernel reading
    /// the `[query, cell]` scores transposed would (`model/forward.rs`, `indexer_select`; only
    /// where the scores are square, a prefill from an empty cache). First seen at
    /// `blk.0.indexer_top_k` of a glm-dsa case.
    IndexerTopKWrongAxis,
    /// A full indexer layer after the first reuses the previous full layer's selection instead
    /// of computing its own, as a shared layer does (`model/forward.rs`, `mla_attention`; its
    /// `indexer_top_k` tap shows the selection it used). First seen at `blk.2.indexer_top_k` of
    /// the glm-dsa fixture (layers 0 and 2 full) by verify's layer-isolated comparison.
    IndexerFullLayerReuses,
    /// The indexer's `attn_q_b` loaded with its two halves of heads swapped, as a loader placing
    /// the weight's shards (or dequantized blocks) in the wrong order would — GLM-5's original
    /// deployment failure class (`model/weights.rs`, `Weight::bytes`). First seen at
    /// `blk.0.indexer_top_k`.
    IndexerWeightsShardOrder,
    /// The server looks for a stop string in the newest token's text only, not in the text held
    /// back from earlier tokens (`cli/src/serve/batcher.rs` `scan_stop`): a stop string split
    /// over two tokens is missed (first seen at the serve case's `stop` gate).
    ServeStopInOnePiece,
    /// The server samples a prompt's first token from the batch row before its chunk (the
    /// previous sequence's last row) whenever another sequence's tokens come first in that batch
    /// (`cli/src/serve/batcher.rs`, `push_work`: row bookkeeping off by one chunk). First seen
    /// at the serve case's `concurrent` gate, whose requests share batches.
    ServeRowOfNeighbour,
    /// The CPU backend's f16 KV cache converts each value by truncation (rounding toward zero)
    /// instead of to the nearest f16 (`runtime/cpu.rs`, `KvStore::write`): every value it changes
    /// moves one f16 unit toward zero, about half of them, a relative error near 2⁻¹¹ that the
    /// NMSE bounds of the taps after the cache cannot see. Only with `--kv-dtype f16`; first seen
    /// at `blk.0.kv_cache` of an f16-cache path case (its rounding-bias bound).
    KvF16Truncates,
}

impl Fault {
    pub const ALL: [Fault; 39] = [
        Fault::RopePositionOffByOne,
        Fault::SkipResidualAdd,
        Fault::SlidingWindowOffByOne,
        Fault::NanInExpert,
        Fault::WrongRouterTopK,
        Fault::SwappedQkShards,
        Fault::WrongDequantScale,
        Fault::PermutedExperts,
        Fault::TokenizerDropsBos,
        Fault::SplitListingOrder,
        Fault::TpQkvShardOrder,
        Fault::TpMissingAttnAllReduce,
        Fault::TpVocabGatherOrder,
        Fault::TpExpertWrongRank,
        Fault::TpReduceOwnOrder,
        Fault::TreeMaskSeesSibling,
        Fault::BatchSeesOtherSequence,
        Fault::TreeMaskFirstWordOnly,
        Fault::CompactKeepsWrongRow,
        Fault::AcceptPastRejection,
        Fault::AcceptByDraftProbability,
        Fault::AcceptZeroProbability,
        Fault::Q8_0BlockTail,
        Fault::PrefillTileTail,
        Fault::Avx2TileTail,
        Fault::DecodeLateKvOffByOne,
        Fault::MoeWeightsSwapped,
        Fault::TpMlaShardOrder,
        Fault::CudaQ6KHighBitsHalf,
        Fault::CudaCausalMaskOffByOne,
        Fault::CudaGemmMissingBarrier,
        Fault::CudaRopeArgsSwapped,
        Fault::CudaKvGrowsByTheNewCells,
        Fault::IndexerTopKWrongAxis,
        Fault::IndexerFullLayerReuses,
        Fault::IndexerWeightsShardOrder,
        Fault::ServeStopInOnePiece,
        Fault::ServeRowOfNeighbour,
        Fault::KvF16Truncates,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::RopePositionOffByOne => "rope-position-off-by-one",
            Fault::SkipResidualAdd => "skip-residual-add",
            Fault::SlidingWindowOffByOne => "sliding-window-off-by-one",
            Fault::NanInExpert => "nan-in-expert",
            Fault::WrongRouterTopK => "wrong-router-top-k",
            Fault::SwappedQkShards => "swapped-qk-shards",
            Fault::WrongDequantScale => "wrong-dequant-scale",
            Fault::PermutedExperts => "permuted-experts",
            Fault::TokenizerDropsBos => "tokenizer-drops-bos",
            Fault::SplitListingOrder => "split-listing-order",
            Fault::TpQkvShardOrder => "tp-qkv-shard-order",
            Fault::TpMissingAttnAllReduce => "tp-missing-attn-allreduce",
            Fault::TpVocabGatherOrder => "tp-vocab-gather-order",
            Fault::TpExpertWrongRank => "tp-expert-wrong-rank",
            Fault::TpReduceOwnOrder => "tp-reduce-own-order",
            Fault::TreeMaskSeesSibling => "tree-mask-sees-sibling",
            Fault::BatchSeesOtherSequence => "batch-sees-other-sequence",
            Fault::TreeMaskFirstWordOnly => "tree-mask-first-word-only",
            Fault::CompactKeepsWrongRow => "compact-keeps-wrong-row",
            Fault::AcceptPastRejection => "accept-past-rejection",
            Fault::AcceptByDraftProbability => "accept-by-draft-probability",
            Fault::AcceptZeroProbability => "accept-zero-probability",
            Fault::Q8_0BlockTail => "q8_0-block-tail",
            Fault::PrefillTileTail => "prefill-tile-tail",
            Fault::Avx2TileTail => "avx2-tile-tail",
            Fault::DecodeLateKvOffByOne => "decode-late-kv-off-by-one",
            Fault::MoeWeightsSwapped => "moe-weights-swapped",
            Fault::TpMlaShardOrder => "tp-mla-shard-order",
            Fault::CudaQ6KHighBitsHalf => "cuda-q6_k-high-bits-half",
            Fault::CudaCausalMaskOffByOne => "cuda-causal-mask-off-by-one",
            Fault::CudaGemmMissingBarrier => "cuda-gemm-missing-barrier",
            Fault::CudaRopeArgsSwapped => "cuda-rope-args-swapped",
            Fault::CudaKvGrowsByTheNewCells => "cuda-kv-grows-by-the-new-cells",
            Fault::IndexerTopKWrongAxis => "indexer-top-k-wrong-axis",
            Fault::IndexerFullLayerReuses => "indexer-full-layer-reuses",
            Fault::IndexerWeightsShardOrder => "indexer-weights-shard-order",
            Fault::ServeStopInOnePiece => "serve-stop-in-one-piece",
            Fault::ServeRowOfNeighbour => "serve-logits-row-of-neighbour",
            Fault::KvF16Truncates => "kv-f16-truncates",
        }
    }

    /// The preprocessor symbol that plants this fault in the CUDA kernel sources
    /// (`kernels/cuda/*.cu`), for faults that live there: the engine defines it in the program
    /// NVRTC compiles (engine/src/runtime/cuda/sources.rs: a distinct source, so a distinct
    /// cubin cache entry) and `cargo xtask cuda-emu` builds an emulator with it defined, in a
    /// folder of its own (`target/faults/cuda-emu/<fault>`), for the fault build only.
    pub fn cuda_define(self) -> Option<&'static str> {
        match self {
            Fault::CudaQ6KHighBitsHalf => Some("PLUMBLINE_FAULT_CUDA_Q6K_HIGH_BITS_HALF"),
            Fault::CudaCausalMaskOffByOne => Some("PLUMBLINE_FAULT_CUDA_CAUSAL_MASK_OFF_BY_ONE"),
            Fault::CudaGemmMissingBarrier => Some("PLUMBLINE_FAULT_CUDA_GEMM_MISSING_BARRIER"),
            _ => None,
        }
    }

    pub fn from_name(name: &str) -> Option<Fault> {
        Self::ALL.into_iter().find(|f| f.name() == name.trim())
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why the fault setting could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    #[error("{ENV_VAR}: expected one of {}, found {found:?}", Fault::ALL.map(|f| f.name()).join(", "))]
    Unknown { found: String },
    #[error("a fault setting was already read or installed ({current:?}); it is chosen once per process")]
    AlreadySet { current: Option<Fault> },
    #[error("this build has no fault injection (build with the `fault-injection` feature)")]
    NotCompiled,
}

#[cfg(feature = "fault-injection")]
mod imp {
    use std::sync::OnceLock;

    use super::{Fault, FaultError, ENV_VAR};

    static ACTIVE: OnceLock<Result<Option<Fault>, FaultError>> = OnceLock::new();

    fn from_env() -> Result<Option<Fault>, FaultError> {
        match std::env::var(ENV_VAR) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Fault::from_name(&v)
                .map(Some)
                .ok_or(FaultError::Unknown { found: v }),
            Err(_) => Ok(None),
        }
    }

    pub fn setting() -> Result<Option<Fault>, FaultError> {
        ACTIVE.get_or_init(from_env).clone()
    }

    pub fn install(fault: Option<Fault>) -> Result<(), FaultError> {
        ACTIVE.set(Ok(fault)).map_err(|_| FaultError::AlreadySet {
            current: ACTIVE.get().and_then(|r| r.clone().ok()).flatten(),
        })
    }

    #[inline]
    pub fn is_active(fault: Fault) -> bool {
        matches!(ACTIVE.get_or_init(from_env), Ok(Some(f)) if *f == fault)
    }
}

#[cfg(not(feature = "fault-injection"))]
mod imp {
    use super::{Fault, FaultError};

    pub fn setting() -> Result<Option<Fault>, FaultError> {
        Ok(None)
    }

    pub fn install(_fault: Option<Fault>) -> Result<(), FaultError> {
        Err(FaultError::NotCompiled)
    }

    #[inline(always)]
    pub fn is_active(_fault: Fault) -> bool {
        false
    }
}

/// The active fault (read from [`ENV_VAR`] on first use), or an error naming a bad setting.
/// Commands call it at start so that a misspelt fault fails loudly instead of running clean.
pub fn setting() -> Result<Option<Fault>, FaultError> {
    imp::setting()
}

/// Choose the fault for this process before anything reads the setting.
pub fn install(fault: Option<Fault>) -> Result<(), FaultError> {
    imp::install(fault)
}

/// The active fault, if it is planted in the CUDA kernel sources ([`Fault::cuda_define`]).
/// `None` without the `fault-injection` feature.
pub fn active_cuda_source_fault() -> Option<Fault> {
    Fault::ALL
        .into_iter()
        .find(|&f| f.cuda_define().is_some() && is_active(f))
}

/// Whether `fault` is the active one. A constant `false` without the `fault-injection` feature.
#[inline(always)]
pub fn is_active(fault: Fault) -> bool {
    imp::is_active(fault)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_source_faults_have_distinct_defines() {
        let defs: Vec<&str> = Fault::ALL.iter().filter_map(|f| f.cuda_define()).collect();
        let mut sorted = defs.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), defs.len(), "{defs:?}");
        // Each is used by a kernel source (or the fault would plant nothing).
        let sources = [
            include_str!("../../kernels/cuda/quant.cuh"),
            include_str!("../../kernels/cuda/attention.cu"),
            include_str!("../../kernels/cuda/dequant.cu"),
        ]
        .concat();
        for d in defs {
            assert!(sources.contains(d), "{d} appears in no kernel source");
        }
        assert_eq!(active_cuda_source_fault(), None);
    }

    #[test]
    fn names_round_trip() {
        for f in Fault::ALL {
            assert_eq!(Fault::from_name(f.name()), Some(f));
        }
        assert_eq!(Fault::from_name("no-such-fault"), None);
    }
}
