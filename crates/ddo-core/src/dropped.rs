//! Cleanup that failed inside `Drop`, where no caller can receive the error.
//!
//! A value that releases device memory or registrations when dropped (an arena, a session's
//! memory) cannot return an error from `drop`. It keeps what it could not release (contract 2:
//! never freed by force) and notes the failure here; hosts take the notes and show them
//! ([`take_drop_failures`]), so a failed release is never silent.

use std::sync::Mutex;

/// One cleanup that failed while a value was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropFailure {
    /// What was being dropped (`"arena"`, `"host registrations"`).
    pub what: &'static str,
    /// The error, as its `Display` gives it.
    pub message: String,
    /// Bytes kept (device memory or registered host memory) because of the failure, where known.
    pub retained_bytes: Option<u64>,
}

impl std::fmt::Display for DropFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "releasing the {} when it was dropped failed: {}", self.what, self.message)?;
        if let Some(b) = self.retained_bytes {
            write!(f, " ({} kept, never freed by force)", crate::ByteSize(b))?;
        }
        Ok(())
    }
}

/// Notes kept beyond this many are counted, not stored.
const KEEP: usize = 256;

#[derive(Default)]
struct Notes {
    failures: Vec<DropFailure>,
    not_kept: u64,
}

static NOTES: Mutex<Notes> = Mutex::new(Notes { failures: Vec::new(), not_kept: 0 });

/// Notes a failed cleanup from a `Drop` implementation.
pub fn note_drop_failure(failure: DropFailure) {
    let mut notes = NOTES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if notes.failures.len() < KEEP {
        notes.failures.push(failure);
    } else {
        notes.not_kept += 1;
    }
}

/// Takes the failures noted since the last call, oldest first, and how many more were noted
/// than kept.
pub fn take_drop_failures() -> (Vec<DropFailure>, u64) {
    let mut notes = NOTES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let failures = std::mem::take(&mut notes.failures);
    (failures, std::mem::take(&mut notes.not_kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_taken_once_and_bounded() {
        let _ = take_drop_failures();
        for i in 0..KEEP + 3 {
            note_drop_failure(DropFailure {
                what: "arena",
                message: format!("failure {i}"),
                retained_bytes: Some(4096),
            });
        }
        let (failures, not_kept) = take_drop_failures();
        assert_eq!(failures.len(), KEEP);
        assert_eq!(not_kept, 3);
        assert_eq!(
            failures[0].to_string(),
            "releasing the arena when it was dropped failed: failure 0 (4.00 KiB kept, never freed by force)"
        );
        assert_eq!(take_drop_failures(), (Vec::new(), 0));
    }
}
