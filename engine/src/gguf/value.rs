//! Metadata values (the thirteen GGUF value types) and the ordered key/value map with typed
//! accessors.

use std::collections::HashMap;
use std::fmt;

use super::error::GgufError;

/// GGUF metadata value type ids (`gguf_type` in ggml).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with id `id`, or `None` for an id GGUF does not define.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// GGUF type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Fewest bytes one value of this type takes on disk: the fixed size for scalars, the length
    /// prefix for a string, type + count for an array. Used to bound counts before allocating.
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// Lower-case name as gguf-py prints it.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value. Arrays may nest; GGUF requires all elements of one array to share a type,
/// which the reader guarantees and the writer checks.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
}

impl MetadataValue {
    /// The value's GGUF type.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetadataValue::U8(_) => ValueType::U8,
            MetadataValue::I8(_) => ValueType::I8,
            MetadataValue::U16(_) => ValueType::U16,
            MetadataValue::I16(_) => ValueType::I16,
            MetadataValue::U32(_) => ValueType::U32,
            MetadataValue::I32(_) => ValueType::I32,
            MetadataValue::U64(_) => ValueType::U64,
            MetadataValue::I64(_) => ValueType::I64,
            MetadataValue::F32(_) => ValueType::F32,
            MetadataValue::F64(_) => ValueType::F64,
            MetadataValue::Bool(_) => ValueType::Bool,
            MetadataValue::String(_) => ValueType::String,
            MetadataValue::Array(_) => ValueType::Array,
        }
    }

    /// The value as a signed 128-bit integer, for any integer type.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetadataValue::U8(v) => v.into(),
            MetadataValue::I8(v) => v.into(),
            MetadataValue::U16(v) => v.into(),
            MetadataValue::I16(v) => v.into(),
            MetadataValue::U32(v) => v.into(),
            MetadataValue::I32(v) => v.into(),
            MetadataValue::U64(v) => v.into(),
            MetadataValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a string slice, for a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// A short description for error messages: `u32 7`, `string "llama"`, `array of 262144 string`.
    pub fn describe(&self) -> String {
        match self {
            MetadataValue::String(s) if s.len() > 40 => {
                let cut = (0..=40).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                format!("string {:?}…", &s[..cut])
            }
            MetadataValue::String(s) => format!("string {s:?}"),
            MetadataValue::Array(items) => match items.first() {
                Some(first) => format!("array of {} {}", items.len(), first.value_type().name()),
                None => "empty array".to_string(),
            },
            other => format!("{} {other}", other.value_type().name()),
        }
    }
}

impl fmt::Display for MetadataValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetadataValue::U8(v) => write!(f, "{v}"),
            MetadataValue::I8(v) => write!(f, "{v}"),
            MetadataValue::U16(v) => write!(f, "{v}"),
            MetadataValue::I16(v) => write!(f, "{v}"),
            MetadataValue::U32(v) => write!(f, "{v}"),
            MetadataValue::I32(v) => write!(f, "{v}"),
            MetadataValue::U64(v) => write!(f, "{v}"),
            MetadataValue::I64(v) => write!(f, "{v}"),
            MetadataValue::F32(v) => write!(f, "{v}"),
            MetadataValue::F64(v) => write!(f, "{v}"),
            MetadataValue::Bool(v) => write!(f, "{v}"),
            MetadataValue::String(v) => write!(f, "{v:?}"),
            MetadataValue::Array(items) => {
                f.write_str("[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
        }
    }
}

/// Metadata in file order, with lookup by key. Keys are unique (the reader refuses duplicates;
/// [`Metadata::insert`] replaces in place).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

