//! Text → id lookup over the vocabulary without a second copy of the texts.
//!
//! An open-addressing table of ids (linear probing, at most half full) hashed by token text and
//! compared against the token list itself. Building it for a 262144-token vocabulary touches
//! 2 MiB and allocates once; a `HashMap<Box<str>, u32>` needed a clone of every text and most of
//! the load time.

/// Slot value 0 is empty; otherwise the slot holds `id + 1`.
#[derive(Debug, Clone)]
pub(super) struct VocabIndex {
    slots: Vec<u32>,
    mask: usize,
}

impl VocabIndex {
    /// Indexes `tokens`; on duplicate texts the later id wins, as in llama.cpp's map.
    pub(super) fn new(tokens: &[Box<str>]) -> Self {
        let cap = (tokens.len() * 2).next_power_of_two().max(16);
        let mut index = VocabIndex {
            slots: vec![0; cap],
            mask: cap - 1,
        };
        for (id, t) in tokens.iter().enumerate() {
            let mut i = hash(t.as_bytes()) as usize & index.mask;
            loop {
                match index.slots[i] {
                    0 => {
                        index.slots[i] = id as u32 + 1;
                        break;
                    }
                    s if *tokens[s as usize - 1] == **t => {
                        index.slots[i] = id as u32 + 1;
                        break;
                    }
                    _ => i = (i + 1) & index.mask,
                }
            }
        }
        index
    }

    /// The id of `text`, if it is a token.
    pub(super) fn get(&self, tokens: &[Box<str>], text: &str) -> Option<u32> {
        let mut i = hash(text.as_bytes()) as usize & self.mask;
        loop {
            match self.slots[i] {
                0 => return None,
                s if *tokens[s as usize - 1] == *text => return Some(s - 1),
                _ => i = (i + 1) & self.mask,
            }
        }
    }
}

/// FNV-1a over the bytes, then a multiply-xorshift finalizer so the low bits (the table index)
/// depend on every byte.
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_token_and_nothing_else() {
        let tokens: Vec<Box<str>> = (0..1000).map(|i| format!("t{i}").into()).collect();
        let index = VocabIndex::new(&tokens);
        for (i, t) in tokens.iter().enumerate() {
            assert_eq!(index.get(&tokens, t), Some(i as u32));
        }
        assert_eq!(index.get(&tokens, "t1000"), None);
        assert_eq!(index.get(&tokens, ""), None);
    }

    #[test]
    fn later_duplicate_wins() {
        let tokens: Vec<Box<str>> = vec!["a".into(), "b".into(), "a".into()];
        let index = VocabIndex::new(&tokens);
        assert_eq!(index.get(&tokens, "a"), Some(2));
        assert_eq!(index.get(&tokens, "b"), Some(1));
    }
}
