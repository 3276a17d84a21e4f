//! Device-side identifiers: ordinals, addresses, reservations, backings and streams.

use std::fmt;

/// A GPU's ordinal as the driver numbers it (`cuda:0` is ordinal 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceOrdinal(pub u32);

impl fmt::Display for DeviceOrdinal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.0)
    }
}

/// A device virtual address. It is only a number: dereferencing it is the adapter's business.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceAddress(pub u64);

impl DeviceAddress {
    /// The address `offset` bytes further on.
    pub const fn offset(self, offset: u64) -> DeviceAddress {
        DeviceAddress(self.0 + offset)
    }
}

/// A range of device virtual addresses `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceRange {
    /// First address of the range.
    pub start: DeviceAddress,
    /// Length in bytes.
    pub len: u64,
}

impl DeviceRange {
    /// One past the last address.
    pub const fn end(self) -> u64 {
        self.start.0 + self.len
    }

    /// Whether `other` lies entirely inside this range.
    pub const fn contains(self, other: DeviceRange) -> bool {
        other.start.0 >= self.start.0 && other.end() <= self.end()
    }

    /// The sub-range `[start + offset, start + offset + len)`, or `None` if it leaves this range.
    pub fn sub(self, offset: u64, len: u64) -> Option<DeviceRange> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(DeviceRange { start: self.start.offset(offset), len })
    }
}

/// A reserved span of device virtual addresses with no physical memory behind it yet.
///
/// A reservation is not residency: it costs no device memory until backing is mapped into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reservation {
    /// The reserved addresses.
    pub range: DeviceRange,
}

/// A handle to a piece of physical device memory created by a [`crate::Residency`] adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackingId(pub u64);

/// A stream (an in-order queue of device work) known to the adapter. Stream 0 is not special;
/// the ids an adapter hands out or accepts (for example PyTorch's current stream handle) are
/// documented by that adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

/// Device memory of a device other than the one computing (a peer GPU), or of the same device,
/// holding weight bytes the arena copies from: a weight store on the device side of the link.
/// Its addresses are only numbers to everything but the adapter that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerBuffer {
    /// The device whose memory holds the bytes.
    pub device: DeviceOrdinal,
    /// The buffer's addresses (in the adapter's address space).
    pub range: DeviceRange,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_ranges_stay_inside() {
        let r = DeviceRange { start: DeviceAddress(4096), len: 1024 };
        assert_eq!(r.sub(1000, 24).map(|s| s.end()), Some(4096 + 1024));
        assert_eq!(r.sub(1000, 25), None);
        assert_eq!(r.sub(u64::MAX, 2), None);
        assert!(r.contains(DeviceRange { start: DeviceAddress(4096), len: 1024 }));
        assert!(!r.contains(DeviceRange { start: DeviceAddress(4095), len: 2 }));
    }
}
