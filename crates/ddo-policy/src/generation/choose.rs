//! The choices: which components stay on the card, which stream and from where, under what
//! budget, with what encoding.

use ddo_core::{GIB, MIB};

use super::facts::{ComponentFacts, MachineFacts, Phase};
use super::share::{PhaseShare, fill};
use super::{ComponentChoice, GenerationPlan, GenerationRequest, HostTier};
use crate::WeightEncoding;

/// A component this small stays on the card for the whole generation: streaming it saves
/// little and adds copies to every pass.
pub const RESIDENT_BYTES: u64 = GIB;

/// Activation bytes planned for a phase before its first pass measured them, on a card with
/// `card_bytes` to share: the denoiser's at least 1.5 GiB or a sixteenth of the card, an
/// encoder's 1 GiB, a streamed VAE's a quarter of the card (its decode at full resolution is
/// the largest working set of a generation).
pub fn unmeasured_activation_bytes(phase: Phase, card_bytes: u64) -> u64 {
    match phase {
        Phase::Denoise => (3 * GIB / 2).max(card_bytes / 16),
        Phase::Encode => GIB,
        Phase::Decode => card_bytes / 4,
    }
}

/// Passes per generation of a denoiser whose host did not say: a common step count.
pub const DENOISE_PASSES: u32 = 28;

/// Units in flight on a streamed component: one block uploads while one runs, and one more
/// covers a block that computes faster than its successor uploads.
pub const PREFETCH_DEPTH: u32 = 2;

/// What the plan assumes entropy coding keeps of a bf16 block's bytes, for the prediction
/// only (the measured ratio replaces it once encoded).
pub const ASSUMED_ENCODED_RATIO: f64 = 0.70;

