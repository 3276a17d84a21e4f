//! Building an arena (layout, plan, one address reservation, resident and slot backings mapped)
//! and tearing down what it holds, once, in reverse order of creation.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use ddo_core::{DeviceRange, Platform, Reservation, SlotId, StreamId, UnitId, WeightSource};

use super::Arena;
use super::state::State;
use crate::error::device;
use crate::{ArenaError, Budget, Layout, ResidencyPlan, UnitSpec};

/// Identities of arenas, so a lease is only ever given back to its own arena.
static NEXT_ARENA: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Arena {
    /// Builds an arena over `source` for `units` under `budget`: lays the units out, plans
    /// residency, reserves one address range, creates resident and slot backings and maps them.
    /// Nothing is uploaded yet (the first acquisition or prefetch does it).
    ///
    /// On failure everything created is released once, and the original error is returned with
    /// any cleanup error attached.
    pub fn new(
        platform: &Platform,
        source: Arc<dyn WeightSource>,
        units: &[UnitSpec],
        budget: Budget,
    ) -> Result<Arena, ArenaError> {
        Self::with_conversions(platform, source, units, budget, &HashMap::new())
    }

    /// As [`Arena::new`], with the tensors of `conversions` (slice -> dtype) uploaded in their
    /// stored dtype and converted on the device ([`Residency::convert`]) before their upload's
    /// fence: a unit holds their stored bytes and their converted elements.
    ///
    /// Every other tensor the source holds encoded ([`WeightSource::encoding`]) uploads its
    /// encoding and is decoded on the device ([`Residency::decode`]) before its fence, when the
    /// device decodes; otherwise it uploads as its own bytes.
    ///
    /// [`Residency::convert`]: ddo_core::Transforms::convert
    /// [`Residency::decode`]: ddo_core::Transforms::decode
    pub fn with_conversions(
        platform: &Platform,
        source: Arc<dyn WeightSource>,
        units: &[UnitSpec],
        budget: Budget,
        conversions: &HashMap<usize, ddo_core::Dtype>,
    ) -> Result<Arena, ArenaError> {
        let residency = &platform.residency;
        let granularity =
            residency.granularity().map_err(device("query the mapping granularity"))?;
        let mut encodings: HashMap<usize, ddo_core::FileRange> = units
            .iter()
            .flat_map(|u| &u.tensors)
            .filter(|t| !conversions.contains_key(t))
            .filter_map(|&t| Some((t, source.encoding(t)?)))
            .collect();
        // Asked only of a source with encodings: they upload as their tensors' own bytes on a
        // device that does not decode.
        if !encodings.is_empty() && !residency.decodes() {
            encodings.clear();
        }
        let mut layout =
            Layout::build_staged(source.slices(), units, granularity, conversions, &encodings)?;
        let plan = ResidencyPlan::new(&layout, budget)?;
        let streamed: Vec<bool> = plan.resident.iter().map(|r| !r).collect();
        layout.place(plan.slot_len, &streamed);
        let reservation =
            residency.reserve(layout.reserved).map_err(device("reserve device addresses"))?;
        let mut state = State::new(layout.units.len(), plan.slots);
        let arena_parts = (platform.clone(), source, layout, plan, reservation);
        let setup = Self::setup(&arena_parts, &mut state);
        let (platform, source, layout, plan, reservation) = arena_parts;
        let (copy_stream, convert_stream) = match setup {
            Ok(streams) => streams,
            Err(error) => {
                let cleanup =
                    Self::teardown(&platform, &layout, plan.slot_len, reservation, &mut state);
                return Err(match cleanup {
                    Ok(()) => error,
                    Err(c) => {
                        ArenaError::WithCleanup { error: Box::new(error), cleanup: Box::new(c) }
                    }
                });
            }
        };
        let attach_order = (0..layout.units.len() as u32).map(UnitId).collect();
        Ok(Arena {
            id: NEXT_ARENA.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            platform,
            source,
            layout,
            plan,
            reservation,
            copy_stream,
            convert_stream,
            attach_order,
            state: Mutex::new(state),
            changed: Condvar::new(),
        })
    }

    fn setup(
        (platform, _, layout, plan, reservation): &(
            Platform,
            Arc<dyn WeightSource>,
            Layout,
            ResidencyPlan,
            Reservation,
        ),
        state: &mut State,
    ) -> Result<(StreamId, Option<StreamId>), ArenaError> {
        let residency = &platform.residency;
        let range_of = |u: &crate::UnitLayout| DeviceRange {
            start: reservation.range.start.offset(u.offset),
            len: u.len,
        };
        for (i, u) in layout.units.iter().enumerate() {
            if !plan.resident[i] {
                continue;
            }
            let b =
                residency.create_backing(u.len).map_err(device("create resident unit memory"))?;
            state.residents[i].backing = Some(b);
            residency.map(range_of(u), b).map_err(device("map resident unit memory"))?;
            state.residents[i].mapped = true;
            state.stats.resident_bytes += u.len;
        }
        if layout.staging_len > 0 {
            let len = layout.staging_len;
            let b = residency.create_backing(len).map_err(device("create the staging buffer"))?;
            state.staging.0 = Some(b);
            let range =
                DeviceRange { start: reservation.range.start.offset(layout.staging_offset), len };
            residency.map(range, b).map_err(device("map the staging buffer"))?;
            state.staging.1 = true;
            state.stats.resident_bytes += len;
        }
        for s in 0..plan.slots as usize {
            Self::create_slot_backing(platform, layout, plan, reservation, state, s)?;
        }
        state.stats.peak_bytes = state.stats.resident_bytes + state.stats.slot_bytes;
        let copy = residency.create_stream().map_err(device("create the copy stream"))?;
        let convert = match layout.staging_len {
            0 => None,
            _ => match residency.create_stream() {
                Ok(s) => Some(s),
                Err(e) => {
                    // Nothing was enqueued on the copy stream yet.
                    let _ = residency.release_stream(copy);
                    return Err(device("create the conversion stream")(e));
                }
            },
        };
        Ok((copy, convert))
    }

    pub(super) fn create_slot_backing(
        platform: &Platform,
        layout: &Layout,
        plan: &ResidencyPlan,
        reservation: &Reservation,
        state: &mut State,
        s: usize,
    ) -> Result<(), ArenaError> {
        let residency = &platform.residency;
        let b = residency.create_backing(plan.slot_len).map_err(device("create slot memory"))?;
        state.slots[s].backing = Some(b);
        state.stats.slot_bytes += plan.slot_len;
        state.stats.peak_bytes =
            state.stats.peak_bytes.max(state.stats.resident_bytes + state.stats.slot_bytes);
        for (i, u) in layout.units.iter().enumerate() {
            if plan.slot_of[i] != Some(SlotId(s as u32)) {
                continue;
            }
            let range =
                DeviceRange { start: reservation.range.start.offset(u.offset), len: plan.slot_len };
            residency.map(range, b).map_err(device("map slot memory"))?;
            state.slots[s].mapped.push(UnitId(i as u32));
        }
        Ok(())
    }

    /// Releases everything in `state`, in reverse order of creation. Stops at the first failure
    /// and marks what is left unsafe (kept, never freed).
    pub(super) fn teardown(
        platform: &Platform,
        layout: &Layout,
        slot_len: u64,
        reservation: Reservation,
        state: &mut State,
    ) -> Result<(), ArenaError> {
        let residency = &platform.residency;
        let start = reservation.range.start;
        for s in state.slots.iter_mut() {
            let Some(b) = s.backing else { continue };
            while let Some(&u) = s.mapped.last() {
                let unit = &layout.units[u.0 as usize];
                if let Err(e) =
                    residency.unmap(DeviceRange { start: start.offset(unit.offset), len: slot_len })
                {
                    s.holder.unsafe_ = true;
                    return Err(device("unmap slot memory")(e));
                }
                s.mapped.pop();
            }
            if let Err(e) = residency.release_backing(b) {
                s.holder.unsafe_ = true;
                return Err(device("release slot memory")(e));
            }
            s.backing = None;
        }
        if let (Some(b), mapped) = state.staging {
            let range =
                DeviceRange { start: start.offset(layout.staging_offset), len: layout.staging_len };
            if mapped {
                residency.unmap(range).map_err(device("unmap the staging buffer"))?;
                state.staging.1 = false;
            }
            residency.release_backing(b).map_err(device("release the staging buffer"))?;
            state.staging.0 = None;
        }
        for (i, r) in state.residents.iter_mut().enumerate() {
            let unit = &layout.units[i];
            if r.mapped {
                if let Err(e) =
                    residency.unmap(DeviceRange { start: start.offset(unit.offset), len: unit.len })
                {
                    r.holder.unsafe_ = true;
                    return Err(device("unmap resident unit memory")(e));
                }
                r.mapped = false;
            }
            if let Some(b) = r.backing {
                if let Err(e) = residency.release_backing(b) {
                    r.holder.unsafe_ = true;
                    return Err(device("release resident unit memory")(e));
                }
                r.backing = None;
            }
        }
        residency.release_reservation(reservation).map_err(device("release device addresses"))
    }
}
