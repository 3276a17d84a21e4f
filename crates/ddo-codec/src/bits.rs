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

    /// Appends the low `len` bits of `code` (`len` <= 16).
    pub(crate) fn put(&mut self, code: u16, len: u8) {
        self.acc = (self.acc << len) | u64::from(code);
        self.filled += u32::from(len);
        while self.filled >= 8 {
            self.filled -= 8;
            self.out.push((self.acc >> self.filled) as u8);
        }
    }

    /// Pads the last byte with zeros.
    pub(crate) fn finish(self) {
        if self.filled > 0 {
            self.out.push((self.acc << (8 - self.filled)) as u8);
        }
    }
}

/// Reads windows of bits from a byte slice, most significant bit first; past its end it reads
/// zeros, and [`BitReader::overrun`] says whether a consumed bit lay there.
pub(crate) struct BitReader<'a> {
    bytes: &'a [u8],
    /// Position in bits.
    at: u64,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        BitReader { bytes, at: 0 }
    }

    /// The next `n` bits (`n` <= 16) without consuming them.
    pub(crate) fn peek(&self, n: u32) -> u32 {
        let byte = (self.at / 8) as usize;
        let mut window = 0u32;
        for k in 0..3 {
            window = (window << 8) | u32::from(self.bytes.get(byte + k).copied().unwrap_or(0));
        }
        let skip = (self.at % 8) as u32;
        (window << skip >> (24 - n)) & ((1 << n) - 1)
    }

    pub(crate) fn consume(&mut self, n: u32) {
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
