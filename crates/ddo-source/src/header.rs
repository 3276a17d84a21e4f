//! The safetensors header: an 8-byte little-endian length, then that many bytes of JSON mapping
//! tensor names to `{dtype, shape, data_offsets}` (offsets relative to the end of the header).
//! Parsing validates everything and never panics on any input.
//!
//! The rules are the safetensors format's, as its reference reader (the `safetensors` crate)
//! enforces them, checked from the header alone and the file's length: the tensors' data ranges
//! cover the data section exactly, from its first byte to the end of the file, with no gap and
//! no overlap. ddo is stricter in three places, where the reference reader keeps one reading of
//! an ambiguous or unsupported header: a tensor name written twice, a dtype ddo cannot stream
//! (sub-byte, complex, E8M0 and FNUZ floats) and an entry written as a JSON array instead of an
//! object are refused. `tests/differential.rs` holds ddo to this against the crate.

mod raw;

use std::path::Path;

use ddo_core::{Dtype, SourceError};

use raw::{METADATA_KEY, RawEntry, RawHeader};

/// Largest header accepted: 100,000,000 bytes, the limit of the safetensors format's reference
/// reader.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Why a gap in the data section is refused.
const COVERAGE_RULE: &str =
    "safetensors requires the tensors to cover the data section exactly, without gaps";

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
    /// Entries sorted by offset; together they cover the data section exactly.
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
    if n > file_len.saturating_sub(8) {
        return Err(invalid(
            path,
            None,
            format!("header length {n} goes beyond the end of the file ({file_len} bytes)"),
        ));
    }
    Ok(n)
}

/// Parses and validates a header. `bytes` holds at least the first `8 + header length` bytes of
/// a file of `file_len` bytes; the rest of the file is the data section, which the tensors'
/// ranges must cover exactly. Only `bytes` is read.
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
    let raw: RawHeader = serde_json::from_str(text)
        .map_err(|e| invalid(path, None, format!("header is not valid JSON: {e}")))?;
    let data_len = file_len - data_start;

    if let Some(m) = &raw.metadata {
        let ok = m.is_null() || m.as_object().is_some_and(|m| m.values().all(|v| v.is_string()));
        if !ok {
            return Err(invalid(path, None, format!("{METADATA_KEY} must map strings to strings")));
        }
    }
    let mut entries = raw
        .entries
        .into_iter()
        .map(|(name, e)| entry(path, &name, e, data_start, data_len))
        .collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(|e| (e.offset, e.len));
    check_coverage(path, &entries, data_start, data_len)?;
    Ok(Header { entries, data_start })
}

/// Checks that `entries`, sorted by offset, cover the data section exactly: each starts where
/// the ones before it end, the first at 0, and the last ends at the end of the file.
fn check_coverage(
    path: &Path,
    entries: &[HeaderEntry],
    data_start: u64,
    data_len: u64,
) -> Result<(), SourceError> {
    let range = |e: &HeaderEntry| (e.offset - data_start, e.offset - data_start + e.len);
    let mut covered = 0;
    let mut last: Option<&HeaderEntry> = None;
    for e in entries {
        let (start, end) = range(e);
        if let Some(prev) = last.filter(|_| start < covered) {
            let (ps, pe) = range(prev);
            return Err(invalid(
                path,
                Some(&e.name),
                format!(
                    "data range [{start}, {end}) overlaps tensor {:?} at [{ps}, {pe})",
                    prev.name
                ),
            ));
        }
        if start > covered {
            let after = match last {
                Some(prev) => {
                    let (ps, pe) = range(prev);
                    format!("after tensor {:?} at [{ps}, {pe})", prev.name)
                }
                None => "at the start of the data section".to_owned(),
            };
            return Err(invalid(
                path,
                Some(&e.name),
                format!(
                    "data range [{start}, {end}) leaves a gap {after}: bytes [{covered}, {start}) \
                     of the data section (file offsets [{}, {})) belong to no tensor; {COVERAGE_RULE}",
                    data_start + covered,
                    data_start + start
                ),
            ));
        }
        covered = end;
        last = Some(e);
    }
    if covered < data_len {
        let why = match last {
            Some(prev) => {
                let (ps, pe) = range(prev);
                format!("the last one, {:?} at [{ps}, {pe}), ends at {pe}", prev.name)
            }
            None => "the header lists none".to_owned(),
        };
        return Err(invalid(
            path,
            None,
            format!(
                "bytes [{covered}, {data_len}) at the end of the {data_len}-byte data section \
                 (file offsets [{}, {})) belong to no tensor: {why}; {COVERAGE_RULE}",
                data_start + covered,
                data_start + data_len
            ),
        ));
    }
    Ok(())
}

