//! Fuzz `engine::gguf::Gguf::open`: any bytes must give a model or a typed error, never a panic,
//! and an opened model's tensor slices must be exactly as long as their infos say.
//!
//! Run: `cargo +nightly fuzz run gguf_reader` (from `fuzz/`).
#![no_main]

use std::io::Write;

use engine::gguf::Gguf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The reader maps files, so the input goes through a real file.
    let Ok(mut file) = tempfile::Builder::new().suffix(".gguf").tempfile() else {
        return;
    };
    if file.write_all(data).and_then(|()| file.flush()).is_err() {
        return;
    }
    if let Ok(g) = Gguf::open(file.path()) {
        for t in g.tensors() {
            assert_eq!(g.tensor_data(t).len() as u64, t.n_bytes);
        }
        let _ = g.architecture();
    }
});
