//! The card's time-sharing among a generation's phases while it runs: when a phase starts and
//! its working set does not fit what is free, the arenas of idle phases shrink to their floor
//! (those that run fewest passes first, the denoiser last), and an evicted arena takes its
//! budget back when its own phase starts again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::GenerationPlan;
use super::facts::Phase;

/// One phase's share of the card in a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseShare {
    /// The phase.
    pub phase: Phase,
    /// Bytes its arenas share.
    pub share_bytes: u64,
    /// Activation bytes planned for it (measured, or the unmeasured estimate).
    pub activation_bytes: u64,
    /// Its streamed components.
    pub components: Vec<String>,
}

/// `total` split among wants: each gets what it wants or an equal part of what is left,
/// smallest first (water-filling), so a small component is never starved by a large one.
pub fn fill(total: u64, wants: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| wants[i]);
    let mut given = vec![0; wants.len()];
    let mut left = total;
    for (k, &i) in order.iter().enumerate() {
        let part = left / (wants.len() - k) as u64;
        given[i] = wants[i].min(part);
        left -= given[i];
    }
    given
}

/// A change to one arena's budget, applied between its passes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resize {
    /// The component.
    pub name: String,
    /// Its new budget.
    pub budget_bytes: u64,
    /// Whether its idle slots' memory is then released (a shrink).
    pub reclaim: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Member {
    name: String,
    phase: Phase,
    passes: u32,
    budget_bytes: u64,
    floor_bytes: u64,
    /// Bytes it holds while evicted (its floor, less the slots a reclaim releases).
    idle_bytes: u64,
    evicted: bool,
}

/// The card's time-sharing among the phases of running generations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardShare {
    members: Vec<Member>,
    activation: BTreeMap<Phase, u64>,
    current: Option<Phase>,
    evictions: u64,
}

impl CardShare {
    /// The sharing of `plan`'s streamed components; `idle_bytes` says what each holds while
    /// evicted (by name; the plan's floor when absent). Components of phases other than the
    /// denoiser's start evicted: the host shrinks them to their floor once attached, and they
    /// take their budget when their phase first runs.
    pub fn new(plan: &GenerationPlan, idle_bytes: &BTreeMap<String, u64>) -> CardShare {
        let members = plan
            .components
            .iter()
            .filter(|c| {
                matches!(c.route.as_str(), "vmm_fast_runtime" | "vmm_runtime" | "linear_runtime")
            })
            .map(|c| Member {
                name: c.name.clone(),
                phase: c.phase,
                passes: c.passes,
                budget_bytes: c.budget_bytes,
                floor_bytes: c.floor_bytes,
                idle_bytes: idle_bytes.get(&c.name).copied().unwrap_or(c.floor_bytes),
                evicted: c.phase != Phase::Denoise,
            })
            .collect();
        let activation = plan.phases.iter().map(|p| (p.phase, p.activation_bytes)).collect();
        CardShare { members, activation, current: None, evictions: 0 }
    }

    /// The arena's true floor once attached (the session knows it to the byte).
    pub fn set_floor(&mut self, name: &str, floor_bytes: u64) {
        for m in self.members.iter_mut().filter(|m| m.name == name) {
            m.floor_bytes = floor_bytes;
            m.budget_bytes = m.budget_bytes.max(floor_bytes);
        }
    }

    /// The working set of `phase` beside its arenas: its activations as measured (a decode's
    /// at the resolution asked), replacing the plan's estimate.
    pub fn set_activation(&mut self, phase: Phase, bytes: u64) {
        self.activation.insert(phase, bytes);
    }

    /// The activation bytes `phase` is planned with now.
    pub fn activation(&self, phase: Phase) -> u64 {
        self.activation.get(&phase).copied().unwrap_or(0)
    }

    /// Whether `phase` starting now may change any arena: a phase change, or an arena of
    /// `phase` still evicted. A host skips sampling the card otherwise.
    pub fn entering(&self, phase: Phase) -> bool {
        self.current != Some(phase) || self.members.iter().any(|m| m.phase == phase && m.evicted)
    }