/// Plans a whole generation ([`GenerationRequest`]).
pub fn plan_generation(request: &GenerationRequest) -> GenerationPlan {
    let m = &request.machine;
    let host_device = m.keeps_everything();
    let mut notes = Vec::new();
    let mut choices: Vec<ComponentChoice> =
        request.components.iter().map(|c| first_choice(c, m, host_device)).collect();

    // Components on the card for the whole generation come off the top.
    let fixed: u64 = choices
        .iter()
        .zip(&request.components)
        .filter(|(c, _)| c.route == "none")
        .map(|(_, f)| f.weight_bytes)
        .sum();
    let card = m.card_free_bytes.saturating_sub(fixed);
    // A user's budget bounds the weights, fixed ones included; activations are outside it.
    let cap = m.weights_cap().map(|b| b.saturating_sub(fixed));
    let mut phases = Vec::new();
    if fixed > m.usable_bytes() {
        notes.push(format!(
            "the components kept on the card ({}) exceed its free memory ({}): stream them with \
             component_configs={{name: ddo.DynamicOffloadConfig(route=\"dynamic_offload\", backend=\"vmm\")}}",
            gib(fixed),
            gib(m.usable_bytes())
        ));
    }

    // The phases share the card. The denoiser, which runs every step, keeps its budget for the
    // whole generation: it takes the card less its own activations or, when larger, the
    // working set of another phase (its arenas' floors and activations), so no phase evicts
    // it. The phases that run once take what the denoiser leaves them.
    let is_arena: Vec<bool> = choices.iter().map(|c| c.route != "none").collect();
    let phase_of: Vec<Phase> = choices.iter().map(|c| c.phase).collect();
    let floor_of: Vec<u64> = choices.iter().map(|c| c.floor_bytes).collect();
    let arena = |i: usize| is_arena[i];
    let act = |phase: Phase, members: &[usize]| -> u64 {
        members
            .iter()
            .filter_map(|&i| request.components[i].activation_bytes)
            .max()
            .unwrap_or_else(|| unmeasured_activation_bytes(phase, m.usable_bytes()))
    };
    let members_of = |phase: Phase| -> Vec<usize> {
        (0..phase_of.len()).filter(|&i| phase_of[i] == phase && arena(i)).collect()
    };
    let idle = |i: usize| request.components[i].outside_blocks_bytes();
    let denoisers = members_of(Phase::Denoise);
    let others: Vec<usize> =
        (0..phase_of.len()).filter(|&i| arena(i) && phase_of[i] != Phase::Denoise).collect();
    let idle_others: u64 = others.iter().map(|&i| idle(i)).sum();
    let mut working = if denoisers.is_empty() { 0 } else { act(Phase::Denoise, &denoisers) };
    // The same without activations: what the other phases' arenas take within a budget.
    let mut weights_working = 0;
    for phase in [Phase::Encode, Phase::Decode] {
        let members = members_of(phase);
        if !members.is_empty() {
            let floors: u64 = members.iter().map(|&i| floor_of[i] - idle(i).min(floor_of[i])).sum();
            working = working.max(floors + act(phase, &members));
            weights_working = weights_working.max(floors);
        }
    }
    let mut denoiser_bytes = 0;
    // The denoiser first: the other phases take what it leaves.
    for phase in [Phase::Denoise, Phase::Encode, Phase::Decode] {
        let members = members_of(phase);
        if members.is_empty() {
            continue;
        }
        let activation = act(phase, &members);
        let share = if phase == Phase::Denoise {
            let on_card = card.saturating_sub(idle_others).saturating_sub(working);
            let in_budget =
                cap.map(|c| c.saturating_sub(idle_others).saturating_sub(weights_working));
            in_budget.map_or(on_card, |b| b.min(on_card))
        } else {
            let idle_rest: u64 =
                others.iter().filter(|&&i| phase_of[i] != phase).map(|&i| idle(i)).sum();
            let on_card = card
                .saturating_sub(denoiser_bytes)
                .saturating_sub(idle_rest)
                .saturating_sub(activation);
            let in_budget = cap.map(|c| c.saturating_sub(denoiser_bytes).saturating_sub(idle_rest));
            in_budget.map_or(on_card, |b| b.min(on_card))
        };
        // Each its floor first, then the rest by water-filling what more each wants.
        let floors: Vec<u64> = members.iter().map(|&i| floor_of[i]).collect();
        let wants: Vec<u64> = members
            .iter()
            .zip(&floors)
            .map(|(&i, f)| request.components[i].weight_bytes.saturating_sub(*f))
            .collect();
        let more = fill(share.saturating_sub(floors.iter().sum()), &wants);
        let given: Vec<u64> = floors.iter().zip(more).map(|(f, m)| f + m).collect();
        // The phase's arenas at their floors, side by side.
        let floors_sum: u64 = floors.iter().sum();
        for (&i, budget) in members.iter().zip(given) {
            let c = &request.components[i];
            let choice = &mut choices[i];
            let budget = budget.max(choice.floor_bytes);
            choice.budget_bytes = budget;
            choice.streamed_bytes_per_pass = streamed_bytes(c, budget);
            if phase == Phase::Denoise {
                denoiser_bytes += budget;
            }
            let kept = if phase == Phase::Denoise {
                format!(
                    "kept through every phase (the others' working set is at most {})",
                    gib(working)
                )
            } else {
                format!(
                    "beside the denoiser's {}, shrunk to {} while other phases run",
                    gib(denoiser_bytes),
                    gib(idle(i))
                )
            };
            if floors_sum > share {
                notes.push(format!(
                    "{}: streaming block by block it needs {} of the card ({} for its phase's \
                     arenas), and its phase's share is {}: a phase that runs evicts another arena \
                     (re-uploaded when that phase runs again); a card with more free memory avoids it",
                    c.name,
                    gib(choice.floor_bytes),
                    gib(floors_sum),
                    gib(share)
                ));
            } else if budget >= c.weight_bytes {
                choice.reasons.push(format!(
                    "fits its share of the card ({} of {}): resident, {kept}",
                    gib(c.weight_bytes),
                    gib(share)
                ));
            } else {
                choice.reasons.push(format!(
                    "{} do not fit its share ({} after {} of activations): {} stay on the card, {} stream each pass; {kept}",
                    gib(c.weight_bytes),
                    gib(share),
                    gib(activation),
                    gib(c.weight_bytes - choice.streamed_bytes_per_pass),
                    gib(choice.streamed_bytes_per_pass)
                ));
            }
        }
        phases.push(PhaseShare {
            phase,
            share_bytes: share,
            activation_bytes: activation,
            components: members.iter().map(|&i| choices[i].name.clone()).collect(),
        });
    }

    let host_bytes = place_on_host(&mut choices, &request.components, m, &mut notes);
    for (choice, c) in choices.iter_mut().zip(&request.components) {
        choose_encoding(choice, c, m);
        choice.copy_seconds_per_pass = copy_seconds(choice, m);
    }
    GenerationPlan {
        device: m.device.clone(),
        card_bytes: cap.map_or(card, |c| c.min(card)),
        components: choices,
        phases,
        host_bytes,
        notes,
    }
}

