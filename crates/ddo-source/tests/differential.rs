//! ddo's safetensors header parser against the format's reference reader, the `safetensors`
//! crate (`SafeTensors::read_metadata` on the whole file).
//!
//! On every file of the fuzz corpus, on generated headers (valid ones, then broken the ways files
//! break: gaps, overlaps, truncation, trailing bytes, wrong sizes, repeated names and fields,
//! bad length fields) and on byte-level corruptions of those, the two agree: whatever the crate
//! refuses, ddo refuses, and when both accept they list the same tensors at the same offsets.
//! ddo refuses three kinds of header the crate accepts, each recognised precisely
//! ([`Deliberate`]); anything else is a disagreement. `PROPTEST_CASES=N` searches longer; the
//! fuzz target `header` checks the same agreement.

use std::cell::Cell;
use std::path::Path;

use ddo_core::SourceError;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use safetensors::SafeTensors;

/// A parser's view of a header: the data section's start and every tensor as
/// `(name, dtype, shape, start, end)`, offsets relative to the data section, sorted.
type Listing = (u64, Vec<(String, String, Vec<u64>, u64, u64)>);

fn reference(bytes: &[u8]) -> Result<Listing, String> {
    let (n, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let mut tensors: Vec<_> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let shape = info.shape.iter().map(|&d| d as u64).collect();
            let (s, e) = info.data_offsets;
            (name, info.dtype.to_string(), shape, s as u64, e as u64)
        })
        .collect();
    tensors.sort_by(|a, b| (a.3, a.4, &a.0).cmp(&(b.3, b.4, &b.0)));
    Ok((8 + n as u64, tensors))
}

fn ddo(bytes: &[u8]) -> Result<Listing, SourceError> {
    let h = ddo_source::parse_header(bytes, bytes.len() as u64, Path::new("m.safetensors"))?;
    let mut tensors: Vec<_> = h
        .entries
        .into_iter()
        .map(|e| {
            let start = e.offset - h.data_start;
            (e.name, e.dtype.as_str().to_owned(), e.shape, start, start + e.len)
        })
        .collect();
    tensors.sort_by(|a, b| (a.3, a.4, &a.0).cmp(&(b.3, b.4, &b.0)));
    Ok((h.data_start, tensors))
}

/// Headers ddo refuses although the crate accepts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deliberate {
    /// A tensor name written twice: the crate keeps the last entry, ddo refuses the ambiguity.
    RepeatedName,
    /// A dtype ddo has no `Dtype` for (sub-byte, complex, FNUZ floats): it cannot stream it.
    UnsupportedDtype,
    /// An entry written as a JSON array `[dtype, shape, data_offsets]`: the crate's derived
    /// deserializer takes it, the format defines entries as objects.
    ArrayEntry,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    BothAccept,
    BothRefuse,
    DdoRefuses(Deliberate),
}

fn compare(bytes: &[u8]) -> Result<Verdict, String> {
    match (reference(bytes), ddo(bytes)) {
        (Ok(want), Ok(got)) if want == got => Ok(Verdict::BothAccept),
        (Ok(want), Ok(got)) => Err(format!("both accept but list\n  {want:?}\nand\n  {got:?}")),
        (Err(_), Err(_)) => Ok(Verdict::BothRefuse),
        (Err(why), Ok(got)) => Err(format!("the crate refuses ({why}) but ddo accepts {got:?}")),
        (Ok(want), Err(e)) => deliberate(&want, &e)
            .map(Verdict::DdoRefuses)
            .ok_or_else(|| format!("the crate accepts {want:?} but ddo refuses: {e}")),
    }
}

/// The deliberate difference that explains ddo refusing `error` where the crate read `listing`.
fn deliberate(listing: &Listing, error: &SourceError) -> Option<Deliberate> {
    let SourceError::InvalidCheckpoint { tensor, reason, .. } = error else { return None };
    if tensor.is_none() && reason.contains("duplicate tensor name") {
        return Some(Deliberate::RepeatedName);
    }
    let listed = listing.1.iter().find(|t| Some(&t.0) == tensor.as_ref())?;
    if reason.starts_with("unknown dtype") && listed.1.parse::<ddo_core::Dtype>().is_err() {
        return Some(Deliberate::UnsupportedDtype);
    }
    (reason == "entry is not a JSON object").then_some(Deliberate::ArrayEntry)
}

