//! The engine's layers point down only (ARCHITECTURE.md, "Layers"):
//!
//! ```text
//! faults, taps, gguf  ←  tokenizer  ←  runtime  ←  model  ←  tp  ←  exec  ←  spec  ←  capabilities
//! ```
//!
//! A module may use its own layer and the layers left of it, never one to its right. This test
//! scans every `crate::NAME` path in `engine/src` (comments and test-only code excepted: a
//! lower layer's tests may drive it through the layers above) and fails naming the file, the
//! line and the upward path.

use std::path::{Path, PathBuf};

/// The layers, lowest first; modules on one line share a layer.
const LAYERS: &[&[&str]] = &[
    &["faults", "taps", "gguf", "testing"],
    &["tokenizer"],
    &["runtime", "sampling"],
    &["model"],
    &["tp"],
    &["exec"],
    &["spec"],
    &["capabilities", "lib"],
];

fn level(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The top-level module a file of `engine/src` belongs to (`runtime/cuda/backend.rs` →
/// `runtime`, `lib.rs` → `lib`).
fn module_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default();
    first.trim_end_matches(".rs").to_owned()
}

/// Every upward `crate::` path in `source` (a file of layer `module`): `(line, path)`.
fn upward(module: &str, source: &str) -> Vec<(usize, String)> {
    let Some(own) = level(module) else {
        return vec![(0, format!("module {module} is in no layer"))];
    };
    let mut found = Vec::new();
    let mut lines = source.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        if line.trim() == "#[cfg(test)]" {
            // A test-only `mod x;` is skipped (its file is too); an inline test module ends the
            // file's code (modules end with their tests).
            match lines.next() {
                Some((_, item)) if item.trim_end().ends_with(';') => continue,
                _ => break,
            }
        }
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            match level(&name) {
                Some(l) if l <= own => {}
                Some(_) => found.push((i + 1, format!("crate::{name}"))),
                None => found.push((i + 1, format!("crate::{name} (in no layer)"))),
            }
        }
    }
    found
}

/// Files of `dir`, recursively, except those declared as test-only modules by their parent.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let parent = std::fs::read_to_string(dir.join("mod.rs")).unwrap_or_default();
    let test_only: Vec<String> = parent
        .lines()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0].trim() == "#[cfg(test)]")
        .filter_map(|w| w[1].trim().strip_prefix("mod "))
        .map(|m| m.trim_end_matches(';').to_owned())
        .collect();
    let mut entries: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        if test_only.contains(&stem) {
            continue;
        }
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_layer_imports_a_higher_one() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(
        files.len() > 40,
        "found only {} files in {}",
        files.len(),
        src.display()
    );
    let mut violations = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap_or(f);
        let module = module_of(rel);
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for (line, path) in upward(&module, &text) {
            violations.push(format!("{}:{line}: {module} uses {path}", rel.display()));
        }
    }
    assert!(
        violations.is_empty(),
        "lower layers use higher ones:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_scan_sees_upward_paths_and_ignores_comments_and_tests() {
    let check = |module: &str, src: &str, expect: &[(usize, &str)]| {
        let got = upward(module, src);
        let got: Vec<(usize, &str)> = got.iter().map(|(l, p)| (*l, p.as_str())).collect();
        assert_eq!(got, expect, "{module}: {src}");
    };
    check(
        "runtime",
        "use crate::model::Activation;",
        &[(1, "crate::model")],
    );
    check(
        "model",
        "fn f() { crate::exec::open(); crate::runtime::x(); }",
        &[(1, "crate::exec")],
    );
    check("runtime", "use crate::faults::Fault;\nuse super::x;", &[]);
    check(
        "runtime",
        "/// see [`crate::model::Model`]\nlet a = 1; // crate::tp",
        &[],
    );
    check(
        "runtime",
        "fn a() {}\n#[cfg(test)]\nmod tests { use crate::exec::Engine; }",
        &[],
    );
    check(
        "runtime",
        "#[cfg(test)]\nmod gpu;\nuse crate::tp::X;",
        &[(3, "crate::tp")],
    );
    check("tp", "use crate::spec::Tree;", &[(1, "crate::spec")]);
    check(
        "exec",
        "use crate::nowhere::X;",
        &[(1, "crate::nowhere (in no layer)")],
    );
}