/// The route before budgets: small components stay on the card, the others stream.
fn first_choice(c: &ComponentFacts, m: &MachineFacts, host_device: bool) -> ComponentChoice {
    let phase = c.phase();
    let passes =
        c.passes.unwrap_or(if phase == Phase::Denoise { DENOISE_PASSES } else { 1 }).max(1);
    let mut choice = ComponentChoice {
        name: c.name.clone(),
        phase,
        route: "none".into(),
        host_tier: if host_device { HostTier::Host } else { HostTier::Device },
        budget_bytes: 0,
        floor_bytes: 0,
        prefetch_depth: PREFETCH_DEPTH,
        encoding: WeightEncoding::Off,
        streamed_bytes_per_pass: 0,
        copy_seconds_per_pass: None,
        passes,
        reasons: Vec::new(),
    };
    if host_device {
        choice.reasons.push("the host backend runs it where its weights are".into());
        return choice;
    }
    if !c.streams() {
        choice.reasons.push(format!(
            "no repeated blocks to stream ({}): on the card for the whole generation",
            gib(c.weight_bytes)
        ));
        return choice;
    }
    if c.weight_bytes <= RESIDENT_BYTES.min(m.usable_bytes() / 8) {
        choice.reasons.push(format!(
            "{} (at most {}): on the card for the whole generation, no copies per pass",
            gib(c.weight_bytes),
            gib(RESIDENT_BYTES.min(m.usable_bytes() / 8))
        ));
        return choice;
    }
    choice.route = if c.from_checkpoint { "vmm_fast_runtime" } else { "linear_runtime" }.into();
    choice.host_tier = HostTier::Mapped;
    choice.floor_bytes = floor_bytes(c);
    choice.reasons.push(if c.from_checkpoint {
        "its blocks stream from the checkpoint's mapping into a bounded arena (vmm_fast_runtime)"
            .into()
    } else {
        "built in memory, not from a checkpoint: its blocks stream from the module's own host \
         tensors (linear_runtime)"
            .into()
    });
    choice
}

/// The smallest budget a streamed component's arena plans under: what stays outside the
/// blocks, two slots of its largest block, and four 2 MiB mapping granules for rounding (the
/// session's own floor replaces this once attached).
pub fn floor_bytes(c: &ComponentFacts) -> u64 {
    c.outside_blocks_bytes().saturating_add(c.largest_block_bytes.saturating_mul(2)) + 8 * MIB
}

/// Bytes that cross the link each pass under `budget`: every block that cannot stay (two
/// slots are kept for those that stream).
fn streamed_bytes(c: &ComponentFacts, budget: u64) -> u64 {
    if budget >= c.weight_bytes {
        return 0;
    }
    let slots = c.largest_block_bytes.saturating_mul(2);
    let resident_blocks = budget.saturating_sub(c.outside_blocks_bytes()).saturating_sub(slots);
    c.block_bytes.saturating_sub(resident_blocks)
}

/// Host memory: mapped components keep their weights in host memory; when the host cannot
/// hold them all, those that run fewest passes read from disk each pass instead.
fn place_on_host(
    choices: &mut [ComponentChoice],
    facts: &[ComponentFacts],
    m: &MachineFacts,
    notes: &mut Vec<String>,
) -> u64 {
    let mapped = |choices: &[ComponentChoice]| -> u64 {
        choices
            .iter()
            .zip(facts)
            .filter(|(c, _)| c.host_tier == HostTier::Mapped)
            .map(|(_, f)| f.weight_bytes)
            .sum()
    };
    let Some(available) = m.host_available_bytes else {
        return mapped(choices);
    };
    // Fewest passes first, then the largest: each moved component frees the most for the
    // fewest reads.
    let mut order: Vec<usize> =
        (0..choices.len()).filter(|&i| choices[i].route == "vmm_fast_runtime").collect();
    order.sort_by_key(|&i| (choices[i].passes, std::cmp::Reverse(facts[i].weight_bytes)));
    for i in order {
        let held = mapped(choices);
        if held <= available {
            break;
        }
        let choice = &mut choices[i];
        choice.route = "vmm_runtime".into();
        choice.host_tier = HostTier::Disk;
        choice.reasons.push(format!(
            "the host may take {} and the mapped components hold {}: read from disk each pass \
             into bounded staging (vmm_runtime)",
            gib(available),
            gib(held)
        ));
    }
    let held = mapped(choices);
    if held > available {
        notes.push(format!(
            "the host may take {} and the components streamed from host memory hold {}: the \
             kernel pages the mappings in from disk as passes run (slower than the plan says)",
            gib(available),
            gib(held)
        ));
    }
    held
}

