//! The encoded form of a bf16 tensor, its encoder and decoder.

use crate::bits::{BitReader, BitWriter};
use crate::huffman::{Code, MAX_CODE_BITS};

/// Elements per independently decodable chunk of coded exponents.
pub const CHUNK_ELEMENTS: u32 = 256;

const MAGIC: &[u8; 4] = b"DDOE";
/// The version of the encoded form this build writes and reads.
pub const ENCODING_VERSION: u8 = 1;
const VERSION: u8 = ENCODING_VERSION;
const DTYPE_BF16: u8 = 1;
/// Magic, version, dtype, code bits, reserved, elements, chunk elements, chunks, coded bytes,
/// the CRC-32 of everything after the header, reserved.
const HEADER: usize = 4 + 4 + 8 + 4 + 4 + 8 + 4 + 4;
/// Entries of the decoding table the encoding carries (one per `MAX_CODE_BITS`-bit window).
const TABLE_ENTRIES: usize = 1 << MAX_CODE_BITS;

/// Where the parts of an encoding of `elements` elements lie in its bytes
/// ([`EncodedBf16::to_bytes`]), for decoders that read the bytes in place (the GPU kernel):
/// - `table`: `2^MAX_CODE_BITS` little-endian `u16` entries, entry `w` for the window `w` of the
///   next `MAX_CODE_BITS` bits: `symbol | length << 8` (length 0: no code starts so);
/// - `offsets`: `chunks + 1` little-endian `u32` chunk boundaries in the coded exponents;
/// - `raw`: one sign-and-mantissa byte per element;
/// - `coded`: the coded exponents, most significant bit first, to the end of the bytes.
///
/// Every part starts at a multiple of 4 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Chunks of [`CHUNK_ELEMENTS`] elements (the last may be short).
    pub chunks: u64,
    /// Offset of the decoding table.
    pub table: u64,
    /// Offset of the chunk boundaries.
    pub offsets: u64,
    /// Offset of the sign-and-mantissa bytes.
    pub raw: u64,
    /// Offset of the coded exponents.
    pub coded: u64,
}

impl Layout {
    /// The layout of an encoding of `elements` elements.
    pub fn of(elements: u64) -> Layout {
        let chunks = elements.div_ceil(u64::from(CHUNK_ELEMENTS));
        let table = (HEADER + 256) as u64;
        let offsets = table + 2 * TABLE_ENTRIES as u64;
        let raw = offsets + 4 * (chunks + 1);
        Layout { chunks, table, offsets, raw, coded: raw + elements }
    }
}

/// What can go wrong encoding or decoding.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    /// The input is not a whole number of bf16 elements.
    #[error("{0} bytes are not a whole number of 2-byte bf16 elements")]
    OddLength(usize),
    /// The destination does not have the decoded length.
    #[error("the decoded tensor is {expected} bytes; the destination has {got}")]
    Destination {
        /// Bytes the decoded tensor has.
        expected: u64,
        /// Bytes the destination has.
        got: usize,
    },
    /// The destination does not have the encoding's length.
    #[error("the encoding is {expected} bytes; the destination has {got}")]
    EncodedDestination {
        /// Bytes the encoding has.
        expected: u64,
        /// Bytes the destination has.
        got: usize,
    },
    /// The tensor is too large for one encoding (its coded exponents pass 4 GiB).
    #[error("{0} elements are too many for one encoding; encode the tensor in parts")]
    TooLarge(u64),
    /// The encoded bytes are damaged or not an encoding of this version.
    #[error("corrupt encoding: {0}")]
    Corrupt(String),
}

fn corrupt(what: impl Into<String>) -> CodecError {
    CodecError::Corrupt(what.into())
}

/// A bf16 tensor with Huffman-coded exponents: per element one raw byte (sign bit, then the 7
/// mantissa bits) and one exponent code; the codes cut into chunks of [`CHUNK_ELEMENTS`]
/// elements, chunk `c` occupying `coded[offsets[c]..offsets[c + 1]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedBf16 {
    elements: u64,
    code: Code,
    offsets: Vec<u32>,
    raw: Vec<u8>,
    coded: Vec<u8>,
}

impl EncodedBf16 {
    /// Elements of the tensor.
    pub fn elements(&self) -> u64 {
        self.elements
    }

    /// Bytes of the tensor decoded (2 per element).
    pub fn decoded_len(&self) -> u64 {
        self.elements * 2
    }

