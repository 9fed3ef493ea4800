//! Split GGUF sets as llama.cpp's `gguf-split` writes them: `PREFIX-00001-of-00005.gguf` …, each
//! shard carrying `split.no` (u16, 0-based), `split.count` (u16) and `split.tensors.count` (i32);
//! shard 0 carries the model's metadata.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::error::GgufError;
use super::reader::{read_file, ParsedFile};
use super::value::Metadata;

/// `split.no`: this shard's 0-based number.
pub const KEY_SPLIT_NO: &str = "split.no";
/// `split.count`: number of shards in the set.
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// `split.tensors.count`: number of tensors across the whole set.
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The path of shard `no` (0-based) of `count` for `prefix`, as gguf-split names it:
/// `{prefix}-{no+1:05}-of-{count:05}.gguf`.
pub fn split_path(prefix: impl AsRef<Path>, no: u16, count: u16) -> PathBuf {
    let prefix = prefix.as_ref();
    let mut s = prefix.as_os_str().to_os_string();
    s.push(format!("-{:05}-of-{:05}.gguf", u32::from(no) + 1, count));
    PathBuf::from(s)
}

/// Splits a shard path into (prefix, 0-based number, count) when its file name ends in
/// `-NNNNN-of-NNNNN.gguf` with 1 ≤ number ≤ count.
pub fn parse_split_path(path: &Path) -> Option<(PathBuf, u16, u16)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    // "-NNNNN-of-NNNNN" is 15 bytes, all ASCII when it matches.
    if stem.len() < 15 || !stem.is_char_boundary(stem.len() - 15) {
        return None;
    }
    let (head, tail) = stem.split_at(stem.len() - 15);
    let tb = tail.as_bytes();
    let digits = |r: std::ops::Range<usize>| -> Option<u16> {
        let s = tail.get(r)?;
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    if tb[0] != b'-' || &tail[6..10] != "-of-" {
        return None;
    }
    let no = digits(1..6)?;
    let count = digits(10..15)?;
    if no == 0 || no > count {
        return None;
    }
    Some((path.with_file_name(head), no - 1, count))
}

/// A shard's split keys, read leniently so the checks below can name what is wrong.
struct SplitKeys {
    no: Option<u16>,
    count: Option<u16>,
    tensors_count: Option<u64>,
}

fn split_keys(md: &Metadata) -> SplitKeys {
    let int = |k: &str| md.get(k).and_then(|v| v.as_integer());
    SplitKeys {
        no: int(KEY_SPLIT_NO).and_then(|i| u16::try_from(i).ok()),
        count: int(KEY_SPLIT_COUNT).and_then(|i| u16::try_from(i).ok()),
        tensors_count: int(KEY_SPLIT_TENSORS_COUNT).and_then(|i| u64::try_from(i).ok()),
    }
}

fn show(md: &Metadata, key: &str) -> String {
    md.get(key)
        .map(|v| v.describe())
        .unwrap_or_else(|| "no such key".to_string())
}

/// The files making up the model `path` belongs to, parsed and checked, in shard order.
/// A file without `split.count` (or with `split.count` = 1 and a plain name) is a set of one.
pub(crate) fn load_set(path: &Path) -> Result<Vec<ParsedFile>, GgufError> {
    let first = read_file(path)?;
    let keys = split_keys(&first.metadata);
    let named = parse_split_path(path);

    let (prefix, opened_no, count) = match (&named, first.metadata.get(KEY_SPLIT_COUNT)) {
        (None, None) => return Ok(vec![first]),
        (None, Some(_)) if keys.count == Some(1) => return Ok(vec![first]),
        (None, Some(_)) => {
            return Err(GgufError::SplitName {
                path: path.to_path_buf(),
                expected: format!(
                    "a name ending in -NNNNN-of-NNNNN.gguf for a shard with split.count {}",
                    show(&first.metadata, KEY_SPLIT_COUNT)
                ),
                found: path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            })
        }
        // A shard name on a file with no split keys: a single model only if the name says so.
        (Some((_, _, 1)), None) => return Ok(vec![first]),
        (Some((prefix, no, count)), _) => (prefix.clone(), *no, *count),
    };

    // Open every shard by name; the file asked for is already parsed.
    let mut first = Some(first);
    let mut files = Vec::with_capacity(usize::from(count));
    for no in 0..count {
        let p = split_path(&prefix, no, count);
        let parsed = if no == opened_no {
            match first.take() {
                Some(f) => f,
                None => read_file(&p)?,
            }
        } else if !p.exists() {
            return Err(GgufError::ShardMissing { path: p, no, count });
        } else {
            read_file(&p)?
        };
        files.push(parsed);
    }

    check_set(&files, count)?;
    Ok(files)
}

