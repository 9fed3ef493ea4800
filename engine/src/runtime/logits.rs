//! [`Logits`]: what a forward returns, rows of vocabulary scores for the batch tokens that
//! asked for them.

/// Logits of a forward call: `n_rows` rows of `n_vocab`, one per batch token that asked for
/// logits (`tokens[i]` is row `i`'s batch index).
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub data: Vec<f32>,
    pub n_rows: usize,
    pub n_vocab: usize,
    /// The batch index of each row.
    pub tokens: Vec<usize>,
}

impl Logits {
    /// The logits `data` (`rows.len()` rows of `n_vocab`) of batch tokens `rows`, as the forward
    /// pass returns them.
    pub fn of_rows(data: Vec<f32>, rows: &[u32], n_vocab: usize) -> Logits {
        Logits {
            data,
            n_rows: rows.len(),
            n_vocab,
            tokens: rows.iter().map(|&r| r as usize).collect(),
        }
    }

    /// Row `i` (`0..n_rows`).
    pub fn row(&self, i: usize) -> &[f32] {
        self.data
            .get(i * self.n_vocab..(i + 1) * self.n_vocab)
            .unwrap_or(&[])
    }

    /// The row of batch token `index`, if it asked for logits.
    pub fn of_token(&self, index: usize) -> Option<&[f32]> {
        self.tokens
            .iter()
            .position(|&t| t == index)
            .map(|i| self.row(i))
    }

    /// The last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.n_rows.saturating_sub(1))
    }
}
