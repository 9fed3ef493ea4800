//! GGUF files: reading (memory-mapped, validated, split sets) and writing.
