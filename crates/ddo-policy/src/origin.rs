//! Where a resolved value came from.

use std::fmt;

use serde::Serialize;

/// The layer that decided a value, from lowest to highest precedence:
/// default < preset < `DDO_*` env < `DDO_<COMPONENT>_*` env < component policy < the route's
/// own configuration (used when no config is given) < config < argument.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(tag = "layer", content = "name", rename_all = "snake_case")]
pub enum Origin {
    /// The built-in default.
    Default,
    /// The named preset's value table.
    Preset(String),
    /// A global environment variable (`DDO_PIN_CPU_MEMORY`).
    Env(String),
    /// A per-component environment variable (`DDO_VAE_ROUTE`).
    ComponentEnv(String),
    /// A per-component policy of the configuration.
    ComponentPolicy(String),
    /// The configuration a route brings when the caller gives none (`linear_convolution`'s).
    Route(String),
    /// The explicit configuration object.
    Config,
    /// An explicit argument (keyword argument, CLI flag).
    Argument,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("default"),
            Origin::Preset(p) => write!(f, "preset {p}"),
            Origin::Env(v) | Origin::ComponentEnv(v) => f.write_str(v),
            Origin::ComponentPolicy(c) => write!(f, "component policy {c:?}"),
            Origin::Route(r) => write!(f, "route {r}"),
            Origin::Config => f.write_str("config"),
            Origin::Argument => f.write_str("argument"),
        }
    }
}
