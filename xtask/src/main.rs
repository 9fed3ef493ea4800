//! `cargo xtask`: project automation (model fetching, fixtures, verification).

fn main() {}