macro_rules! opt_variant {
    ($(#[$doc:meta])* $name:ident, $base:ident, $ty:ty) => {
        $(#[$doc])*
        pub fn $name(&self, key: &str) -> Result<Option<$ty>, GgufError> {
            if self.get(key).is_none() {
                return Ok(None);
            }
            self.$base(key).map(Some)
        }
    };
}

impl Metadata {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Key/value pairs in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Keys in file order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// Sets `key`; an existing key keeps its position and gets the new value. Returns the old
    /// value, if any.
    pub fn insert(
        &mut self,
        key: impl Into<String>,
        value: MetadataValue,
    ) -> Option<MetadataValue> {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
                None
            }
        }
    }

    /// Removes `key`, keeping the order of the others. Returns its value, if any.
    pub fn remove(&mut self, key: &str) -> Option<MetadataValue> {
        let i = self.index.remove(key)?;
        let (_, v) = self.entries.remove(i);
        for slot in self.index.values_mut() {
            if *slot > i {
                *slot -= 1;
            }
        }
        Some(v)
    }

    fn require(&self, key: &str, expected: &'static str) -> Result<&MetadataValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::Metadata {
            key: key.to_string(),
            expected,
            found: "no such key".to_string(),
        })
    }

    fn mismatch(key: &str, expected: &'static str, found: &MetadataValue) -> GgufError {
        GgufError::Metadata {
            key: key.to_string(),
            expected,
            found: found.describe(),
        }
    }

    fn array<'a>(
        &'a self,
        key: &str,
        expected: &'static str,
    ) -> Result<&'a [MetadataValue], GgufError> {
        match self.require(key, expected)? {
            MetadataValue::Array(items) => Ok(items),
            other => Err(Self::mismatch(key, expected, other)),
        }
    }

    /// An integer of any type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        const E: &str = "an integer that fits in u32";
        let v = self.require(key, E)?;
        v.as_integer()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| Self::mismatch(key, E, v))
    }

    /// An integer of any type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        const E: &str = "an integer that fits in u64";
        let v = self.require(key, E)?;
        v.as_integer()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| Self::mismatch(key, E, v))
    }

    /// An integer of any type whose value fits in i32.
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        const E: &str = "an integer that fits in i32";
        let v = self.require(key, E)?;
        v.as_integer()
            .and_then(|i| i32::try_from(i).ok())
            .ok_or_else(|| Self::mismatch(key, E, v))
    }

    /// An f32, or an f64 narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        const E: &str = "f32 or f64";
        match self.require(key, E)? {
            MetadataValue::F32(v) => Ok(*v),
            MetadataValue::F64(v) => Ok(*v as f32),
            other => Err(Self::mismatch(key, E, other)),
        }
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        const E: &str = "bool";
        match self.require(key, E)? {
            MetadataValue::Bool(v) => Ok(*v),
            other => Err(Self::mismatch(key, E, other)),
        }
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        const E: &str = "string";
        match self.require(key, E)? {
            MetadataValue::String(v) => Ok(v),
            other => Err(Self::mismatch(key, E, other)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        const E: &str = "array of string";
        let items = self.array(key, E)?;
        items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| Self::mismatch(key, E, v)))
            .collect()
    }

    /// An array of f32 (f64 elements are narrowed).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const E: &str = "array of f32 or f64";
        let items = self.array(key, E)?;
        items
            .iter()
            .map(|v| match v {
                MetadataValue::F32(x) => Ok(*x),
                MetadataValue::F64(x) => Ok(*x as f32),
                other => Err(Self::mismatch(key, E, other)),
            })
            .collect()
    }

    /// An array of integers that all fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        const E: &str = "array of integers that fit in i32";
        let items = self.array(key, E)?;
        items
            .iter()
            .map(|v| {
                v.as_integer()
                    .and_then(|i| i32::try_from(i).ok())
                    .ok_or_else(|| Self::mismatch(key, E, v))
            })
            .collect()
    }

    /// An array of integers that all fit in u32.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        const E: &str = "array of integers that fit in u32";
        let items = self.array(key, E)?;
        items
            .iter()
            .map(|v| {
                v.as_integer()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| Self::mismatch(key, E, v))
            })
            .collect()
    }

    opt_variant!(
        /// [`Metadata::get_u32`], `Ok(None)` when the key is absent.
        get_u32_opt, get_u32, u32);
    opt_variant!(
        /// [`Metadata::get_u64`], `Ok(None)` when the key is absent.
        get_u64_opt, get_u64, u64);
    opt_variant!(
        /// [`Metadata::get_i32`], `Ok(None)` when the key is absent.
        get_i32_opt, get_i32, i32);
    opt_variant!(
        /// [`Metadata::get_f32`], `Ok(None)` when the key is absent.
        get_f32_opt, get_f32, f32);
    opt_variant!(
        /// [`Metadata::get_bool`], `Ok(None)` when the key is absent.
        get_bool_opt, get_bool, bool);
    opt_variant!(
        /// [`Metadata::get_str`], `Ok(None)` when the key is absent.
        get_str_opt, get_str, &str);
    opt_variant!(
        /// [`Metadata::get_str_array`], `Ok(None)` when the key is absent.
        get_str_array_opt, get_str_array, Vec<&str>);
    opt_variant!(
        /// [`Metadata::get_f32_array`], `Ok(None)` when the key is absent.
        get_f32_array_opt, get_f32_array, Vec<f32>);
    opt_variant!(
        /// [`Metadata::get_i32_array`], `Ok(None)` when the key is absent.
        get_i32_array_opt, get_i32_array, Vec<i32>);
    opt_variant!(
        /// [`Metadata::get_u32_array`], `Ok(None)` when the key is absent.
        get_u32_array_opt, get_u32_array, Vec<u32>);
}

