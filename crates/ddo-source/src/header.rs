//! The safetensors header: an 8-byte little-endian length, then that many bytes of JSON mapping
//! tensor names to `{dtype, shape, data_offsets}` (offsets relative to the end of the header).
//! Parsing validates everything and never panics on any input.

use std::fmt;
use std::path::Path;

use ddo_core::{Dtype, SourceError};
use serde::de::{self, Deserializer, MapAccess, Visitor};

/// Largest header accepted: 100 MiB.
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// One validated tensor entry of a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A parsed header: its entries in file order and where the data section starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Entries sorted by offset.
    pub entries: Vec<HeaderEntry>,
    /// Absolute offset of the data section (8 + header length).
    pub data_start: u64,
}

fn invalid(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> SourceError {
    SourceError::InvalidCheckpoint {
        file: path.to_owned(),
        tensor: tensor.map(str::to_owned),
        reason: reason.into(),
    }
}

/// Reads the header length from the first 8 bytes and checks it against the file length.
/// Returns the header length.
pub fn header_len(prefix: &[u8], file_len: u64, path: &Path) -> Result<u64, SourceError> {
    let Some(len_bytes) = prefix.get(..8) else {
        return Err(invalid(
            path,
            None,
            format!("file is {file_len} bytes, shorter than the 8-byte header length"),
        ));
    };
    let n = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    if n == 0 {
        return Err(invalid(path, None, "header length is 0"));
    }
    if n > MAX_HEADER_LEN {
        return Err(invalid(
            path,
            None,
            format!("header length {n} exceeds the {MAX_HEADER_LEN}-byte limit"),
        ));
    }
    if n > file_len - 8 {
        return Err(invalid(
            path,
            None,
            format!("header length {n} goes beyond the end of the file ({file_len} bytes)"),
        ));
    }
    Ok(n)
}

/// Parses and validates a header. `bytes` holds at least the first `8 + header length` bytes of
/// a file of `file_len` bytes; tensor ranges are checked against `file_len`.
pub fn parse_header(bytes: &[u8], file_len: u64, path: &Path) -> Result<Header, SourceError> {
    let file_len = file_len.max(bytes.len() as u64);
    let n = header_len(bytes, file_len, path)?;
    let data_start = 8 + n;
    let json = bytes
        .get(8..data_start as usize)
        .ok_or_else(|| invalid(path, None, "the header was not fully read"))?;
    let text = std::str::from_utf8(json).map_err(|e| {
        invalid(path, None, format!("header is not UTF-8 (invalid byte at {})", e.valid_up_to()))
    })?;
    let RawHeader(raw) = serde_json::from_str(text)
        .map_err(|e| invalid(path, None, format!("header is not valid JSON: {e}")))?;
    let data_len = file_len - data_start;

    let mut entries = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        if name == "__metadata__" {
            let ok = value.as_object().is_some_and(|m| m.values().all(|v| v.is_string()));
            if !ok {
                return Err(invalid(path, None, "__metadata__ must map strings to strings"));
            }
            continue;
        }
        entries.push(entry(path, &name, &value, data_start, data_len)?);
    }
    entries.sort_by_key(|e| (e.offset, e.len));
    for pair in entries.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.offset < a.offset + a.len {
            return Err(invalid(
                path,
                Some(&b.name),
                format!(
                    "data range [{}, {}) overlaps tensor {:?} at [{}, {})",
                    b.offset - data_start,
                    b.offset - data_start + b.len,
                    a.name,
                    a.offset - data_start,
                    a.offset - data_start + a.len
                ),
            ));
        }
    }
    Ok(Header { entries, data_start })
}

