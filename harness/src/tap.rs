//! Taps as plain data, and the parsing of tap names into (kind, layer).
//!
//! The contract is `docs/TAPS.md`: shape `[n_tokens, width]`, row-major, forward order.

use serde::{Deserialize, Serialize};

/// One tap: what the engine's `RecordedTap` and the reference's taps both convert into.
#[derive(Debug, Clone, PartialEq)]
pub struct Tap {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tap {
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Self {
        Tap {
            name: name.into(),
            shape,
            data,
        }
    }
}

/// What a tap holds, independent of its layer. One variant per row of `docs/TAPS.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TapKind {
    Embed,
    AttnNorm,
    Q,
    K,
    V,
    /// What an f16 KV cache hands back of the rows a forward wrote (docs/TAPS.md): each token's
    /// `[K | V]` row, or MLA's latent row. Emitted only with an f16 cache.
    KvCache,
    /// `glm-dsa`: the lightning indexer's key rows as its f16 cache hands them back (only with
    /// an f16 cache, on a full indexer layer).
    IndexerKCache,
    /// `glm-dsa`: a full indexer layer's selection, as positions (docs/TAPS.md).
    IndexerTopK,
    Attn,
    AttnOut,
    FfnNorm,
    Router,
    FfnOut,
    Out,
    OutputNorm,
    Logits,
}

impl TapKind {
    pub const ALL: [TapKind; 16] = [
        TapKind::Embed,
        TapKind::AttnNorm,
        TapKind::Q,
        TapKind::K,
        TapKind::V,
        TapKind::KvCache,
        TapKind::IndexerKCache,
        TapKind::IndexerTopK,
        TapKind::Attn,
        TapKind::AttnOut,
        TapKind::FfnNorm,
        TapKind::Router,
        TapKind::FfnOut,
        TapKind::Out,
        TapKind::OutputNorm,
        TapKind::Logits,
    ];

    /// The name as it appears in tap names (`blk.{i}.<this>` for per-layer kinds).
    pub fn as_str(self) -> &'static str {
        match self {
            TapKind::Embed => "embed",
            TapKind::AttnNorm => "attn_norm",
            TapKind::Q => "q",
            TapKind::K => "k",
            TapKind::V => "v",
            TapKind::KvCache => "kv_cache",
            TapKind::IndexerKCache => "indexer_k_cache",
            TapKind::IndexerTopK => "indexer_top_k",
            TapKind::Attn => "attn",
            TapKind::AttnOut => "attn_out",
            TapKind::FfnNorm => "ffn_norm",
            TapKind::Router => "router",
            TapKind::FfnOut => "ffn_out",
            TapKind::Out => "out",
            TapKind::OutputNorm => "output_norm",
            TapKind::Logits => "logits",
        }
    }

    /// Whether taps of this kind show what an f16 KV cache holds: compared only against the
    /// exact-numerics reference that rounds its cache the same way, and judged also by the
    /// rounding-bias bound ([`crate::tolerance::CACHE_ROUNDING_BIAS_MAX`]).
    pub fn is_cache(self) -> bool {
        matches!(self, TapKind::KvCache | TapKind::IndexerKCache)
    }

    /// Whether taps of this kind carry a layer index (`blk.{i}.…`).
    pub fn is_per_layer(self) -> bool {
        !matches!(self, TapKind::Embed | TapKind::OutputNorm | TapKind::Logits)
    }

    fn per_layer_from_str(s: &str) -> Option<TapKind> {
        TapKind::ALL
            .into_iter()
            .find(|k| k.is_per_layer() && k.as_str() == s)
    }
}

impl std::fmt::Display for TapKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed tap name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapId {
    pub kind: TapKind,
    /// `Some(i)` for `blk.{i}.…`, `None` for `embed`, `output_norm`, `logits`.
    pub layer: Option<usize>,
}

impl TapId {
    /// Parse a tap name of `docs/TAPS.md`; `None` for a name outside the contract.
    pub fn parse(name: &str) -> Option<TapId> {
        match name {
            "embed" => {
                return Some(TapId {
                    kind: TapKind::Embed,
                    layer: None,
                })
            }
            "output_norm" => {
                return Some(TapId {
                    kind: TapKind::OutputNorm,
                    layer: None,
                })
            }
            "logits" => {
                return Some(TapId {
                    kind: TapKind::Logits,
                    layer: None,
                })
            }
            _ => {}
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, kind) = rest.split_once('.')?;
        // Reject "+1", "01" and the like: the contract writes plain decimal indices.
        if layer.is_empty()
            || !layer.bytes().all(|b| b.is_ascii_digit())
            || (layer.len() > 1 && layer.starts_with('0'))
        {
            return None;
        }
        let layer = layer.parse().ok()?;
        let kind = TapKind::per_layer_from_str(kind)?;
        Some(TapId {
            kind,
            layer: Some(layer),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, expect: Option<(TapKind, Option<usize>)>) {
        let got = TapId::parse(name).map(|t| (t.kind, t.layer));
        assert_eq!(got, expect, "{name}");
    }

    #[test]
    fn parses_contract_names() {
        check("embed", Some((TapKind::Embed, None)));
        check("output_norm", Some((TapKind::OutputNorm, None)));
        check("logits", Some((TapKind::Logits, None)));
        check("blk.0.attn_norm", Some((TapKind::AttnNorm, Some(0))));
        check("blk.17.attn_out", Some((TapKind::AttnOut, Some(17))));
        check("blk.3.router", Some((TapKind::Router, Some(3))));
        check("blk.12.out", Some((TapKind::Out, Some(12))));
        check("blk.0.kv_cache", Some((TapKind::KvCache, Some(0))));
        check(
            "blk.2.indexer_k_cache",
            Some((TapKind::IndexerKCache, Some(2))),
        );
    }

    #[test]
    fn rejects_names_outside_the_contract() {
        check("blk.0.attn_q", None);
        check("blk..q", None);
        check("blk.01.q", None);
        check("blk.+1.q", None);
        check("blk.1.embed", None);
        check("blk.1.logits", None);
        check("Embed", None);
        check("", None);
    }

    #[test]
    fn every_kind_round_trips_through_its_name() {
        for kind in TapKind::ALL {
            let name = if kind.is_per_layer() {
                format!("blk.4.{kind}")
            } else {
                kind.to_string()
            };
            let id = TapId::parse(&name);
            assert_eq!(id.map(|t| t.kind), Some(kind), "{name}");
        }
    }
}