/// Every dtype the crate knows, those ddo streams first.
const DTYPES: [&str; 22] = [
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "I32",
    "U32",
    "I64",
    "U64",
    "F16",
    "BF16",
    "F32",
    "F64",
    "F8_E4M3",
    "F8_E5M2",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "C64",
];

fn bits(dtype: &str) -> u64 {
    let d: safetensors::Dtype = serde_json::from_value(dtype.into()).unwrap();
    d.bitsize() as u64
}

/// One entry as it will be written.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<String>,
    offsets: [String; 2],
    array_form: bool,
    extra_field: bool,
    repeated_field: Option<usize>,
}

/// A way a header goes wrong; `at` picks an entry (modulo their number).
#[derive(Debug, Clone)]
enum Mutation {
    /// Entries from `at` on move `by` bytes later, and the data section grows: a gap (at the
    /// end: trailing bytes).
    Gap {
        at: usize,
        by: u64,
    },
    /// Entries from `at` on move `by` bytes earlier.
    Overlap {
        at: usize,
        by: u64,
    },
    /// The data section is `by` bytes shorter or longer.
    DataLen {
        by: i64,
    },
    /// One entry's end moves by `by`.
    Resize {
        at: usize,
        by: i64,
    },
    ReverseOffsets {
        at: usize,
    },
    Reshape {
        at: usize,
        shape: Vec<u64>,
    },
    Retype {
        at: usize,
        dtype: usize,
    },
    /// One entry takes another's name.
    Rename {
        at: usize,
        to: usize,
    },
    RepeatField {
        at: usize,
        field: usize,
    },
    ExtraField {
        at: usize,
    },
    ArrayForm {
        at: usize,
    },
    /// A number written as a float, a negative or a string.
    BadNumber {
        at: usize,
        which: usize,
        form: usize,
    },
    /// The header length field is off by `by`.
    LengthField {
        by: i64,
    },
}

#[derive(Debug, Clone)]
enum Metadata {
    Absent,
    Null,
    Strings(Vec<(String, String)>),
    NotStrings,
    NotObject,
}

#[derive(Debug, Clone)]
enum ByteDamage {
    Flip { at: usize, value: u8 },
    Truncate { to: usize },
    Splice { at: usize, bytes: Vec<u8> },
}

/// A generated file: tensors in offset order, the order they are written, then what goes wrong.
#[derive(Debug, Clone)]
struct Spec {
    tensors: Vec<(String, usize, Vec<u64>)>,
    order: Vec<usize>,
    metadata: Metadata,
    padding: usize,
    mutations: Vec<Mutation>,
    damage: Vec<ByteDamage>,
}

fn dtype_index() -> impl Strategy<Value = usize> {
    // Mostly dtypes ddo streams, so that most valid headers stay valid for both.
    prop_oneof![8 => 0usize..15, 1 => 15usize..22]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = 0usize..8;
    prop_oneof![
        3 => (at.clone(), 1u64..16).prop_map(|(at, by)| Mutation::Gap { at, by }),
        2 => (at.clone(), 1u64..16).prop_map(|(at, by)| Mutation::Overlap { at, by }),
        2 => (-8i64..8).prop_map(|by| Mutation::DataLen { by }),
        1 => (at.clone(), -4i64..4).prop_map(|(at, by)| Mutation::Resize { at, by }),
        1 => at.clone().prop_map(|at| Mutation::ReverseOffsets { at }),
        1 => (at.clone(), proptest::collection::vec(0u64..5, 0..3))
            .prop_map(|(at, shape)| Mutation::Reshape { at, shape }),
        1 => (at.clone(), 0usize..22).prop_map(|(at, dtype)| Mutation::Retype { at, dtype }),
        1 => (at.clone(), at.clone()).prop_map(|(at, to)| Mutation::Rename { at, to }),
        1 => (at.clone(), 0usize..3).prop_map(|(at, field)| Mutation::RepeatField { at, field }),
        1 => at.clone().prop_map(|at| Mutation::ExtraField { at }),
        1 => at.clone().prop_map(|at| Mutation::ArrayForm { at }),
        1 => (at.clone(), 0usize..3, 0usize..4)
            .prop_map(|(at, which, form)| Mutation::BadNumber { at, which, form }),
        1 => (-3i64..3).prop_map(|by| Mutation::LengthField { by }),
    ]
}

