//! Serde for f64 values that may be NaN or ±∞ (an NMSE against an all-zero reference is +∞).
//! JSON has no such numbers, so they are written as the strings "nan", "inf", "-inf".

use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_nan() {
        s.serialize_str("nan")
    } else if v.is_infinite() {
        s.serialize_str(if *v > 0.0 { "inf" } else { "-inf" })
    } else {
        s.serialize_f64(*v)
    }
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Num(f64),
        Str(String),
    }
    match Repr::deserialize(d)? {
        Repr::Num(v) => Ok(v),
        Repr::Str(s) => match s.as_str() {
            "nan" => Ok(f64::NAN),
            "inf" => Ok(f64::INFINITY),
            "-inf" => Ok(f64::NEG_INFINITY),
            other => Err(serde::de::Error::custom(format!(
                "expected a number, \"nan\", \"inf\" or \"-inf\", found \"{other}\""
            ))),
        },
    }
}

/// Compact human formatting shared by the console table, markdown and JUnit messages:
/// three significant digits, scientific below 1e-3 or from 1e5.
pub fn fmt_sig(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        // 1e-3 ≤ a < 1: three significant digits.
        let digits = (2 - a.log10().floor() as i32).max(0) as usize;
        format!("{v:.digits$}")
    }
}

/// A cosine with enough decimals that 1 − cos keeps three significant digits (0.99999664, not
/// 1.000), so a floor just below 1 and a value just below the floor stay distinguishable.
pub fn fmt_cosine(c: f64) -> String {
    let gap = 1.0 - c;
    if !c.is_finite() || !(1e-12..0.1).contains(&gap) {
        return fmt_sig(c);
    }
    let decimals = (-gap.log10()).ceil() as usize + 2;
    format!("{c:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug)]
    struct W(#[serde(with = "super")] f64);

    #[test]
    fn non_finite_values_round_trip_through_json() {
        for (v, text) in [
            (f64::INFINITY, "\"inf\""),
            (f64::NEG_INFINITY, "\"-inf\""),
            (1.5, "1.5"),
        ] {
            let json = serde_json::to_string(&W(v)).unwrap_or_default();
            assert_eq!(json, text);
            let back: Result<W, _> = serde_json::from_str(&json);
            assert_eq!(back.map(|w| w.0).ok(), Some(v));
        }
        let nan: Result<W, _> = serde_json::from_str("\"nan\"");
        assert!(nan.map(|w| w.0.is_nan()).unwrap_or(false));
        assert!(serde_json::from_str::<W>("\"big\"").is_err());
    }

    #[test]
    fn formats_three_significant_digits() {
        for (v, s) in [
            (0.0, "0"),
            (1.234e-7, "1.23e-7"),
            (0.01234, "0.0123"),
            (0.5, "0.500"),
            (3.21987, "3.22"),
            (42.42, "42.4"),
            (123.4, "123"),
            (2.5e6, "2.50e6"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(fmt_sig(v), s, "{v}");
        }
    }

    #[test]
    fn cosines_near_one_keep_their_gap() {
        for (v, s) in [
            (1.0 - 3.36e-6, "0.99999664"),
            (0.98817, "0.9882"),
            (0.5, "0.500"),
            (1.0, "1.00"),
        ] {
            assert_eq!(fmt_cosine(v), s, "{v}");
        }
    }
}
