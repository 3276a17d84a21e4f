//! What the arena's one lock guards, as data (the modules beside it act on it): per unit or
//! slot who holds the bytes and which fences gate their reuse, the staging cursor, the learned
//! order, the peer store, the counters, and the copy lane an upload holds while it reads the
//! source with the lock released.

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard};

use std::sync::Arc;

use ddo_core::{BackingId, FenceValue, FileRange, PeerBuffer, StreamId, UnitId};

use crate::{ArenaError, ArenaStats};

/// Who holds a resident unit's or a slot's bytes, and the fences that gate their reuse.
#[derive(Debug, Default)]
pub(super) struct Holder {
    /// Upload of the bytes now held (device-side completion).
    pub(super) upload: Option<FenceValue>,
    /// The last fence each consumer stream recorded since the upload (a later fence on a
    /// stream completes after the earlier ones); reuse waits for all of them.
    pub(super) releases: Vec<(StreamId, FenceValue)>,
    pub(super) leases: u32,
    /// The upload was observed complete on the host: consumers need not wait for it.
    pub(super) upload_done: bool,
    /// Retained after a failed release: never reused, close refuses.
    pub(super) unsafe_: bool,
    /// An upload into this memory is reading the source with the lock released: until it
    /// commits, only that upload changes the holder; every other path waits for it or skips it.
    pub(super) loading: bool,
}

impl Holder {
    /// Records `fence` as `stream`'s last release, replacing the one it recorded before.
    pub(super) fn released_on(&mut self, stream: StreamId, fence: FenceValue) {
        match self.releases.iter_mut().find(|(s, _)| *s == stream) {
            Some(last) => last.1 = fence,
            None => self.releases.push((stream, fence)),
        }
    }

    pub(super) fn release_fences(&self) -> impl Iterator<Item = FenceValue> + '_ {
        self.releases.iter().map(|&(_, f)| f)
    }

    /// Marks the memory retained unsafe; returns whether it was not already (so its bytes are
    /// counted as retained once).
    pub(super) fn retain_unsafe(&mut self) -> bool {
        !std::mem::replace(&mut self.unsafe_, true)
    }
}

/// An execution slot: one backing mapped at the ranges of every unit assigned to it.
#[derive(Debug, Default)]
pub(super) struct Slot {
    pub(super) holder: Holder,
    pub(super) backing: Option<BackingId>,
    /// Unit whose bytes the slot holds.
    pub(super) occupant: Option<UnitId>,
    /// The occupant came from prefetch and has not been acquired yet.
    pub(super) prefetched: bool,
    /// Unit ranges the backing is mapped at now.
    pub(super) mapped: Vec<UnitId>,
}

/// A resident unit: its own backing, mapped at its range for the arena's life.
#[derive(Debug, Default)]
pub(super) struct Resident {
    pub(super) holder: Holder,
    pub(super) backing: Option<BackingId>,
    pub(super) mapped: bool,
}

/// The execution order: the one learned from the first complete pass, and where the current
/// pass stands.
#[derive(Debug, Default)]
pub(super) struct Order {
    pub(super) learned: Option<Arc<[UnitId]>>,
    pub(super) current: Vec<UnitId>,
    pub(super) position: usize,
    pub(super) lookahead: bool,
}

/// A weight store in a peer device's memory: each stored unit's bytes as its range holds them
/// once uploaded (conversions and decodes done), at an offset of one buffer.
#[derive(Debug)]
pub(super) struct PeerStore {
    pub(super) buffer: PeerBuffer,
    /// Per unit: its offset in the buffer, when stored.
    pub(super) offsets: Vec<Option<u64>>,
}

