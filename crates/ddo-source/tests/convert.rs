//! Dtype conversion: values as PyTorch converts them, and a source serving converted tensors.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::{CheckpointFileId, Dtype, ReadRequest, SourceError, WeightSource};
use ddo_source::{
    Checkpoint, CheckpointSource, ConvertedSource, ReadOptions, RetainedStore, convert, convertible,
};
use proptest::prelude::*;

fn f32_to(to: Dtype, x: u32) -> u16 {
    let mut out = [0u8; 2];
    convert(Dtype::F32, to, &x.to_le_bytes(), &mut out);
    u16::from_le_bytes(out)
}

fn to_f32(from: Dtype, x: u16) -> u32 {
    let mut out = [0u8; 4];
    convert(from, Dtype::F32, &x.to_le_bytes(), &mut out);
    u32::from_le_bytes(out)
}

fn is_nan32(x: u32) -> bool {
    f32::from_bits(x).is_nan()
}

/// PyTorch's fp32 -> bf16 for a number: round to nearest even on the upper 16 bits.
fn bf16_reference(x: u32) -> u16 {
    let bias = ((x >> 16) & 1) + 0x7FFF;
    (x.wrapping_add(bias) >> 16) as u16
}

/// fp16 bits as an exact f64 (finite or infinite).
fn f16_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1F);
    let man = f64::from(h & 0x3FF);
    match exp {
        0 => sign * man * 2f64.powi(-24),
        31 => sign * f64::INFINITY,
        e => sign * (1.0 + man / 1024.0) * 2f64.powi(e - 15),
    }
}

/// Checks that `h` is the fp16 nearest to the finite `x`, ties to even, overflowing to infinity
/// from 65520 up, as IEEE 754 rounds.
fn check_f16_rounding(x: f32, h: u16) {
    let x = f64::from(x);
    if x.abs() >= 65520.0 {
        assert_eq!(h & 0x7FFF, 0x7C00, "{x} overflows to infinity");
        return;
    }
    let got = f16_value(h);
    // The neighbours of h (by magnitude) must not be nearer.
    for n in [h.wrapping_add(1), h.wrapping_sub(1)] {
        if n & 0x7FFF > 0x7BFF || (n ^ h) & 0x8000 != 0 {
            continue;
        }
        let other = f16_value(n);
        let (d, e) = ((x - got).abs(), (x - other).abs());
        assert!(d < e || (d == e && h & 1 == 0), "{x}: got {got} ({h:#06x}), {other} is nearer");
    }
}

#[test]
fn widening_is_exact_for_every_half_and_bfloat_pattern() {
    for bits in 0..=u16::MAX {
        let wide = to_f32(Dtype::BF16, bits);
        assert_eq!(wide >> 16, u32::from(bits), "bf16 {bits:#06x} widens by its bits");
        assert_eq!(wide & 0xFFFF, 0);
        let h = to_f32(Dtype::F16, bits);
        let want = f16_value(bits);
        if (bits >> 10) & 0x1F == 0x1F && bits & 0x3FF != 0 {
            assert!(is_nan32(h), "f16 NaN {bits:#06x} stays NaN");
        } else {
            assert_eq!(f64::from(f32::from_bits(h)), want, "f16 {bits:#06x}");
            assert_eq!(f32::from_bits(h).is_sign_negative(), bits & 0x8000 != 0);
        }
    }
}

#[test]
fn every_half_and_bfloat_pattern_survives_the_round_trip_through_fp32() {
    for bits in 0..=u16::MAX {
        for d in [Dtype::BF16, Dtype::F16] {
            let back = f32_to(d, to_f32(d, bits));
            if is_nan32(to_f32(d, bits)) {
                assert!(is_nan32(to_f32(d, back)), "{d:?} NaN {bits:#06x} stays NaN");
            } else {
                assert_eq!(back, bits, "{d:?} {bits:#06x}");
            }
        }
    }
}

