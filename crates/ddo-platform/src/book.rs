//! Address bookkeeping shared by the device adapters: every range, backing and mapping a caller
//! hands in is checked here before it reaches the driver or raw memory, which is what lets the
//! ports be safe to call.

use std::collections::{BTreeMap, HashMap};

use ddo_core::{BackingId, DeviceError, DeviceRange};

fn invalid(message: String) -> DeviceError {
    DeviceError::InvalidUse(message)
}

/// Live reservations, backings and mappings of one device.
#[derive(Debug, Default)]
pub(crate) struct AddressBook {
    reservations: BTreeMap<u64, u64>,
    backings: HashMap<BackingId, u64>,
    mappings: BTreeMap<u64, (u64, BackingId)>,
}

impl AddressBook {
    /// `value` must be a positive multiple of `granularity`.
    pub(crate) fn check_aligned(
        granularity: u64,
        what: &str,
        value: u64,
    ) -> Result<(), DeviceError> {
        if value == 0 || !value.is_multiple_of(granularity) {
            return Err(invalid(format!(
                "{what} {value} is not a positive multiple of the {granularity}-byte granularity"
            )));
        }
        Ok(())
    }

    /// A copy or read between `host` and `device` bytes must have one length.
    pub(crate) fn check_lengths(what: &str, host: usize, device: u64) -> Result<(), DeviceError> {
        if host as u64 != device {
            return Err(invalid(format!("{what} of {host} host bytes and {device} device bytes")));
        }
        Ok(())
    }

    /// Checks a conversion's ranges: a pair [`ddo_core::convertible`] names, the same number of
    /// elements on both sides, no overlap, both inside mappings. Returns the element count.
    pub(crate) fn check_conversion(
        &self,
        src: DeviceRange,
        from: ddo_core::Dtype,
        dst: DeviceRange,
        to: ddo_core::Dtype,
    ) -> Result<u64, DeviceError> {
        if !ddo_core::convertible(from, to) {
            return Err(invalid(format!(
                "no conversion from {} to {}",
                from.as_str(),
                to.as_str()
            )));
        }
        let n = src.len / from.size_bytes();
        if src.len != n * from.size_bytes() || dst.len != n.saturating_mul(to.size_bytes()) {
            return Err(invalid(format!(
                "{} {} bytes do not convert into {} {} bytes",
                src.len,
                from.as_str(),
                dst.len,
                to.as_str()
            )));
        }
        if src.start.0 < dst.end() && dst.start.0 < src.end() {
            return Err(invalid("a conversion's source and destination overlap".into()));
        }
        self.check_mapped(src)?;
        self.check_mapped(dst)?;
        Ok(n)
    }

