//! What a generation plan is made from: the machine as measured and each component as loaded.

use serde::{Deserialize, Serialize};

/// The phase of a generation a component runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The prompt's encoding: text (and image) encoders, once per generation.
    Encode,
    /// The denoising steps: the transformer or UNet, once (or twice, with guidance) per step.
    Denoise,
    /// The latents' decoding: the VAE, once per generation.
    Decode,
}

impl Phase {
    /// The phase of the component named `name` in a Diffusers pipeline: `text_encoder*`,
    /// `image_encoder` and other encoders encode; `transformer*`, `unet*` and `prior*` denoise;
    /// `vae*` decodes. `None` for a name that says nothing (a host then names the phase).
    pub fn of_component(name: &str) -> Option<Phase> {
        let n = name.to_ascii_lowercase();
        if n.starts_with("vae") {
            Some(Phase::Decode)
        } else if n.starts_with("transformer") || n.starts_with("unet") || n.starts_with("prior") {
            Some(Phase::Denoise)
        } else if n.contains("encoder") {
            Some(Phase::Encode)
        } else {
            None
        }
    }

    /// The phase's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Encode => "encode",
            Phase::Denoise => "denoise",
            Phase::Decode => "decode",
        }
    }

    /// Every phase, in the order a generation runs them.
    pub const ALL: [Phase; 3] = [Phase::Encode, Phase::Denoise, Phase::Decode];
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The machine as the host measured it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineFacts {
    /// The execution device (`cuda:N`, or `cpu` for the host backend).
    pub device: String,
    /// The card's memory, bytes (the host's available memory on the host backend).
    pub card_total_bytes: u64,
    /// Bytes free on the card for this process now: what other processes and allocations hold
    /// is already taken out.
    pub card_free_bytes: u64,
    /// The host-to-device link, bytes per second (`None`: not measured).
    #[serde(default)]
    pub link_bytes_per_second: Option<f64>,
    /// How fast the device decodes entropy-coded weights, bytes of bf16 output per second.
    #[serde(default)]
    pub decode_bytes_per_second: Option<f64>,
    /// How fast the checkpoints' disk reads, bytes per second.
    #[serde(default)]
    pub disk_bytes_per_second: Option<f64>,
    /// Host memory this process may still take under the admission rules (available memory,
    /// cgroup limits, the safety margin), bytes (`None`: not observed).
    #[serde(default)]
    pub host_available_bytes: Option<u64>,
    /// A GPU budget the user set for the whole pipeline: the plan shares at most this much of
    /// the card. On the host backend it plans the host device as a card of this size (what
    /// tests and demonstrations of streaming without a GPU use).
    #[serde(default)]
    pub budget_bytes: Option<u64>,
}

impl MachineFacts {
    /// Bytes the plan may share: the card's free memory, or the user's budget when smaller.
    pub fn usable_bytes(&self) -> u64 {
        self.budget_bytes.map_or(self.card_free_bytes, |b| b.min(self.card_free_bytes))
    }

    /// Bytes the weights may take in all (the user's budget; activations are outside it), or
    /// `None` without one.
    pub fn weights_cap(&self) -> Option<u64> {
        self.budget_bytes
    }

    /// Whether the plan keeps every component where its weights are: the host backend
    /// without a budget.
    pub fn keeps_everything(&self) -> bool {
        self.device == "cpu" && self.budget_bytes.is_none()
    }
}

/// One model component of the pipeline as loaded (or as its checkpoint says it will load).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComponentFacts {
    /// Its name in the pipeline (`transformer`, `text_encoder_2`, `vae`).
    pub name: String,
    /// The phase it runs in (`None`: from its name, [`Phase::of_component`]; encode when the
    /// name says nothing).
    #[serde(default)]
    pub phase: Option<Phase>,
    /// Bytes of its weights as loaded.
    pub weight_bytes: u64,
    /// Bytes of its largest repeated block (0 without repeated blocks).
    #[serde(default)]
    pub largest_block_bytes: u64,
    /// How many repeated blocks it has.
    #[serde(default)]
    pub blocks: u32,
    /// Bytes of all its repeated blocks.
    #[serde(default)]
    pub block_bytes: u64,
    /// Bytes of bf16 weights in its blocks (what entropy coding can shrink).
    #[serde(default)]
    pub bf16_block_bytes: u64,
    /// Whether its weights are stored as safetensors a native arena can map (a component
    /// built in memory, or stored otherwise, takes the module's own tensors).
    #[serde(default)]
    pub from_checkpoint: bool,
    /// Peak activation bytes of one pass, when measured (or cached from an earlier run).
    #[serde(default)]
    pub activation_bytes: Option<u64>,
    /// Passes per generation (`None`: the denoiser's steps for it, else 1).
    #[serde(default)]
    pub passes: Option<u32>,
}