fn metadata() -> impl Strategy<Value = Metadata> {
    prop_oneof![
        4 => Just(Metadata::Absent),
        1 => Just(Metadata::Null),
        2 => proptest::collection::vec(("[a-z]{0,4}", "\\PC{0,4}"), 0..3).prop_map(Metadata::Strings),
        1 => Just(Metadata::NotStrings),
        1 => Just(Metadata::NotObject),
    ]
}

fn byte_damage() -> impl Strategy<Value = ByteDamage> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| ByteDamage::Flip { at, value }),
        any::<usize>().prop_map(|to| ByteDamage::Truncate { to }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..6))
            .prop_map(|(at, bytes)| ByteDamage::Splice { at, bytes }),
    ]
}

fn spec() -> impl Strategy<Value = Spec> {
    let tensor = ("\\PC{0,6}", dtype_index(), proptest::collection::vec(0u64..6, 0..4));
    proptest::collection::vec(tensor, 0..7)
        .prop_flat_map(|tensors| {
            let n = tensors.len();
            let order = Just((0..n).collect::<Vec<_>>()).prop_shuffle();
            (
                Just(tensors),
                order,
                metadata(),
                0usize..9,
                proptest::collection::vec(mutation(), 0..3),
                prop_oneof![4 => Just(vec![]), 1 => proptest::collection::vec(byte_damage(), 1..3)],
            )
        })
        .prop_map(|(tensors, order, metadata, padding, mutations, damage)| Spec {
            // Names made unique by their position; `Rename` repeats one on purpose.
            tensors: tensors
                .into_iter()
                .enumerate()
                .map(|(i, (n, d, s))| (format!("{n}{i}"), d, s))
                .collect(),
            order,
            metadata,
            padding,
            mutations,
            damage,
        })
}

