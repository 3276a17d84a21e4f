//! Element conversion between floating dtypes, as PyTorch's `Tensor.to(dtype)` converts on the
//! host: widening is exact, narrowing rounds to nearest even, keeps subnormals, signed zeros and
//! infinities, and overflows to infinity. NaN stays NaN; its payload is not part of the contract
//! (PyTorch's own payload changes with the instruction set and the tensor's length).

use half::{bf16, f16};

use crate::Dtype;

/// Whether ddo converts `from` to `to`: two different dtypes among F32, F16 and BF16, or an
/// fp8 dtype (F8_E4M3, F8_E5M2) widened to one of them.
pub fn convertible(from: Dtype, to: Dtype) -> bool {
    let float = |d| matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16);
    from != to && (float(from) || is_fp8(from)) && float(to)
}

fn is_fp8(d: Dtype) -> bool {
    matches!(d, Dtype::F8E4M3 | Dtype::F8E5M2)
}

/// The value of an fp8 byte: E4M3 as `float8_e4m3fn` (no infinities; `S.1111.111` is NaN),
/// E5M2 as the upper byte of an f16. Every fp8 value is exact in F16, BF16 and F32.
fn fp8_value(from: Dtype, b: u8) -> f32 {
    if from == Dtype::F8E5M2 {
        return f16::from_bits(u16::from(b) << 8).to_f32();
    }
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    sign * match (e, b & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => m * (-9f32).exp2(),
        _ => (1.0 + m / 8.0) * ((e - 7) as f32).exp2(),
    }
}

/// Applies `f` to every `A`-byte element of `src`, writing `B`-byte elements into `dst`.
fn each<const A: usize, const B: usize>(
    src: &[u8],
    dst: &mut [u8],
    f: impl Fn([u8; A]) -> [u8; B],
) {
    for (s, d) in src.chunks_exact(A).zip(dst.chunks_exact_mut(B)) {
        d.copy_from_slice(&f(s.try_into().expect("A bytes")));
    }
}

/// Converts `src` (elements of `from`, little-endian) into `dst` (elements of `to`). Both
/// must hold the same number of elements and `convertible(from, to)` must hold.
///
/// # Panics
/// When the lengths disagree or the pair is not convertible (a caller's bug).
pub fn convert(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) {
    assert!(convertible(from, to), "no conversion from {from:?} to {to:?}");
    let n = src.len() / from.size_bytes() as usize;
    assert!(
        src.len() == n * from.size_bytes() as usize && dst.len() == n * to.size_bytes() as usize,
        "{} {from:?} bytes do not convert into {} {to:?} bytes",
        src.len(),
        dst.len()
    );
    use Dtype::{BF16, F16, F32};
    if is_fp8(from) {
        let v = |x: [u8; 1]| fp8_value(from, x[0]);
        match to {
            F32 => each(src, dst, |x| v(x).to_le_bytes()),
            F16 => each(src, dst, |x| f16::from_f32(v(x)).to_le_bytes()),
            _ => each(src, dst, |x| bf16::from_f32(v(x)).to_le_bytes()),
        }
        return;
    }
    let f32_of = f32::from_le_bytes;
    // bf16 is the upper half of an f32: widening is a shift (NaN payloads included).
    let bf16_f32 = |x: [u8; 2]| f32::from_bits(u32::from(u16::from_le_bytes(x)) << 16);
    match (from, to) {
        (F32, BF16) => each(src, dst, |x| bf16::from_f32(f32_of(x)).to_le_bytes()),
        (F32, F16) => each(src, dst, |x| f16::from_f32(f32_of(x)).to_le_bytes()),
        (BF16, F32) => each(src, dst, |x| bf16_f32(x).to_le_bytes()),
        (F16, F32) => each(src, dst, |x| f16::from_le_bytes(x).to_f32().to_le_bytes()),
        (F16, BF16) => {
            each(src, dst, |x| bf16::from_f32(f16::from_le_bytes(x).to_f32()).to_le_bytes())
        }
        (BF16, F16) => {
            each(src, dst, |x| f16::from_f32(bf16::from_le_bytes(x).to_f32()).to_le_bytes())
        }
        _ => unreachable!("convertible() holds"),
    }
}