impl ComponentFacts {
    /// The phase it runs in.
    pub fn phase(&self) -> Phase {
        self.phase.or_else(|| Phase::of_component(&self.name)).unwrap_or(Phase::Encode)
    }

    /// Whether its blocks can stream: it has repeated blocks holding most of its weights.
    pub fn streams(&self) -> bool {
        self.blocks >= 2 && self.largest_block_bytes > 0
    }

    /// Bytes outside its repeated blocks (embeddings, norms, heads): always resident while it
    /// streams.
    pub fn outside_blocks_bytes(&self) -> u64 {
        self.weight_bytes.saturating_sub(self.block_bytes.min(self.weight_bytes))
    }
}

/// A component's repeated blocks, found from its tensors' names: the tensors under
/// `<container>.<index>.` for the first numbered segment of each name, in containers with at
/// least two indices (`transformer_blocks.0.`, `encoder.block.7.`, `layers.11.`), as a module
/// list of blocks names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blocks {
    /// How many blocks.
    pub blocks: u32,
    /// Bytes of the largest.
    pub largest_block_bytes: u64,
    /// Bytes of all of them.
    pub block_bytes: u64,
    /// Bytes of their bf16 tensors.
    pub bf16_block_bytes: u64,
}

impl Blocks {
    /// The blocks of the tensors `(name, bytes, is bf16)`.
    pub fn of_tensors<'a>(tensors: impl IntoIterator<Item = (&'a str, u64, bool)>) -> Blocks {
        use std::collections::BTreeMap;
        // container -> index -> (bytes, bf16 bytes)
        let mut containers: BTreeMap<&str, BTreeMap<u64, (u64, u64)>> = BTreeMap::new();
        for (name, bytes, bf16) in tensors {
            let mut offset = 0;
            for segment in name.split('.') {
                if offset > 0 && !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit())
                {
                    let Ok(index) = segment.parse::<u64>() else { break };
                    let block = containers
                        .entry(&name[..offset - 1])
                        .or_default()
                        .entry(index)
                        .or_default();
                    block.0 += bytes;
                    block.1 += if bf16 { bytes } else { 0 };
                    break;
                }
                offset += segment.len() + 1;
            }
        }
        let mut found = Blocks::default();
        for blocks in containers.values().filter(|b| b.len() >= 2) {
            found.blocks += u32::try_from(blocks.len()).unwrap_or(u32::MAX);
            for &(bytes, bf16) in blocks.values() {
                found.largest_block_bytes = found.largest_block_bytes.max(bytes);
                found.block_bytes += bytes;
                found.bf16_block_bytes += bf16;
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_the_numbered_children_of_a_container() {
        let tensors = [
            ("x_embedder.weight", 10, true),
            ("transformer_blocks.0.attn.to_q.weight", 100, true),
            ("transformer_blocks.0.norm.weight", 4, false),
            ("transformer_blocks.1.attn.to_q.weight", 100, true),
            ("single_transformer_blocks.0.proj.weight", 50, true),
            ("single_transformer_blocks.1.proj.weight", 50, true),
            ("single_transformer_blocks.2.proj.weight", 50, true),
            // One numbered child is no repetition.
            ("norm_out.0.weight", 7, true),
        ];
        let b = Blocks::of_tensors(tensors);
        assert_eq!(
            b,
            Blocks { blocks: 5, largest_block_bytes: 104, block_bytes: 354, bf16_block_bytes: 350 }
        );
        let t5 = [
            ("encoder.block.0.layer.0.q.weight", 8, true),
            ("encoder.block.1.layer.0.q.weight", 8, true),
        ];
        assert_eq!(Blocks::of_tensors(t5).blocks, 2);
        assert_eq!(Blocks::of_tensors([("1.weight", 3, true), ("2.weight", 3, true)]).blocks, 0);
    }

    #[test]
    fn phases_follow_diffusers_component_names() {
        for (name, phase) in [
            ("text_encoder", Some(Phase::Encode)),
            ("text_encoder_2", Some(Phase::Encode)),
            ("image_encoder", Some(Phase::Encode)),
            ("transformer", Some(Phase::Denoise)),
            ("transformer_2", Some(Phase::Denoise)),
            ("unet", Some(Phase::Denoise)),
            ("prior", Some(Phase::Denoise)),
            ("vae", Some(Phase::Decode)),
            ("scheduler", None),
        ] {
            assert_eq!(Phase::of_component(name), phase, "{name}");
        }
    }
}