fn entry(
    path: &Path,
    name: &str,
    raw: RawEntry,
    data_start: u64,
    data_len: u64,
) -> Result<HeaderEntry, SourceError> {
    let bad = |reason: String| invalid(path, Some(name), reason);
    let RawEntry { is_object, dtype, shape, data_offsets, repeated } = raw;
    if !is_object {
        return Err(bad("entry is not a JSON object".into()));
    }
    if let Some(field) = repeated {
        return Err(bad(format!("field {field:?} is written more than once")));
    }
    let dtype_name = dtype
        .as_ref()
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("dtype is missing or not a string".into()))?;
    let dtype: Dtype =
        dtype_name.parse().map_err(|e: ddo_core::UnknownDtype| bad(e.to_string()))?;
    let shape = shape
        .as_ref()
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("shape is missing or not a list".into()))?
        .iter()
        .map(|d| d.as_u64())
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| bad("shape must list non-negative integers".into()))?;
    let (start, end) = data_offsets
        .as_ref()
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
        .ok_or_else(|| bad("data_offsets must be two non-negative integers".into()))?;
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
    fn zero_element_tensors_and_a_null_metadata_are_valid() {
        let b = file(
            r#"{"__metadata__":null,"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},"s":{"dtype":"U8","shape":[],"data_offsets":[2,3]}}"#,
            3,
        );
        let h = parse_header(&b, b.len() as u64, Path::new("m")).unwrap();
        let e = &h.entries[1];
        assert_eq!((e.name.as_str(), e.shape.clone(), e.len), ("e", vec![0, 3], 0));
        assert_eq!(h.entries[2].shape, Vec::<u64>::new());
        let only_empty = file(r#"{"e":{"dtype":"BF16","shape":[4,0],"data_offsets":[0,0]}}"#, 0);
        assert_eq!(parse_header(&only_empty, 0, Path::new("m")).unwrap().entries[0].len, 0);
        assert_eq!(parse_header(&file("{}", 0), 0, Path::new("m")).unwrap().entries, []);
    }

    #[test]
    fn the_header_length_limit_is_the_formats() {
        let at = |n: u64| header_len(&n.to_le_bytes(), u64::MAX, Path::new("m"));
        assert_eq!(at(100_000_000).unwrap(), 100_000_000);
        assert_eq!(
            at(100_000_001).unwrap_err().to_string(),
            "invalid checkpoint m: header length 100000001 exceeds the 100000000-byte limit"
        );
        // A file shorter than its own prefix (it shrank after its length was taken).
        assert!(header_len(&8u64.to_le_bytes(), 3, Path::new("m")).is_err());
    }

    #[test]
    fn bytes_no_tensor_covers_are_named_with_their_offsets() {
        let rule =
            "safetensors requires the tensors to cover the data section exactly, without gaps";
        assert_eq!(
            err(&file(
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[12,20]}}"#,
                20
            )),
            format!(
                "invalid checkpoint m.safetensors: tensor \"b\": data range [12, 20) leaves a gap after tensor \"a\" at [0, 8): bytes [8, 12) of the data section (file offsets [123, 127)) belong to no tensor; {rule}"
            )
        );
        assert_eq!(
            err(&file(r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#, 12)),
            format!(
                "invalid checkpoint m.safetensors: tensor \"a\": data range [4, 12) leaves a gap at the start of the data section: bytes [0, 4) of the data section (file offsets [62, 66)) belong to no tensor; {rule}"
            )
        );
        assert_eq!(
            err(&file(r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#, 12)),
            format!(
                "invalid checkpoint m.safetensors: bytes [8, 12) at the end of the 12-byte data section (file offsets [69, 73)) belong to no tensor: the last one, \"a\" at [0, 8), ends at 8; {rule}"
            )
        );
        assert_eq!(
            err(&file("{}", 3)),
            format!(
                "invalid checkpoint m.safetensors: bytes [0, 3) at the end of the 3-byte data section (file offsets [10, 13)) belong to no tensor: the header lists none; {rule}"
            )
        );
        // A zero-element tensor inside another's range overlaps it.
        assert_eq!(
            err(&file(
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"z":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}"#,
                8
            )),
            "invalid checkpoint m.safetensors: tensor \"z\": data range [4, 4) overlaps tensor \"a\" at [0, 8)"
        );
    }

    #[test]
    fn a_field_written_twice_and_an_entry_that_is_no_object() {
        assert_eq!(
            err(&file(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"shape":[1]}}"#, 1)),
            "invalid checkpoint m.safetensors: tensor \"a\": field \"shape\" is written more than once"
        );
        // Unknown fields are ignored, even repeated.
        let b = file(r#"{"a":{"x":1,"dtype":"U8","x":[2],"shape":[1],"data_offsets":[0,1]}}"#, 1);
        assert_eq!(parse_header(&b, 1, Path::new("m")).unwrap().entries.len(), 1);
        assert_eq!(
            err(&file(r#"{"a":["U8",[1],[0,1]]}"#, 1)),
            "invalid checkpoint m.safetensors: tensor \"a\": entry is not a JSON object"
        );
        assert!(
            err(&file(r#"{"__metadata__":{},"__metadata__":{}}"#, 0))
                .contains("__metadata__ appears twice")
        );
        assert!(
            err(&file(r#"{"__metadata__":"pt"}"#, 0))
                .ends_with("__metadata__ must map strings to strings")
        );
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
        assert!(err(&huge).contains("exceeds the 100000000-byte limit"));
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