/// The shard files `paths`, listed in any order, parsed and put in `split.no` order, then
/// checked as a set. The `split-listing-order` fault keeps each shard's header but maps the
/// data of the file at the same place in the *listing*, as a loader that trusted the listing
/// would.
pub(crate) fn load_listed<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<ParsedFile>, GgufError> {
    let mut files = Vec::with_capacity(paths.len());
    for p in paths {
        files.push(read_file(p.as_ref())?);
    }
    let Some(first) = files.first() else {
        return Err(GgufError::SplitName {
            path: PathBuf::new(),
            expected: "at least one shard file".into(),
            found: "an empty list".into(),
        });
    };
    let count = match split_keys(&first.metadata).count {
        Some(c) => c,
        None if files.len() == 1 => return Ok(files),
        None => {
            return Err(GgufError::ShardForeign {
                path: first.info.path.clone(),
                key: KEY_SPLIT_COUNT,
                expected: format!("u16 {}", files.len()),
                found: show(&first.metadata, KEY_SPLIT_COUNT),
            })
        }
    };
    if usize::from(count) != files.len() {
        // Name the first shard number the listing lacks.
        let have: Vec<Option<u16>> = files.iter().map(|f| split_keys(&f.metadata).no).collect();
        let no = (0..count)
            .find(|n| !have.contains(&Some(*n)))
            .unwrap_or(count);
        let prefix = parse_split_path(&first.info.path).map_or_else(
            || first.info.path.with_extension(""),
            |(prefix, _, _)| prefix,
        );
        return Err(GgufError::ShardMissing {
            path: split_path(prefix, no, count),
            no,
            count,
        });
    }
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by_key(|&i| split_keys(&files[i].metadata).no.unwrap_or(u16::MAX));
    let mut slots: Vec<Option<ParsedFile>> = files.into_iter().map(Some).collect();
    let mut sorted: Vec<ParsedFile> = order.iter().filter_map(|&i| slots[i].take()).collect();
    check_set(&sorted, count)?;
    if crate::faults::is_active(crate::faults::Fault::SplitListingOrder) {
        // The bug: shard k's tensors read the bytes of the k-th file listed.
        let mut maps: Vec<Option<super::reader::Backing>> = sorted
            .iter_mut()
            .map(|f| {
                Some(std::mem::replace(
                    &mut f.bytes,
                    super::reader::Backing::Empty,
                ))
            })
            .collect();
        let mut sorted_pos = vec![0; order.len()];
        for (k, &listed) in order.iter().enumerate() {
            sorted_pos[listed] = k;
        }
        for (k, f) in sorted.iter_mut().enumerate() {
            if let Some(m) = maps[sorted_pos[k]].take() {
                f.bytes = m;
            }
        }
    }
    Ok(sorted)
}

