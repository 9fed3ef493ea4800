//! Proposers: who drafts the tree. The target never trusts them: a draft only decides which
//! tokens the verify forward runs; acceptance reads the target's logits alone
//! ([`super::acceptance`]).
//!
//! - [`NgramProposer`]: suffix matching over the context and the generated text (no model): the
//!   longest recent suffix that occurred before proposes what followed it, as a conditional
//!   tree (each path asks again). A real win on code and repetitive text.
//! - [`ModelProposer`]: another model with the same vocabulary ([`Engine::new`] on a second
//!   GGUF) or the target's own first layers ([`Engine::with_layers`]); it decodes a greedy
//!   chain and gives DDTree its top-k at each depth. Its cache keeps a sliding draft window.
//! - [`SyntheticProposer`]: knows the continuation in advance and drafts the right token with a
//!   set probability: for tests and cost curves.
//! - [`TableProposer`]: a fixed conditional table (tests and the exact-law proof).

use crate::exec::BatchEngine;
use crate::runtime::{Batch, CellMeta, KvDtype, SeqCache};
use crate::sampling::Rng;

use super::tree::{build, build_per_depth, top_k_log_probs, Tree, TreeShape};
use super::SpecError;

/// The sequence id drafters use in their own caches.
const SEQ: u32 = 0;

/// Drafts a tree after a context.
pub trait Proposer {
    /// A short name for reports (`ngram`, `model:FILE`, `self:6`, `synthetic:0.8`).
    fn name(&self) -> String;

    /// A draft tree after `context` (prompt and emitted tokens; its last token is the tree's
    /// root), of at most `shape.budget` nodes.
    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError>;

    /// Whether drafting costs a model forward (the policy then drafts only when it speculates).
    fn is_costly(&self) -> bool {
        false
    }

    /// For a self-draft (the target's own first layers and its head): the fraction of the
    /// target's layers it runs, so that the cost of one draft level is known before drafting
    /// (that fraction of a decode step's layers, plus one head row). `None` for any other
    /// drafter.
    fn self_draft_fraction(&self) -> Option<f64> {
        None
    }
}

/// A borrowed drafter drafts as the drafter does (for a [`super::Speculation`] over a drafter
/// the caller keeps).
impl<P: Proposer + ?Sized> Proposer for &mut P {
    fn name(&self) -> String {
        (**self).name()
    }

    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError> {
        (**self).propose(context, shape)
    }

    fn is_costly(&self) -> bool {
        (**self).is_costly()
    }

    fn self_draft_fraction(&self) -> Option<f64> {
        (**self).self_draft_fraction()
    }
}

/// The best-first tree of a conditional drafter: `next(text)` gives the candidates after the
/// whole text (context and the path so far).
fn conditional_tree(
    context: &[u32],
    shape: TreeShape,
    mut next: impl FnMut(&[u32]) -> Vec<(u32, f64)>,
) -> Result<Tree, SpecError> {
    let Some(&root) = context.last() else {
        return Err(SpecError::EmptyContext);
    };
    let mut text = context.to_vec();
    let n0 = text.len();
    Ok(build(root, shape, |path| {
        text.truncate(n0);
        text.extend_from_slice(path);
        next(&text)
    }))
}

/// N-gram / suffix drafter over the last `window` tokens of the text.
#[derive(Clone, Debug)]
pub struct NgramProposer {
    /// Longest suffix matched.
    pub max_n: usize,
    /// Tokens of history searched (the draft window).
    pub window: usize,
}

impl NgramProposer {
    pub fn new(window: usize) -> NgramProposer {
        NgramProposer { max_n: 6, window }
    }

    /// Candidates after `text`: the tokens that followed the longest earlier occurrence(s) of
    /// its suffix, most frequent first (ties: most recent first), with log-probabilities
    /// `ln(count / (total + 1))` (one count kept for "something else"), halved for a one-token
    /// match. These are drafting weights only.
    pub fn continuations(&self, text: &[u32]) -> Vec<(u32, f64)> {
        let start = text.len().saturating_sub(self.window);
        let text = &text[start..];
        let n = text.len();
        for m in (1..=self.max_n.min(n.saturating_sub(1))).rev() {
            let suffix = &text[n - m..];
            // (token, count, most recent position)
            let mut found: Vec<(u32, u32, usize)> = Vec::new();
            for j in (m..n).rev() {
                if &text[j - m..j] == suffix {
                    let t = text[j];
                    match found.iter_mut().find(|f| f.0 == t) {
                        Some(f) => f.1 += 1,
                        None => found.push((t, 1, j)),
                    }
                }
            }
            if found.is_empty() {
                continue;
            }
            found.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)));
            let total: u32 = found.iter().map(|f| f.1).sum();
            let short = if m == 1 { 0.5f64.ln() } else { 0.0 };
            return found
                .into_iter()
                .map(|(t, c, _)| (t, (f64::from(c) / f64::from(total + 1)).ln() + short))
                .collect();
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> String {
        "ngram".into()
    }

    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError> {
        conditional_tree(context, shape, |text| self.continuations(text))
    }
}