fn json(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// Writes the file `spec` describes.
fn build(spec: &Spec) -> Vec<u8> {
    let mut ranges = Vec::new();
    let mut offset = 0u64;
    for (_, dtype, shape) in &spec.tensors {
        let len = shape.iter().product::<u64>() * bits(DTYPES[*dtype]) / 8;
        ranges.push((offset, offset + len));
        offset += len;
    }
    let mut data_len = offset as i64;
    let mut entries: Vec<Entry> = spec
        .tensors
        .iter()
        .map(|(name, dtype, shape)| Entry {
            name: name.clone(),
            dtype: DTYPES[*dtype].to_owned(),
            shape: shape.iter().map(u64::to_string).collect(),
            offsets: [String::new(), String::new()],
            array_form: false,
            extra_field: false,
            repeated_field: None,
        })
        .collect();
    let mut length_delta = 0i64;
    let n = entries.len();
    for m in &spec.mutations {
        match *m {
            Mutation::Gap { at, by } => {
                for r in ranges.iter_mut().skip(at % (n + 1)) {
                    *r = (r.0 + by, r.1 + by);
                }
                data_len += by as i64;
            }
            Mutation::Overlap { at, by } => {
                for r in ranges.iter_mut().skip(at % (n + 1)) {
                    let by = by.min(r.0);
                    *r = (r.0 - by, r.1.saturating_sub(by));
                }
            }
            Mutation::DataLen { by } => data_len += by,
            _ if n == 0 => {}
            Mutation::Resize { at, by } => {
                let r = &mut ranges[at % n];
                r.1 = r.1.saturating_add_signed(by);
            }
            Mutation::ReverseOffsets { at } => {
                let r = &mut ranges[at % n];
                *r = (r.1, r.0);
            }
            Mutation::Reshape { at, ref shape } => {
                entries[at % n].shape = shape.iter().map(u64::to_string).collect();
            }
            Mutation::Retype { at, dtype } => entries[at % n].dtype = DTYPES[dtype].to_owned(),
            Mutation::Rename { at, to } => entries[at % n].name = entries[to % n].name.clone(),
            Mutation::RepeatField { at, field } => entries[at % n].repeated_field = Some(field),
            Mutation::ExtraField { at } => entries[at % n].extra_field = true,
            Mutation::ArrayForm { at } => entries[at % n].array_form = true,
            Mutation::BadNumber { .. } | Mutation::LengthField { .. } => {}
        }
    }
    for (e, r) in entries.iter_mut().zip(&ranges) {
        e.offsets = [r.0.to_string(), r.1.to_string()];
    }
    for m in &spec.mutations {
        match *m {
            Mutation::BadNumber { at, which, form } if n > 0 => {
                let e = &mut entries[at % n];
                let slot = match which {
                    0 | 1 => &mut e.offsets[which],
                    _ if e.shape.is_empty() => continue,
                    _ => &mut e.shape[0],
                };
                *slot = match form {
                    0 => format!("{slot}.0"),
                    1 => format!("-{slot}"),
                    2 => format!("\"{slot}\""),
                    _ => "18446744073709551616".to_owned(),
                };
            }
            Mutation::LengthField { by } => length_delta += by,
            _ => {}
        }
    }

    let mut items = Vec::new();
    match &spec.metadata {
        Metadata::Absent => {}
        Metadata::Null => items.push("\"__metadata__\":null".to_owned()),
        Metadata::Strings(kv) => {
            let kv: Vec<String> =
                kv.iter().map(|(k, v)| format!("{}:{}", json(k), json(v))).collect();
            items.push(format!("\"__metadata__\":{{{}}}", kv.join(",")));
        }
        Metadata::NotStrings => items.push("\"__metadata__\":{\"k\":1}".to_owned()),
        Metadata::NotObject => items.push("\"__metadata__\":\"pt\"".to_owned()),
    }
    for &i in &spec.order {
        let e = &entries[i];
        let (dtype, shape) = (json(&e.dtype), format!("[{}]", e.shape.join(",")));
        let offsets = format!("[{},{}]", e.offsets[0], e.offsets[1]);
        let value = if e.array_form {
            format!("[{dtype},{shape},{offsets}]")
        } else {
            let mut fields = vec![
                format!("\"dtype\":{dtype}"),
                format!("\"shape\":{shape}"),
                format!("\"data_offsets\":{offsets}"),
            ];
            if let Some(f) = e.repeated_field {
                fields.push(fields[f % 3].clone());
            }
            if e.extra_field {
                fields.insert(1, "\"note\":{\"x\":[1,null]}".to_owned());
            }
            format!("{{{}}}", fields.join(","))
        };
        items.push(format!("{}:{value}", json(&e.name)));
    }
    let mut header = format!("{{{}}}", items.join(",")).into_bytes();
    header.extend(std::iter::repeat_n(b' ', spec.padding));
    let length = (header.len() as u64).saturating_add_signed(length_delta);
    let mut bytes = length.to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend(std::iter::repeat_n(0u8, data_len.max(0) as usize));
    for d in &spec.damage {
        damage(&mut bytes, d);
    }
    bytes
}

fn damage(bytes: &mut Vec<u8>, d: &ByteDamage) {
    match d {
        ByteDamage::Flip { at, value } if !bytes.is_empty() => {
            let n = bytes.len();
            bytes[at % n] = *value;
        }
        ByteDamage::Truncate { to } => bytes.truncate(to % (bytes.len() + 1)),
        ByteDamage::Splice { at, bytes: ins } => {
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, ins.iter().copied());
        }
        ByteDamage::Flip { .. } => {}
    }
}

/// Outcome counts, so that a generator that stopped producing some kind of case fails.
#[derive(Default)]
struct Tally {
    cases: Cell<u32>,
    accepted: Cell<u32>,
    refused: Cell<u32>,
    repeated_name: Cell<u32>,
    unsupported_dtype: Cell<u32>,
    array_entry: Cell<u32>,
}

