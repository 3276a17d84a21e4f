//! The plan of a whole generation: every component of a pipeline, the phase it runs in and the
//! machine as measured go in; the route, host tier, GPU budget, prefetch depth and encoding of
//! each component come out, each with its reason, and the copy time each streamed pass is
//! predicted to take.
//!
//! A pipeline's components run one phase after another (the text encoders, the denoiser's
//! steps, the VAE's decode), so the phases time-share the card: the phase that runs gets every
//! byte its components' arenas can use, and the arenas of idle phases shrink to their floor
//! ([`share`]). The plan is pure: the host measures (free memory, the link, the decoder's
//! speed, the host's admission) and applies.

mod choose;
pub mod decode;
mod facts;
pub mod share;
mod table;

pub use choose::{
    ASSUMED_ENCODED_RATIO, DENOISE_PASSES, PREFETCH_DEPTH, RESIDENT_BYTES, floor_bytes,
    plan_generation, unmeasured_activation_bytes,
};
pub use facts::{Blocks, ComponentFacts, MachineFacts, Phase};

use serde::{Deserialize, Serialize};

use crate::WeightEncoding;

/// Where a component's weights live between the passes that use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostTier {
    /// On the GPU for the whole generation (small components).
    Device,
    /// In host memory, mapped from the checkpoint (route `vmm_fast_runtime`).
    Mapped,
    /// Read from disk each pass into bounded staging (route `vmm_runtime`).
    Disk,
    /// On the execution device, which is the host (the host backend).
    Host,
}

/// What the plan chose for one component.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComponentChoice {
    /// The component's name in the pipeline.
    pub name: String,
    /// The phase it runs in.
    pub phase: Phase,
    /// The route (`vmm_fast_runtime`, `vmm_runtime` or `none`).
    pub route: String,
    /// Where the weights live between passes.
    pub host_tier: HostTier,
    /// The arena's budget while its phase runs (0 for a component that is not streamed).
    pub budget_bytes: u64,
    /// The arena's floor: what it keeps while another phase runs.
    pub floor_bytes: u64,
    /// Units in flight.
    pub prefetch_depth: u32,
    /// Entropy-coded streaming.
    pub encoding: WeightEncoding,
    /// Bytes that cross the link each pass at this budget.
    pub streamed_bytes_per_pass: u64,
    /// The copies of one pass at the measured link (raw bytes), `None` without a measured link.
    pub copy_seconds_per_pass: Option<f64>,
    /// Passes per generation.
    pub passes: u32,
    /// Why each choice was made, one line each.
    pub reasons: Vec<String>,
}

impl ComponentChoice {
    /// The budget the component attaches under: a denoiser's whole budget (it keeps it through
    /// every phase); another phase's component its floor with room for rounding, never more
    /// than its budget (it takes its budget when its phase runs, [`share::CardShare`]), so
    /// loading never holds every phase's share at once.
    pub fn attach_bytes(&self) -> u64 {
        if self.phase == Phase::Denoise {
            return self.budget_bytes;
        }
        self.budget_bytes.min(self.floor_bytes + self.floor_bytes / 4 + 256 * ddo_core::MIB)
    }

    /// The configuration that attaches the component, as `DynamicOffloadConfig` fields.
    pub fn config(&self) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::json;
        let gib = |bytes: u64| json!(bytes as f64 / ddo_core::GIB as f64);
        let mut c = serde_json::Map::new();
        let streamed = self.route != "none";
        c.insert("route".into(), json!(if streamed { "dynamic_offload" } else { "none" }));
        if streamed {
            c.insert("execution_mode".into(), json!(self.route));
            c.insert("prefetch_depth".into(), json!(self.prefetch_depth));
        }
        match self.route.as_str() {
            "vmm_fast_runtime" | "vmm_runtime" => {
                c.insert("backend".into(), json!("vmm"));
                c.insert("vmm_resident_weight_budget_gb".into(), gib(self.attach_bytes()));
                c.insert("vmm_weight_encoding".into(), json!(self.encoding.to_string()));
            }
            "linear_runtime" => {
                c.insert("backend".into(), json!("linear"));
                c.insert("resident_module_budget_gb".into(), json!(0.0));
            }
            _ => {}
        }
        c
    }
}

/// The plan of a whole generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationPlan {
    /// The execution device.
    pub device: String,
    /// Bytes of the card the plan shares among the phases.
    pub card_bytes: u64,
    /// Each component, in the order given.
    pub components: Vec<ComponentChoice>,
    /// Each phase's share of the card.
    pub phases: Vec<share::PhaseShare>,
    /// Host bytes the plan keeps: the mapped components' weights.
    pub host_bytes: u64,
    /// What the plan could not do as asked, or what the user should know.
    pub notes: Vec<String>,
}

impl GenerationPlan {
    /// The plan as a table a user reads before anything runs.
    pub fn table(&self) -> String {
        table::format(self)
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Option<&ComponentChoice> {
        self.components.iter().find(|c| c.name == name)
    }
}

/// The request of a generation plan: the machine and the components, as JSON hosts send it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The machine as measured.
    pub machine: MachineFacts,
    /// The pipeline's model components.
    pub components: Vec<ComponentFacts>,
}