    /// Bytes of [`to_bytes`](Self::to_bytes): header, code lengths, chunk offsets, raw bytes and
    /// coded exponents.
    pub fn encoded_len(&self) -> u64 {
        Layout::of(self.elements).coded + self.coded.len() as u64
    }

    /// Encoded bytes per decoded byte (below 1 when coding pays).
    pub fn ratio(&self) -> f64 {
        if self.elements == 0 {
            return 1.0;
        }
        self.encoded_len() as f64 / self.decoded_len() as f64
    }

    /// The exponent code.
    pub fn code(&self) -> &Code {
        &self.code
    }

    /// Chunk boundaries in the coded exponents (one more than the chunks).
    pub fn offsets(&self) -> &[u32] {
        &self.offsets
    }

    /// Sign-and-mantissa bytes, one per element.
    pub fn raw(&self) -> &[u8] {
        &self.raw
    }

    /// The coded exponents.
    pub fn coded(&self) -> &[u8] {
        &self.coded
    }

    /// The encoding as bytes (little-endian fields), as [`parse`](Self::parse) reads it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![0; self.encoded_len() as usize];
        self.write_into(&mut out).expect("the buffer has the encoding's length");
        out
    }

    /// Writes the encoding, as [`to_bytes`](Self::to_bytes) gives it, into `out`, which must
    /// have exactly [`encoded_len`](Self::encoded_len) bytes.
    pub fn write_into(&self, out: &mut [u8]) -> Result<(), CodecError> {
        if out.len() as u64 != self.encoded_len() {
            return Err(CodecError::EncodedDestination {
                expected: self.encoded_len(),
                got: out.len(),
            });
        }
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(MAGIC);
        put(&[VERSION, DTYPE_BF16, MAX_CODE_BITS, 0]);
        put(&self.elements.to_le_bytes());
        put(&CHUNK_ELEMENTS.to_le_bytes());
        put(&(self.offsets.len() as u32 - 1).to_le_bytes());
        put(&(self.coded.len() as u64).to_le_bytes());
        // The CRC-32 goes in the first 4 of these once the body is written.
        put(&[0; 8]);
        put(self.code.lengths());
        for (symbol, len) in self.code.decoding_table() {
            put(&(u16::from(symbol) | u16::from(len) << 8).to_le_bytes());
        }
        for o in &self.offsets {
            put(&o.to_le_bytes());
        }
        put(&self.raw);
        put(&self.coded);
        let crc = crc32fast::hash(&out[HEADER..]);
        out[32..36].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }

    /// Reads an encoding written by [`to_bytes`](Self::to_bytes), checking every field and the
    /// CRC-32 of the body: a damaged encoding is refused, never decoded into other values.
    pub fn parse(bytes: &[u8]) -> Result<EncodedBf16, CodecError> {
        let Checked { elements, code, coded_len } = check(bytes)?;
        let layout = Layout::of(elements);
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        let offsets =
            (0..=layout.chunks as usize).map(|c| u32_at(layout.offsets as usize + 4 * c)).collect();
        let raw = bytes[layout.raw as usize..layout.coded as usize].to_vec();
        let coded = bytes[layout.coded as usize..(layout.coded + coded_len) as usize].to_vec();
        Ok(EncodedBf16 { elements, code, offsets, raw, coded })
    }

    /// Checks encoded bytes in place as [`parse`](Self::parse) does (every field, the CRC-32 of
    /// the body, the table and the chunk offsets), without copying their parts: what a decoder
    /// reading them in place (the GPU kernel) relies on. Gives the tensor's elements.
    pub fn check(bytes: &[u8]) -> Result<u64, CodecError> {
        check(bytes).map(|c| c.elements)
    }
}

/// What a check of encoded bytes read from their header.
struct Checked {
    elements: u64,
    code: Code,
    coded_len: u64,
}

