//! Canonical Huffman codes over byte symbols, limited in length.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The longest code: a decoder resolves any code with one lookup in `2^MAX_CODE_BITS` entries.
pub const MAX_CODE_BITS: u8 = 12;

/// A canonical prefix code over the 256 byte values: each symbol's code length (0: the symbol
/// does not occur) and, from the lengths alone, its code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    lengths: [u8; 256],
    codes: [u16; 256],
}

impl Code {
    /// The shortest code for `histogram` (occurrences per symbol) whose lengths stay within
    /// [`MAX_CODE_BITS`]. A single occurring symbol gets a 1-bit code; no occurring symbol, an
    /// empty code.
    pub fn for_histogram(histogram: &[u64; 256]) -> Code {
        let mut symbols: Vec<(u64, u8)> = (0..=255u8)
            .filter(|&s| histogram[s as usize] > 0)
            .map(|s| (histogram[s as usize], s))
            .collect();
        let mut lengths = [0u8; 256];
        match symbols.len() {
            0 => {}
            1 => lengths[symbols[0].1 as usize] = 1,
            _ => {
                let depths = huffman_depths(&symbols);
                let counts = limit(&depths, MAX_CODE_BITS);
                // Most frequent symbols take the shortest lengths (ties by symbol: deterministic).
                symbols.sort_by_key(|&(n, s)| (Reverse(n), s));
                let mut next = symbols.iter();
                for (len, &count) in counts.iter().enumerate() {
                    for _ in 0..count {
                        let (_, s) = next.next().expect("one length per symbol");
                        lengths[*s as usize] = len as u8;
                    }
                }
            }
        }
        Code::from_lengths(lengths).expect("the lengths built satisfy the Kraft inequality")
    }

    /// The canonical code with these lengths, or `None` when they are longer than
    /// [`MAX_CODE_BITS`] or oversubscribe the code space (no prefix code has them).
    pub fn from_lengths(lengths: [u8; 256]) -> Option<Code> {
        if lengths.iter().any(|&l| l > MAX_CODE_BITS) {
            return None;
        }
        let mut count = [0u32; MAX_CODE_BITS as usize + 1];
        for &l in &lengths {
            count[l as usize] += 1;
        }
        count[0] = 0;
        // Kraft: the codes of each length fit the space the shorter ones leave.
        let mut space: i64 = 1;
        for &c in &count[1..] {
            space = space * 2 - i64::from(c);
            if space < 0 {
                return None;
            }
        }
        let mut first = [0u16; MAX_CODE_BITS as usize + 2];
        let mut code = 0u32;
        for len in 1..=MAX_CODE_BITS as usize {
            code = (code + count[len - 1]) << 1;
            first[len] = code as u16;
        }
        let mut codes = [0u16; 256];
        for s in 0..256 {
            let l = lengths[s] as usize;
            if l > 0 {
                codes[s] = first[l];
                first[l] += 1;
            }
        }
        Some(Code { lengths, codes })
    }

    /// Each symbol's code length (0: absent).
    pub fn lengths(&self) -> &[u8; 256] {
        &self.lengths
    }

    /// `(code, length)` of `symbol`; length 0 when the symbol has no code.
    pub fn code(&self, symbol: u8) -> (u16, u8) {
        (self.codes[symbol as usize], self.lengths[symbol as usize])
    }

    /// The decoding table: for every `MAX_CODE_BITS`-bit window, `(symbol, length)` of the code
    /// it starts with; length 0 where no code starts (corrupt input).
    pub fn decoding_table(&self) -> Vec<(u8, u8)> {
        let bits = MAX_CODE_BITS as u32;
        let mut table = vec![(0u8, 0u8); 1 << bits];
        for s in 0..256usize {
            let l = u32::from(self.lengths[s]);
            if l == 0 {
                continue;
            }
            let start = (u32::from(self.codes[s]) << (bits - l)) as usize;
            for entry in &mut table[start..start + (1 << (bits - l))] {
                *entry = (s as u8, l as u8);
            }
        }
        table
    }

