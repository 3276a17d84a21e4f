//! Host memory handed to device copies and registrations.

use std::fmt;
use std::sync::Arc;

/// A span of host memory that stays valid and unchanged for as long as any `Arc` to it lives:
/// a mapped checkpoint file, a retained buffer, a staging buffer.
///
/// Ports that copy asynchronously keep an `Arc` of the region until the copy is proven complete,
/// so a region can never be freed under a copy in flight. [`HostBytes`] is the safe owned one.
///
/// # Safety
///
/// Devices read the bytes behind the returned address after `bytes` returns: asynchronous
/// copies and page-locked registrations keep the raw address. An implementor promises that
/// `bytes` returns the same address and length on every call, and that the memory stays
/// allocated, readable and unchanged for as long as the value lives. Safe code cannot make that
/// promise:
///
/// ```compile_fail
/// #[derive(Debug)]
/// struct Mine(Vec<u8>);
/// impl ddo_core::HostRegion for Mine {
///     fn bytes(&self) -> &[u8] {
///         &self.0
///     }
/// }
/// ```
#[allow(unsafe_code)]
pub unsafe trait HostRegion: Send + Sync + fmt::Debug {
    /// The region's bytes. The same address and length on every call.
    fn bytes(&self) -> &[u8];
}

/// Bytes owned on the heap: a [`HostRegion`] whose memory never moves or changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBytes(Box<[u8]>);

impl From<Vec<u8>> for HostBytes {
    fn from(bytes: Vec<u8>) -> Self {
        HostBytes(bytes.into_boxed_slice())
    }
}

// SAFETY: the boxed slice is owned and only lent immutably: its address, length and contents
// stay the same until it is dropped.
#[allow(unsafe_code)]
unsafe impl HostRegion for HostBytes {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A sub-range of a [`HostRegion`], sharing ownership of the region.
#[derive(Clone, Debug)]
pub struct HostSlice {
    region: Arc<dyn HostRegion>,
    offset: usize,
    len: usize,
}

impl HostSlice {
    /// The sub-range `[offset, offset + len)` of `region`, or `None` if it leaves the region.
    pub fn new(region: Arc<dyn HostRegion>, offset: usize, len: usize) -> Option<HostSlice> {
        let end = offset.checked_add(len)?;
        (end <= region.bytes().len()).then_some(HostSlice { region, offset, len })
    }

    /// The whole region.
    pub fn whole(region: Arc<dyn HostRegion>) -> HostSlice {
        let len = region.bytes().len();
        HostSlice { region, offset: 0, len }
    }

    /// The sub-range `[offset, offset + len)` of this slice, sharing its region, or `None` if it
    /// leaves the slice.
    pub fn slice(&self, offset: usize, len: usize) -> Option<HostSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| HostSlice {
            region: Arc::clone(&self.region),
            offset: self.offset + offset,
            len,
        })
    }

    /// The bytes of the slice.
    pub fn as_bytes(&self) -> &[u8] {
        &self.region.bytes()[self.offset..self.offset + self.len]
    }

    /// Where the slice starts in its region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region the slice belongs to.
    pub fn region(&self) -> &Arc<dyn HostRegion> {
        &self.region
    }
}

/// Proof that a host range is registered (page-locked) for device DMA. Returned by
/// [`crate::HostRegistration::register_host`] and consumed by [`crate::HostRegistration::unregister_host`].
/// It holds the region, and so does the device until the registration is undone (or for good
/// when undoing it fails): registered memory is never freed while registered, whatever happens
/// to this value.
#[derive(Debug)]
pub struct Registration {
    /// The registered bytes.
    pub slice: HostSlice,
    /// Adapter-specific handle.
    pub handle: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_bounded_by_their_region() {
        let region: Arc<dyn HostRegion> = Arc::new(HostBytes::from(vec![1, 2, 3, 4]));
        let s = HostSlice::new(region.clone(), 1, 2).unwrap();
        assert_eq!(s.as_bytes(), &[2, 3]);
        assert!(HostSlice::new(region.clone(), 3, 2).is_none());
        assert!(HostSlice::new(region.clone(), usize::MAX, 2).is_none());
        let whole = HostSlice::whole(region);
        assert_eq!(whole.len(), 4);
        let inner = s.slice(1, 1).unwrap();
        assert_eq!(inner.as_bytes(), &[3]);
        assert!(s.slice(1, 2).is_none(), "leaves the slice");
        assert_eq!(whole.slice(3, 1).unwrap().as_bytes(), &[4]);
    }
}
