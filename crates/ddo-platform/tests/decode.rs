//! Decoding ddo-codec's bf16 encodings on the device, one test body per backend: the host
//! backend always, CUDA under `cargo xtask test-gpu`. The decoded bytes equal the input, bit
//! for bit; damaged encodings never make the device read or write out of its ranges.

use std::sync::Arc;

use ddo_codec::{EncodedBf16, Layout, encode_bf16};
use ddo_core::{DeviceError, DeviceRange, HostBytes, HostSlice, Platform, StreamId};
use ddo_platform::host::HostDevice;

struct Env {
    platform: Platform,
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

fn host_env() -> Env {
    let device = Arc::new(HostDevice::with_granularity(64 << 10));
    Env { platform: ddo_platform::host_platform(device.clone()), _keep: Some(device) }
}

fn cuda_env() -> Env {
    let (platform, device) =
        ddo_platform::cuda_platform(0).expect("a CUDA device (run with cargo xtask test-gpu)");
    Env { platform, _keep: Some(device) }
}

macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod host_backend {
            $( #[test] fn $name() { super::$name(&super::host_env()) } )*
        }
        mod cuda_backend {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
                fn $name() { super::$name(&super::cuda_env()) }
            )*
        }
    };
}

backend_tests!(
    every_bf16_pattern_decodes_bit_for_bit,
    weight_like_tensors_of_every_shape_decode_bit_for_bit,
    a_one_symbol_tensor_decodes,
    a_destination_aligned_to_4_but_not_16_bytes_decodes,
    a_damaged_encoding_stays_inside_its_ranges,
    decode_refuses_ranges_it_cannot_use,
);

/// Bytes written around the destination, which no decoding may change.
const GUARD: u64 = 256;
const GUARD_BYTE: u8 = 0xa5;