    /// `phase` starts with `free_bytes` free on the card: the resizes to apply, shrinks first.
    /// Evicted arenas of `phase` take their budget back; when its working set (its activations
    /// and those regrowths) does not fit, arenas of other phases shrink to their floor, those
    /// that run fewest passes first and then the largest.
    pub fn enter(&mut self, phase: Phase, free_bytes: u64) -> Vec<Resize> {
        if !self.entering(phase) {
            return Vec::new();
        }
        self.current = Some(phase);
        let grow: u64 = self
            .members
            .iter()
            .filter(|m| m.phase == phase && m.evicted)
            .map(|m| m.budget_bytes.saturating_sub(m.idle_bytes))
            .sum();
        let mut deficit = (self.activation(phase) + grow).saturating_sub(free_bytes);
        let mut order: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].phase != phase && !self.members[i].evicted)
            .collect();
        order.sort_by_key(|&i| {
            let m = &self.members[i];
            (m.passes, std::cmp::Reverse(m.budget_bytes))
        });
        let mut resizes = Vec::new();
        for i in order {
            if deficit == 0 {
                break;
            }
            let m = &mut self.members[i];
            if m.budget_bytes <= m.floor_bytes {
                continue;
            }
            m.evicted = true;
            self.evictions += 1;
            deficit = deficit.saturating_sub(m.budget_bytes.saturating_sub(m.idle_bytes));
            resizes.push(Resize {
                name: m.name.clone(),
                budget_bytes: m.floor_bytes,
                reclaim: true,
            });
        }
        for m in self.members.iter_mut().filter(|m| m.phase == phase && m.evicted) {
            m.evicted = false;
            resizes.push(Resize {
                name: m.name.clone(),
                budget_bytes: m.budget_bytes,
                reclaim: false,
            });
        }
        resizes
    }

    /// A resize could not be applied (tensors view the arena, or the budget was refused): the
    /// component keeps the budget it had.
    pub fn refused(&mut self, resize: &Resize) {
        if let Some(m) = self.members.iter_mut().find(|m| m.name == resize.name) {
            m.evicted = !m.evicted;
        }
    }

    /// Bytes `phase` could have on top of what is free: every arena of another phase shrunk to
    /// what it holds evicted.
    pub fn evictable_bytes(&self, phase: Phase) -> u64 {
        self.members
            .iter()
            .filter(|m| m.phase != phase && !m.evicted)
            .map(|m| m.budget_bytes.saturating_sub(m.idle_bytes))
            .sum()
    }

    /// How many arenas were evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn fill_never_exceeds_total_or_wants(total in 0u64..1 << 40, wants in prop::collection::vec(0u64..1 << 38, 0..6)) {
            let given = fill(total, &wants);
            prop_assert!(given.iter().sum::<u64>() <= total);
            for (g, w) in given.iter().zip(&wants) {
                prop_assert!(g <= w);
            }
            // Whatever is left over, every want was met.
            if given.iter().sum::<u64>() < total.saturating_sub(wants.len() as u64) {
                prop_assert_eq!(&given, &wants);
            }
        }
    }

    fn member(
        name: &str,
        phase: Phase,
        passes: u32,
        budget: u64,
        floor: u64,
    ) -> super::super::ComponentChoice {
        super::super::ComponentChoice {
            name: name.into(),
            phase,
            route: "vmm_fast_runtime".into(),
            host_tier: super::super::HostTier::Mapped,
            budget_bytes: budget,
            floor_bytes: floor,
            prefetch_depth: 2,
            encoding: crate::WeightEncoding::Off,
            streamed_bytes_per_pass: 0,
            copy_seconds_per_pass: None,
            passes,
            reasons: vec![],
        }
    }

    fn share() -> CardShare {
        let plan = GenerationPlan {
            device: "cuda:0".into(),
            card_bytes: 16,
            components: vec![
                member("text_encoder_2", Phase::Encode, 1, 2, 1),
                member("transformer", Phase::Denoise, 28, 12, 2),
            ],
            phases: vec![
                PhaseShare {
                    phase: Phase::Encode,
                    share_bytes: 2,
                    activation_bytes: 1,
                    components: vec![],
                },
                PhaseShare {
                    phase: Phase::Denoise,
                    share_bytes: 12,
                    activation_bytes: 2,
                    components: vec![],
                },
            ],
            host_bytes: 0,
            notes: vec![],
        };
        CardShare::new(
            &plan,
            &BTreeMap::from([("text_encoder_2".into(), 0), ("transformer".into(), 1)]),
        )
    }

    #[test]
    fn a_phase_that_fits_changes_nothing_and_is_not_entered_twice() {
        let mut s = share();
        // The encoder starts at its floor and takes its budget the first time it runs.
        let r = s.enter(Phase::Encode, 3);
        assert_eq!(
            r,
            vec![Resize { name: "text_encoder_2".into(), budget_bytes: 2, reclaim: false }]
        );
        assert!(!s.entering(Phase::Encode));
        assert!(s.enter(Phase::Denoise, 2).is_empty());
        assert_eq!(s.evictions(), 0);
    }

    #[test]
    fn a_decode_that_needs_the_card_evicts_the_encoder_first_then_the_denoiser() {
        let mut s = share();
        s.enter(Phase::Encode, 3);
        s.set_activation(Phase::Decode, 3);
        // 1 free, 3 needed: shrinking the encoder (2 -> held 0) is enough.
        let r = s.enter(Phase::Decode, 1);
        assert_eq!(
            r,
            vec![Resize { name: "text_encoder_2".into(), budget_bytes: 1, reclaim: true }]
        );
        // The encoder takes its budget back when it runs again, before anything else shrinks.
        let r = s.enter(Phase::Encode, 5);
        assert_eq!(
            r,
            vec![Resize { name: "text_encoder_2".into(), budget_bytes: 2, reclaim: false }]
        );
        // Not enough even then: the denoiser goes too, and comes back at its phase.
        s.set_activation(Phase::Decode, 10);
        let r = s.enter(Phase::Decode, 0);
        assert_eq!(r.len(), 2);
        assert_eq!(r[1], Resize { name: "transformer".into(), budget_bytes: 2, reclaim: true });
        assert_eq!(s.evictable_bytes(Phase::Decode), 0);
        let r = s.enter(Phase::Denoise, 12);
        assert_eq!(
            r,
            vec![Resize { name: "transformer".into(), budget_bytes: 12, reclaim: false }]
        );
        // A refused regrowth leaves it evicted: the next entry tries again.
        s.refused(&r[0]);
        assert!(s.entering(Phase::Denoise));
        assert_eq!(s.evictions(), 3);
        assert!(s.entering(Phase::Encode));
    }

    #[test]
    fn fill_gives_small_wants_in_full() {
        assert_eq!(fill(10, &[2, 100, 100]), vec![2, 4, 4]);
        assert_eq!(fill(10, &[20, 3]), vec![7, 3]);
    }
}
