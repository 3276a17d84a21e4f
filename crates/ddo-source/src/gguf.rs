//! GGUF files (llama.cpp's format, used for quantized diffusion transformers): a header of
//! metadata and tensor infos, then an aligned data section. Quantized tensors travel as opaque
//! bytes: each is a `U8` tensor shaped as its rows times the bytes of one row, the shape a GGUF
//! reader hands a framework's quantized parameter; `F32`, `F16`, `BF16`, `F64` and integer
//! tensors keep their element type. Dimensions are listed outermost first (GGUF lists them
//! innermost first). Parsing reads the header only, validates every field against the file's
//! length and never panics on any input.

use std::path::Path;

use ddo_core::{Dtype, SourceError};

use crate::header::HeaderEntry;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Alignment of tensor data when the file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Largest count of tensors, metadata entries or array items accepted: a header claiming more
/// is refused before anything is allocated for it.
const MAX_COUNT: u64 = 1 << 24;
/// Largest string accepted (key, value or tensor name).
const MAX_STRING: u64 = 1 << 20;
/// Most dimensions a GGUF tensor has.
const MAX_DIMS: u32 = 4;

/// A parsed GGUF header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Tensors in file order, offsets absolute.
    pub entries: Vec<HeaderEntry>,
    /// Each tensor's GGUF type name (`Q8_0`, `F16`), in the order of `entries`.
    pub types: Vec<&'static str>,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// Alignment of tensor data.
    pub alignment: u64,
}

/// A GGML tensor type: its name, elements per block, bytes per block, and the element type of
/// an unquantized one.
struct GgmlType {
    name: &'static str,
    block: u64,
    bytes: u64,
    dtype: Option<Dtype>,
}

const fn t(name: &'static str, block: u64, bytes: u64, dtype: Option<Dtype>) -> GgmlType {
    GgmlType { name, block, bytes, dtype }
}

/// GGML types by id (llama.cpp's `ggml_type`); ids left out are retired and refused.
fn ggml_type(id: u32) -> Option<GgmlType> {
    Some(match id {
        0 => t("F32", 1, 4, Some(Dtype::F32)),
        1 => t("F16", 1, 2, Some(Dtype::F16)),
        2 => t("Q4_0", 32, 18, None),
        3 => t("Q4_1", 32, 20, None),
        6 => t("Q5_0", 32, 22, None),
        7 => t("Q5_1", 32, 24, None),
        8 => t("Q8_0", 32, 34, None),
        9 => t("Q8_1", 32, 36, None),
        10 => t("Q2_K", 256, 84, None),
        11 => t("Q3_K", 256, 110, None),
        12 => t("Q4_K", 256, 144, None),
        13 => t("Q5_K", 256, 176, None),
        14 => t("Q6_K", 256, 210, None),
        15 => t("Q8_K", 256, 292, None),
        16 => t("IQ2_XXS", 256, 66, None),
        17 => t("IQ2_XS", 256, 74, None),
        18 => t("IQ3_XXS", 256, 98, None),
        19 => t("IQ1_S", 256, 50, None),
        20 => t("IQ4_NL", 32, 18, None),
        21 => t("IQ3_S", 256, 110, None),
        22 => t("IQ2_S", 256, 82, None),
        23 => t("IQ4_XS", 256, 136, None),
        24 => t("I8", 1, 1, Some(Dtype::I8)),
        25 => t("I16", 1, 2, Some(Dtype::I16)),
        26 => t("I32", 1, 4, Some(Dtype::I32)),
        27 => t("I64", 1, 8, Some(Dtype::I64)),
        28 => t("F64", 1, 8, Some(Dtype::F64)),
        29 => t("IQ1_M", 256, 56, None),
        30 => t("BF16", 1, 2, Some(Dtype::BF16)),
        34 => t("TQ1_0", 256, 54, None),
        35 => t("TQ2_0", 256, 66, None),
        _ => return None,
    })
}