/// Little-endian bf16 of a normal spread of `scale`, as initialised weights have.
fn weights(elements: usize, scale: f64, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..elements)
        .flat_map(|_| {
            let (u, v) = (uniform().max(1e-300), uniform());
            let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            ((((z * scale) as f32).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// One mapping holding an encoding of `encoded` bytes at its start, then the guard, the
/// destination of `decoded` bytes at `offset` past a 16-byte boundary, and the guard again.
struct Layouted {
    whole: DeviceRange,
    src: DeviceRange,
    dst: DeviceRange,
}

fn mapping(env: &Env, encoded: u64, decoded: u64, offset: u64) -> Layouted {
    let r = &env.platform.residency;
    let g = r.granularity().unwrap();
    let dst_at = (encoded + GUARD).next_multiple_of(16) + offset;
    let len = (dst_at + decoded + GUARD).next_multiple_of(g);
    let reservation = r.reserve(len).unwrap();
    let backing = r.create_backing(len).unwrap();
    let whole = DeviceRange { start: reservation.range.start, len };
    r.map(whole, backing).unwrap();
    Layouted {
        whole,
        src: DeviceRange { start: whole.start, len: encoded },
        dst: DeviceRange { start: whole.start.offset(dst_at), len: decoded },
    }
}

fn upload(env: &Env, bytes: Vec<u8>, at: DeviceRange, stream: StreamId) {
    let host = HostSlice::whole(Arc::new(HostBytes::from(bytes)));
    env.platform.residency.copy_to_device(host, at, stream).unwrap();
}

/// Fills everything past the encoding with the guard byte, decodes, and returns the
/// destination's bytes after checking that nothing else changed. `Err` is the decoding's.
fn decode_guarded(
    env: &Env,
    encoding: Vec<u8>,
    decoded: u64,
    offset: u64,
) -> Result<Vec<u8>, DeviceError> {
    let r = &env.platform.residency;
    let stream = r.create_stream().unwrap();
    let m = mapping(env, encoding.len() as u64, decoded, offset);
    let rest = DeviceRange { start: m.whole.start.offset(m.src.len), len: m.whole.len - m.src.len };
    upload(env, vec![GUARD_BYTE; rest.len as usize], rest, stream);
    upload(env, encoding, m.src, stream);
    let decoded = r.decode(m.src, m.dst, stream);
    // A device fault would fail this wait (and every call after it).
    env.platform.fences.wait(env.platform.fences.record(stream).unwrap()).unwrap();
    let (bytes, seconds) = r.decode_totals(stream);
    if decoded.is_ok() {
        assert_eq!(bytes, m.dst.len, "the decode totals count the decoded bytes");
        assert!(seconds > 0.0, "and its time");
    } else {
        assert_eq!((bytes, seconds), (0, 0.0), "a refused decode counts nothing");
    }
    let mut after = vec![0u8; rest.len as usize];
    r.read_back(rest, &mut after).unwrap();
    let dst_at = (m.dst.start.0 - rest.start.0) as usize;
    let (before, tail) = after.split_at(dst_at);
    let (out, behind) = tail.split_at(m.dst.len as usize);
    let changed = |b: &[u8]| b.iter().position(|&x| x != GUARD_BYTE);
    assert_eq!(changed(before), None, "a byte before the destination changed");
    assert_eq!(changed(behind), None, "a byte after the destination changed");
    decoded.map(|()| out.to_vec())
}

/// Encodes `bytes`, decodes them on the device with the destination at `offset` past a 16-byte
/// boundary, and checks that every bit comes back.
fn round_trip(env: &Env, bytes: &[u8], offset: u64) -> EncodedBf16 {
    assert!(env.platform.residency.decodes(), "H200 and the host backend decode");
    let enc = encode_bf16(bytes, 4).unwrap();
    let out = decode_guarded(env, enc.to_bytes(), bytes.len() as u64, offset)
        .unwrap_or_else(|e| panic!("{} elements: {e}", enc.elements()));
    if let Some(i) = out.iter().zip(bytes).position(|(a, b)| a != b) {
        panic!(
            "{} elements at offset {offset}: element {} is {:02x?}, the input's {:02x?}",
            enc.elements(),
            i / 2,
            &out[i & !1..][..2],
            &bytes[i & !1..][..2]
        );
    }
    enc
}

fn every_bf16_pattern_decodes_bit_for_bit(env: &Env) {
    let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    round_trip(env, &all, 0);
    let mut reversed = all.clone();
    reversed.reverse();
    round_trip(env, &reversed, 0);
}

fn weight_like_tensors_of_every_shape_decode_bit_for_bit(env: &Env) {
    // Single elements, one chunk and around it, one block of 128 chunks and one past it.
    for elements in [1, 255, 256, 257, 128 * 256 + 1] {
        round_trip(env, &weights(elements, 0.02, elements as u64), 0);
    }
    let enc = round_trip(env, &weights(8 << 20, 0.02, 7), 0);
    assert!(enc.ratio() < 0.75, "16 MiB of weights: ratio {}", enc.ratio());
}

fn a_one_symbol_tensor_decodes(env: &Env) {
    let one: Vec<u8> = std::iter::repeat_n(0x3f80u16.to_le_bytes(), 100_003).flatten().collect();
    round_trip(env, &one, 0);
    round_trip(env, &vec![0u8; 2 * 1000], 0);
}

fn a_destination_aligned_to_4_but_not_16_bytes_decodes(env: &Env) {
    let w = weights(3 * 128 * 256 + 100, 0.02, 11);
    for offset in [4, 8, 12, 2, 6] {
        round_trip(env, &w, offset);
    }
}

fn a_damaged_encoding_stays_inside_its_ranges(env: &Env) {
    let w = weights(2 * 128 * 256 + 999, 0.02, 5);
    let enc = encode_bf16(&w, 4).unwrap();
    let good = enc.to_bytes();
    let at = Layout::of(enc.elements());
    let (table, offsets, raw, coded) =
        (at.table as usize, at.offsets as usize, at.raw as usize, at.coded as usize);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut damaged: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut b = good.clone();
    b[coded..].iter_mut().for_each(|x| *x = random() as u8);
    damaged.push(("random coded exponents", b));
    let mut b = good.clone();
    for (c, o) in b[offsets..raw].chunks_exact_mut(4).enumerate() {
        let v = match c % 3 {
            0 => u32::MAX - c as u32,
            1 => (at.chunks as u32).saturating_sub(c as u32) * 7,
            _ => random() as u32,
        };
        o.copy_from_slice(&v.to_le_bytes());
    }
    damaged.push(("huge and decreasing chunk offsets", b));
    let mut b = good.clone();
    b[table..offsets].iter_mut().for_each(|x| *x = 0);
    damaged.push(("a table of length-0 entries", b));
    let mut b = good.clone();
    b[table..offsets].iter_mut().for_each(|x| *x = random() as u8);
    damaged.push(("a random table", b));
    let mut b = good.clone();
    b.iter_mut().for_each(|x| *x = random() as u8);
    damaged.push(("random bytes", b));
    damaged.push(("no coded exponents", good[..coded].to_vec()));
    for (what, bytes) in damaged {
        match decode_guarded(env, bytes, w.len() as u64, 4) {
            // The GPU decodes whatever the bytes hold; the host checks them first.
            Ok(_) => assert_ne!(env.platform.name, "host", "{what}: the host refuses damage"),
            Err(DeviceError::InvalidUse(m)) => {
                assert_eq!(env.platform.name, "host", "{what}: {m}");
                assert!(m.contains("corrupt encoding"), "{what}: {m}");
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    // The device still works, and decodes the undamaged encoding.
    round_trip(env, &w, 0);
}

fn decode_refuses_ranges_it_cannot_use(env: &Env) {
    let r = &env.platform.residency;
    let stream = r.create_stream().unwrap();
    let w = weights(1000, 0.02, 3);
    let encoding = encode_bf16(&w, 1).unwrap().to_bytes();
    let m = mapping(env, encoding.len() as u64, w.len() as u64, 0);
    upload(env, encoding, m.src, stream);
    r.decode(m.src, m.dst, stream).unwrap();
    let refused = |src: DeviceRange, dst: DeviceRange, says: &str| match r.decode(src, dst, stream)
    {
        Err(DeviceError::InvalidUse(message)) => assert!(message.contains(says), "{message}"),
        other => panic!("{src:?} -> {dst:?}: {other:?}, expected a refusal saying {says:?}"),
    };
    let past = DeviceRange { start: m.whole.start.offset(m.whole.len), len: m.dst.len };
    refused(m.src, past, "not inside one mapped range");
    let past = DeviceRange { start: m.whole.start.offset(m.whole.len), len: m.src.len };
    refused(past, m.dst, "not inside one mapped range");
    let odd = DeviceRange { start: m.dst.start, len: m.dst.len - 1 };
    refused(m.src, odd, "not whole 2-byte-aligned bf16 elements");
    let odd = DeviceRange { start: m.dst.start.offset(1), len: m.dst.len - 2 };
    refused(m.src, odd, "not whole 2-byte-aligned bf16 elements");
    let fixed = Layout::of(w.len() as u64 / 2).coded;
    let short = DeviceRange { start: m.src.start, len: fixed - 1 };
    refused(short, m.dst, &format!("takes at least {fixed} bytes"));
    for shift in [1, 2] {
        let misaligned = DeviceRange { start: m.src.start.offset(shift), len: m.src.len };
        refused(misaligned, m.dst, "does not start 4-byte aligned");
    }
    let overlapping =
        DeviceRange { start: m.src.start.offset((m.src.len - 5) & !1), len: m.dst.len };
    refused(m.src, overlapping, "overlap");
    // Nothing refused was enqueued: the first decoding's bytes are there.
    env.platform.fences.wait(env.platform.fences.record(stream).unwrap()).unwrap();
    let mut out = vec![0u8; w.len()];
    r.read_back(m.dst, &mut out).unwrap();
    assert!(out == w, "the decoded bytes");
}
