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
}

#[cfg(test)]
mod tests {
    use super::*;

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
