//! Lossless entropy coding of bf16 weights.
//!
//! A bf16 value is a sign bit, an 8-bit exponent and a 7-bit mantissa. In trained (and randomly
//! initialised) weights the exponents cluster in a few values, so they carry about 2-3 bits of
//! information in 8, while sign and mantissa look random. [`encode_bf16`] keeps each element's
//! sign and mantissa as one raw byte and codes its exponent with a canonical Huffman code built
//! from the tensor's (or unit's) exponent histogram, limited to [`MAX_CODE_BITS`] bits so that a
//! decoder resolves any code with one lookup in a table of `2^MAX_CODE_BITS` entries, which
//! the encoding carries (checked against the code lengths when parsed). The coded
//! exponents are cut into chunks of a fixed number of elements, each starting on a byte boundary
//! at an offset the encoded form records, so chunks decode independently and in parallel (one
//! GPU thread, or one CPU thread, per chunk). Decoding gives back every input bit pattern exactly:
//! NaN payloads, infinities, subnormals and both zeros included.
//!
//! The split is by bit position, so fp16 encodes through the same functions, bit for bit: its
//! coded byte holds the 5-bit exponent and the top 3 mantissa bits, which the code cannot
//! compress, so fp16 weights shrink less (to about 0.85x against bf16's 0.66x).
//!
//! The crate is pure computation (no I/O, no `unsafe`): the same [`decode_bf16`] serves the host
//! backend and the tests the GPU decoder is checked against, and [`EncodedBf16::parse`] (or
//! [`EncodedBf16::check`], in place) refuses a corrupt encoding with an error instead of panicking
//! or reading out of bounds.
#![forbid(unsafe_code)]

mod bits;
mod format;
mod huffman;

pub use format::{
    CHUNK_ELEMENTS, CodecError, ENCODING_VERSION, EncodedBf16, Layout, decode_bf16, encode_bf16,
};
pub use huffman::{Code, MAX_CODE_BITS};
