//! The KV cache: per layer, the keys and values of every cached position, row = position.
//!
//! Sliding-window layers keep the full history too; the window is applied as a mask in
//! attention, so every layer's row `j` is position `j`.

use crate::model::ModelConfig;

#[derive(Debug, Clone)]
struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
    k_width: usize,
    v_width: usize,
}

/// Keys and values of positions `0..len()` for every layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
}

impl KvCache {
    /// An empty cache shaped for `config` (MLA in its expanded form: `n_head` heads).
    pub fn new(config: &ModelConfig) -> KvCache {
        let k_width = config.n_head_kv * config.head_dim_k;
        let v_width = config.n_head_kv * config.head_dim_v;
        KvCache {
            layers: (0..config.n_layer)
                .map(|_| LayerCache {
                    k: Vec::new(),
                    v: Vec::new(),
                    k_width,
                    v_width,
                })
                .collect(),
            len: 0,
        }
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Row widths `(k, v)` of each layer.
    pub fn widths(&self) -> (usize, usize) {
        self.layers
            .first()
            .map_or((0, 0), |l| (l.k_width, l.v_width))
    }

    /// Append the new positions of layer `il` (`k`, `v`: whole rows).
    pub(crate) fn append(&mut self, il: usize, k: &[f32], v: &[f32]) {
        if let Some(l) = self.layers.get_mut(il) {
            l.k.extend_from_slice(k);
            l.v.extend_from_slice(v);
        }
    }

    /// Everything layer `il` holds, committed and appended: `(k, v, n_positions)`.
    pub(crate) fn layer(&self, il: usize) -> (&[f32], &[f32], usize) {
        match self.layers.get(il) {
            Some(l) if l.k_width > 0 => (&l.k, &l.v, l.k.len() / l.k_width),
            _ => (&[], &[], 0),
        }
    }

    /// Mark `n` appended positions as cached (after every layer appended them).
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keep positions `0..n` (drops appended but uncommitted rows too).
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.len);
        for l in &mut self.layers {
            l.k.truncate(n * l.k_width);
            l.v.truncate(n * l.v_width);
        }
        self.len = n;
    }

    /// Drop every position.
    pub fn clear(&mut self) {
        self.truncate(0);
    }
}