    /// Bits the code spends on `histogram`.
    pub fn cost_bits(&self, histogram: &[u64; 256]) -> u64 {
        (0..256).map(|s| histogram[s] * u64::from(self.lengths[s])).sum()
    }
}

/// Unlimited Huffman code lengths, indexed like `symbols` (at least two).
fn huffman_depths(symbols: &[(u64, u8)]) -> Vec<u32> {
    // Nodes: leaves first, then merged nodes; parent links give each leaf's depth.
    let n = symbols.len();
    let mut parent = vec![usize::MAX; 2 * n - 1];
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> =
        symbols.iter().enumerate().map(|(i, &(f, _))| Reverse((f, i))).collect();
    let mut next = n;
    while heap.len() > 1 {
        let Reverse((fa, a)) = heap.pop().expect("two nodes");
        let Reverse((fb, b)) = heap.pop().expect("two nodes");
        parent[a] = next;
        parent[b] = next;
        heap.push(Reverse((fa.saturating_add(fb), next)));
        next += 1;
    }
    (0..n)
        .map(|leaf| {
            let (mut depth, mut at) = (0, leaf);
            while parent[at] != usize::MAX {
                at = parent[at];
                depth += 1;
            }
            depth
        })
        .collect()
}

/// How many codes of each length (index = length) when `depths` are cut to `max` bits, keeping
/// a prefix code: each code that is too long moves up next to a shorter code that splits.
fn limit(depths: &[u32], max: u8) -> Vec<u32> {
    let deepest = depths.iter().copied().max().unwrap_or(0) as usize;
    let mut count = vec![0u32; deepest.max(max as usize) + 1];
    for &d in depths {
        count[d as usize] += 1;
    }
    for i in (max as usize + 1..count.len()).rev() {
        while count[i] > 0 {
            let mut j = i - 2;
            while count[j] == 0 {
                j -= 1;
            }
            count[i] -= 2;
            count[i - 1] += 1;
            count[j + 1] += 2;
            count[j] -= 1;
        }
    }
    count.truncate(max as usize + 1);
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skewed_histograms_stay_within_the_length_limit_and_stay_prefix_free() {
        // Fibonacci frequencies give the deepest unlimited Huffman trees.
        let mut h = [0u64; 256];
        let (mut a, mut b) = (1u64, 1u64);
        for s in h.iter_mut().take(40) {
            *s = a;
            (a, b) = (b, a + b);
        }
        let code = Code::for_histogram(&h);
        assert!(code.lengths().iter().all(|&l| l <= MAX_CODE_BITS));
        assert_eq!(code.lengths().iter().filter(|&&l| l > 0).count(), 40);
        assert!(Code::from_lengths(*code.lengths()).is_some());
    }

    #[test]
    fn one_symbol_gets_one_bit_and_none_gets_an_empty_code() {
        let mut h = [0u64; 256];
        h[127] = 10;
        assert_eq!(Code::for_histogram(&h).code(127), (0, 1));
        assert!(Code::for_histogram(&[0; 256]).lengths().iter().all(|&l| l == 0));
    }

    #[test]
    fn oversubscribed_lengths_are_refused() {
        let mut lengths = [0u8; 256];
        lengths[..3].fill(1);
        assert!(Code::from_lengths(lengths).is_none());
        lengths[0] = 13;
        assert!(Code::from_lengths(lengths).is_none());
    }

    #[test]
    fn a_skewed_histogram_costs_close_to_its_entropy() {
        let mut h = [0u64; 256];
        for (i, s) in h.iter_mut().enumerate().take(16) {
            *s = 1 << (16 - i);
        }
        let total: u64 = h.iter().sum();
        let entropy: f64 = h
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| {
                let p = n as f64 / total as f64;
                -p * p.log2() * total as f64
            })
            .sum();
        let cost = Code::for_histogram(&h).cost_bits(&h) as f64;
        assert!(cost >= entropy && cost < entropy * 1.05, "{cost} bits for {entropy}");
    }
}
