//! What several sources of one file hold once per process (its mapping, its descriptor).

use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Live values by key, held weakly: a value lives while someone holds it.
pub(crate) struct Registry<K, T> {
    live: Mutex<Vec<(K, Weak<T>)>>,
}

impl<K: PartialEq, T> Registry<K, T> {
    pub(crate) const fn new() -> Self {
        Registry { live: Mutex::new(Vec::new()) }
    }

    /// The live value under `key` when `usable` accepts it, else the one `make` gives, which
    /// later callers with the same key share.
    pub(crate) fn get_or_make<E>(
        &self,
        key: K,
        usable: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.retain(|(_, w)| w.strong_count() > 0);
        if let Some(v) = live.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade())
            && usable(&v)
        {
            return Ok(v);
        }
        let v = Arc::new(make()?);
        live.retain(|(k, _)| *k != key);
        live.push((key, Arc::downgrade(&v)));
        Ok(v)
    }
}
