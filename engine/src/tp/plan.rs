//! The shard plan: for every tensor of a model, how `degree` tensor-parallel ranks hold it.
//!
//! [`ShardPlan::new`] is a pure function of the architecture ([`ModelConfig`]), the file's
//! tensor table (name, shape, weight type: [`TensorDesc`]) and the degree. It decides per block
//! kind, uniformly over the layers (the forward pass runs one configuration per rank):
//!
//! - **Attention** (Megatron-style): query heads split over the ranks, `attn_q`/`attn_k`/`attn_v`
//!   split by output rows *per part* (never as one byte range), `attn_output` split by input
//!   columns and all-reduced. KV heads fewer than the degree are replicated: each rank computes
//!   the KV head its query heads read (Gemma 3 270M: 4 query heads, 1 KV head). MLA: the latent
//!   path (`attn_q_a`, `attn_kv_a_mqa`, their norms) replicated, `attn_q_b`/`attn_q` and
//!   `attn_kv_b` split by heads.
//! - **Dense FFN**: `ffn_gate`/`ffn_up` by rows, `ffn_down` by columns, all-reduced.
//! - **MoE**: the router replicated; the experts' intermediate rows split like a dense FFN where
//!   that lands on block boundaries, otherwise expert-parallel (each rank a range of whole
//!   experts, the others' slots weighted zero, all-reduced); the shared expert split with the
//!   experts, or (expert-parallel) held and computed by rank 0 alone.
//! - **Vocabulary head**: split by rows, the logits all-gathered. The embedding table is
//!   replicated (a gather reads whole rows).
//!
//! A column split must start and end on [`shard_block`] of the weight's type (the weight's block
//! or its activations' block, 256 for K-quants), so no rank ever holds part of a block and each
//! rank quantizes exactly the activation blocks that TP 1 quantizes. Where that fails (or a head
//! count does not divide), the whole block kind falls back to replication and
//! [`Decision::Replicated`] says why.

use std::fmt;
use std::ops::Range;

use kernels::quant::GgmlType;

use crate::faults::{self, Fault};
use crate::gguf::Gguf;
use crate::model::{shard_block, ModelConfig};

/// One tensor of the file as the plan sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    /// ggml order: `dims[0]` contiguous (the reduction dimension of a matrix).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorDesc {
    pub fn new(name: &str, dims: &[u64], ty: GgmlType) -> TensorDesc {
        TensorDesc {
            name: name.to_owned(),
            dims: dims.to_vec(),
            ty,
        }
    }

    fn dim(&self, i: usize) -> usize {
        self.dims
            .get(i)
            .and_then(|&d| usize::try_from(d).ok())
            .unwrap_or(1)
    }

    /// Bytes of `cols` of `rows` rows of `mats` matrices.
    fn bytes(&self, rows: usize, cols: usize, mats: usize) -> u64 {
        let bs = self.ty.block_size().max(1);
        (cols / bs * self.ty.type_size()) as u64 * rows as u64 * mats as u64
    }
}

/// How a tensor is laid over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Output rows split (Megatron's column-parallel linear): each rank computes a slice of
    /// the outputs, no reduction.
    Column,
    /// Input columns split (row-parallel): each rank computes a partial sum, all-reduced.
    Row,
    /// Every rank holds the whole tensor.
    Replicated,
    /// Each rank holds a range of whole experts of a stacked expert tensor.
    Expert,
    /// Only rank 0 holds and computes it (a shared expert beside expert-parallel experts).
    RankZero,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Column => "column",
            Placement::Row => "row",
            Placement::Replicated => "replicated",
            Placement::Expert => "expert",
            Placement::RankZero => "rank0",
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one rank holds of a tensor: rows (`dims[1]`), columns (`dims[0]`, in elements) and
/// experts (`dims[2]`) of the whole tensor. A rank holding nothing has empty ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPart {
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    pub experts: Range<usize>,
    pub bytes: u64,
}

impl RankPart {
    fn new(t: &TensorDesc, rows: Range<usize>, cols: Range<usize>, experts: Range<usize>) -> Self {
        let bytes = t.bytes(rows.len(), cols.len(), experts.len());
        RankPart {
            rows,
            cols,
            experts,
            bytes,
        }
    }

