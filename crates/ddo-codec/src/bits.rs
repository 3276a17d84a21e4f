//! Bit streams, most significant bit first.

/// Appends codes to a byte vector, most significant bit first.
pub(crate) struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    filled: u32,
}

impl<'a> BitWriter<'a> {
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter { out, acc: 0, filled: 0 }
    }

    /// Appends the low `len` bits of `code` (`len` <= 16), four bytes at a time.
    #[inline]
    pub(crate) fn put(&mut self, code: u16, len: u8) {
        self.acc = (self.acc << len) | u64::from(code);
        self.filled += u32::from(len);
        if self.filled >= 32 {
            self.filled -= 32;
            self.out.extend_from_slice(&((self.acc >> self.filled) as u32).to_be_bytes());
        }
    }

    /// Writes the bits still held, the last byte padded with zeros.
    pub(crate) fn finish(mut self) {
        while self.filled >= 8 {
            self.filled -= 8;
            self.out.push((self.acc >> self.filled) as u8);
        }
        if self.filled > 0 {
            self.out.push((self.acc << (8 - self.filled)) as u8);
        }
    }
}

/// Reads windows of bits from a byte slice, most significant bit first, through a 64-bit
/// buffer; past its end it reads zeros, and [`BitReader::overrun`] says whether a consumed bit
/// lay there.
pub(crate) struct BitReader<'a> {
    bytes: &'a [u8],
    /// The next byte to load.
    next: usize,
    /// Bits loaded and not consumed, left-aligned.
    buf: u64,
    /// How many of them.
    held: u32,
    /// Bits consumed.
    at: u64,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        BitReader { bytes, next: 0, buf: 0, held: 0, at: 0 }
    }

    /// The next `n` bits (1 <= `n` <= 32) without consuming them.
    #[inline]
    pub(crate) fn peek(&mut self, n: u32) -> u32 {
        if self.held < n {
            self.refill();
        }
        (self.buf >> (64 - n)) as u32
    }

    /// Loads whole bytes until more than 56 bits are held (zeros past the end). Below the bits
    /// held, the buffer may hold the first bits of the next byte: the stream's own, so a later
    /// load writes the same bits over them.
    #[inline]
    fn refill(&mut self) {
        if let Some(word) = self.bytes.get(self.next..self.next + 8) {
            let word = u64::from_be_bytes(word.try_into().expect("8 bytes"));
            self.buf |= word >> self.held;
            let take = (64 - self.held) / 8;
            self.next += take as usize;
            self.held += 8 * take;
            return;
        }
        while self.held <= 56 {
            let byte = self.bytes.get(self.next).copied().unwrap_or(0);
            self.buf |= u64::from(byte) << (56 - self.held);
            self.next += 1;
            self.held += 8;
        }
    }

    #[inline]
    pub(crate) fn consume(&mut self, n: u32) {
        self.buf <<= n;
        self.held -= n;
        self.at += u64::from(n);
    }

    /// Whether a consumed bit lay past the end of the bytes.
    pub(crate) fn overrun(&self) -> bool {
        self.at > self.bytes.len() as u64 * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_read_back_as_written() {
        let items = [(0b1u16, 1u8), (0b0110, 4), (0xabc, 12), (0, 3), (0b11, 2)];
        let mut out = Vec::new();
        let mut w = BitWriter::new(&mut out);
        for (c, l) in items {
            w.put(c, l);
        }
        w.finish();
        assert_eq!(out.len(), 3);
        let mut r = BitReader::new(&out);
        for (c, l) in items {
            assert_eq!(r.peek(u32::from(l)), u32::from(c));
            r.consume(u32::from(l));
        }
        assert!(!r.overrun());
        r.consume(8);
        assert!(r.overrun());
    }
}
