//! Typed setting values and their text form (environment variables and preset tables).

use std::fmt;

/// A value that can be written as text in `DDO_*` variables and preset tables.
pub trait SettingValue: Sized + Clone + fmt::Debug {
    /// What the text must look like, for error messages ("a boolean (1/0, true/false, ...)").
    fn expected() -> String;
    /// Parses the text form.
    fn parse_text(text: &str) -> Option<Self>;
    /// The value as JSON, for metrics.
    fn to_json(&self) -> serde_json::Value;
    /// The value as error messages show it: numbers and booleans as they are, text quoted.
    fn to_text(&self) -> String;
}

impl SettingValue for bool {
    fn expected() -> String {
        "a boolean (1/0, true/false, yes/no, on/off)".to_owned()
    }
    fn parse_text(text: &str) -> Option<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Some(true),
            "0" | "false" | "no" | "off" | "" => Some(false),
            _ => None,
        }
    }
    fn to_json(&self) -> serde_json::Value {
        (*self).into()
    }
    fn to_text(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for u32 {
    fn expected() -> String {
        "a whole number >= 0".to_owned()
    }
    fn parse_text(text: &str) -> Option<Self> {
        text.trim().parse().ok()
    }
    fn to_json(&self) -> serde_json::Value {
        (*self).into()
    }
    fn to_text(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for f64 {
    fn expected() -> String {
        "a number".to_owned()
    }
    fn parse_text(text: &str) -> Option<Self> {
        text.trim().parse().ok()
    }
    fn to_json(&self) -> serde_json::Value {
        serde_json::Number::from_f64(*self).map_or(serde_json::Value::Null, Into::into)
    }
    fn to_text(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for String {
    fn expected() -> String {
        "text".to_owned()
    }
    fn parse_text(text: &str) -> Option<Self> {
        Some(text.trim().to_owned())
    }
    fn to_json(&self) -> serde_json::Value {
        self.clone().into()
    }
    fn to_text(&self) -> String {
        format!("{self:?}")
    }
}

impl SettingValue for Vec<String> {
    fn expected() -> String {
        "a list of patterns separated by ',' or ';'".to_owned()
    }
    fn parse_text(text: &str) -> Option<Self> {
        Some(
            text.split([',', ';'])
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        )
    }
    fn to_json(&self) -> serde_json::Value {
        self.clone().into()
    }
    fn to_text(&self) -> String {
        format!("{self:?}")
    }
}

/// Declares a closed set of lower-case choices usable as a setting.
macro_rules! choice {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ::serde::Serialize, ::serde::Deserialize, ::schemars::JsonSchema)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)+
        }

        impl $name {
            /// Every choice, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The choice's name.
            pub const fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }

            /// The choices as one comma-separated string, for error messages.
            pub fn allowed() -> String {
                Self::ALL.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::value::SettingValue for $name {
            fn expected() -> String {
                format!("one of: {}", Self::allowed())
            }
            fn parse_text(text: &str) -> Option<Self> {
                let t = text.trim().to_ascii_lowercase();
                Self::ALL.iter().copied().find(|c| c.as_str() == t)
            }
            fn to_json(&self) -> serde_json::Value {
                self.as_str().into()
            }
            fn to_text(&self) -> String {
                format!("{:?}", self.as_str())
            }
        }
    };
}
pub(crate) use choice;

choice! {
    /// The peer library's automatic budget policy; ddo accepts only `off`.
    AutoBudgetPolicy {
        /// Use the configured budgets as they are.
        Off = "off",
        /// The peer library's budget sized from VRAM and RAM; ddo refuses it.
        Balanced = "balanced"
    }
}

choice! {
    /// The peer library's order of candidates under a budget; ddo accepts only the default.
    Selection {
        /// Model order.
        First = "first",
        /// Evenly spaced through the model first, then the rest.
        Spread = "spread",
        /// Largest first.
        Largest = "largest"
    }
}

choice! {
    /// How the native route reads checkpoint bytes.
    ReadBackend {
        /// The mapping, as `mmap`.
        Auto = "auto",
        /// Memory-map the files.
        Mmap = "mmap",
        /// Positioned reads through the page cache.
        Pread = "pread",
        /// O_DIRECT reads that bypass the page cache.
        Direct = "direct"
    }
}

choice! {
    /// Where the native route converts checkpoint tensors stored in another dtype than their
    /// parameters'.
    ConversionSite {
        /// Widening (bf16 -> fp32, fp8 -> bf16) on the device, where the link carries the
        /// smaller stored bytes; the rest once at load on the host, or on the device when the
        /// host cannot hold the converted copy.
        Auto = "auto",
        /// Once at load, into retained host memory.
        Host = "host",
        /// On the device after each upload, streaming the stored bytes.
        Device = "device"
    }
}

choice! {
    /// Which bf16 tensors the native route streams entropy-coded.
    WeightEncoding {
        /// None: every tensor uploads as its own bytes.
        Off = "off",
        /// The tensors of the units the plan streams, when the device decodes.
        Auto = "auto",
        /// Every unit's tensors.
        On = "on"
    }
}

choice! {
    /// The peer library's way of running a streamed layer; ddo publishes arena views as the
    /// parameters instead and accepts only the default.
    LinearRuntimeStrategy {
        /// Call the functional op with the transient weight.
        Functional = "functional",
        /// Swap the parameter's data around the layer's own forward.
        Swap = "swap"
    }
}

choice! {
    /// Diffusers' group-offload granularity.
    OffloadType {
        /// One group per leaf module.
        LeafLevel = "leaf_level",
        /// Groups of `num_blocks_per_group` blocks.
        BlockLevel = "block_level"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms() {
        assert_eq!(bool::parse_text("Yes"), Some(true));
        assert_eq!(bool::parse_text("maybe"), None);
        assert_eq!(u32::parse_text("-1"), None);
        assert_eq!(
            Vec::<String>::parse_text("a, b;;c"),
            Some(vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(ReadBackend::parse_text("DIRECT"), Some(ReadBackend::Direct));
        assert_eq!(Selection::allowed(), "first, spread, largest");
        assert_eq!(AutoBudgetPolicy::expected(), "one of: off, balanced");
        assert_eq!(1.5f64.to_text(), "1.5");
        assert_eq!(0.0f64.to_text(), "0");
        assert_eq!("cpu".to_owned().to_text(), "\"cpu\"");
        assert_eq!(vec!["a".to_owned()].to_text(), "[\"a\"]");
        assert_eq!(Selection::First.to_text(), "\"first\"");
    }
}