    fn whole(t: &TensorDesc) -> RankPart {
        RankPart::new(t, 0..t.dim(1), 0..t.dim(0), 0..t.dim(2))
    }

    fn empty() -> RankPart {
        RankPart {
            rows: 0..0,
            cols: 0..0,
            experts: 0..0,
            bytes: 0,
        }
    }

    /// The byte range of the part inside one row of the tensor (a column range is a whole
    /// number of blocks, so this is exact).
    pub fn row_bytes(&self, t: &TensorDesc) -> Range<u64> {
        let bs = t.ty.block_size().max(1);
        let ts = t.ty.type_size() as u64;
        (self.cols.start / bs) as u64 * ts..(self.cols.end / bs) as u64 * ts
    }
}

/// The plan of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPlan {
    pub tensor: TensorDesc,
    pub placement: Placement,
    /// One per rank.
    pub ranks: Vec<RankPart>,
    /// Why it is replicated (or how a split is special); `None` for a plain split.
    pub note: Option<String>,
}

/// A block kind's decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Split,
    Replicated { reason: String },
}

impl Decision {
    pub fn is_split(&self) -> bool {
        matches!(self, Decision::Split)
    }

    fn reason(&self) -> Option<&str> {
        match self {
            Decision::Split => None,
            Decision::Replicated { reason } => Some(reason),
        }
    }
}

/// How the routed experts of MoE layers are laid out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoeMode {
    /// No MoE layers.
    None,
    /// Every expert's intermediate rows split like a dense FFN.
    SplitExperts,
    /// Each rank a range of whole experts.
    ExpertParallel,
    Replicated {
        reason: String,
    },
}

/// The per-kind decisions and per-rank ranges every tensor's plan is derived from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decisions {
    pub degree: usize,
    pub attn: Decision,
    /// Query heads of each rank.
    pub q_heads: Vec<Range<usize>>,
    /// KV heads of each rank (standard attention; the MLA's expanded heads are `q_heads`).
    pub kv_heads: Vec<Range<usize>>,
    /// Set when KV heads are replicated because there are fewer than the degree.
    pub kv_note: Option<String>,
    pub ffn: Decision,
    /// Dense FFN intermediate rows of each rank.
    pub ff_rows: Vec<Range<usize>>,
    pub moe: MoeMode,
    /// Expert intermediate rows of each rank ([`MoeMode::SplitExperts`]).
    pub ff_exp_rows: Vec<Range<usize>>,
    /// Experts each rank routes to itself ([`MoeMode::ExpertParallel`]).
    pub experts: Vec<Range<usize>>,
    /// Experts whose weights each rank is given (equal to `experts` unless the
    /// `tp-expert-wrong-rank` fault is active).
    pub expert_weights: Vec<Range<usize>>,
    pub vocab: Decision,
    /// Vocabulary rows of each rank.
    pub vocab_rows: Vec<Range<usize>>,
}

/// The plan of a whole model at one degree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub decisions: Decisions,
    /// Every tensor of the file, in file order; a tied output head is listed a second time
    /// as `output (tied: token_embd.weight)`.
    pub tensors: Vec<TensorPlan>,
}

/// Why no plan can be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("tensor-parallel degree: expected at least 1, found 0")]
    ZeroDegree,
    #[error("tensor-parallel degree {degree}: the model has {what} {n}, fewer than the degree (a rank would hold nothing)")]
    TooFew {
        degree: usize,
        what: &'static str,
        n: usize,
    },
}

/// `0..n` cut into `parts` contiguous ranges as even as possible (the first ones one longer).
pub fn even_ranges(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.max(1);
    (0..parts)
        .map(|r| r * n / parts..(r + 1) * n / parts)
        .collect()
}

/// `(layer, role, is_bias)` of `blk.{layer}.{role}.{weight|bias}`; `(None, name stem, _)` for
/// the model's global tensors.
fn parse_name(name: &str) -> (Option<usize>, &str, bool) {
    let (stem, bias) = if let Some(s) = name.strip_suffix(".weight") {
        (s, false)
    } else if let Some(s) = name.strip_suffix(".bias") {
        (s, true)
    } else {
        (name, false)
    };
    if let Some(rest) = stem.strip_prefix("blk.") {
        if let Some((il, role)) = rest.split_once('.') {
            if let Ok(il) = il.parse() {
                return (Some(il), role, bias);
            }
        }
    }
    (None, stem, bias)
}