/// A drafter that runs a model: a second GGUF of the same vocabulary, or the target's first
/// layers. It decodes a greedy chain of `shape.max_depth` tokens and hands DDTree its top-k at
/// each depth (DDTree's approximation: the alternatives at depth d are those after the best
/// chain).
pub struct ModelProposer<'e, E: BatchEngine + ?Sized> {
    engine: &'e E,
    cache: E::Cache,
    /// Tokens whose keys and values are in `cache`, from position 0 (forgotten ones included).
    fed: Vec<u32>,
    window: usize,
    label: String,
}

impl<'e, E: BatchEngine + ?Sized> ModelProposer<'e, E> {
    /// A drafter on `engine` whose cache holds at most `window` positions (the draft window) plus
    /// one draft chain.
    pub fn new(engine: &'e E, window: usize, label: impl Into<String>) -> Result<Self, SpecError> {
        if window == 0 {
            return Err(SpecError::Config(
                "the draft window must be at least 1 token".into(),
            ));
        }
        // The window, one catch-up chunk of the same size and a draft chain fit.
        let cache = engine.new_cache(2 * window + 64, KvDtype::F32)?;
        Ok(ModelProposer {
            engine,
            cache,
            fed: Vec::new(),
            window,
            label: label.into(),
        })
    }

    /// Positions the drafter's cache holds now (at most the window after each draft).
    pub fn cached(&self) -> usize {
        self.cache.seq_len(SEQ)
    }

    /// Run `tokens` at the end of what is fed; the logits of the last.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, SpecError> {
        let pos = self.fed.len() as u32;
        let batch = Batch::chain(SEQ, pos, tokens, false);
        let logits = self.engine.forward(&mut self.cache, &batch, None)?;
        self.engine.commit(&mut self.cache);
        self.fed.extend_from_slice(tokens);
        Ok(logits.last().to_vec())
    }

    /// Keep the drafter's cache within its window.
    fn slide(&mut self) {
        let next = self.fed.len();
        if next > self.window {
            self.cache.forget_before(SEQ, (next - self.window) as u32);
        }
    }
}

impl<E: BatchEngine + ?Sized> Proposer for ModelProposer<'_, E> {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn is_costly(&self) -> bool {
        true
    }

    fn self_draft_fraction(&self) -> Option<f64> {
        let all = self.engine.model().config().n_layer;
        let n = self.engine.n_layers();
        (n < all).then(|| n as f64 / all as f64)
    }

    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError> {
        let Some(&root) = context.last() else {
            return Err(SpecError::EmptyContext);
        };
        let n_vocab = self.engine.model().config().n_vocab;
        if let Some(&bad) = context.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(SpecError::VocabMismatch {
                token: bad,
                n_vocab,
            });
        }
        // Keep the common prefix of what was fed and the context; forget the rest (the last
        // draft chain beyond what the target accepted).
        let common = self
            .fed
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        // The oldest position still cached: a sequence cannot restart above position 0, so a
        // common prefix that ends below it (the target rejected more than the window) means
        // running the text again from the start.
        let oldest = self
            .cache
            .cells()
            .iter()
            .filter(|c| c.seq == SEQ && c.batch == CellMeta::COMMITTED)
            .map(|c| c.pos as usize)
            .min();
        let restart = match oldest {
            Some(o) => common <= o && o > 0,
            None => common > 0,
        };
        if restart {
            self.cache.clear();
            self.fed.clear();
        } else {
            self.cache.truncate(SEQ, common as u32);
            self.fed.truncate(common);
        }
        let mut todo = context[self.fed.len()..].to_vec();
        if todo.is_empty() {
            // The whole context was fed (it ended with a draft token the target accepted):
            // run its last token again to get its logits.
            let last = self.fed.len() - 1;
            self.cache.truncate(SEQ, last as u32);
            self.fed.truncate(last);
            if self.cache.seq_len(SEQ) == 0 && last > 0 {
                self.cache.clear();
                self.fed.clear();
                todo = context.to_vec();
            } else {
                todo = vec![root];
            }
        }
        let mut logits = Vec::new();
        for chunk in todo.chunks(self.window.max(1)) {
            logits = self.feed(chunk)?;
            self.slide();
        }
        let depth = shape.max_depth.min(shape.budget);
        let mut per_depth = Vec::with_capacity(depth);
        for d in 0..depth {
            let top = top_k_log_probs(&logits, shape.top_k.max(1));
            let Some(&(best, _)) = top.first() else { break };
            per_depth.push(top);
            if d + 1 < depth {
                logits = self.feed(&[best])?;
            }
        }
        self.slide();
        Ok(build_per_depth(root, shape, &per_depth))
    }
}

