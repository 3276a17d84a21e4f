//! The decoding kernel of ddo-codec's bf16 encodings: CUDA C in `decode.cu`, shipped as the PTX
//! NVRTC 12.0 compiles it to (`cargo xtask kernels`; PTX 8.0 for sm_80, so any driver from CUDA
//! 12.0 on loads it on an Ampere or newer GPU), compiled by the driver when first used.
//!
//! Block `b` decodes chunks `[128 b, 128 b + 128)`: each thread decodes one chunk's exponents
//! into shared memory, then the block writes its elements coalesced. The kernel reads only the
//! encoding and writes only the destination's elements, whatever the bytes hold.

/// The PTX, whose first line records the SHA-256 of the source it was compiled from.
pub(crate) const PTX: &str = include_str!("decode.ptx");

/// The kernel: `(const u8* blob, u16* dst, u64 elements, u64 coded_bytes)`.
pub(crate) const KERNEL: &std::ffi::CStr = c"ddo_decode_bf16";

/// Threads per block, one chunk each.
pub(crate) const THREADS: u32 = 128;

/// Blocks of the grid decoding `elements` elements.
pub(crate) fn blocks(elements: u64) -> u64 {
    elements.div_ceil(u64::from(ddo_codec::CHUNK_ELEMENTS)).div_ceil(u64::from(THREADS))
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    const SOURCE: &str = include_str!("decode.cu");

    #[test]
    fn the_ptx_is_compiled_from_the_committed_source() {
        let digest: String =
            Sha256::digest(SOURCE.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        let first = PTX.lines().next().unwrap_or_default();
        assert!(
            first.contains(&format!("decode.cu sha256 {digest}")),
            "decode.ptx was not compiled from this decode.cu (sha256 {digest}): run `cargo xtask \
             kernels`; its first line is {first:?}"
        );
        assert!(PTX.contains(".visible .entry ddo_decode_bf16("), "the entry point");
        assert!(PTX.contains("\n.version 8.0\n") && PTX.contains("\n.target sm_80\n"));
    }

    #[test]
    fn the_kernel_lays_out_encodings_as_the_codec_does() {
        let layout = ddo_codec::Layout::of(0);
        assert!(SOURCE.contains(&format!("#define HEADER_AND_LENGTHS {}ull", layout.table)));
        assert_eq!(layout.offsets, layout.table + 2 * (1 << ddo_codec::MAX_CODE_BITS));
        assert!(SOURCE.contains(&format!("#define CODE_BITS {}\n", ddo_codec::MAX_CODE_BITS)));
        assert!(SOURCE.contains(&format!("#define CHUNK {} ", ddo_codec::CHUNK_ELEMENTS)));
        assert!(SOURCE.contains(&format!("#define THREADS {THREADS} ")));
        let at = ddo_codec::Layout::of(1000);
        assert_eq!((at.raw, at.coded), (at.offsets + 4 * 5, at.raw + 1000));
        assert_eq!((blocks(0), blocks(1), blocks(128 * 256), blocks(128 * 256 + 1)), (0, 1, 1, 2));
    }
}
