//! Architecture invariant: the harness judges the engine and the reference, so it depends on
//! neither (directly or through another crate), dev-dependencies included. Checked on Cargo.lock.

use std::collections::{BTreeMap, BTreeSet};

/// package name → names of its dependencies, from Cargo.lock.
fn lock_graph(lock: &str) -> BTreeMap<String, Vec<String>> {
    let mut graph = BTreeMap::new();
    for block in lock.split("[[package]]").skip(1) {
        let mut name = None;
        let mut deps = Vec::new();
        let mut in_deps = false;
        for line in block.lines().map(str::trim) {
            if let Some(n) = line.strip_prefix("name = ") {
                name = Some(n.trim_matches('"').to_owned());
            } else if line.starts_with("dependencies = [") {
                in_deps = true;
            } else if in_deps && line == "]" {
                in_deps = false;
            } else if in_deps {
                // `"serde 1.0.229",` or `"serde",`: the name is the first word.
                let d = line.trim_matches(|c| c == '"' || c == ',');
                deps.push(d.split(' ').next().unwrap_or_default().to_owned());
            }
        }
        if let Some(n) = name {
            graph.entry(n).or_insert_with(Vec::new).extend(deps);
        }
    }
    graph
}

#[test]
fn harness_depends_on_neither_engine_nor_reference() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock");
    let lock = std::fs::read_to_string(path).unwrap_or_default();
    assert!(!lock.is_empty(), "could not read {path}");
    let graph = lock_graph(&lock);
    assert!(
        graph.contains_key("harness"),
        "harness is not in Cargo.lock"
    );
    let mut seen = BTreeSet::new();
    let mut stack = vec!["harness".to_owned()];
    while let Some(p) = stack.pop() {
        for d in graph.get(&p).into_iter().flatten() {
            if seen.insert(d.clone()) {
                stack.push(d.clone());
            }
        }
    }
    for forbidden in ["engine", "reference", "golden", "xtask"] {
        assert!(!seen.contains(forbidden), "harness depends on {forbidden}");
    }
    // The check itself can see dependencies.
    assert!(seen.contains("serde"));
}
