//! The header's JSON as written, before validation. A JSON object may repeat a key and a plain
//! map keeps only the last value; here a repeated tensor name or `__metadata__` is refused and a
//! repeated tensor field is recorded, so that no value is silently dropped.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// The key of the header's string-to-string metadata.
pub(super) const METADATA_KEY: &str = "__metadata__";

/// The header's top-level object: `__metadata__`'s value, undecoded, and the tensor entries in
/// document order.
#[derive(Default)]
pub(super) struct RawHeader {
    pub(super) metadata: Option<Value>,
    pub(super) entries: Vec<(String, RawEntry)>,
}

/// A tensor entry as written: whether it is a JSON object, its three known fields, undecoded
/// (other fields are ignored, as the format allows), and the first known field written more
/// than once. Any other JSON value has no fields.
#[derive(Default)]
pub(super) struct RawEntry {
    pub(super) is_object: bool,
    pub(super) dtype: Option<Value>,
    pub(super) shape: Option<Value>,
    pub(super) data_offsets: Option<Value>,
    pub(super) repeated: Option<&'static str>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut seen = HashSet::new();
                let mut out = RawHeader::default();
                while let Some(k) = map.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(if k == METADATA_KEY {
                            format!("{METADATA_KEY} appears twice")
                        } else {
                            format!("duplicate tensor name {k:?}")
                        }));
                    }
                    if k == METADATA_KEY {
                        out.metadata = Some(map.next_value()?);
                    } else {
                        let entry = map.next_value()?;
                        out.entries.push((k, entry));
                    }
                }
                Ok(out)
            }
        }
        deserializer.deserialize_map(V)
    }
}

impl<'de> serde::Deserialize<'de> for RawEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntry;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a tensor entry")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEntry, A::Error> {
                let mut entry = RawEntry { is_object: true, ..RawEntry::default() };
                while let Some(k) = map.next_key::<String>()? {
                    let (name, slot) = match k.as_str() {
                        "dtype" => ("dtype", &mut entry.dtype),
                        "shape" => ("shape", &mut entry.shape),
                        "data_offsets" => ("data_offsets", &mut entry.data_offsets),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    let value: Value = map.next_value()?;
                    if slot.replace(value).is_some() {
                        entry.repeated.get_or_insert(name);
                    }
                }
                Ok(entry)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawEntry, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(RawEntry::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
            fn visit_unit<E>(self) -> Result<RawEntry, E> {
                Ok(RawEntry::default())
            }
        }
        deserializer.deserialize_any(V)
    }
}
