//! SentencePiece-style merging (llama.cpp's `llm_tokenizer_spm`).
//!
//! The text (spaces already `▁`) starts as one symbol per character. Every adjacent pair whose
//! concatenation is a token goes into a priority queue keyed by that token's score (highest
//! first; on equal scores the leftmost pair first). The best pair is merged, its new neighbours
//! are queued, and stale entries (a side already merged away) are skipped. Each final symbol is
//! its token, or, if it is a lone character the vocabulary lacks, its UTF-8 bytes as `<0xHH>`
//! byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::{Tokenizer, TokenizerError};

/// One symbol: `text[start..start + len]`, linked to its neighbours. `len == 0` once merged away.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text when queued, to recognize stale entries.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The max-heap pops the highest score first; among equal scores the smallest `left`.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Appends the tokens of `text` (already `▁`-escaped, one fragment between special tokens).
pub(super) fn tokenize(
    tok: &Tokenizer,
    text: &str,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let i = symbols.len();
        symbols.push(Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }
    if symbols.is_empty() {
        return Ok(());
    }

    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left, right| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let l: &Symbol = &symbols[left];
        let r: &Symbol = &symbols[right];
        let merged = &text[l.start..r.start + r.len];
        if let Some(id) = tok.token_id(merged) {
            queue.push(Bigram {
                score: tok.scores[id as usize],
                left,
                right,
                size: merged.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        try_add(&symbols, &mut queue, l.prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), r.next);
    }

    let mut cur = Some(0);
    while let Some(i) = cur {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match tok.token_id(piece) {
            Some(id) => out.push(id),
            None => {
                for &byte in piece.as_bytes() {
                    out.push(tok.byte_token(byte)?);
                }
            }
        }
        cur = s.next;
    }
    Ok(())
}
