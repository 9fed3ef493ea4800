//! Incremental detokenization: ids in, text out as soon as it is complete UTF-8.

use super::Tokenizer;

/// Turns ids into text one at a time. A character whose bytes span several tokens (byte
/// fallback, GPT-2 byte tokens) is held back until its last byte arrives, so every returned
/// string is valid text and the concatenation equals [`Tokenizer::decode`] of all ids.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'t> {
    tok: &'t Tokenizer,
    pending: Vec<u8>,
    /// Whether text has been produced yet (the SPM leading space is dropped only there).
    started: bool,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tok: &'t Tokenizer) -> Self {
        StreamDecoder {
            tok,
            pending: Vec::new(),
            started: false,
        }
    }

    /// Adds one id; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let bytes = self.tok.token_bytes(id);
        if bytes.is_empty() {
            return String::new();
        }
        let bytes = if !self.started && self.tok.add_space_prefix && bytes[0] == b' ' {
            &bytes[1..]
        } else {
            &bytes[..]
        };
        self.started = true;
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Flushes what is left; an incomplete sequence at the end becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back because they do not yet form a complete character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Emits everything up to the last position that could still be the start of an
    /// incomplete character; invalid bytes become U+FFFD exactly as a lossy decode of the
    /// whole text would make them.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[valid + bad..];
                        }
                        // Truncated sequence at the end: wait for more bytes.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}