impl<'a> IntoIterator for &'a Metadata {
    type Item = (&'a str, &'a MetadataValue);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, MetadataValue)>,
        fn(&'a (String, MetadataValue)) -> (&'a str, &'a MetadataValue),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(pairs: &[(&str, MetadataValue)]) -> Metadata {
        let mut m = Metadata::new();
        for (k, v) in pairs {
            m.insert(*k, v.clone());
        }
        m
    }

    fn check_err<T: std::fmt::Debug>(r: Result<T, GgufError>, key: &str, found_contains: &str) {
        match r {
            Err(GgufError::Metadata { key: k, found, .. }) => {
                assert_eq!(k, key);
                assert!(found.contains(found_contains), "found {found:?}");
            }
            other => panic!("expected a Metadata error, got {other:?}"),
        }
    }

    #[test]
    fn integers_widen_when_they_fit() {
        let m = md(&[
            ("a", MetadataValue::U8(7)),
            ("b", MetadataValue::I64(-1)),
            ("c", MetadataValue::U64(u64::from(u32::MAX) + 1)),
            ("d", MetadataValue::I32(5)),
        ]);
        assert_eq!(m.get_u32("a").ok(), Some(7));
        assert_eq!(m.get_u64("d").ok(), Some(5));
        assert_eq!(m.get_i32("b").ok(), Some(-1));
        check_err(m.get_u32("b"), "b", "i64 -1");
        check_err(m.get_u32("c"), "c", "u64 4294967296");
        assert_eq!(m.get_u64("c").ok(), Some(1 << 32));
        check_err(m.get_u32("zz"), "zz", "no such key");
        assert_eq!(m.get_u32_opt("zz").ok(), Some(None));
        check_err(m.get_u32_opt("b"), "b", "i64");
    }

    #[test]
    fn floats_strings_bools_and_arrays() {
        let m = md(&[
            ("f", MetadataValue::F64(0.5)),
            ("s", MetadataValue::String("gemma3".into())),
            ("t", MetadataValue::Bool(true)),
            (
                "toks",
                MetadataValue::Array(vec![
                    MetadataValue::String("a".into()),
                    MetadataValue::String("b".into()),
                ]),
            ),
            (
                "ints",
                MetadataValue::Array(vec![MetadataValue::I8(-3), MetadataValue::I8(4)]),
            ),
        ]);
        assert_eq!(m.get_f32("f").ok(), Some(0.5));
        assert_eq!(m.get_str("s").ok(), Some("gemma3"));
        assert_eq!(m.get_bool("t").ok(), Some(true));
        assert_eq!(m.get_str_array("toks").ok(), Some(vec!["a", "b"]));
        assert_eq!(m.get_i32_array("ints").ok(), Some(vec![-3, 4]));
        check_err(m.get_u32_array("ints"), "ints", "i8 -3");
        check_err(m.get_str("t"), "t", "bool true");
        check_err(m.get_f32_array("toks"), "toks", "string \"a\"");
        check_err(m.get_str_array("s"), "s", "string \"gemma3\"");
    }

    #[test]
    fn insert_replaces_in_place_and_remove_keeps_order() {
        let mut m = md(&[
            ("a", MetadataValue::U8(1)),
            ("b", MetadataValue::U8(2)),
            ("c", MetadataValue::U8(3)),
        ]);
        assert_eq!(
            m.insert("a", MetadataValue::U8(9)),
            Some(MetadataValue::U8(1))
        );
        assert_eq!(m.remove("b"), Some(MetadataValue::U8(2)));
        assert_eq!(m.keys().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(m.get("c"), Some(&MetadataValue::U8(3)));
        assert_eq!(m.get("a"), Some(&MetadataValue::U8(9)));
    }
}
