//! [`Batch`]: the tokens of one forward: any number of sequences, each at its own positions,
//! chains or draft trees.

use super::backend::SeqId;
use super::RuntimeError;

/// The tokens of one forward, with their positions, sequences and (for trees) parents.
///
/// - [`Batch::push`] appends a token to its sequence's chain: its parent is the previous token
///   of the same sequence in this batch, if any.
/// - [`Batch::push_node`] appends a draft-tree node under any earlier token of the same
///   sequence (or as a root, `None`); a batch with a node is a tree batch, and its attention
///   uses the ancestor mask.
///
/// A token's position is its parent's plus one; a token without a parent in the batch sits at
/// the sequence's next position in the cache. [`crate::exec::Engine::forward`] checks both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub(crate) tokens: Vec<u32>,
    pub(crate) pos: Vec<u32>,
    pub(crate) seq: Vec<SeqId>,
    pub(crate) parent: Vec<Option<u32>>,
    pub(crate) logits: Vec<bool>,
    pub(crate) tree: bool,
}

impl Batch {
    pub fn new() -> Batch {
        Batch::default()
    }

    /// A chain of `tokens` for `seq` from position `pos0`, logits for the last token or all.
    pub fn chain(seq: SeqId, pos0: u32, tokens: &[u32], logits_all: bool) -> Batch {
        let mut b = Batch::new();
        for (i, &t) in tokens.iter().enumerate() {
            b.push(t, pos0 + i as u32, seq, logits_all || i + 1 == tokens.len());
        }
        b
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether any token was added with [`Batch::push_node`].
    pub fn is_tree(&self) -> bool {
        self.tree
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn positions(&self) -> &[u32] {
        &self.pos
    }

    pub fn seqs(&self) -> &[SeqId] {
        &self.seq
    }

    pub fn parents(&self) -> &[Option<u32>] {
        &self.parent
    }

    /// The same batch with logits for every token (an engine without a separate head pass
    /// answers `forward_hidden` with every row's logits).
    pub fn with_all_logits(&self) -> Batch {
        let mut b = self.clone();
        b.logits.iter_mut().for_each(|l| *l = true);
        b
    }

    /// Batch indices of the tokens whose logits are returned, in batch order.
    pub fn logit_rows(&self) -> Vec<u32> {
        (0..self.len() as u32)
            .filter(|&i| self.logits[i as usize])
            .collect()
    }

    /// Append `token` at `pos` to `seq`'s chain; returns its batch index.
    pub fn push(&mut self, token: u32, pos: u32, seq: SeqId, logits: bool) -> usize {
        let parent = self.seq.iter().rposition(|&s| s == seq).map(|p| p as u32);
        self.push_raw(token, pos, seq, parent, logits)
    }

    /// Append a tree node under `parent` (a batch index of the same sequence) or as a root;
    /// returns its batch index.
    pub fn push_node(
        &mut self,
        token: u32,
        pos: u32,
        seq: SeqId,
        parent: Option<usize>,
        logits: bool,
    ) -> usize {
        self.tree = true;
        self.push_raw(token, pos, seq, parent.map(|p| p as u32), logits)
    }

    fn push_raw(
        &mut self,
        token: u32,
        pos: u32,
        seq: SeqId,
        parent: Option<u32>,
        logits: bool,
    ) -> usize {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.parent.push(parent);
        self.logits.push(logits);
        self.tokens.len() - 1
    }

    /// Check the batch's structure: parents earlier, of the same sequence, one position
    /// before; tokens below `n_vocab`.
    pub(crate) fn validate(&self, n_vocab: usize) -> Result<(), RuntimeError> {
        if self.is_empty() {
            return Err(RuntimeError::NoTokens);
        }
        for (index, &token) in self.tokens.iter().enumerate() {
            if token as usize >= n_vocab {
                return Err(RuntimeError::TokenOutOfRange {
                    token,
                    index,
                    n_vocab,
                });
            }
            if let Some(p) = self.parent[index] {
                let p = p as usize;
                let ok = p < index
                    && self.seq[p] == self.seq[index]
                    && self.pos[p].checked_add(1) == Some(self.pos[index]);
                if !ok {
                    return Err(RuntimeError::BadBatch {
                        index,
                        reason: format!(
                            "parent {p} must be an earlier token of sequence {} at position {}",
                            self.seq[index],
                            self.pos[index].wrapping_sub(1)
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Per token, the bit set (`words` u64s) of itself and its ancestors in the batch.
    pub(crate) fn ancestors(&self) -> (Vec<u64>, usize) {
        let n = self.len();
        let words = n.div_ceil(64);
        let mut bits = vec![0u64; n * words];
        for i in 0..n {
            if let Some(p) = self.parent[i] {
                let p = p as usize;
                let (head, tail) = bits.split_at_mut(i * words);
                tail[..words].copy_from_slice(&head[p * words..(p + 1) * words]);
            }
            bits[i * words + i / 64] |= 1 << (i % 64);
            if crate::faults::is_active(crate::faults::Fault::TreeMaskSeesSibling) && self.tree {
                // A mask that also lets a node see its previous sibling.
                if let Some(s) = (0..i).rev().find(|&s| self.parent[s] == self.parent[i]) {
                    bits[i * words + s / 64] |= 1 << (s % 64);
                }
            }
        }
        (bits, words)
    }
}