/// Entropy-coded streaming where it can pay: a native denoiser that streams every step.
fn choose_encoding(choice: &mut ComponentChoice, c: &ComponentFacts, m: &MachineFacts) {
    if choice.route != "vmm_fast_runtime" {
        return;
    }
    let why = if m.device == "cpu" {
        Some("the host backend decodes nothing".to_owned())
    } else if choice.streamed_bytes_per_pass == 0 {
        Some("nothing streams at this budget".to_owned())
    } else if choice.phase != Phase::Denoise {
        Some(format!(
            "runs once per generation ({} phase): encoding pays over many passes",
            choice.phase
        ))
    } else if c.bf16_block_bytes == 0 {
        Some("no bf16 block weights to encode".to_owned())
    } else {
        match (m.decode_bytes_per_second, m.link_bytes_per_second) {
            (Some(decode), Some(link)) if decode * (1.0 - ASSUMED_ENCODED_RATIO) < link * 0.05 => {
                Some(format!(
                    "decoding ({:.1} GB/s) saves less than it costs at this link ({:.1} GB/s)",
                    decode / 1e9,
                    link / 1e9
                ))
            }
            _ => None,
        }
    };
    match why {
        Some(why) => choice.reasons.push(format!("encoding off: {why}")),
        None => {
            choice.encoding = WeightEncoding::Auto;
            choice.reasons.push(format!(
                "encoding auto: {} stream each step; the first passes are timed and, when they \
                 are transfer-bound, the blocks are encoded in the background and stream \
                 entropy-coded (about {:.0} % of the bytes)",
                gib(choice.streamed_bytes_per_pass),
                ASSUMED_ENCODED_RATIO * 100.0
            ));
        }
    }
}

/// The copies of one pass: its streamed bytes at the link (or the disk, when slower).
fn copy_seconds(choice: &ComponentChoice, m: &MachineFacts) -> Option<f64> {
    let link = m.link_bytes_per_second?;
    let rate = match (choice.host_tier, m.disk_bytes_per_second) {
        (HostTier::Disk, Some(disk)) => link.min(disk),
        _ => link,
    };
    (rate > 0.0).then(|| choice.streamed_bytes_per_pass as f64 / rate)
}

