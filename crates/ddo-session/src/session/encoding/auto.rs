//! `vmm_weight_encoding = auto` where the link is measured: a state machine over the times
//! between pass starts.

use std::time::Instant;

/// Passes `auto` times before choosing (after the first, which loads kernels).
const AUTO_TIMED_PASSES: u32 = 3;

/// A pass below this factor of its copy floor is limited by its copies, and encoding shortens
/// it: encoded streaming saves `1 - r` of the copies (`r`, the bytes an encoding keeps,
/// [`ASSUMED_ENCODED_RATIO`](ddo_policy::generation::ASSUMED_ENCODED_RATIO)), so a pass whose
/// time above its floor is less than that saving waits on its copies, not its kernels. (A fixed
/// 1.15 left passes at 1.14-1.17x their floor raw, which `on` ran 8 % faster.)
const TRANSFER_BOUND: f64 = 2.0 - ddo_policy::generation::ASSUMED_ENCODED_RATIO;

/// `vmm_weight_encoding = auto` where the link is measured: the first passes stream raw and the
/// time between their starts is compared with the copy floor of the bytes they stream. Passes at
/// the floor are transfer-bound and switch to encoded streaming (fewer bytes cross the link);
/// passes well above it are compute-bound and stay raw (decoding would only add device work).
#[derive(Debug, Clone, PartialEq)]
pub(in crate::session) enum AutoEncoding {
    /// Passes being timed: when the last began (`None` after an interrupted pass or a
    /// reload), the seconds between timed starts so far, and the passes seen.
    Timing { last: Option<Instant>, intervals: Vec<f64>, passes: u32 },
    /// Encode the streamed units (`applied` once attached so).
    Encode { applied: bool, why: String },
    /// Stay raw.
    Raw { why: String },
}

impl AutoEncoding {
    pub(in crate::session) fn timing() -> AutoEncoding {
        AutoEncoding::Timing { last: None, intervals: Vec::new(), passes: 0 }
    }

    /// A pass was interrupted or the weights attached again: the time to the next start is not
    /// a pass's.
    pub(in crate::session) fn interrupted(&mut self) {
        if let AutoEncoding::Timing { last, .. } = self {
            *last = None;
        }
    }

    /// A pass begins at `now`; the passes before it streamed at a copy floor of `floor` seconds.
    pub(in crate::session) fn pass_begins(&mut self, now: Instant, floor: f64) {
        let AutoEncoding::Timing { last, intervals, passes } = self else { return };
        *passes += 1;
        // The first interval holds the first pass (kernel loading, first uploads): not timed.
        if let Some(t) = last.replace(now)
            && *passes > 2
        {
            intervals.push(now.duration_since(t).as_secs_f64());
        }
        if intervals.len() < AUTO_TIMED_PASSES as usize {
            return;
        }
        // The median: a gap between passes (the rest of a pipeline, the host's own work) makes
        // one interval longer, not the pass.
        intervals.sort_by(f64::total_cmp);
        let pass = intervals[intervals.len() / 2];
        *self = if floor <= 0.0 {
            AutoEncoding::Raw { why: "no unit streams".into() }
        } else if pass <= TRANSFER_BOUND * floor {
            AutoEncoding::Encode {
                applied: false,
                why: format!(
                    "a raw pass took {pass:.4} s, {:.2}x its copy floor of {floor:.4} s: under {TRANSFER_BOUND:.2}x, its \
                     copies limit it (transfer-bound)",
                    pass / floor
                ),
            }
        } else {
            AutoEncoding::Raw {
                why: format!(
                    "a pass took {pass:.4} s, {:.2}x its copy floor of {floor:.4} s (compute-bound: decoding would add device work and save no time)",
                    pass / floor
                ),
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The state after pass starts `first` seconds, then `each` seconds apart, at a 0.1 s floor.
    fn timed(first: f64, each: f64, starts: u32) -> AutoEncoding {
        let mut auto = AutoEncoding::timing();
        let mut t = Instant::now();
        for k in 0..starts {
            auto.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(if k == 0 { first } else { each });
        }
        auto
    }

    #[test]
    fn passes_at_their_copy_floor_encode_and_slower_ones_stay_raw() {
        // Decided at the start of the fifth pass: three passes timed after the first.
        assert!(matches!(timed(5.0, 0.105, 4), AutoEncoding::Timing { .. }));
        match timed(5.0, 0.105, 5) {
            AutoEncoding::Encode { applied: false, why } => assert!(why.contains("transfer-bound")),
            other => panic!("{other:?}"),
        }
        match timed(0.1, 0.3, 5) {
            AutoEncoding::Raw { why } => assert!(why.contains("compute-bound"), "{why}"),
            other => panic!("{other:?}"),
        }
        // 1.17x the floor (copies beside kernels slowing both) still waits on its copies;
        // 1.35x is more than encoding would save.
        assert!(matches!(timed(5.0, 0.117, 5), AutoEncoding::Encode { .. }));
        assert!(matches!(timed(5.0, 0.135, 5), AutoEncoding::Raw { .. }));
        // One long gap between passes (the rest of a pipeline) does not make them compute-bound.
        let mut gap = AutoEncoding::timing();
        let mut t = Instant::now();
        for each in [1.0, 0.105, 5.0, 0.105, 0.0] {
            gap.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(each);
        }
        assert!(matches!(gap, AutoEncoding::Encode { .. }), "{gap:?}");
        // An interrupted pass is not timed.
        let mut cut = AutoEncoding::timing();
        let mut t = Instant::now();
        for k in 0..6 {
            if k == 3 {
                cut.interrupted();
            }
            cut.pass_begins(t, 0.1);
            t += Duration::from_secs_f64(if k == 0 { 1.0 } else { 0.105 });
        }
        assert!(matches!(cut, AutoEncoding::Encode { .. }), "{cut:?}");
        // A decision stays.
        let mut decided = timed(0.1, 0.3, 5);
        decided.pass_begins(Instant::now(), 1.0);
        assert!(matches!(decided, AutoEncoding::Raw { .. }));
        let mut nothing = AutoEncoding::timing();
        for _ in 0..5 {
            nothing.pass_begins(Instant::now(), 0.0);
        }
        assert_eq!(nothing, AutoEncoding::Raw { why: "no unit streams".into() });
    }
}
