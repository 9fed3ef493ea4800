//! No code: see Cargo.toml (the workspace-hack pattern).
