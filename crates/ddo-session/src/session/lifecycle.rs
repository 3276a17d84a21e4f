//! Reclaim, unload, reload and close.

use std::sync::Arc;

use ddo_arena::ReclaimReport;

use super::ComponentSession;
use crate::SessionError;

impl ComponentSession {
    /// Releases the memory of idle execution slots (addresses kept; the next use uploads again).
    pub fn reclaim(&self) -> Result<ReclaimReport, SessionError> {
        let mut g = self.lock();
        Ok(Self::attached(&mut g)?.memory.arena.reclaim_idle()?)
    }

    /// The smallest GPU budget the arena plans under ([`Layout::budget_floor`]), and the bytes
    /// it holds at that budget once [`reclaim`](Self::reclaim) released its idle slots: what a
    /// component keeps while another phase of a generation has the card.
    ///
    /// [`Layout::budget_floor`]: ddo_arena::Layout::budget_floor
    pub fn budget_floor(&self) -> Result<(u64, u64), SessionError> {
        let mut g = self.lock();
        let layout = Self::attached(&mut g)?.memory.arena.layout();
        let floor = layout.budget_floor();
        let held: u64 = layout.units.iter().filter(|u| u.pinned).map(|u| u.len).sum();
        Ok((floor, held + layout.staging_len))
    }

    /// Frees the weights' device memory and host registrations once every fence completed.
    /// Refused while a lease is live. Views handed out
    /// ([`TensorView::owner`](crate::TensorView::owner)) keep the memory until they are dropped;
    /// it is freed then. Returns whether the memory was freed now
    /// (`false`: views still hold it).
    pub fn unload(&self) -> Result<bool, SessionError> {
        let mut g = self.lock();
        let a = Self::attached(&mut g)?;
        Self::between_passes(a, "unload during a forward pass")?;
        // Encodings being written in the background stop (their thread joined, their temporary
        // file removed); the next attach starts them again if they are still wanted.
        self.stop_background_encoding();
        let attached = g.take().expect("attached");
        match Arc::try_unwrap(attached.memory) {
            Ok(memory) => {
                // Nothing else holds the memory: close now and report a failure.
                memory.close()?;
                Ok(true)
            }
            Err(_held) => Ok(false),
        }
    }

    /// Whether the weights are unloaded.
    pub fn is_unloaded(&self) -> bool {
        self.lock().is_none()
    }

    /// Attaches again after [`unload`](Self::unload): the checkpoint is opened again (and its
    /// identity recorded anew); addresses differ from the previous attach.
    pub fn reload(&self) -> Result<(), SessionError> {
        let mut g = self.lock();
        if g.is_some() {
            return Err(SessionError::Lifecycle(
                "reload needs an unloaded component (call unload() first)".into(),
            ));
        }
        if let Some(auto) = self.auto_encoding.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            auto.interrupted();
        }
        *g = Some(self.attach()?);
        Ok(())
    }

    /// Closes the session: unloads (refused while leases are live); encodings being written in
    /// the background stop (dropping the session stops them too).
    pub fn close(self) -> Result<(), SessionError> {
        self.stop_background_encoding();
        if self.is_unloaded() { Ok(()) } else { self.unload().map(|_| ()) }
    }
}