#[test]
fn half_and_bfloat_convert_to_each_other_through_fp32_rounding() {
    for bits in 0..=u16::MAX {
        let mut out = [0u8; 2];
        convert(Dtype::F16, Dtype::BF16, &bits.to_le_bytes(), &mut out);
        let wide = to_f32(Dtype::F16, bits);
        if is_nan32(wide) {
            assert!(is_nan32(to_f32(Dtype::BF16, u16::from_le_bytes(out))));
        } else {
            assert_eq!(u16::from_le_bytes(out), bf16_reference(wide), "f16 {bits:#06x}");
        }
        convert(Dtype::BF16, Dtype::F16, &bits.to_le_bytes(), &mut out);
        let wide = f32::from_bits(to_f32(Dtype::BF16, bits));
        let got = u16::from_le_bytes(out);
        if wide.is_nan() {
            assert!(is_nan32(to_f32(Dtype::F16, got)));
        } else if wide.is_infinite() {
            assert_eq!(got, if wide > 0.0 { 0x7C00 } else { 0xFC00 });
        } else {
            check_f16_rounding(wide, got);
        }
    }
}

/// Values where rounding is decided: ties, the largest finite values, subnormals, zeros,
/// infinities.
const EDGES: [u32; 14] = [
    0x3F80_8000, // 1 + 2^-8: a tie, rounds to even (down)
    0x3F81_8000, // a tie that rounds up
    0x3F80_8001, // just above a tie
    0x7F7F_FFFF, // f32::MAX: rounds to bf16 infinity
    0x477F_F000, // 65520: overflows fp16
    0x477F_E000, // 65504: fp16's largest
    0x0000_0001, // the smallest subnormal
    0x3380_0000, // 2^-24: fp16's smallest subnormal
    0x3300_0000, // 2^-25: a tie with zero in fp16, rounds to even (zero)
    0x0000_0000,
    0x8000_0000,
    0x7F80_0000,
    0xFF80_0000,
    0x8080_8000,
];

#[test]
fn narrowing_rounds_the_deciding_values_to_nearest_even() {
    for x in EDGES {
        assert_eq!(f32_to(Dtype::BF16, x), bf16_reference(x), "bf16 of {x:#010x}");
        let f = f32::from_bits(x);
        let h = f32_to(Dtype::F16, x);
        if f.is_infinite() {
            assert_eq!(h, if f > 0.0 { 0x7C00 } else { 0xFC00 });
        } else {
            check_f16_rounding(f, h);
        }
    }
    assert_eq!(f32_to(Dtype::F16, 0x3300_0000), 0, "2^-25 ties to zero");
    assert_eq!(f32_to(Dtype::F16, 0x8000_0000), 0x8000, "negative zero keeps its sign");
    assert_eq!(f32_to(Dtype::BF16, 0x7F7F_FFFF), 0x7F80);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn narrowing_any_fp32_matches_round_to_nearest_even(x in any::<u32>()) {
        let f = f32::from_bits(x);
        if f.is_nan() {
            prop_assert!(is_nan32(to_f32(Dtype::BF16, f32_to(Dtype::BF16, x))));
            prop_assert!(is_nan32(to_f32(Dtype::F16, f32_to(Dtype::F16, x))));
        } else {
            prop_assert_eq!(f32_to(Dtype::BF16, x), bf16_reference(x));
            if f.is_infinite() {
                prop_assert_eq!(f32_to(Dtype::F16, x) & 0x7FFF, 0x7C00);
            } else {
                check_f16_rounding(f, f32_to(Dtype::F16, x));
            }
        }
    }
}

#[test]
fn only_floating_pairs_convert() {
    assert!(convertible(Dtype::F32, Dtype::BF16));
    assert!(convertible(Dtype::BF16, Dtype::F32));
    assert!(convertible(Dtype::F16, Dtype::BF16));
    assert!(!convertible(Dtype::BF16, Dtype::BF16));
    assert!(convertible(Dtype::F8E4M3, Dtype::BF16));
    assert!(convertible(Dtype::F8E5M2, Dtype::F32));
    assert!(!convertible(Dtype::BF16, Dtype::F8E4M3), "narrowing to fp8 is quantization");
    assert!(!convertible(Dtype::F8E4M3, Dtype::F8E5M2));
    assert!(!convertible(Dtype::F32, Dtype::I32));
}

