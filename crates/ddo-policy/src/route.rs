//! Routes: what ddo does with one component.

use schemars::JsonSchema;
use serde::Serialize;

use crate::value::{OffloadType, choice};
use crate::{ConfigError, Origin};

choice! {
    /// The route a user may ask for. Aliases are accepted by [`RouteChoice::parse`].
    RouteChoice {
        /// Decide from the preset and the component's policy.
        Auto = "auto",
        /// ddo's own runtime (linear_runtime, vmm_fast_runtime or vmm_runtime, by backend).
        DynamicOffload = "dynamic_offload",
        /// The linear runtime streaming each convolution and linear layer on its own (a VAE).
        LinearConvolution = "linear_convolution",
        /// Diffusers' own group/leaf offload hooks.
        DiffusersGroupOffload = "diffusers_group_offload",
        /// No offload.
        None = "none"
    }
}

impl RouteChoice {
    /// Parses a route name or alias: `diffusers`, `diffusers_group`, `group`, `group_offload`
    /// mean `diffusers_group_offload`; `dynamic`, `ddo` mean `dynamic_offload`; `cuda`,
    /// `standard`, `off` mean `none`. The error lists the valid names.
    pub fn parse(value: &str, origin: Origin) -> Result<RouteChoice, ConfigError> {
        let name = value.trim().to_ascii_lowercase();
        let choice = match name.as_str() {
            "auto" | "" => RouteChoice::Auto,
            "dynamic_offload" | "dynamic" | "ddo" => RouteChoice::DynamicOffload,
            "linear_convolution" => RouteChoice::LinearConvolution,
            "diffusers_group_offload"
            | "diffusers"
            | "diffusers_group"
            | "group"
            | "group_offload" => RouteChoice::DiffusersGroupOffload,
            "none" | "cuda" | "standard" | "off" => RouteChoice::None,
            _ => {
                return Err(ConfigError::InvalidChoice {
                    field: "route".into(),
                    value: value.to_owned(),
                    origin,
                    allowed: RouteChoice::allowed(),
                });
            }
        };
        Ok(choice)
    }
}

/// Diffusers group-offload parameters of the compatibility route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
pub struct GroupOffload {
    /// Granularity.
    pub offload_type: OffloadType,
    /// Copies on a side stream.
    pub use_stream: bool,
    /// Diffusers `record_stream`.
    pub record_stream: bool,
    /// Diffusers `low_cpu_mem_usage`.
    pub low_cpu_mem_usage: bool,
    /// Blocks per group (meaningful for `block_level`).
    pub num_blocks_per_group: u32,
}

/// Who places a component that ddo does not offload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// ddo moves the whole component to the execution device.
    Resident,
    /// The caller owns placement; ddo touches nothing.
    Unmanaged,
}

/// The resolved route of one component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum Route {
    /// The weight arena fed by the module's own host tensors (registered in place).
    LinearRuntime,
    /// The linear runtime with each convolution and linear layer its own unit
    /// (`linear_convolution_offload`): for components without repeated blocks, such as a VAE.
    LinearConvolution,
    /// The weight arena fed by the checkpoint's mapping or retained windows.
    VmmFastRuntime,
    /// Weights read from disk each pass into registered staging, bounded host memory.
    VmmRuntime,
    /// Delegates to Diffusers' group offload hooks.
    DiffusersGroupOffload(GroupOffload),
    /// No offload.
    None {
        /// Who places the component.
        placement: Placement,
    },
}

impl Route {
    /// The route's name as metrics and users see it.
    pub const fn name(&self) -> &'static str {
        match self {
            Route::LinearRuntime => "linear_runtime",
            Route::LinearConvolution => "linear_convolution",
            Route::VmmFastRuntime => "vmm_fast_runtime",
            Route::VmmRuntime => "vmm_runtime",
            Route::DiffusersGroupOffload(_) => "diffusers_group_offload",
            Route::None { .. } => "none",
        }
    }

    /// Whether ddo's own runtime streams this component.
    pub const fn is_dynamic(&self) -> bool {
        matches!(
            self,
            Route::LinearRuntime
                | Route::LinearConvolution
                | Route::VmmFastRuntime
                | Route::VmmRuntime
        )
    }

    /// Whether the route runs on the native arena.
    pub const fn is_native(&self) -> bool {
        matches!(self, Route::VmmFastRuntime | Route::VmmRuntime)
    }

    /// The published library's name of the route: its four arena routes are all
    /// `dynamic_offload` there.
    pub const fn published_name(&self) -> &'static str {
        if self.is_dynamic() { "dynamic_offload" } else { self.name() }
    }

    /// Whether every weight streams from the checkpoint the module was loaded from (its mapping,
    /// retained windows or reads into staging): a loader then builds the module without weights
    /// (on the meta device), so host memory holds the model at most once.
    pub const fn reads_checkpoint(&self) -> bool {
        self.is_native()
    }

    /// The setting that sizes the route's GPU weight budget: the whole arena on the native
    /// route, the resident blocks beside the slots on the linear route; `None` on routes
    /// without one (a capacity profile has nothing to size there).
    pub const fn budget_setting(&self) -> Option<&'static str> {
        match self {
            Route::VmmFastRuntime => Some("vmm_resident_weight_budget_gb"),
            Route::LinearRuntime => Some("resident_module_budget_gb"),
            _ => None,
        }
    }

    /// Whether the automatic GPU budget (`auto_budget_policy = balanced`) can size the route:
    /// only the native arena's budget follows the card.
    pub const fn takes_auto_budget(&self) -> bool {
        matches!(self, Route::VmmFastRuntime)
    }

    /// What a host needs to know about the route, in one value it can read as JSON.
    pub const fn facts(&self) -> RouteFacts {
        RouteFacts {
            name: self.name(),
            published_name: self.published_name(),
            streams: self.is_dynamic(),
            native: self.is_native(),
            reads_checkpoint: self.reads_checkpoint(),
            budget_setting: self.budget_setting(),
            takes_auto_budget: self.takes_auto_budget(),
            layer_units: matches!(self, Route::LinearConvolution),
        }
    }
}

