//! Fidelity: every bf16 bit pattern and every tensor decodes to exactly its bytes; damaged
//! encodings are refused.

use ddo_codec::{CHUNK_ELEMENTS, CodecError, EncodedBf16, decode_bf16, encode_bf16};
use proptest::prelude::*;

fn roundtrip(bytes: &[u8], threads: usize) -> EncodedBf16 {
    let enc = encode_bf16(bytes, threads).unwrap();
    let encoded = enc.to_bytes();
    assert_eq!(EncodedBf16::check(&encoded), Ok(enc.elements()));
    let parsed = EncodedBf16::parse(&encoded).unwrap();
    assert_eq!(parsed, enc);
    // Written in place, at an offset of a larger buffer, the bytes are the same.
    let mut placed = vec![0x5au8; encoded.len() + 3];
    enc.write_into(&mut placed[3..]).unwrap();
    assert!(placed[3..] == encoded[..] && placed[..3] == [0x5a; 3]);
    let mut out = vec![0xa5u8; bytes.len()];
    decode_bf16(&parsed, &mut out, threads).unwrap();
    assert!(out == bytes, "decoded bytes differ");
    enc
}

/// Little-endian bytes of bf16 values with a weight-like spread (normal, scale `scale`).
fn weights(n: usize, scale: f32, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .flat_map(|_| {
            // Box-Muller.
            let (u, v) = (next().max(1e-300), next());
            let z = ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32;
            (((z * scale).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

#[test]
fn every_bf16_bit_pattern_round_trips() {
    // All 65536 patterns: both zeros, subnormals, infinities, every NaN payload.
    let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    roundtrip(&all, 4);
    // In reverse and interleaved, so chunks see other mixes.
    let rev: Vec<u8> = (0..=u16::MAX).rev().flat_map(u16::to_le_bytes).collect();
    roundtrip(&rev, 1);
    let mixed: Vec<u8> =
        (0..=u16::MAX).map(|i| i.wrapping_mul(40503)).flat_map(u16::to_le_bytes).collect();
    roundtrip(&mixed, 3);
}

#[test]
fn weight_like_tensors_shrink_to_about_two_thirds() {
    let w = weights(1 << 20, 0.02, 7);
    let enc = roundtrip(&w, 2);
    // Sign and mantissa stay 8 bits of 16; the exponents of a normal spread cost under 3 bits.
    assert!(enc.ratio() < 0.70, "ratio {}", enc.ratio());
    assert!(enc.ratio() > 0.55, "ratio {}", enc.ratio());
}

#[test]
fn small_and_degenerate_tensors_round_trip() {
    roundtrip(&[], 1);
    roundtrip(&[0, 0], 1);
    roundtrip(&vec![0u8; 2 * CHUNK_ELEMENTS as usize + 2], 2);
    // One exponent costs one bit; the 8 KiB decoding table is the rest of the overhead.
    let one_value: Vec<u8> =
        std::iter::repeat_n(0x3f80u16.to_le_bytes(), 50_000).flatten().collect();
    let enc = roundtrip(&one_value, 2);
    assert!(enc.ratio() < 0.66, "ratio {}", enc.ratio());
}

#[test]
fn an_odd_length_and_a_wrong_destination_are_refused() {
    assert_eq!(encode_bf16(&[1, 2, 3], 1), Err(CodecError::OddLength(3)));
    let enc = encode_bf16(&[1, 2, 3, 4], 1).unwrap();
    let mut small = [0u8; 2];
    assert_eq!(
        decode_bf16(&enc, &mut small, 1),
        Err(CodecError::Destination { expected: 4, got: 2 })
    );
    let len = enc.encoded_len();
    for got in [0, len as usize - 1, len as usize + 1] {
        assert_eq!(
            enc.write_into(&mut vec![0; got]),
            Err(CodecError::EncodedDestination { expected: len, got })
        );
    }
}

#[test]
fn every_damaged_byte_is_refused() {
    let w = weights(3000, 1.0, 3);
    let bytes = encode_bf16(&w, 1).unwrap().to_bytes();
    for at in 0..bytes.len() {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x10;
        assert!(EncodedBf16::parse(&damaged).is_err(), "a flip at byte {at} was accepted");
        assert!(EncodedBf16::check(&damaged).is_err(), "a flip at byte {at} was checked");
    }
    for len in 0..bytes.len() {
        assert!(EncodedBf16::parse(&bytes[..len]).is_err(), "a cut at {len} was accepted");
        assert!(EncodedBf16::check(&bytes[..len]).is_err(), "a cut at {len} was checked");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(EncodedBf16::check(&longer).is_err() && EncodedBf16::parse(&longer).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_tensor_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..6000).prop_map(|mut v| { v.truncate(v.len() & !1); v }), threads in 1usize..5) {
        roundtrip(&bytes, threads);
    }

    #[test]
    fn weights_of_any_scale_round_trip(scale in 1e-30f32..1e30, seed in any::<u64>(), n in 1usize..5000) {
        roundtrip(&weights(n, scale, seed), 2);
    }

    #[test]
    fn parsing_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
        let parsed = EncodedBf16::parse(&bytes);
        let checked = EncodedBf16::check(&bytes);
        prop_assert_eq!(parsed.map(|e| e.elements()), checked);
    }
}

#[test]
fn the_layout_says_where_each_part_lies() {
    let w = weights(3 * CHUNK_ELEMENTS as usize + 17, 0.02, 3);
    let enc = encode_bf16(&w, 2).unwrap();
    let bytes = enc.to_bytes();
    let at = ddo_codec::Layout::of(enc.elements());
    assert_eq!(at.chunks, 4);
    assert_eq!(enc.encoded_len(), bytes.len() as u64);
    let part = |from: u64, len: usize| &bytes[from as usize..from as usize + len];
    let table = enc.code().decoding_table();
    for (w, &(symbol, len)) in table.iter().enumerate() {
        let e = part(at.table + 2 * w as u64, 2);
        assert_eq!(u16::from_le_bytes([e[0], e[1]]), u16::from(symbol) | u16::from(len) << 8);
    }
    for (c, &o) in enc.offsets().iter().enumerate() {
        assert_eq!(part(at.offsets + 4 * c as u64, 4), o.to_le_bytes());
    }
    assert_eq!(part(at.raw, enc.raw().len()), enc.raw());
    assert_eq!(&bytes[at.coded as usize..], enc.coded());
    for p in [at.table, at.offsets, at.raw] {
        assert_eq!(p % 4, 0, "{at:?}");
    }
}