fn fp8_to_f32(from: Dtype, b: u8) -> f32 {
    let mut out = [0u8; 4];
    convert(from, Dtype::F32, &[b], &mut out);
    f32::from_le_bytes(out)
}

#[test]
fn fp8_widens_to_its_exact_value() {
    let e4m3 = [
        (0x00, 0.0),
        (0x01, 2f32.powi(-9)),
        (0x07, 7.0 * 2f32.powi(-9)),
        (0x08, 2f32.powi(-6)),
        (0x38, 1.0),
        (0x3c, 1.5),
        (0x7e, 448.0),
        (0xb8, -1.0),
        (0xfe, -448.0),
    ];
    for (b, want) in e4m3 {
        assert_eq!(fp8_to_f32(Dtype::F8E4M3, b), want, "e4m3 {b:#04x}");
    }
    assert!(fp8_to_f32(Dtype::F8E4M3, 0x7f).is_nan() && fp8_to_f32(Dtype::F8E4M3, 0xff).is_nan());
    assert!(fp8_to_f32(Dtype::F8E4M3, 0x80).is_sign_negative(), "negative zero keeps its sign");
    let e5m2 = [(0x3c, 1.0), (0x01, 2f32.powi(-16)), (0x7b, 57344.0), (0x7c, f32::INFINITY)];
    for (b, want) in e5m2 {
        assert_eq!(fp8_to_f32(Dtype::F8E5M2, b), want, "e5m2 {b:#04x}");
    }
    assert!(fp8_to_f32(Dtype::F8E5M2, 0x7d).is_nan());
}

#[test]
fn every_fp8_pattern_widens_to_the_same_value_in_every_float() {
    for from in [Dtype::F8E4M3, Dtype::F8E5M2] {
        for b in 0..=u8::MAX {
            let wide = fp8_to_f32(from, b);
            for to in [Dtype::F16, Dtype::BF16] {
                let mut out = [0u8; 2];
                convert(from, to, &[b], &mut out);
                let back = f32::from_bits(to_f32(to, u16::from_le_bytes(out)));
                if wide.is_nan() {
                    assert!(back.is_nan(), "{from:?} {b:#04x} stays NaN in {to:?}");
                } else {
                    assert_eq!(
                        back.to_bits(),
                        wide.to_bits(),
                        "{from:?} {b:#04x} is exact in {to:?}"
                    );
                }
            }
        }
    }
}

// ---- the source ------------------------------------------------------------------------------

/// An F32 checkpoint: `a`, `b` (adjacent), `c`, each of 1000 elements with [`pattern`] bytes.
fn f32_checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let bytes: Vec<(String, Vec<u8>)> =
        ["a", "b", "c"].iter().map(|n| (n.to_string(), pattern(n, 4000))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1000], b);
            (n.clone(), v.unwrap())
        })
        .collect();
    let path = dir.join("f32.safetensors");
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    path
}

fn sources(dir: &std::path::Path) -> Vec<Arc<dyn WeightSource>> {
    let c = Arc::new(Checkpoint::open(f32_checkpoint(dir)).unwrap());
    vec![
        Arc::new(CheckpointSource::new(c.clone(), ReadOptions::default()).unwrap()),
        // SAFETY: the test's file is not modified while mapped.
        Arc::new(unsafe { CheckpointSource::with_mmap(c, 2) }.unwrap()),
    ]
}

