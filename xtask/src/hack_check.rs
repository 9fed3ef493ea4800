//! The workspace-hack check: the `plumbline` binary (which verify's serve case and serve-bench
//! build) and `cargo xtask` must resolve every third-party crate they share to the same features,
//! or the second build compiles the shared dependency tree again (about 3 minutes on two cores).
//! `hack/Cargo.toml` holds the union; this test names any crate that drifted and the features
//! to add there.

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::process::Command;

    /// `name version` → features, of every crate in `package`'s build (normal and build edges).
    fn features(package: &str) -> BTreeMap<String, BTreeSet<String>> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .args(["tree", "--offline", "-p", package, "-e", "normal,build"])
            .args(["-f", "{p} {f}", "--prefix", "none", "--no-dedupe"])
            .output()
            .unwrap_or_else(|e| panic!("running cargo tree: {e}"));
        assert!(
            out.status.success(),
            "cargo tree -p {package}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let parts: Vec<&str> = line.split_whitespace().collect();
            let [name, version, rest @ ..] = parts.as_slice() else {
                continue;
            };
            // A path dependency prints its path in parentheses where the features would be.
            let feats = rest.first().filter(|f| !f.starts_with('('));
            map.entry(format!("{name} {version}")).or_default().extend(
                feats
                    .into_iter()
                    .flat_map(|f| f.split(','))
                    .map(str::to_owned),
            );
        }
        map
    }

    #[test]
    fn the_plumbline_and_xtask_builds_share_every_dependency() {
        let xtask = features("xtask");
        let plumbline = features("plumbline");
        let drift: Vec<String> = xtask
            .iter()
            .filter_map(|(k, a)| {
                let b = plumbline.get(k)?;
                (a != b).then(|| {
                    format!(
                        "{k}: xtask only {:?}, plumbline only {:?}",
                        a.difference(b).collect::<Vec<_>>(),
                        b.difference(a).collect::<Vec<_>>()
                    )
                })
            })
            .collect();
        assert!(
            xtask.len() > 50 && plumbline.len() > 50,
            "cargo tree listed too little"
        );
        assert!(
            drift.is_empty(),
            "add these features to hack/Cargo.toml (normal deps; host-only crates such as syn \
             under [build-dependencies]):\n{}",
            drift.join("\n")
        );
    }
}
