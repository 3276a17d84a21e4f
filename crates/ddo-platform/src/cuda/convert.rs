//! Conversion kernels: one PTX kernel per dtype pair, compiled by the driver when first used.
//!
//! Every kernel widens its input exactly to f32, then rounds once to the output (round to
//! nearest even), as [`ddo_core::convert`] does; fp8 and half widen exactly, so only a
//! narrowing from f32 (or between F16 and BF16) rounds. A grid-stride loop walks the elements.

use ddo_core::Dtype;

/// The kernel's name in every module.
pub(crate) const KERNEL: &std::ffi::CStr = c"ddo_convert";

/// PTX loading element `%rd7` of `from` into `%f1` (exactly).
fn load(from: Dtype) -> Option<&'static str> {
    Some(match from {
        Dtype::F32 => "ld.global.f32 %f1, [%rd7];",
        Dtype::F16 => "ld.global.b16 %h1, [%rd7];\n    cvt.f32.f16 %f1, %h1;",
        // bf16 is the upper half of an f32.
        Dtype::BF16 => {
            "ld.global.b16 %h1, [%rd7];\n    cvt.u32.u16 %r4, %h1;\n    shl.b32 %r4, %r4, 16;\n    mov.b32 %f1, %r4;"
        }
        // E5M2 is the upper byte of an f16.
        Dtype::F8E5M2 => {
            "ld.global.u8 %h1, [%rd7];\n    shl.b16 %h1, %h1, 8;\n    cvt.f32.f16 %f1, %h1;"
        }
        // The byte in both halves, so either half of the f16x2 result is its value.
        Dtype::F8E4M3 => {
            "ld.global.u8 %h1, [%rd7];\n    shl.b16 %h2, %h1, 8;\n    or.b16 %h1, %h1, %h2;\n    cvt.rn.f16x2.e4m3x2 %r4, %h1;\n    cvt.u16.u32 %h1, %r4;\n    cvt.f32.f16 %f1, %h1;"
        }
        _ => return None,
    })
}

/// PTX storing `%f1` as `to` at `%rd7`.
fn store(to: Dtype) -> Option<&'static str> {
    Some(match to {
        Dtype::F32 => "st.global.f32 [%rd7], %f1;",
        Dtype::F16 => "cvt.rn.f16.f32 %h1, %f1;\n    st.global.b16 [%rd7], %h1;",
        Dtype::BF16 => "cvt.rn.bf16.f32 %h1, %f1;\n    st.global.b16 [%rd7], %h1;",
        _ => return None,
    })
}

/// The PTX module converting `from` to `to`, or `None` for a pair without a kernel.
pub(crate) fn ptx(from: Dtype, to: Dtype) -> Option<String> {
    if !ddo_core::convertible(from, to) {
        return None;
    }
    let (load, store) = (load(from)?, store(to)?);
    // E4M3 needs the fp8 conversion instructions (sm_89, PTX 8.1); bf16 rounding needs sm_80.
    let (version, target) = if from == Dtype::F8E4M3 { ("8.1", "sm_89") } else { ("7.8", "sm_80") };
    let (a, b) = (from.size_bytes(), to.size_bytes());
    Some(format!(
        r#".version {version}
.target {target}
.address_size 64

.visible .entry ddo_convert(.param .u64 src, .param .u64 dst, .param .u64 n)
{{
    .reg .pred %p1;
    .reg .b16 %h<3>;
    .reg .b32 %r<5>;
    .reg .f32 %f1;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [n];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mov.u32 %r1, %nctaid.x;
    mul.wide.u32 %rd6, %r1, %r2;
LOOP:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra DONE;
    mad.lo.u64 %rd7, %rd4, {a}, %rd1;
    {load}
    mad.lo.u64 %rd7, %rd4, {b}, %rd2;
    {store}
    add.u64 %rd4, %rd4, %rd6;
    bra LOOP;
DONE:
    ret;
}}
"#
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_convertible_pair_has_a_kernel_and_no_other() {
        for from in Dtype::ALL {
            for to in Dtype::ALL {
                let text = ptx(from, to);
                assert_eq!(text.is_some(), ddo_core::convertible(from, to), "{from:?} -> {to:?}");
                if let Some(t) = text {
                    assert!(t.contains(".entry ddo_convert("), "{t}");
                    assert_eq!(t.matches('{').count(), t.matches('}').count(), "{t}");
                }
            }
        }
    }
}