/// Drafts the known continuation: at each depth the right token is ranked first with
/// probability `rate` (else it is missing), followed by wrong tokens. The acceptance of a
/// chain draft is then `rate` per depth, whatever the model.
#[derive(Clone, Debug)]
pub struct SyntheticProposer {
    /// The full expected sequence (prompt and continuation).
    oracle: Vec<u32>,
    rate: f64,
    n_vocab: u32,
    rng: Rng,
}

impl SyntheticProposer {
    pub fn new(oracle: Vec<u32>, rate: f64, n_vocab: usize, seed: u64) -> SyntheticProposer {
        SyntheticProposer {
            oracle,
            rate,
            n_vocab: n_vocab.max(2) as u32,
            rng: Rng::new(seed),
        }
    }
}

impl Proposer for SyntheticProposer {
    fn name(&self) -> String {
        format!("synthetic:{}", self.rate)
    }

    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError> {
        let Some(&root) = context.last() else {
            return Err(SpecError::EmptyContext);
        };
        let depth = shape.max_depth.min(shape.budget);
        let mut per_depth = Vec::with_capacity(depth);
        for d in 0..depth {
            let Some(&right) = self.oracle.get(context.len() + d) else {
                break;
            };
            let hit = self.rng.next_f64() < self.rate;
            let mut list = Vec::with_capacity(shape.top_k);
            if hit {
                list.push(right);
            }
            let mut wrong = right;
            while list.len() < shape.top_k.max(1) {
                wrong = (wrong + 1) % self.n_vocab;
                if wrong != right {
                    list.push(wrong);
                }
            }
            per_depth.push(
                list.into_iter()
                    .enumerate()
                    .map(|(r, t)| (t, 0.6f64.ln() + r as f64 * 0.4f64.ln()))
                    .collect(),
            );
        }
        Ok(build_per_depth(root, shape, &per_depth))
    }
}

/// A drafter given as a table: the candidates after each context (looked up by the whole
/// context), for the exact-law proof and adversarial tests.
pub struct TableProposer<F: FnMut(&[u32]) -> Vec<(u32, f64)>> {
    pub table: F,
}

impl<F: FnMut(&[u32]) -> Vec<(u32, f64)>> Proposer for TableProposer<F> {
    fn name(&self) -> String {
        "table".into()
    }

    fn propose(&mut self, context: &[u32], shape: TreeShape) -> Result<Tree, SpecError> {
        conditional_tree(context, shape, &mut self.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_longest_suffix() {
        let p = NgramProposer::new(2048);
        // "1 2 3 4 ... 1 2 3" → 4 (a 3-token match) rather than 9 (after a lone 3).
        let c = p.continuations(&[1, 2, 3, 4, 5, 3, 9, 1, 2, 3]);
        assert_eq!(c[0].0, 4);
        assert_eq!(c.len(), 1);
        // No earlier occurrence of the last token: nothing.
        assert!(p.continuations(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn ngram_tree_follows_a_repeated_phrase() {
        let mut p = NgramProposer::new(2048);
        let ctx = [7, 1, 2, 3, 4, 5, 8, 1, 2];
        let t = p
            .propose(&ctx, TreeShape::new(3, 2))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.tokens(), &[2, 3, 4, 5]);
    }

    #[test]
    fn ngram_window_limits_the_history() {
        let p = NgramProposer {
            max_n: 4,
            window: 3,
        };
        // The match [5] → 6 is outside the last three tokens.
        assert!(p.continuations(&[5, 6, 1, 2, 5]).is_empty());
    }

    #[test]
    fn synthetic_rate_one_drafts_the_oracle() {
        let mut p = SyntheticProposer::new(vec![1, 2, 3, 4, 5, 6], 1.0, 10, 0);
        let t = p
            .propose(&[1, 2], TreeShape::new(3, 1))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.tokens(), &[2, 3, 4, 5]);
        let mut p = SyntheticProposer::new(vec![1, 2, 3, 4, 5, 6], 0.0, 10, 0);
        let t = p
            .propose(&[1, 2], TreeShape::new(3, 1))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(t.tokens()[1..].iter().zip([3, 4, 5]).all(|(a, b)| *a != b));
    }
}