/// Which of the two staging buffers of device conversions the next upload fills, and per
/// buffer the fence after which its last conversions have read it.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct StagingCursor {
    pub(super) next: usize,
    pub(super) read: [Option<FenceValue>; 2],
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) residents: Vec<Resident>,
    pub(super) slots: Vec<Slot>,
    /// The staging buffers of device conversions: their backing, and whether it is mapped.
    pub(super) staging: (Option<BackingId>, bool),
    /// Only the holder of the copy lane reads or moves it.
    pub(super) staging_cursor: StagingCursor,
    pub(super) order: Order,
    pub(super) stats: ArenaStats,
    pub(super) closed: bool,
    /// The first error [`Arena::close`](super::Arena::close) returned: reported to its caller,
    /// so a drop does not report it again.
    pub(super) close_failure: Option<String>,
    /// The ranges announced to the source last (reused, so announcing allocates nothing).
    pub(super) announced: Vec<FileRange>,
    /// Streamed units held in a peer device's memory, copied from there instead of the host.
    pub(super) peer: Option<PeerStore>,
    /// The copy lane is taken: one upload is enqueuing its copies (and conversions) with the
    /// lock released. Uploads enqueue one at a time, so the staging buffers alternate in order.
    pub(super) uploading: bool,
    /// The peer weight store is being filled (fills run one at a time).
    pub(super) filling: bool,
}

impl State {
    pub(super) fn new(units: usize, slots: u32) -> State {
        State {
            residents: (0..units).map(|_| Resident::default()).collect(),
            slots: (0..slots).map(|_| Slot::default()).collect(),
            staging: (None, false),
            staging_cursor: StagingCursor::default(),
            order: Order { lookahead: true, ..Order::default() },
            stats: ArenaStats::default(),
            closed: false,
            close_failure: None,
            announced: Vec::new(),
            peer: None,
            uploading: false,
            filling: false,
        }
    }
}

/// The arena's lock, held: dereferences to the [`State`], and lets an upload release it while
/// it reads the source ([`unlocked`](Locked::unlocked)) or wait for another upload to commit
/// ([`wait`](Locked::wait)). Whoever releases it re-validates what it decided before.
pub(super) struct Locked<'a> {
    mutex: &'a Mutex<State>,
    changed: &'a Condvar,
    guard: Option<MutexGuard<'a, State>>,
}

impl<'a> Locked<'a> {
    pub(super) fn new(mutex: &'a Mutex<State>, changed: &'a Condvar) -> Locked<'a> {
        let guard = mutex.lock().unwrap_or_else(|p| p.into_inner());
        Locked { mutex, changed, guard: Some(guard) }
    }

    /// Runs `f` with the lock released, and takes it again.
    pub(super) fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.guard = None;
        let result = f();
        self.guard = Some(self.mutex.lock().unwrap_or_else(|p| p.into_inner()));
        result
    }

    /// Waits, with the lock released, until an upload or a fill commits.
    pub(super) fn wait(&mut self) {
        let guard = self.guard.take().expect("the lock is held");
        self.guard = Some(self.changed.wait(guard).unwrap_or_else(|p| p.into_inner()));
    }

    /// Waits as [`wait`](Locked::wait) does, for a caller that goes on using the arena's
    /// memory: [`ArenaError::Closed`] when the arena was closed meanwhile (its memory and
    /// reservation released, so nothing decided before the wait holds).
    pub(super) fn wait_open(&mut self) -> Result<(), ArenaError> {
        self.wait();
        if self.closed { Err(ArenaError::Closed) } else { Ok(()) }
    }

    /// Waits until no fill of the peer weight store runs: a fill copies each unit it uploads
    /// from its slot, so no lease or look-ahead takes a slot while it runs (it checked for
    /// live leases only when it started).
    pub(super) fn wait_for_fill(&mut self) {
        while self.filling {
            self.wait();
        }
    }

    /// Wakes every caller waiting for an upload or a fill to commit.
    pub(super) fn notify(&self) {
        self.changed.notify_all();
    }
}

impl Deref for Locked<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.guard.as_ref().expect("the lock is held")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("the lock is held")
    }
}