impl Tally {
    fn count(&self, v: Verdict) {
        let c = match v {
            Verdict::BothAccept => &self.accepted,
            Verdict::BothRefuse => &self.refused,
            Verdict::DdoRefuses(Deliberate::RepeatedName) => &self.repeated_name,
            Verdict::DdoRefuses(Deliberate::UnsupportedDtype) => &self.unsupported_dtype,
            Verdict::DdoRefuses(Deliberate::ArrayEntry) => &self.array_entry,
        };
        c.set(c.get() + 1);
        self.cases.set(self.cases.get() + 1);
    }
}

/// A runner of at least `cases` cases; `PROPTEST_CASES` raises it for a longer search.
fn runner(cases: u32) -> TestRunner {
    let defaults = Config::default();
    TestRunner::new(Config {
        cases: cases.max(defaults.cases),
        failure_persistence: None,
        ..defaults
    })
}

#[test]
fn generated_headers_agree() {
    let tally = Tally::default();
    runner(4000)
        .run(&spec(), |spec| {
            let bytes = build(&spec);
            let v = compare(&bytes)
                .map_err(|e| TestCaseError::fail(format!("{e}\nfile: {bytes:?}")))?;
            tally.count(v);
            Ok(())
        })
        .unwrap();
    let cases = f64::from(tally.cases.get());
    let share = |c: &Cell<u32>| f64::from(c.get()) / cases;
    eprintln!(
        "{} cases: {} accepted by both, {} refused by both, ddo alone refuses {} repeated names, {} unsupported dtypes, {} array entries",
        tally.cases.get(),
        tally.accepted.get(),
        tally.refused.get(),
        tally.repeated_name.get(),
        tally.unsupported_dtype.get(),
        tally.array_entry.get()
    );
    assert!(share(&tally.accepted) > 0.15, "too few valid headers");
    assert!(share(&tally.refused) > 0.3, "too few invalid headers");
    for c in [&tally.repeated_name, &tally.unsupported_dtype, &tally.array_entry] {
        assert!(c.get() > 0, "a deliberate difference was never exercised");
    }
}

#[test]
fn the_fuzz_corpus_agrees() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/header");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 20, "the corpus at {} lost its seeds", dir.display());
    // Every seed's corruptions a few mutations away, fewer each as the corpus grows.
    let damaged_per_file = (4096 / files.len() as u32).clamp(4, 64);
    let tally = Tally::default();
    for path in &files {
        let bytes = std::fs::read(path).unwrap();
        match compare(&bytes) {
            Ok(v) => tally.count(v),
            Err(e) => panic!("{}: {e}", path.display()),
        }
        runner(damaged_per_file)
            .run(&proptest::collection::vec(byte_damage(), 1..4), |ds| {
                let mut b = bytes.clone();
                for d in &ds {
                    damage(&mut b, d);
                }
                compare(&b).map(|_| ()).map_err(|e| {
                    TestCaseError::fail(format!("{} damaged: {e}\nfile: {b:?}", path.display()))
                })
            })
            .unwrap();
    }
    assert!(tally.accepted.get() > 0 && tally.refused.get() > 0);
}

#[test]
fn the_header_size_limit_is_the_crates() {
    use safetensors::SafeTensorError;
    let limit = ddo_source::MAX_HEADER_LEN;
    // The crate checks its limit before the buffer's length: past the limit a header is too
    // large; at it, merely longer than this 8-byte buffer.
    let crate_says = |n: u64| SafeTensors::read_metadata(&n.to_le_bytes()).map(|_| ()).unwrap_err();
    assert!(matches!(crate_says(limit + 1), SafeTensorError::HeaderTooLarge));
    assert!(matches!(crate_says(limit), SafeTensorError::InvalidHeaderLength));
    let ddo_says = |n: u64| ddo_source::header_len(&n.to_le_bytes(), u64::MAX, Path::new("m"));
    assert_eq!(ddo_says(limit).unwrap(), limit);
    assert!(
        ddo_says(limit + 1).unwrap_err().to_string().contains("exceeds the 100000000-byte limit")
    );
}