/// The route's predicates as data ([`Route::facts`]): what a host (the Python package) reads
/// instead of comparing route names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
pub struct RouteFacts {
    /// [`Route::name`].
    pub name: &'static str,
    /// [`Route::published_name`].
    pub published_name: &'static str,
    /// [`Route::is_dynamic`]: ddo's arena streams the component.
    pub streams: bool,
    /// [`Route::is_native`].
    pub native: bool,
    /// [`Route::reads_checkpoint`].
    pub reads_checkpoint: bool,
    /// [`Route::budget_setting`].
    pub budget_setting: Option<&'static str>,
    /// [`Route::takes_auto_budget`].
    pub takes_auto_budget: bool,
    /// Whether each convolution and linear layer is its own unit (route `linear_convolution`),
    /// not each repeated block.
    pub layer_units: bool,
}

impl RouteFacts {
    /// The facts of the route named `name` (as [`Route::name`] writes it), or `None` for a
    /// name that is no route. Group-offload parameters do not change the facts.
    pub fn of_name(name: &str) -> Option<RouteFacts> {
        let route = match name {
            "linear_runtime" => Route::LinearRuntime,
            "linear_convolution" => Route::LinearConvolution,
            "vmm_fast_runtime" => Route::VmmFastRuntime,
            "vmm_runtime" => Route::VmmRuntime,
            "diffusers_group_offload" => Route::DiffusersGroupOffload(GroupOffload {
                offload_type: OffloadType::LeafLevel,
                use_stream: false,
                record_stream: false,
                low_cpu_mem_usage: false,
                num_blocks_per_group: 1,
            }),
            "none" => Route::None { placement: Placement::Unmanaged },
            _ => return None,
        };
        Some(route.facts())
    }
}

/// Parameters up to this many KiB stay resident on route `linear_convolution` unless the
/// configuration sets `small_tensor_threshold_kb` (the published route's threshold).
pub const LAYER_ROUTE_RESIDENT_KIB: u32 = 16;

/// The parameter dtypes route `linear_convolution` streams: plain float weights, since each
/// layer runs its own forward on them (a quantized or integer parameter is refused).
pub const LAYER_ROUTE_DTYPES: [ddo_core::Dtype; 4] =
    [ddo_core::Dtype::F16, ddo_core::Dtype::BF16, ddo_core::Dtype::F32, ddo_core::Dtype::F64];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_agree_with_the_published_names() {
        let streamed = [
            Route::LinearRuntime,
            Route::LinearConvolution,
            Route::VmmFastRuntime,
            Route::VmmRuntime,
        ];
        for route in streamed {
            assert!(route.is_dynamic());
            assert_eq!(route.published_name(), "dynamic_offload");
            assert_eq!(route.facts().name, route.name());
        }
        let none = Route::None { placement: Placement::Unmanaged };
        assert_eq!(none.published_name(), "none");
        assert!(!none.facts().streams && none.budget_setting().is_none());
        assert!(Route::VmmRuntime.reads_checkpoint() && !Route::LinearRuntime.reads_checkpoint());
        assert_eq!(Route::VmmFastRuntime.budget_setting(), Some("vmm_resident_weight_budget_gb"));
        assert_eq!(Route::LinearRuntime.budget_setting(), Some("resident_module_budget_gb"));
        assert_eq!(Route::VmmRuntime.budget_setting(), None);
        assert!(Route::VmmFastRuntime.takes_auto_budget());
        assert!(
            !Route::VmmRuntime.takes_auto_budget() && !Route::LinearRuntime.takes_auto_budget()
        );
        for route in streamed.into_iter().chain([none]) {
            assert_eq!(RouteFacts::of_name(route.name()), Some(route.facts()));
        }
        assert_eq!(RouteFacts::of_name("dynamic_offload"), None);
        let json = serde_json::to_value(Route::LinearConvolution.facts()).unwrap();
        assert_eq!(json["published_name"], "dynamic_offload");
        assert_eq!(json["budget_setting"], serde_json::Value::Null);
    }

    #[test]
    fn aliases_and_errors() {
        for (alias, want) in [
            ("group", RouteChoice::DiffusersGroupOffload),
            ("DDO", RouteChoice::DynamicOffload),
            ("cuda", RouteChoice::None),
            ("", RouteChoice::Auto),
            (" Linear_Convolution ", RouteChoice::LinearConvolution),
        ] {
            assert_eq!(RouteChoice::parse(alias, Origin::Argument), Ok(want));
        }
        assert_eq!(
            RouteChoice::parse("fast", Origin::Argument).unwrap_err().to_string(),
            "route = \"fast\" (from argument) is not valid; allowed: auto, dynamic_offload, linear_convolution, diffusers_group_offload, none"
        );
    }
}
