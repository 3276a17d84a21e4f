//! Random corruptions of valid checkpoints never panic: opening answers Ok or a clear error.

mod common;

use common::*;
use ddo_source::{Checkpoint, parse_header};
use proptest::prelude::*;

fn valid_file() -> Vec<u8> {
    let dir = scratch();
    let p = write(
        &dir.path().join("m.safetensors"),
        &[("a.weight", vec![3, 5]), ("b", vec![7]), ("c.bias", vec![2, 2])],
    );
    std::fs::read(p).unwrap()
}

#[derive(Debug, Clone)]
enum Corruption {
    Flip { at: usize, value: u8 },
    Truncate { to: usize },
    Length { value: u64 },
    Splice { at: usize, bytes: Vec<u8> },
}

fn corruption() -> impl Strategy<Value = Corruption> {
    prop_oneof![
        (0usize..400, any::<u8>()).prop_map(|(at, value)| Corruption::Flip { at, value }),
        (0usize..400).prop_map(|to| Corruption::Truncate { to }),
        any::<u64>().prop_map(|value| Corruption::Length { value }),
        (0usize..400, proptest::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(at, bytes)| Corruption::Splice { at, bytes }),
    ]
}

fn apply(mut bytes: Vec<u8>, c: &Corruption) -> Vec<u8> {
    if bytes.is_empty() {
        return bytes;
    }
    match c {
        Corruption::Flip { at, value } => {
            let n = bytes.len();
            bytes[at % n] = *value;
        }
        Corruption::Truncate { to } => bytes.truncate(*to % (bytes.len() + 1)),
        Corruption::Length { value } => {
            let n = bytes.len().min(8);
            bytes[..n].copy_from_slice(&value.to_le_bytes()[..n]);
        }
        Corruption::Splice { at, bytes: ins } => {
            let at = at % bytes.len();
            bytes.splice(at..at, ins.iter().copied());
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn corrupted_headers_never_panic(cs in proptest::collection::vec(corruption(), 1..4)) {
        let mut bytes = valid_file();
        for c in &cs {
            bytes = apply(bytes, c);
        }
        let dir = scratch();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        match Checkpoint::open(&path) {
            Ok(c) => {
                for s in c.slices() {
                    prop_assert!(s.is_consistent());
                    prop_assert!(s.offset + s.len <= bytes.len() as u64);
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        let _ = parse_header(&bytes, bytes.len() as u64, &path);
    }
}