    /// Checks a decoding's ranges ([`ddo_core::Transforms::decode`]): a destination of whole
    /// bf16 elements at an even address, an encoding starting 4-byte aligned and at least as
    /// long as the fixed parts of the layout for that many elements, no overlap, both inside
    /// mappings. Returns the elements and the bytes of the encoding past its fixed parts (where
    /// its coded exponents lie).
    pub(crate) fn check_decode(
        &self,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<(u64, u64), DeviceError> {
        if !dst.len.is_multiple_of(2) || !dst.start.0.is_multiple_of(2) {
            return Err(invalid(format!(
                "a decoding's destination of {} bytes at {:#x} is not whole 2-byte-aligned bf16 \
                 elements",
                dst.len, dst.start.0
            )));
        }
        if !src.start.0.is_multiple_of(4) {
            return Err(invalid(format!(
                "an encoding at {:#x} does not start 4-byte aligned",
                src.start.0
            )));
        }
        let elements = dst.len / 2;
        let fixed = ddo_codec::Layout::of(elements).coded;
        if src.len < fixed {
            return Err(invalid(format!(
                "an encoding of {elements} bf16 elements takes at least {fixed} bytes; the \
                 source has {}",
                src.len
            )));
        }
        if src.start.0 < dst.end() && dst.start.0 < src.end() {
            return Err(invalid("a decoding's source and destination overlap".into()));
        }
        self.check_mapped(src)?;
        self.check_mapped(dst)?;
        Ok((elements, src.len - fixed))
    }

    pub(crate) fn add_reservation(&mut self, start: u64, len: u64) {
        self.reservations.insert(start, len);
    }

    /// Checks that `range` is a whole live reservation with nothing mapped in it.
    pub(crate) fn check_release_reservation(&self, range: DeviceRange) -> Result<(), DeviceError> {
        if self.reservations.get(&range.start.0) != Some(&range.len) {
            return Err(invalid(format!(
                "no reservation of {} bytes at {:#x}",
                range.len, range.start.0
            )));
        }
        if self.mappings.range(range.start.0..range.end()).next().is_some() {
            return Err(invalid("a reservation with live mappings cannot be released".into()));
        }
        Ok(())
    }

    pub(crate) fn remove_reservation(&mut self, start: u64) {
        self.reservations.remove(&start);
    }

    pub(crate) fn add_backing(&mut self, id: BackingId, len: u64) {
        self.backings.insert(id, len);
    }

    /// Checks that `range` is an aligned, unmapped part of a reservation and that `backing` is
    /// live with the same length.
    pub(crate) fn check_map(
        &self,
        range: DeviceRange,
        backing: BackingId,
        granularity: u64,
    ) -> Result<(), DeviceError> {
        Self::check_aligned(granularity, "mapping length", range.len)?;
        let inside = self
            .reservations
            .range(..=range.start.0)
            .next_back()
            .is_some_and(|(&s, &len)| range.end() <= s + len);
        if !inside || !range.start.0.is_multiple_of(granularity) {
            return Err(invalid(format!(
                "{} bytes at {:#x} are not an aligned part of a reservation",
                range.len, range.start.0
            )));
        }
        if self
            .mappings
            .range(..range.end())
            .next_back()
            .is_some_and(|(&s, &(l, _))| s + l > range.start.0)
        {
            return Err(invalid(format!("{:#x} is already mapped", range.start.0)));
        }
        match self.backings.get(&backing) {
            Some(&len) if len == range.len => Ok(()),
            Some(&len) => {
                Err(invalid(format!("backing of {len} bytes mapped over {} bytes", range.len)))
            }
            None => Err(invalid(format!("no backing {backing:?}"))),
        }
    }

    pub(crate) fn add_mapping(&mut self, range: DeviceRange, backing: BackingId) {
        self.mappings.insert(range.start.0, (range.len, backing));
    }

    /// Checks that `range` is exactly one mapping.
    pub(crate) fn check_unmap(&self, range: DeviceRange) -> Result<(), DeviceError> {
        match self.mappings.get(&range.start.0) {
            Some(&(len, _)) if len == range.len => Ok(()),
            _ => Err(invalid(format!(
                "{} bytes at {:#x} are not one mapping",
                range.len, range.start.0
            ))),
        }
    }

    pub(crate) fn remove_mapping(&mut self, start: u64) {
        self.mappings.remove(&start);
    }

    /// Checks that `backing` is live and mapped nowhere; returns its length.
    pub(crate) fn check_release_backing(&self, backing: BackingId) -> Result<u64, DeviceError> {
        if self.mappings.values().any(|&(_, b)| b == backing) {
            return Err(invalid(format!("backing {backing:?} is still mapped")));
        }
        self.backings
            .get(&backing)
            .copied()
            .ok_or_else(|| invalid(format!("no backing {backing:?}")))
    }

    pub(crate) fn remove_backing(&mut self, backing: BackingId) {
        self.backings.remove(&backing);
    }

    /// Checks that `range` lies inside one mapping.
    pub(crate) fn check_mapped(&self, range: DeviceRange) -> Result<(), DeviceError> {
        match self.mappings.range(..=range.start.0).next_back() {
            Some((&s, &(len, _))) if range.end() <= s + len => Ok(()),
            _ => Err(invalid(format!(
                "{} bytes at {:#x} are not inside one mapped range",
                range.len, range.start.0
            ))),
        }
    }

    /// Live mappings, reservations and backings, for teardown.
    #[cfg(feature = "cuda")]
    pub(crate) fn mappings(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.mappings.iter().map(|(&s, &(l, _))| (s, l))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn reservations(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.reservations.iter().map(|(&s, &l)| (s, l))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn backings(&self) -> impl Iterator<Item = BackingId> + '_ {
        self.backings.keys().copied()
    }
}
