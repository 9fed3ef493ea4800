//! A tiny glob matcher for case names: `*` matches any run of characters (`/` included, so
//! `gemma3-270m/*` selects every case of that model), `?` exactly one character; everything
//! else matches itself.

/// Whether `text` matches `pattern` as a whole.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with one backtrack point (the last `*`): linear in practice, never
    // exponential.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(pattern: &str, text: &str, expect: bool) {
        assert_eq!(glob_match(pattern, text), expect, "{pattern} vs {text}");
    }

    #[test]
    fn literals_and_wildcards() {
        check("abc", "abc", true);
        check("abc", "abd", false);
        check("abc", "abcd", false);
        check("a?c", "abc", true);
        check("a?c", "ac", false);
        check("*", "", true);
        check("", "", true);
        check("", "a", false);
        check("a*", "a", true);
        check("*c", "abc", true);
        check("a*b*c", "axxbyyc", true);
        check("a*b*c", "axxbyy", false);
        check("**x", "abx", true);
    }

    #[test]
    fn star_crosses_slashes_in_case_names() {
        check(
            "gemma3-270m/*",
            "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off",
            true,
        );
        check(
            "*/cuda-*/*",
            "gemma3-270m/q4_k_m/cuda-sm90/tp1-shm/off",
            true,
        );
        check("*/tp?-*", "llama/q4_0/cpu-scalar/tp1-shm/off", true);
        check("*tree*", "llama/q4_0/cpu-scalar/tp1-shm/off", false);
    }

    #[test]
    fn backtracking_finds_the_later_match() {
        check("*ab", "aab", true);
        check("*aab", "aaab", true);
        check(
            "a*a*a*a*b",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            false,
        );
    }
}

#[cfg(test)]
mod props {
    use super::glob_match;
    use proptest::prelude::*;

    /// The definition, written recursively: obviously right, exponential in the worst case.
    fn reference(p: &[char], t: &[char]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some(('*', rest)) => (0..=t.len()).any(|i| reference(rest, &t[i..])),
            Some((&c, rest)) => t
                .split_first()
                .is_some_and(|(&d, tr)| (c == '?' || c == d) && reference(rest, tr)),
        }
    }

    proptest! {
        #[test]
        fn agrees_with_the_recursive_definition(p in "[ab*?/]{0,8}", t in "[ab/]{0,10}") {
            let (pc, tc): (Vec<char>, Vec<char>) = (p.chars().collect(), t.chars().collect());
            prop_assert_eq!(glob_match(&p, &t), reference(&pc, &tc));
        }
    }
}