/// A cursor over the header bytes; every read checks the bounds.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn fail(&self, tensor: Option<&str>, reason: impl Into<String>) -> SourceError {
        SourceError::InvalidCheckpoint {
            file: self.path.to_owned(),
            tensor: tensor.map(str::to_owned),
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], SourceError> {
        let end = usize::try_from(n).ok().and_then(|n| self.at.checked_add(n));
        match end.filter(|&end| end <= self.bytes.len()) {
            Some(end) => {
                let out = &self.bytes[self.at..end];
                self.at = end;
                Ok(out)
            }
            None => {
                Err(self.fail(None, format!("the header ends inside {what} (at byte {})", self.at)))
            }
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32, SourceError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64, SourceError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }

    fn count(&mut self, what: &str) -> Result<u64, SourceError> {
        let n = self.u64(what)?;
        if n > MAX_COUNT {
            return Err(
                self.fail(None, format!("{what} is {n}, more than the {MAX_COUNT} ddo reads"))
            );
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, SourceError> {
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(
                self.fail(None, format!("{what} is {n} bytes long, more than {MAX_STRING}"))
            );
        }
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.fail(None, format!("{what} is not UTF-8")))
    }

    /// Skips (or, for an integer, returns) one metadata value of `kind`.
    fn value(&mut self, kind: u32, depth: u32) -> Result<Option<u64>, SourceError> {
        let fixed = match kind {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(n) = fixed {
            let raw = self.take(n, "a metadata value")?;
            let mut wide = [0u8; 8];
            wide[..raw.len()].copy_from_slice(raw);
            return Ok(matches!(kind, 0 | 2 | 4 | 10).then(|| u64::from_le_bytes(wide)));
        }
        match kind {
            8 => {
                self.string("a metadata string")?;
                Ok(None)
            }
            9 if depth < 2 => {
                let item = self.u32("an array's item type")?;
                let n = self.count("an array's length")?;
                for _ in 0..n {
                    self.value(item, depth + 1)?;
                }
                Ok(None)
            }
            9 => Err(self.fail(None, "arrays nested more than twice")),
            other => Err(self.fail(None, format!("unknown metadata value type {other}"))),
        }
    }
}

/// Parses a GGUF header from the file's first bytes (`bytes`, at least up to the end of the
/// tensor infos) against the file's length `file_len`.
pub fn parse_gguf(bytes: &[u8], file_len: u64, path: &Path) -> Result<GgufHeader, SourceError> {
    let mut r = Reader { bytes, at: 0, path };
    if r.take(4, "the magic")? != GGUF_MAGIC {
        return Err(r.fail(None, "not a GGUF file (it does not start with \"GGUF\")"));
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(r.fail(None, format!("GGUF version {version}; ddo reads versions 2 and 3")));
    }
    let tensors = r.count("the tensor count")?;
    let entries = r.count("the metadata count")?;
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..entries {
        let key = r.string("a metadata key")?;
        let kind = r.u32("a metadata value type")?;
        let value = r.value(kind, 0)?;
        if key == "general.alignment" {
            alignment = value.filter(|a| a.is_power_of_two()).ok_or_else(|| {
                r.fail(None, "general.alignment must be an unsigned power of two")
            })?;
        }
    }
    let mut infos = Vec::with_capacity(tensors.min(4096) as usize);
    for _ in 0..tensors {
        let name = r.string("a tensor name")?;
        let dims = r.u32("a tensor's dimension count")?;
        if dims == 0 || dims > MAX_DIMS {
            return Err(r.fail(
                Some(&name),
                format!("{dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}"),
            ));
        }
        let mut ne = Vec::with_capacity(dims as usize);
        for _ in 0..dims {
            ne.push(r.u64("a tensor dimension")?);
        }
        let kind = r.u32("a tensor type")?;
        let offset = r.u64("a tensor offset")?;
        infos.push((name, ne, kind, offset));
    }
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    let mut out =
        GgufHeader { version, entries: Vec::new(), types: Vec::new(), data_start, alignment };
    let mut names = std::collections::HashSet::new();
    for (name, ne, kind, offset) in infos {
        let fail = |reason: String| r.fail(Some(&name), reason);
        let ty =
            ggml_type(kind).ok_or_else(|| fail(format!("unknown or retired GGML type {kind}")))?;
        if !names.insert(name.clone()) {
            return Err(fail("the tensor name is written twice".into()));
        }
        if offset % alignment != 0 {
            return Err(fail(format!(
                "offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if ne[0] % ty.block != 0 {
            return Err(fail(format!(
                "{} elements per row is not a multiple of {}'s block of {}",
                ne[0], ty.name, ty.block
            )));
        }
        // Every count fits in u64 in any order: the nonzero dimensions' product (so no reader
        // multiplying the shape overflows), a row's bytes, the tensor's bytes, its end.
        let elements = ne.iter().filter(|&&d| d != 0).try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let row = (ne[0] / ty.block).checked_mul(ty.bytes);
        let rows = ne[1..].iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let len = rows.zip(row).and_then(|(rows, row)| rows.checked_mul(row));
        let start = data_start.checked_add(offset);
        let (Some(_), Some(row), Some(len), Some(start)) = (elements, row, len, start) else {
            return Err(fail("its size overflows".into()));
        };
        if start.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(fail(format!("{len} bytes at {start} leave the file of {file_len} bytes")));
        }
        let (dtype, shape) = match ty.dtype {
            Some(d) => (d, ne.iter().rev().copied().collect()),
            None => (Dtype::U8, ne[1..].iter().rev().copied().chain([row]).collect()),
        };
        out.entries.push(HeaderEntry { name, dtype, shape, offset: start, len });
        out.types.push(ty.name);
    }
    // Tensors must not overlap (padding between them is allowed).
    let mut ranges: Vec<(u64, u64, &str)> =
        out.entries.iter().map(|e| (e.offset, e.offset + e.len, e.name.as_str())).collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(r.fail(Some(w[1].2), format!("its bytes overlap tensor {:?}", w[0].2)));
        }
    }
    Ok(out)
}