/// The tensors of the model in the file.
pub fn describe(gguf: &Gguf) -> Vec<TensorDesc> {
    gguf.tensors()
        .iter()
        .map(|t| TensorDesc {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: t.ggml_type,
        })
        .collect()
}

/// Checks that `per_rank` columns of every layer's `role` (`n_layer` layers, those that have
/// it) land on block boundaries; the reason of the first that does not.
fn cols_fit(tensors: &[TensorDesc], role: &str, per_rank: usize, what: &str) -> Result<(), String> {
    for t in tensors {
        let (Some(_), r, false) = parse_name(&t.name) else {
            continue;
        };
        if r != role {
            continue;
        }
        let block = shard_block(t.ty);
        if !per_rank.is_multiple_of(block) {
            return Err(format!(
                "{} ({}) split into {per_rank} columns per rank would cut its {block}-value blocks: {what} replicated",
                t.name, t.ty
            ));
        }
    }
    Ok(())
}

fn replicated(reason: String) -> Decision {
    Decision::Replicated { reason }
}

impl Decisions {
    /// Decide every block kind for `degree` ranks.
    pub fn new(
        c: &ModelConfig,
        tensors: &[TensorDesc],
        degree: usize,
    ) -> Result<Decisions, PlanError> {
        if degree == 0 {
            return Err(PlanError::ZeroDegree);
        }
        let n = degree;
        let all = |len: usize| vec![0..len; n];

        // Attention.
        let (nh, nkv) = (c.n_head, c.n_head_kv);
        let head_v = match c.mla {
            Some(m) => m.v_head_dim,
            None => c.head_dim_v,
        };
        let mut attn = if !nh.is_multiple_of(n) {
            replicated(format!(
                "{nh} query heads do not divide over {n} ranks: attention replicated"
            ))
        } else if c.mla.is_none() && !(nkv.is_multiple_of(n) || n.is_multiple_of(nkv)) {
            replicated(format!(
                "{nkv} KV heads neither divide over {n} ranks nor divide {n}: attention replicated"
            ))
        } else {
            match cols_fit(tensors, "attn_output", nh / n * head_v, "attention") {
                Ok(()) => Decision::Split,
                Err(reason) => replicated(reason),
            }
        };
        if n == 1 {
            attn = Decision::Split;
        }
        let (q_heads, kv_heads, kv_note) = if attn.is_split() {
            let q = even_ranges(nh, n);
            if c.mla.is_some() {
                (q.clone(), q, None)
            } else if nkv.is_multiple_of(n) {
                (q, even_ranges(nkv, n), None)
            } else {
                // Fewer KV heads than ranks: rank r's query heads all read KV head r·nkv/n.
                let kv = (0..n).map(|r| r * nkv / n..r * nkv / n + 1).collect();
                let note = format!(
                    "{nkv} KV head(s) for {n} ranks: each KV head replicated on {} ranks",
                    n / nkv
                );
                (q, kv, Some(note))
            }
        } else {
            (all(nh), all(nkv), None)
        };

        // Dense FFN.
        let nff = c.n_ff;
        let has_dense = tensors.iter().any(|t| parse_name(&t.name).1 == "ffn_down");
        let ffn = if !has_dense || n == 1 {
            Decision::Split
        } else if !nff.is_multiple_of(n) {
            replicated(format!(
                "FFN width {nff} does not divide over {n} ranks: dense FFN replicated"
            ))
        } else {
            match cols_fit(tensors, "ffn_down", nff / n, "dense FFN") {
                Ok(()) => Decision::Split,
                Err(reason) => replicated(reason),
            }
        };
        let ff_rows = if ffn.is_split() {
            even_ranges(nff, n)
        } else {
            all(nff)
        };

        // MoE.
        let (moe, ff_exp_rows, experts) = match c.moe {
            None => (MoeMode::None, Vec::new(), Vec::new()),
            Some(m) => {
                let fe = m.n_ff_exp;
                let split = if n == 1 {
                    Ok(())
                } else if !fe.is_multiple_of(n) {
                    Err(format!("expert width {fe} does not divide over {n} ranks"))
                } else {
                    cols_fit(tensors, "ffn_down_exps", fe / n, "experts").and_then(|()| {
                        cols_fit(
                            tensors,
                            "ffn_down_shexp",
                            fe * m.n_expert_shared / n,
                            "experts",
                        )
                    })
                };
                match split {
                    Ok(()) => (
                        MoeMode::SplitExperts,
                        even_ranges(fe, n),
                        all(m.n_expert),
                    ),
                    Err(_) if m.n_expert.is_multiple_of(n) => (
                        MoeMode::ExpertParallel,
                        all(fe),
                        even_ranges(m.n_expert, n),
                    ),
                    Err(why) => (
                        MoeMode::Replicated {
                            reason: format!(
                                "{why}, and {} experts do not divide over {n} ranks: MoE replicated",
                                m.n_expert
                            ),
                        },
                        all(fe),
                        all(m.n_expert),
                    ),
                }
            }
        };
        let mut expert_weights = experts.clone();
        if moe == MoeMode::ExpertParallel && faults::is_active(Fault::TpExpertWrongRank) {
            // A loader that gave rank r the experts of rank r+1.
            expert_weights.rotate_left(1);
        }

        // Vocabulary head: rows split (any row count; rows hold whole blocks).
        let vocab = if c.n_vocab >= n {
            Decision::Split
        } else {
            replicated(format!(
                "{} vocabulary rows for {n} ranks: head replicated",
                c.n_vocab
            ))
        };
        let vocab_rows = if vocab.is_split() {
            even_ranges(c.n_vocab, n)
        } else {
            all(c.n_vocab)
        };

        Ok(Decisions {
            degree,
            attn,
            q_heads,
            kv_heads,
            kv_note,
            ffn,
            ff_rows,
            moe,
            ff_exp_rows,
            experts,
            expert_weights,
            vocab,
            vocab_rows,
        })
    }

