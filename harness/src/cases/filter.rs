//! `--filter GLOB`, `--only AXIS=VALUE`, `--exclude GLOB`.
//!
//! A case is selected when it matches any `--filter` (or there is none), for every axis named by
//! `--only` its value is one of the values given for that axis (repeated `--only` on one axis
//! are alternatives, on different axes all must hold), and it matches no `--exclude`.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::glob::glob_match;
use super::Case;
use crate::error::HarnessError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    Model,
    Weights,
    Backend,
    Tp,
    Topology,
    Path,
    Spec,
    /// The engine's KV cache, `f32` or `f16`.
    Kv,
}

impl FromStr for Axis {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Ok(match s {
            "model" | "arch" => Axis::Model,
            "weights" => Axis::Weights,
            "backend" => Axis::Backend,
            "tp" => Axis::Tp,
            "topology" => Axis::Topology,
            "spec" => Axis::Spec,
            "path" => Axis::Path,
            "kv" | "kv-dtype" | "kv_dtype" => Axis::Kv,
            _ => return Err(()),
        })
    }
}

impl Axis {
    /// The case's value on this axis, spelled as in its name (`tp` as the bare number).
    pub fn value_of(self, case: &Case) -> String {
        match self {
            Axis::Model => case.model.clone(),
            Axis::Weights => case.weights.clone(),
            Axis::Backend => case.backend.to_string(),
            Axis::Tp => case.tp.to_string(),
            Axis::Topology => case.topology.to_string(),
            Axis::Spec => case.spec.to_string(),
            Axis::Path => case.path.to_string(),
            Axis::Kv => case.kv.to_string(),
        }
    }
}

/// The selection of `cargo xtask verify`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Filter {
    pub include: Vec<String>,
    pub only: BTreeMap<Axis, Vec<String>>,
    pub exclude: Vec<String>,
}

impl Filter {
    /// Build from the raw flag values; an `--only` that is not `AXIS=VALUE` is an error.
    pub fn new(
        include: &[String],
        only: &[String],
        exclude: &[String],
    ) -> Result<Filter, HarnessError> {
        let mut f = Filter {
            include: include.to_vec(),
            exclude: exclude.to_vec(),
            ..Filter::default()
        };
        for o in only {
            let (axis, value) = o
                .split_once('=')
                .filter(|(_, v)| !v.is_empty())
                .ok_or_else(|| HarnessError::OnlyFilter(o.clone()))?;
            let axis: Axis = axis
                .trim()
                .parse()
                .map_err(|()| HarnessError::OnlyFilter(o.clone()))?;
            // `tp=tp2` and `tp=2` both mean TP 2.
            let value = value.trim();
            let value = match axis {
                Axis::Tp => value.strip_prefix("tp").unwrap_or(value),
                _ => value,
            };
            f.only.entry(axis).or_default().push(value.to_owned());
        }
        Ok(f)
    }

    pub fn matches(&self, case: &Case) -> bool {
        let name = case.name();
        (self.include.is_empty() || self.include.iter().any(|g| glob_match(g, &name)))
            && self
                .only
                .iter()
                .all(|(axis, values)| values.contains(&axis.value_of(case)))
            && !self.exclude.iter().any(|g| glob_match(g, &name))
    }

    pub fn apply(&self, cases: Vec<Case>) -> Vec<Case> {
        cases.into_iter().filter(|c| self.matches(c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str) -> Case {
        match name.parse() {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    fn selected(include: &[&str], only: &[&str], exclude: &[&str], names: &[&str]) -> Vec<String> {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let f = match Filter::new(&s(include), &s(only), &s(exclude)) {
            Ok(f) => f,
            Err(e) => panic!("{e}"),
        };
        f.apply(names.iter().map(|n| case(n)).collect())
            .iter()
            .map(|c| c.name())
            .collect()
    }

    const NAMES: [&str; 5] = [
        "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off",
        "gemma3-270m/q4_k_m/cuda-sm90/tp2-nvlink/off",
        "llama/q4_0/cpu-scalar/tp1-shm/off",
        "llama/q8_0/cpu-avx2/tp1-shm/tree-b8k4",
        "deepseek2/q4_k/cpu-avx512/tp2-shm/off",
    ];

    #[test]
    fn no_flags_select_everything() {
        assert_eq!(selected(&[], &[], &[], &NAMES).len(), 5);
    }

    #[test]
    fn filter_globs_are_alternatives() {
        assert_eq!(
            selected(&["llama/*", "*/tp2-nvlink/*"], &[], &[], &NAMES),
            [NAMES[1], NAMES[2], NAMES[3]]
        );
    }

    #[test]
    fn only_is_or_within_an_axis_and_across_axes() {
        assert_eq!(
            selected(
                &[],
                &["backend=cpu-avx2", "backend=cpu-scalar"],
                &[],
                &NAMES
            ),
            [NAMES[0], NAMES[2], NAMES[3]]
        );
        assert_eq!(
            selected(&[], &["backend=cpu-avx2", "spec=off"], &[], &NAMES),
            [NAMES[0]]
        );
        assert_eq!(selected(&[], &["tp=2"], &[], &NAMES), [NAMES[1], NAMES[4]]);
        assert_eq!(
            selected(&[], &["tp=tp2", "topology=shm"], &[], &NAMES),
            [NAMES[4]]
        );
        assert_eq!(
            selected(&[], &["arch=llama", "weights=q8_0"], &[], &NAMES),
            [NAMES[3]]
        );
    }

    #[test]
    fn kv_cache_axis_and_old_globs() {
        let names = [
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked",
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16",
            "gemma3/q4_k_m/cpu-avx2/tp1-shm/decode-kvf16",
        ];
        assert_eq!(selected(&[], &["kv=f16"], &[], &names), names[1..]);
        assert_eq!(selected(&[], &["kv=f32"], &[], &names), names[..1]);
        // The path axis is the path, whatever the cache.
        assert_eq!(selected(&[], &["path=chunked"], &[], &names), names[..2]);
        // A glob written before the axis existed selects what it selected then.
        assert_eq!(selected(&["*/chunked"], &[], &[], &names), names[..1]);
        assert_eq!(selected(&["*-kvf16"], &[], &[], &names), names[1..]);
        assert_eq!(
            selected(&[], &["kv-dtype=f16", "path=decode"], &[], &names),
            names[2..]
        );
    }

    #[test]
    fn exclude_wins() {
        assert_eq!(selected(&["llama/*"], &[], &["*tree*"], &NAMES), [NAMES[2]]);
    }

    #[test]
    fn malformed_only_is_an_error() {
        for bad in ["backend", "backend=", "gpu=sm90", "=x"] {
            assert!(Filter::new(&[], &[bad.to_string()], &[]).is_err(), "{bad}");
        }
    }
}