fn entry(
    path: &Path,
    name: &str,
    value: &serde_json::Value,
    data_start: u64,
    data_len: u64,
) -> Result<HeaderEntry, SourceError> {
    let bad = |reason: String| invalid(path, Some(name), reason);
    let obj = value.as_object().ok_or_else(|| bad("entry is not a JSON object".into()))?;
    let dtype_name = obj
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("dtype is missing or not a string".into()))?;
    let dtype: Dtype =
        dtype_name.parse().map_err(|e: ddo_core::UnknownDtype| bad(e.to_string()))?;
    let shape = obj
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("shape is missing or not a list".into()))?
        .iter()
        .map(|d| d.as_u64())
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| bad("shape must list non-negative integers".into()))?;
    let offsets = obj
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
        .ok_or_else(|| bad("data_offsets must be two non-negative integers".into()))?;
    let (start, end) = offsets;
    if start > end {
        return Err(bad(format!("data_offsets [{start}, {end}) end before they start")));
    }
    if end > data_len {
        return Err(bad(format!(
            "data range [{start}, {end}) goes beyond the data section ({data_len} bytes)"
        )));
    }
    let len = end - start;
    let expected = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size_bytes()));
    if expected != Some(len) {
        let want = expected.map_or("more than 2^64".to_owned(), |b| b.to_string());
        return Err(bad(format!(
            "shape {shape:?} of {dtype} needs {want} bytes but data_offsets give {len}"
        )));
    }
    Ok(HeaderEntry { name: name.to_owned(), dtype, shape, offset: data_start + start, len })
}

/// The header's top-level object in document order, refusing duplicate keys.
struct RawHeader(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(format!("duplicate tensor name {k:?}")));
                    }
                    out.push((k, v));
                }
                Ok(RawHeader(out))
            }
        }
        deserializer.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data: usize) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data));
        v
    }

    fn err(bytes: &[u8]) -> String {
        parse_header(bytes, bytes.len() as u64, Path::new("m.safetensors")).unwrap_err().to_string()
    }

    #[test]
    fn parses_a_valid_header() {
        let b = file(
            r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#,
            16,
        );
        let h = parse_header(&b, b.len() as u64, Path::new("m")).unwrap();
        assert_eq!(h.entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(h.entries[0].offset, h.data_start);
        assert_eq!(h.entries[1].len, 8);
    }

    #[test]
    fn each_corruption_is_named() {
        assert_eq!(
            err(&[1, 2, 3]),
            "invalid checkpoint m.safetensors: file is 3 bytes, shorter than the 8-byte header length"
        );
        let mut long = file("{}", 0);
        long[..8].copy_from_slice(&1000u64.to_le_bytes());
        assert_eq!(
            err(&long),
            "invalid checkpoint m.safetensors: header length 1000 goes beyond the end of the file (10 bytes)"
        );
        let mut huge = file("{}", 0);
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("exceeds the 104857600-byte limit"));
        assert!(err(&file("{not json", 0)).contains("header is not valid JSON"));
        let mut bad_utf8 = file("{\"x\":1}", 0);
        bad_utf8[9] = 0xff;
        assert_eq!(
            err(&bad_utf8),
            "invalid checkpoint m.safetensors: header is not UTF-8 (invalid byte at 1)"
        );
        assert_eq!(
            err(&file(r#"{"w":{"dtype":"F4","shape":[1],"data_offsets":[0,1]}}"#, 1)),
            "invalid checkpoint m.safetensors: tensor \"w\": unknown dtype \"F4\"; known dtypes: BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2"
        );
        assert_eq!(
            err(&file(r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8)),
            "invalid checkpoint m.safetensors: tensor \"w\": shape [3] of F32 needs 12 bytes but data_offsets give 8"
        );
        assert_eq!(
            err(&file(r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#, 4)),
            "invalid checkpoint m.safetensors: tensor \"w\": data range [0, 8) goes beyond the data section (4 bytes)"
        );
        assert_eq!(
            err(&file(
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
                8
            )),
            "invalid checkpoint m.safetensors: tensor \"b\": data range [4, 8) overlaps tensor \"a\" at [0, 8)"
        );
        assert!(
            err(&file(
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                2
            ))
            .contains("duplicate tensor name \"a\"")
        );
        assert!(
            err(&file(r#"{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#, 1))
                .contains("shape must list non-negative integers")
        );
        assert!(
            err(&file(r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[2,1]}}"#, 2))
                .contains("end before they start")
        );
        assert!(
            err(&file(r#"{"w":{"dtype":"U8","shape":[1]}}"#, 2)).contains("data_offsets must be")
        );
        assert!(err(&file("[1,2]", 0)).contains("header is not valid JSON"));
    }
}