    /// Whether attention ends in an all-reduce.
    pub fn attn_reduces(&self) -> bool {
        self.degree > 1 && self.attn.is_split()
    }

    /// Whether a dense FFN ends in an all-reduce.
    pub fn ffn_reduces(&self) -> bool {
        self.degree > 1 && self.ffn.is_split()
    }

    /// Whether an MoE FFN ends in an all-reduce.
    pub fn moe_reduces(&self) -> bool {
        self.degree > 1 && matches!(self.moe, MoeMode::SplitExperts | MoeMode::ExpertParallel)
    }

    /// Whether the logits are all-gathered.
    pub fn vocab_gathers(&self) -> bool {
        self.degree > 1 && self.vocab.is_split()
    }
}

/// Row ranges `heads[r] × width` for every rank.
fn times(ranges: &[Range<usize>], width: usize) -> Vec<Range<usize>> {
    ranges
        .iter()
        .map(|r| r.start * width..r.end * width)
        .collect()
}

/// Plan one tensor, given the model's decisions. Pure: the same inputs give the same plan.
pub fn plan_tensor(c: &ModelConfig, d: &Decisions, t: &TensorDesc) -> TensorPlan {
    let n = d.degree;
    let (layer, role, bias) = parse_name(&t.name);
    let is_vec = t.dims.len() == 1;
    let whole = |placement, note: Option<String>| TensorPlan {
        tensor: t.clone(),
        placement,
        ranks: vec![RankPart::whole(t); n],
        note,
    };
    // Output rows split: a matrix's rows, or a 1-D bias's elements.
    let by_rows = |rows: Vec<Range<usize>>, note: Option<String>| {
        let (k, nr, ne) = (t.dim(0), t.dim(1), t.dim(2));
        let ranks = rows
            .into_iter()
            .map(|r| {
                if is_vec {
                    RankPart::new(t, 0..1, r, 0..1)
                } else {
                    RankPart::new(t, r.start.min(nr)..r.end.min(nr), 0..k, 0..ne)
                }
            })
            .collect();
        TensorPlan {
            tensor: t.clone(),
            placement: Placement::Column,
            ranks,
            note,
        }
    };
    let by_cols = |cols: Vec<Range<usize>>| {
        let (nr, ne) = (t.dim(1), t.dim(2));
        TensorPlan {
            tensor: t.clone(),
            placement: Placement::Row,
            ranks: cols
                .into_iter()
                .map(|c| RankPart::new(t, 0..nr, c, 0..ne))
                .collect(),
            note: None,
        }
    };
    let attn_rep = || whole(Placement::Replicated, d.attn.reason().map(str::to_owned));

    // glm-dsa: the NextN blocks after the trunk are kept, not run by the forward pass.
    if layer.is_some_and(|il| il >= c.n_layer) {
        return whole(
            Placement::Replicated,
            Some("NextN (MTP) block: kept in the file, not run by the forward pass".into()),
        );
    }
    // glm-dsa's lightning indexer: one score per cell summed over all its heads, and a top-k
    // every attention head of the layer shares, so every rank computes it whole and selects the
    // same cells (its heads are not the attention's heads; splitting them would need an
    // all-reduce of the scores before the top-k).
    if role.starts_with("indexer.") {
        return whole(
            Placement::Replicated,
            Some(
                "lightning indexer: every rank scores every cell and selects the same top-k".into(),
            ),
        );
    }

    if layer.is_none() {
        return match role {
            "output" if d.vocab.is_split() => by_rows(d.vocab_rows.clone(), None),
            "output" => whole(Placement::Replicated, d.vocab.reason().map(str::to_owned)),
            "token_embd" => whole(
                Placement::Replicated,
                Some("embedding gather reads whole rows: every rank embeds every token".into()),
            ),
            _ => whole(
                Placement::Replicated,
                Some("norm / scale vector: every rank applies it".into()),
            ),
        };
    }
    let _ = bias;
    match (c.mla, role) {
        (None, "attn_q" | "attn_k" | "attn_v") if d.attn.is_split() => {
            let (heads, width) = match role {
                "attn_q" => (&d.q_heads, c.head_dim_k),
                "attn_k" => (&d.kv_heads, c.head_dim_k),
                _ => (&d.kv_heads, c.head_dim_v),
            };
            let mut rows = times(heads, width);
            if role == "attn_q" && n > 1 && faults::is_active(Fault::TpQkvShardOrder) {
                // The loader's q shards in the wrong rank order.
                rows.rotate_left(1);
            }
            if role != "attn_q" && d.kv_note.is_some() {
                let same = rows.windows(2).all(|w| w[0] == w[1]);
                let mut p = by_rows(rows, d.kv_note.clone());
                if same {
                    p.placement = Placement::Replicated;
                }
                p
            } else {
                by_rows(rows, None)
            }
        }
        (Some(m), "attn_q_b" | "attn_q") if d.attn.is_split() => {
            let mut rows = times(&d.q_heads, m.qk_nope + m.qk_rope);
            if n > 1 && faults::is_active(Fault::TpMlaShardOrder) {
                // The loader's MLA query shards in the wrong rank order.
                rows.rotate_left(1);
            }
            by_rows(rows, None)
        }
        (Some(m), "attn_kv_b") if d.attn.is_split() => {
            by_rows(times(&d.q_heads, m.qk_nope + m.v_head_dim), None)
        }
        (Some(_), "attn_q_a" | "attn_q_a_norm" | "attn_kv_a_mqa" | "attn_kv_a_norm") => whole(
            Placement::Replicated,
            Some("MLA latent path: every rank computes and caches the latent".into()),
        ),
        (_, "attn_output") if d.attn.is_split() => {
            let v = c.mla.map_or(c.head_dim_v, |m| m.v_head_dim);
            by_cols(times(&d.q_heads, v))
        }
        (_, "attn_q" | "attn_k" | "attn_v" | "attn_q_b" | "attn_kv_b" | "attn_output") => {
            attn_rep()
        }
        (_, "ffn_gate" | "ffn_up") if d.ffn.is_split() => by_rows(d.ff_rows.clone(), None),
        (_, "ffn_down") if d.ffn.is_split() => by_cols(d.ff_rows.clone()),
        (_, "ffn_gate" | "ffn_up" | "ffn_down") => {
            whole(Placement::Replicated, d.ffn.reason().map(str::to_owned))
        }
        (_, "ffn_gate_inp" | "exp_probs_b") => whole(
            Placement::Replicated,
            Some("router: every rank routes every token".into()),
        ),
        (_, "ffn_gate_exps" | "ffn_up_exps" | "ffn_down_exps") => match &d.moe {
            MoeMode::SplitExperts if role == "ffn_down_exps" => by_cols(d.ff_exp_rows.clone()),
            MoeMode::SplitExperts => by_rows(d.ff_exp_rows.clone(), None),
            MoeMode::ExpertParallel => TensorPlan {
                tensor: t.clone(),
                placement: Placement::Expert,
                ranks: d
                    .expert_weights
                    .iter()
                    .map(|e| RankPart::new(t, 0..t.dim(1), 0..t.dim(0), e.clone()))
                    .collect(),
                note: Some(
                    "expert width cannot split on block boundaries: whole experts per rank".into(),
                ),
            },
            MoeMode::Replicated { reason } => whole(Placement::Replicated, Some(reason.clone())),
            MoeMode::None => whole(Placement::Replicated, None),
        },
        (_, "ffn_gate_shexp" | "ffn_up_shexp" | "ffn_down_shexp") => {
            let width = c.moe.map_or(0, |m| m.n_ff_exp * m.n_expert_shared);
            match &d.moe {
                MoeMode::SplitExperts if role == "ffn_down_shexp" => by_cols(even_ranges(width, n)),
                MoeMode::SplitExperts => by_rows(even_ranges(width, n), None),
                MoeMode::ExpertParallel => {
                    let mut ranks = vec![RankPart::empty(); n];
                    ranks[0] = RankPart::whole(t);
                    TensorPlan {
                        tensor: t.clone(),
                        placement: if n == 1 {
                            Placement::Replicated
                        } else {
                            Placement::RankZero
                        },
                        ranks,
                        note: Some(
                            "shared expert beside expert-parallel experts: rank 0 computes it whole"
                                .into(),
                        ),
                    }
                }
                MoeMode::Replicated { reason } => {
                    whole(Placement::Replicated, Some(reason.clone()))
                }
                MoeMode::None => whole(Placement::Replicated, None),
            }
        }
        (_, "attn_q_norm" | "attn_k_norm") => whole(
            Placement::Replicated,
            Some("per-head norm: every rank applies it to its heads".into()),
        ),
        _ => whole(
            Placement::Replicated,
            Some("norm / scale vector: every rank applies it".into()),
        ),
    }
}