#[test]
fn converted_tensors_are_served_in_the_new_dtype_and_the_rest_as_stored() {
    let dir = scratch();
    for inner in sources(dir.path()) {
        let (a, b, c) = (0, 1, 2);
        let names: Vec<String> = inner.slices().iter().map(|s| s.name.clone()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let store = RetainedStore::new(u64::MAX, probe(true));
        let dropped = std::sync::Mutex::new(Vec::new());
        let src = ConvertedSource::convert(
            inner.clone(),
            &[(a, Dtype::BF16), (b, Dtype::F16)],
            &store,
            3,
            &|i| dropped.lock().unwrap().push(i),
        )
        .unwrap();
        let mut seen = dropped.into_inner().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, [a, b], "each converted tensor's source bytes are let go once");
        let r = src.report();
        assert_eq!((r.tensors, r.source_bytes, r.bytes, r.workers), (2, 8000, 4000, 3));
        assert_eq!(store.used(), 4000, "converted bytes are retained");
        for (i, to) in [(a, Dtype::BF16), (b, Dtype::F16)] {
            let s = &src.slices()[i];
            assert_eq!((s.dtype, s.len), (to, 2000));
            let mut want = vec![0; 2000];
            convert(Dtype::F32, to, &pattern(&s.name, 4000), &mut want);
            let mut got = vec![0; 2000];
            src.read(i, &mut got).unwrap();
            assert_eq!(got, want, "{}", s.name);
            assert_eq!(src.host_bytes(i).unwrap().as_bytes(), want.as_slice());
        }
        // Adjacent in the file, adjacent in the converted buffer: one copy uploads both.
        let (sa, sb) = (&src.slices()[a], &src.slices()[b]);
        assert_eq!(sa.file, sb.file);
        assert_eq!(sa.offset + sa.len, sb.offset);
        assert_eq!(src.host_pieces(sa.file, sa.offset, 4000).unwrap().len(), 1);
        // Not converted: as stored.
        assert_eq!(src.slices()[c], inner.slices()[c]);
        let mut got = vec![0; 4000];
        src.read(c, &mut got).unwrap();
        assert_eq!(got, pattern("c", 4000));
        // A batch mixing both kinds.
        let mut batch = vec![0; 6016];
        src.read_batch(
            &[ReadRequest { slice: c, dst_offset: 0 }, ReadRequest { slice: a, dst_offset: 4016 }],
            &mut batch,
        )
        .unwrap();
        assert_eq!(&batch[..4000], pattern("c", 4000).as_slice());
        assert_eq!(&batch[4016..], src.host_bytes(a).unwrap().as_bytes());
        assert!(src.host_range(CheckpointFileId(99), 0, 1).is_none());
        drop(src);
        assert_eq!(store.used(), 0, "dropping the source frees the converted bytes");
    }
}

#[test]
fn a_refused_conversion_keeps_nothing_and_says_why() {
    let dir = scratch();
    let inner = sources(dir.path()).remove(0);
    let refusing = RetainedStore::new(u64::MAX, probe(false));
    let e = ConvertedSource::convert(inner.clone(), &[(0, Dtype::BF16)], &refusing, 2, &|_| {})
        .unwrap_err();
    assert!(matches!(e, SourceError::Refused(_)), "{e}");
    assert_eq!(refusing.used(), 0);
    let small = RetainedStore::new(100, probe(true));
    let e = ConvertedSource::convert(inner.clone(), &[(0, Dtype::BF16)], &small, 2, &|_| {})
        .unwrap_err();
    assert!(matches!(e, SourceError::CeilingExceeded { .. }), "{e}");
    assert_eq!(small.used(), 0);
    let store = RetainedStore::new(u64::MAX, probe(true));
    let e = ConvertedSource::convert(inner.clone(), &[(0, Dtype::I32)], &store, 2, &|_| {})
        .unwrap_err();
    assert!(e.to_string().contains("ddo converts between F32, F16 and BF16"), "{e}");
    let e =
        ConvertedSource::convert(inner, &[(0, Dtype::BF16), (0, Dtype::F16)], &store, 2, &|_| {})
            .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    assert_eq!(store.used(), 0);
}