/// Checks that `files` (in name order) form one complete set of `count` shards.
fn check_set(files: &[ParsedFile], count: u16) -> Result<(), GgufError> {
    let keys: Vec<SplitKeys> = files.iter().map(|f| split_keys(&f.metadata)).collect();

    // split.count must be present and agree with the names.
    for (f, k) in files.iter().zip(&keys) {
        if k.count != Some(count) {
            return Err(GgufError::ShardForeign {
                path: f.info.path.clone(),
                key: KEY_SPLIT_COUNT,
                expected: format!("u16 {count}"),
                found: show(&f.metadata, KEY_SPLIT_COUNT),
            });
        }
    }

    // split.tensors.count: the value most shards agree on (shard 0 on a tie) is the set's; a
    // shard that disagrees is the foreign one.
    let mut votes: HashMap<Option<u64>, usize> = HashMap::new();
    for k in &keys {
        *votes.entry(k.tensors_count).or_default() += 1;
    }
    let majority = votes
        .iter()
        .filter(|(v, _)| v.is_some())
        .max_by_key(|(v, n)| (**n, **v == keys[0].tensors_count))
        .and_then(|(v, _)| *v);
    let Some(total) = majority else {
        return Err(GgufError::ShardForeign {
            path: files[0].info.path.clone(),
            key: KEY_SPLIT_TENSORS_COUNT,
            expected: "a non-negative integer".to_string(),
            found: show(&files[0].metadata, KEY_SPLIT_TENSORS_COUNT),
        });
    };
    for (f, k) in files.iter().zip(&keys) {
        if k.tensors_count != Some(total) {
            return Err(GgufError::ShardForeign {
                path: f.info.path.clone(),
                key: KEY_SPLIT_TENSORS_COUNT,
                expected: format!("{total}"),
                found: show(&f.metadata, KEY_SPLIT_TENSORS_COUNT),
            });
        }
    }

    // split.no: present, unique, and equal to the position the name gives.
    let mut claimed: HashMap<u16, usize> = HashMap::new();
    for (i, (f, k)) in files.iter().zip(&keys).enumerate() {
        let Some(no) = k.no else {
            return Err(GgufError::ShardForeign {
                path: f.info.path.clone(),
                key: KEY_SPLIT_NO,
                expected: format!("u16 {i}"),
                found: show(&f.metadata, KEY_SPLIT_NO),
            });
        };
        if let Some(&j) = claimed.get(&no) {
            return Err(GgufError::ShardDuplicate {
                path: f.info.path.clone(),
                other: files[j].info.path.clone(),
                no,
            });
        }
        claimed.insert(no, i);
    }
    for (i, (f, k)) in files.iter().zip(&keys).enumerate() {
        let expected = i as u16;
        if k.no != Some(expected) {
            return Err(GgufError::ShardOutOfOrder {
                path: f.info.path.clone(),
                expected,
                found: k.no.unwrap_or(u16::MAX),
            });
        }
    }

    // Tensors: each in one shard only, and as many as split.tensors.count says.
    let mut owner: HashMap<&str, usize> = HashMap::new();
    let mut found = 0u64;
    for (i, f) in files.iter().enumerate() {
        for t in &f.tensors {
            if let Some(&j) = owner.get(t.name.as_str()) {
                return Err(GgufError::SplitDuplicateTensor {
                    tensor: t.name.clone(),
                    first: files[j].info.path.clone(),
                    second: f.info.path.clone(),
                });
            }
            owner.insert(&t.name, i);
            found += 1;
        }
    }
    if found != total {
        return Err(GgufError::SplitTensorCount {
            path: files[0].info.path.clone(),
            expected: total,
            found,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, expect: Option<(&str, u16, u16)>) {
        let got = parse_split_path(Path::new(name));
        let got = got
            .as_ref()
            .map(|(p, n, c)| (p.to_string_lossy().into_owned(), *n, *c));
        assert_eq!(
            got.as_ref().map(|(p, n, c)| (p.as_str(), *n, *c)),
            expect,
            "{name}"
        );
    }

    #[test]
    fn split_names() {
        check("d/m-00001-of-00005.gguf", Some(("d/m", 0, 5)));
        check("m-00005-of-00005.gguf", Some(("m", 4, 5)));
        check("a-b-00002-of-00003.gguf", Some(("a-b", 1, 3)));
        check("m-00006-of-00005.gguf", None);
        check("m-00000-of-00005.gguf", None);
        check("m-0001-of-00005.gguf", None);
        check("m-00001-of-00005.bin", None);
        check("m.gguf", None);
        check("-00001-of-00001.gguf", Some(("", 0, 1)));
        check("é-00001-of-0000é.gguf", None);
        check("m-+0001-of-00002.gguf", None);
        assert_eq!(
            split_path("d/m", 2, 12),
            PathBuf::from("d/m-00003-of-00012.gguf")
        );
    }
}