impl ShardPlan {
    /// The plan of a model with `config` and `tensors` at `degree`.
    pub fn new(
        c: &ModelConfig,
        tensors: &[TensorDesc],
        degree: usize,
    ) -> Result<ShardPlan, PlanError> {
        let decisions = Decisions::new(c, tensors, degree)?;
        let mut plans: Vec<TensorPlan> = tensors
            .iter()
            .map(|t| plan_tensor(c, &decisions, t))
            .collect();
        let tied = !tensors.iter().any(|t| t.name == "output.weight");
        if tied {
            if let Some(embd) = tensors.iter().find(|t| t.name == "token_embd.weight") {
                let head = TensorDesc {
                    name: "output.weight".into(),
                    ..embd.clone()
                };
                let mut p = plan_tensor(c, &decisions, &head);
                p.tensor.name = "output (tied: token_embd.weight)".into();
                plans.push(p);
            }
        }
        Ok(ShardPlan {
            decisions,
            tensors: plans,
        })
    }

    /// The plan of `gguf`'s model.
    pub fn for_gguf(c: &ModelConfig, gguf: &Gguf, degree: usize) -> Result<ShardPlan, PlanError> {
        ShardPlan::new(c, &describe(gguf), degree)
    }

    pub fn degree(&self) -> usize {
        self.decisions.degree
    }

    /// The plan of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorPlan> {
        self.tensors.iter().find(|p| p.tensor.name == name)
    }

    /// Bytes each rank holds (a tied head counted once, in the embedding).
    pub fn bytes_per_rank(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.degree()];
        for p in self
            .tensors
            .iter()
            .filter(|p| !p.tensor.name.contains("(tied"))
        {
            for (o, r) in out.iter_mut().zip(&p.ranks) {
                *o += r.bytes;
            }
        }
        out
    }

    /// The tensors that are not split, with why.
    pub fn replications(&self) -> Vec<(&str, &str)> {
        self.tensors
            .iter()
            .filter(|p| matches!(p.placement, Placement::Replicated | Placement::RankZero))
            .map(|p| (p.tensor.name.as_str(), p.note.as_deref().unwrap_or("")))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests;