/// `bytes` as GiB with two decimals, or MiB below a GiB.
pub(crate) fn gib(bytes: u64) -> String {
    if bytes >= GIB || bytes == 0 {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const G: u64 = GIB;

    fn machine(card_gib: u64, host_gib: Option<u64>) -> MachineFacts {
        MachineFacts {
            device: "cuda:0".into(),
            card_total_bytes: card_gib * G,
            card_free_bytes: card_gib * G - G / 2,
            link_bytes_per_second: Some(25e9),
            decode_bytes_per_second: Some(200e9),
            disk_bytes_per_second: Some(3e9),
            host_available_bytes: host_gib.map(|h| h * G),
            budget_bytes: None,
        }
    }

    fn component(name: &str, weight: u64, blocks: u32, largest: u64) -> ComponentFacts {
        let block_bytes = (weight * 95 / 100).min(largest * u64::from(blocks));
        ComponentFacts {
            name: name.into(),
            phase: None,
            weight_bytes: weight,
            largest_block_bytes: largest,
            blocks,
            block_bytes,
            bf16_block_bytes: block_bytes,
            from_checkpoint: true,
            activation_bytes: None,
            passes: None,
        }
    }

    /// A Flux.1-dev-shaped pipeline in bf16: CLIP-L, a T5-XXL-sized encoder, the 12 B
    /// transformer (57 blocks, the double ones largest) and the VAE.
    fn flux() -> Vec<ComponentFacts> {
        vec![
            component("text_encoder", 246 << 20, 12, 14 << 20),
            component("text_encoder_2", 9_520 << 20, 24, 385 << 20),
            ComponentFacts {
                passes: Some(28),
                ..component("transformer", 22_700 << 20, 57, 680 << 20)
            },
            component("vae", 160 << 20, 0, 0),
        ]
    }

    fn plan(
        card_gib: u64,
        host_gib: Option<u64>,
        components: Vec<ComponentFacts>,
    ) -> GenerationPlan {
        plan_generation(&GenerationRequest { machine: machine(card_gib, host_gib), components })
    }

    #[test]
    fn flux_on_a_16_gib_card_streams_the_transformer_and_keeps_the_small_parts() {
        let p = plan(16, Some(64), flux());
        let t = p.component("transformer").unwrap();
        assert_eq!(t.route, "vmm_fast_runtime");
        assert_eq!(t.encoding, WeightEncoding::Auto, "{:?}", t.reasons);
        // The transformer takes most of the card, and what it streams is what does not fit.
        assert!(t.budget_bytes > 11 * G && t.budget_bytes < 15 * G, "{}", gib(t.budget_bytes));
        assert!(t.streamed_bytes_per_pass > 7 * G && t.streamed_bytes_per_pass < 12 * G);
        let copies = t.copy_seconds_per_pass.unwrap();
        assert!((copies - t.streamed_bytes_per_pass as f64 / 25e9).abs() < 1e-9);
        for small in ["text_encoder", "vae"] {
            assert_eq!(p.component(small).unwrap().route, "none", "{small}");
        }
        // T5 streams beside the transformer's budget, never encoded (it runs once).
        let t5 = p.component("text_encoder_2").unwrap();
        assert_eq!(t5.route, "vmm_fast_runtime");
        assert_eq!(t5.encoding, WeightEncoding::Off);
        assert!(t5.budget_bytes >= t5.floor_bytes);
        // While T5 runs, the card holds the transformer, T5's budget, its activations and the
        // resident parts.
        let fixed = (246 << 20) + (160 << 20);
        let encode_phase = p.phases.iter().find(|s| s.phase == Phase::Encode).unwrap();
        let encode = t.budget_bytes + t5.budget_bytes + encode_phase.activation_bytes + fixed;
        assert!(encode <= 16 * G - G / 2, "{}", gib(encode));
        assert!(p.notes.is_empty(), "{:?}", p.notes);
        assert!(
            p.table().contains("| transformer | denoise | vmm_fast_runtime | mapped |"),
            "{}",
            p.table()
        );
    }

    #[test]
    fn a_model_that_fits_streams_nothing_and_does_not_encode() {
        let p = plan(80, Some(128), flux());
        let t = p.component("transformer").unwrap();
        assert_eq!(t.streamed_bytes_per_pass, 0);
        assert_eq!(t.encoding, WeightEncoding::Off);
        assert_eq!(t.copy_seconds_per_pass, Some(0.0));
    }

    #[test]
    fn a_small_host_reads_the_encoder_from_disk_first() {
        // 32 GiB of host memory with a margin: 26 GiB may be taken, and the mapped weights are
        // 32 GiB. T5 (one pass) goes to disk; the transformer (28 passes) stays mapped.
        let p = plan(16, Some(26), flux());
        assert_eq!(p.component("text_encoder_2").unwrap().route, "vmm_runtime");
        assert_eq!(p.component("text_encoder_2").unwrap().host_tier, HostTier::Disk);
        assert_eq!(p.component("transformer").unwrap().route, "vmm_fast_runtime");
        assert!(p.host_bytes <= 26 * G);
        // Too small for the transformer too: it reads from disk, and the plan says so.
        let p = plan(16, Some(8), flux());
        assert_eq!(p.component("transformer").unwrap().route, "vmm_runtime");
        let copies = p.component("transformer").unwrap().copy_seconds_per_pass.unwrap();
        assert!(copies > p.component("transformer").unwrap().streamed_bytes_per_pass as f64 / 25e9);
    }

    #[test]
    fn a_module_built_in_memory_takes_the_linear_route() {
        let mut c = flux();
        c[2].from_checkpoint = false;
        let p = plan(16, None, c);
        let t = p.component("transformer").unwrap();
        assert_eq!(t.route, "linear_runtime");
        assert_eq!(t.encoding, WeightEncoding::Off);
        assert_eq!(t.config()["backend"], "linear");
    }

    #[test]
    fn the_host_backend_keeps_everything_where_it_is() {
        let mut m = machine(16, None);
        m.device = "cpu".into();
        let p = plan_generation(&GenerationRequest { machine: m, components: flux() });
        assert!(p.components.iter().all(|c| c.route == "none" && c.host_tier == HostTier::Host));
    }

    #[test]
    fn a_budget_bounds_the_card_and_plans_the_host_backend_as_one() {
        let mut m = machine(80, None);
        m.budget_bytes = Some(16 * G);
        let bounded =
            plan_generation(&GenerationRequest { machine: m.clone(), components: flux() });
        let t = bounded.component("transformer").unwrap();
        assert!(t.budget_bytes < 16 * G && t.streamed_bytes_per_pass > 0, "{}", bounded.table());
        m.device = "cpu".into();
        let host = plan_generation(&GenerationRequest { machine: m, components: flux() });
        assert_eq!(host.component("transformer").unwrap().route, "vmm_fast_runtime");
        assert_eq!(host.component("transformer").unwrap().budget_bytes, t.budget_bytes);
    }

    #[test]
    fn measured_activations_replace_the_estimate() {
        let mut c = flux();
        c[2].activation_bytes = Some(5 * G);
        let measured = plan(16, None, c).component("transformer").unwrap().budget_bytes;
        let estimated = plan(16, None, flux()).component("transformer").unwrap().budget_bytes;
        assert!(estimated > measured + 3 * G, "{} vs {}", gib(estimated), gib(measured));
    }

    #[test]
    fn a_card_too_small_for_a_block_says_so() {
        let p = plan(2, None, flux());
        assert!(p.notes.iter().any(|n| n.contains("transformer")), "{:?}", p.notes);
        assert!(p.component("transformer").unwrap().budget_bytes >= floor_bytes(&flux()[2]));
    }

    #[test]
    fn encoders_whose_floors_crowd_their_share_together_are_noted() {
        // Each floor fits the encode phase's share alone; both together do not.
        let components = vec![
            component("transformer", 1 << 20, 2, 1 << 19),
            component("text_encoder", 12913 << 20, 7, (12913 << 20) * 95 / 700),
            component("text_encoder_2", 2560 << 20, 2, (2560 << 20) * 95 / 200),
        ];
        let p = plan(6, None, components);
        assert!(p.notes.iter().any(|n| n.contains("for its phase's arenas")), "{}", p.table());
    }

    proptest! {
        /// Whatever the card and the components, every streamed budget holds its floor, the
        /// attach budget never exceeds it, and when every floor fits, the denoiser's budget
        /// leaves each other phase its working set.
        #[test]
        fn budgets_fit_the_card(
            card in 4u64..96,
            weights in prop::collection::vec((1u64..40_000, 2u32..80), 1..4),
        ) {
            let mut components: Vec<ComponentFacts> = weights
                .iter()
                .enumerate()
                .map(|(i, &(mib, blocks))| {
                    let w = mib << 20;
                    component(&format!("text_encoder_{i}"), w, blocks, w / u64::from(blocks))
                })
                .collect();
            components[0].name = "transformer".into();
            let p = plan(card, None, components.clone());
            for (c, f) in p.components.iter().zip(&components) {
                if c.route != "none" {
                    prop_assert!(c.budget_bytes >= c.floor_bytes);
                    prop_assert!(c.attach_bytes() <= c.budget_bytes);
                    prop_assert!(c.streamed_bytes_per_pass <= f.weight_bytes);
                }
            }
            if p.notes.is_empty() {
                let fixed: u64 = p.components.iter().zip(&components).filter(|(c, _)| c.route == "none").map(|(_, f)| f.weight_bytes).sum();
                let denoise: u64 = p.components.iter().filter(|c| c.phase == Phase::Denoise && c.route != "none").map(|c| c.budget_bytes).sum();
                for share in &p.phases {
                    let here: u64 = p.components.iter().filter(|c| c.phase == share.phase && c.route != "none").map(|c| c.budget_bytes).sum();
                    let idle: u64 = p.components.iter().zip(&components).filter(|(c, _)| c.phase != share.phase && c.phase != Phase::Denoise && c.route != "none").map(|(_, f)| f.outside_blocks_bytes()).sum();
                    let held = fixed + here + share.activation_bytes + idle + if share.phase == Phase::Denoise { 0 } else { denoise };
                    prop_assert!(held <= card * G - G / 2, "{:?} holds {} of {}", share.phase, gib(held), card);
                }
            }
        }
    }
}
