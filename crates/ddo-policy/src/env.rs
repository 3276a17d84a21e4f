//! The environment as an injected map of `DDO_*` variables.

use std::collections::BTreeMap;

/// Prefix of every variable ddo reads.
pub const ENV_PREFIX: &str = "DDO_";

/// A snapshot of environment variables. Resolution never reads the process environment itself:
/// the host passes [`Environment::from_process`] or a map of its own (tests, `use_environment=False`
/// passes an empty one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    vars: BTreeMap<String, String>,
}

impl Environment {
    /// An empty environment.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The `DDO_*` variables of this process.
    pub fn from_process() -> Self {
        Self::from_pairs(std::env::vars().filter(|(k, _)| k.starts_with(ENV_PREFIX)))
    }

    /// An environment of the given pairs.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Environment { vars: pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect() }
    }

    /// The value of `var`, if set.
    pub fn get(&self, var: &str) -> Option<&str> {
        self.vars.get(var).map(String::as_str)
    }

    /// All variables.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// The name a component takes in variable names: upper case, every non-alphanumeric character
/// replaced by `_`, `MODEL` when empty.
pub fn component_env_name(component: &str) -> String {
    if component.is_empty() {
        return "MODEL".into();
    }
    component
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_names() {
        assert_eq!(component_env_name("text_encoder-2"), "TEXT_ENCODER_2");
        assert_eq!(component_env_name(""), "MODEL");
        let env = Environment::from_pairs([("DDO_PRESET", "off")]);
        assert_eq!(env.get("DDO_PRESET"), Some("off"));
        assert_eq!(env.get("DDO_BACKEND"), None);
    }
}
