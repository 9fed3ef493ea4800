//! Test hooks, off unless the environment variable [`ENV_VAR`] sets them: comma-separated
//! `key=value` pairs. They exist so that tests can see the states a healthy machine rarely shows:
//!
//! - `warmup-delay-ms=N`: the engine waits N ms after loading before it runs anything, so the
//!   warm-up generation is deliberately slow and `/ready` must stay 503 through it;
//! - `step-delay-ms=N`: every engine step (one batched forward) waits N ms first, so a tiny
//!   fixture model generates slowly enough for a test to fill the queue or disconnect midway;
//! - `break-file=PATH`: while PATH exists every forward fails (the process stays up and keeps
//!   answering `/health`): the "active but not serving" failure `/ready` must report.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};

pub const ENV_VAR: &str = "PLUMBLINE_SERVE_TEST_HOOKS";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hooks {
    pub warmup_delay: Option<Duration>,
    pub step_delay: Option<Duration>,
    pub break_file: Option<PathBuf>,
}

impl Hooks {
    /// The hooks from the environment; a misspelt key or bad number fails loudly.
    pub fn from_env() -> Result<Hooks> {
        match std::env::var(ENV_VAR) {
            Ok(v) => Self::parse(&v).with_context(|| format!("reading {ENV_VAR}={v:?}")),
            Err(_) => Ok(Hooks::default()),
        }
    }

    pub fn parse(text: &str) -> Result<Hooks> {
        let mut h = Hooks::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                bail!("expected key=value, found {item:?}");
            };
            let ms = || -> Result<Duration> {
                let n: u64 = value
                    .trim()
                    .parse()
                    .with_context(|| format!("{key}: expected milliseconds, found {value:?}"))?;
                Ok(Duration::from_millis(n))
            };
            match key.trim() {
                "warmup-delay-ms" => h.warmup_delay = Some(ms()?),
                "step-delay-ms" => h.step_delay = Some(ms()?),
                "break-file" => h.break_file = Some(PathBuf::from(value.trim())),
                other => bail!(
                    "unknown hook {other:?}; expected warmup-delay-ms, step-delay-ms or break-file"
                ),
            }
        }
        Ok(h)
    }

    pub fn is_active(&self) -> bool {
        *self != Hooks::default()
    }

    /// Why generation is broken, when the break file exists.
    pub fn broken(&self) -> Option<String> {
        self.break_file
            .as_ref()
            .filter(|p| p.exists())
            .map(|p| format!("test hook: generation broken while {} exists", p.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let h =
            Hooks::parse("warmup-delay-ms=5, break-file=/tmp/x").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(h.warmup_delay, Some(Duration::from_millis(5)));
        assert_eq!(
            h.break_file.as_deref(),
            Some(std::path::Path::new("/tmp/x"))
        );
        assert!(Hooks::parse("warmup-delay=5").is_err());
        assert!(Hooks::parse("step-delay-ms=soon").is_err());
        assert!(!Hooks::parse("")
            .unwrap_or_else(|e| panic!("{e}"))
            .is_active());
    }
}
