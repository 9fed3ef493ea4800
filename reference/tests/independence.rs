//! Architecture invariant: `reference` never depends on `engine` or `kernels`, directly or
//! through another crate, dev-dependencies included. Cargo.lock lists every package's resolved
//! dependencies (normal, build and dev alike), so a walk over it from `reference` sees them all.

use std::collections::{BTreeMap, BTreeSet};

/// `package name → names of its dependencies`, from the lock file's `[[package]]` tables.
fn lock_graph(lock: &str) -> BTreeMap<String, Vec<String>> {
    let mut graph = BTreeMap::new();
    for block in lock.split("[[package]]").skip(1) {
        let mut name = None;
        let mut deps = Vec::new();
        let mut in_deps = false;
        for line in block.lines().map(str::trim) {
            if let Some(n) = line.strip_prefix("name = ") {
                name = Some(n.trim_matches('"').to_string());
            } else if line.starts_with("dependencies = [") {
                in_deps = true;
            } else if in_deps && line.starts_with(']') {
                in_deps = false;
            } else if in_deps {
                // `"name"`, `"name 1.2.3"` or `"name 1.2.3 (registry+…)"`
                let dep = line.trim_matches(|c| c == '"' || c == ',');
                if let Some(dep_name) = dep.split_whitespace().next() {
                    deps.push(dep_name.to_string());
                }
            }
        }
        if let Some(name) = name {
            graph.entry(name).or_insert_with(Vec::new).extend(deps);
        }
    }
    graph
}

fn closure(graph: &BTreeMap<String, Vec<String>>, root: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![root.to_string()];
    while let Some(p) = stack.pop() {
        if seen.insert(p.clone()) {
            stack.extend(graph.get(&p).into_iter().flatten().cloned());
        }
    }
    seen
}

#[test]
fn reference_depends_on_neither_engine_nor_kernels() {
    let lock_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock");
    let lock = std::fs::read_to_string(lock_path).unwrap_or_else(|e| panic!("{lock_path}: {e}"));
    let graph = lock_graph(&lock);
    assert!(
        graph.contains_key("reference"),
        "reference is not in {lock_path}"
    );
    let deps = closure(&graph, "reference");
    assert!(
        deps.contains("candle-core"),
        "the walk should reach candle-core: {deps:?}"
    );
    for forbidden in ["engine", "kernels"] {
        assert!(
            !deps.contains(forbidden),
            "reference reaches `{forbidden}` through its dependencies: {deps:?}"
        );
    }
}

#[test]
fn the_walk_would_see_an_indirect_dependency() {
    // The check above can fail: a lock file where reference → helper → kernels is caught.
    let lock = r#"
[[package]]
name = "reference"
dependencies = [
 "helper",
]

[[package]]
name = "helper"
version = "0.1.0"
dependencies = [
 "kernels 0.1.0",
]

[[package]]
name = "kernels"
"#;
    assert!(closure(&lock_graph(lock), "reference").contains("kernels"));
}