/// Checks every field of encoded bytes and the CRC-32 of their body.
fn check(bytes: &[u8]) -> Result<Checked, CodecError> {
    let field = |at: usize, len: usize| {
        bytes.get(at..at + len).ok_or_else(|| corrupt(format!("{} bytes end early", bytes.len())))
    };
    if field(0, 4)? != MAGIC {
        return Err(corrupt("not a ddo encoding (magic)"));
    }
    let kind = field(4, 4)?;
    if kind[3] != 0 || field(36, 4)? != [0; 4] {
        return Err(corrupt("reserved header bytes are not zero"));
    }
    if kind[0] != VERSION || kind[1] != DTYPE_BF16 || kind[2] != MAX_CODE_BITS {
        return Err(corrupt(format!(
            "version {}, dtype {}, {}-bit codes: this build reads version {VERSION} bf16 with \
             {MAX_CODE_BITS}-bit codes",
            kind[0], kind[1], kind[2]
        )));
    }
    let u64_at = |at| field(at, 8).map(|b| u64::from_le_bytes(b.try_into().expect("8")));
    let u32_at = |at| field(at, 4).map(|b| u32::from_le_bytes(b.try_into().expect("4")));
    let elements = u64_at(8)?;
    if u32_at(16)? != CHUNK_ELEMENTS {
        return Err(corrupt("chunk size"));
    }
    let chunks = u64::from(u32_at(20)?);
    if chunks != elements.div_ceil(u64::from(CHUNK_ELEMENTS)) {
        return Err(corrupt(format!("{chunks} chunks for {elements} elements")));
    }
    let coded_len = u64_at(24)?;
    let expected = Layout::of(elements).coded.checked_add(coded_len);
    if expected != Some(bytes.len() as u64) {
        return Err(corrupt(format!(
            "{} bytes, the header describes {}",
            bytes.len(),
            expected.map_or("more than 2^64".into(), |n| n.to_string())
        )));
    }
    if u32_at(32)? != crc32fast::hash(&bytes[HEADER..]) {
        return Err(corrupt("the body's CRC-32 differs from the header's: the bytes changed"));
    }
    let lengths: [u8; 256] = field(HEADER, 256)?.try_into().expect("256");
    let code = Code::from_lengths(lengths).ok_or_else(|| corrupt("code lengths"))?;
    let layout = Layout::of(elements);
    let table = field(layout.table as usize, 2 * TABLE_ENTRIES)?;
    let consistent =
        code.decoding_table().iter().zip(table.chunks_exact(2)).all(|(&(s, l), e)| {
            u16::from_le_bytes([e[0], e[1]]) == u16::from(s) | u16::from(l) << 8
        });
    if !consistent {
        return Err(corrupt("the decoding table does not match the code lengths"));
    }
    let mut last = 0u32;
    for c in 0..=chunks as usize {
        let o = u32_at(layout.offsets as usize + 4 * c)?;
        if (c == 0 && o != 0) || o < last {
            return Err(corrupt("chunk offsets"));
        }
        last = o;
    }
    if u64::from(last) != coded_len {
        return Err(corrupt("chunk offsets"));
    }
    Ok(Checked { elements, code, coded_len })
}

/// Encodes little-endian bf16 bytes, the chunks coded on up to `threads` threads.
pub fn encode_bf16(bytes: &[u8], threads: usize) -> Result<EncodedBf16, CodecError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(CodecError::OddLength(bytes.len()));
    }
    let elements = bytes.len() / 2;
    let chunk = CHUNK_ELEMENTS as usize;
    // Each thread takes a run of whole chunks.
    let per = elements.div_ceil(chunk).div_ceil(threads.max(1)).max(1) * chunk;
    let mut raw = vec![0u8; elements];
    let parts: Vec<(&[u8], &mut [u8])> = bytes.chunks(2 * per).zip(raw.chunks_mut(per)).collect();
    let histograms = in_parallel_mut(parts, threads, |(input, raw)| {
        // Four histograms, so that runs of one exponent do not wait on one counter.
        let mut h = [[0u64; 256]; 4];
        for (k, (e, r)) in input.chunks_exact(2).zip(raw.iter_mut()).enumerate() {
            let v = u16::from_le_bytes([e[0], e[1]]);
            h[k & 3][usize::from((v >> 7) as u8)] += 1;
            *r = (((v >> 15) as u8) << 7) | (v & 0x7f) as u8;
        }
        let mut sum = [0u64; 256];
        for (s, i) in sum.iter_mut().zip(0..) {
            *s = h[0][i] + h[1][i] + h[2][i] + h[3][i];
        }
        sum
    });
    let mut histogram = [0u64; 256];
    for h in &histograms {
        for (t, v) in histogram.iter_mut().zip(h) {
            *t += v;
        }
    }
    let elements = elements as u64;
    let code = Code::for_histogram(&histogram);
    if code.cost_bits(&histogram) / 8 + elements / u64::from(CHUNK_ELEMENTS) + 1
        > u64::from(u32::MAX)
    {
        return Err(CodecError::TooLarge(elements));
    }
    let codes: [(u16, u8); 256] = std::array::from_fn(|s| code.code(s as u8));
    let inputs: Vec<&[u8]> = bytes.chunks(2 * per).collect();
    // Per run: its coded chunks back to back, and where each chunk ends.
    let runs = in_parallel(&inputs, threads, |input| {
        let mut out = Vec::with_capacity(input.len() / 5);
        let mut ends = Vec::with_capacity(input.len().div_ceil(2 * chunk));
        for c in input.chunks(2 * chunk) {
            let mut w = BitWriter::new(&mut out);
            for e in c.chunks_exact(2) {
                let (bits, len) = codes[usize::from((u16::from_le_bytes([e[0], e[1]]) >> 7) as u8)];
                w.put(bits, len);
            }
            w.finish();
            ends.push(out.len() as u32);
        }
        (out, ends)
    });
    let mut coded = Vec::with_capacity(runs.iter().map(|(c, _)| c.len()).sum());
    let mut offsets = Vec::with_capacity(elements.div_ceil(u64::from(CHUNK_ELEMENTS)) as usize + 1);
    offsets.push(0);
    for (c, ends) in &runs {
        let base = coded.len() as u32;
        offsets.extend(ends.iter().map(|e| base + e));
        coded.extend_from_slice(c);
    }
    Ok(EncodedBf16 { elements, code, offsets, raw, coded })
}

