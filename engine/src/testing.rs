//! Test support shared by the workspace's tests that need a fetched model.

/// Call where a test finds its model absent, then return from the test. Under `CI` (set to
/// anything but `false` or empty) a missing model is a failure: CI fetches it first, so its
/// absence is a broken pipeline, not a reason to pass. Elsewhere the test reports itself
/// skipped on stderr (nextest shows the line) and returns.
pub fn model_absent(what: &str) {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
    if ci {
        panic!("{what} is not fetched and CI is set: run cargo xtask fetch-model gemma3-270m");
    }
    eprintln!("skipped: {what} not fetched (run cargo xtask fetch-model gemma3-270m)");
}
