//! Byte quantities.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One kibibyte (1024 bytes).
pub const KIB: u64 = 1024;
/// One mebibyte.
pub const MIB: u64 = 1024 * KIB;
/// One gibibyte. Every `*_gb` setting in ddo is in GiB (1024³ bytes).
pub const GIB: u64 = 1024 * MIB;

/// A number of bytes. Displays in the largest binary unit that keeps it readable.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Zero bytes.
    pub const ZERO: ByteSize = ByteSize(0);

    /// The size in bytes.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Converts a finite, non-negative GiB value (as users write budgets) to bytes, rounding down
    /// to a whole byte. Returns `None` for negative, NaN or infinite input, or a value that does
    /// not fit in 64 bits.
    pub fn from_gib(gib: f64) -> Option<ByteSize> {
        if !gib.is_finite() || gib < 0.0 {
            return None;
        }
        let bytes = gib * GIB as f64;
        (bytes < u64::MAX as f64).then_some(ByteSize(bytes as u64))
    }

    /// The size in GiB.
    pub fn as_gib(self) -> f64 {
        self.0 as f64 / GIB as f64
    }

    /// Rounds up to a multiple of `align` (a power of two or any non-zero value).
    pub fn align_up(self, align: u64) -> ByteSize {
        assert!(align > 0, "alignment must be non-zero");
        ByteSize(self.0.div_ceil(align) * align)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= GIB {
            write!(f, "{:.2} GiB", b as f64 / GIB as f64)
        } else if b >= MIB {
            write!(f, "{:.2} MiB", b as f64 / MIB as f64)
        } else if b >= KIB {
            write!(f, "{:.2} KiB", b as f64 / KIB as f64)
        } else {
            write!(f, "{b} B")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gib_conversion_refuses_non_finite_and_negative() {
        assert_eq!(ByteSize::from_gib(1.5), Some(ByteSize(3 * GIB / 2)));
        assert_eq!(ByteSize::from_gib(-0.1), None);
        assert_eq!(ByteSize::from_gib(f64::NAN), None);
        assert_eq!(ByteSize::from_gib(f64::INFINITY), None);
        assert_eq!(ByteSize::from_gib(1e30), None);
    }

    #[test]
    fn display_and_alignment() {
        assert_eq!(ByteSize(512).to_string(), "512 B");
        assert_eq!(ByteSize(3 * MIB).to_string(), "3.00 MiB");
        assert_eq!(ByteSize(5 * GIB / 2).to_string(), "2.50 GiB");
        assert_eq!(ByteSize(1).align_up(256), ByteSize(256));
        assert_eq!(ByteSize(512).align_up(256), ByteSize(512));
    }
}