/// Decodes into `dst` (exactly [`EncodedBf16::decoded_len`] bytes), the chunks on up to
/// `threads` threads. A chunk whose codes do not decode within its bytes is an error; `dst` is
/// then partly written.
pub fn decode_bf16(enc: &EncodedBf16, dst: &mut [u8], threads: usize) -> Result<(), CodecError> {
    if dst.len() as u64 != enc.decoded_len() {
        return Err(CodecError::Destination { expected: enc.decoded_len(), got: dst.len() });
    }
    let table = enc.code.decoding_table();
    let chunk = CHUNK_ELEMENTS as usize;
    let per = (enc.elements as usize).div_ceil(chunk).div_ceil(threads.max(1)).max(1) * chunk;
    let work: Vec<(usize, &mut [u8])> = dst.chunks_mut(2 * per).enumerate().collect();
    let results = in_parallel_mut(work, threads, |(part, out)| {
        let first = part * per / chunk;
        for (k, out) in out.chunks_mut(2 * chunk).enumerate() {
            let c = first + k;
            let coded = &enc.coded[enc.offsets[c] as usize..enc.offsets[c + 1] as usize];
            let raw = &enc.raw[c * chunk..];
            let mut r = BitReader::new(coded);
            for (i, (e, &b)) in out.chunks_exact_mut(2).zip(raw).enumerate() {
                let (symbol, len) = table[r.peek(u32::from(MAX_CODE_BITS)) as usize];
                if len == 0 {
                    return Err(corrupt(format!("chunk {c}: no code starts at element {i}")));
                }
                r.consume(u32::from(len));
                let v = (u16::from(b >> 7) << 15) | (u16::from(symbol) << 7) | u16::from(b & 0x7f);
                e.copy_from_slice(&v.to_le_bytes());
            }
            if r.overrun() {
                return Err(corrupt(format!("chunk {c}: codes run past its bytes")));
            }
        }
        Ok(())
    });
    results.into_iter().collect()
}

/// `f` over `items` on up to `threads` scoped threads, results in order.
fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let per = items.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = items
            .chunks(per)
            .map(|part| s.spawn(|| part.iter().map(&f).collect::<Vec<R>>()))
            .collect();
        parts.into_iter().flat_map(|h| h.join().expect("an encoding thread panicked")).collect()
    })
}

/// `f` over owned `items` on up to `threads` scoped threads, results in order.
fn in_parallel_mut<T: Send, R: Send>(
    mut items: Vec<T>,
    threads: usize,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let per = items.len().div_ceil(threads.max(1)).max(1);
    let mut parts = Vec::new();
    while !items.is_empty() {
        let rest = items.split_off(per.min(items.len()));
        parts.push(std::mem::replace(&mut items, rest));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|part| s.spawn(|| part.into_iter().map(&f).collect::<Vec<R>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a decoding thread panicked")).collect()
    })
}
