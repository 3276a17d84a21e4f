//! Checks of resolved settings: settings ddo does not implement, sizes, ranges, the registration
//! ceiling, the execution device and module patterns. Every error names the setting, the value,
//! where it came from and what is allowed.

use std::collections::BTreeMap;

use crate::error::Number;
use crate::limits::{MAX_PREFETCH_DEPTH, MAX_SOURCE_CACHE_GB, REGISTRATION_SEGMENT_MIB};
use crate::{ConfigError, Origin, Settings};

/// GiB sizes are below 2^34 GiB: 2^64 bytes.
const MAX_GIB: f64 = (1u64 << 34) as f64;

/// The forms `execution_device` accepts, for error messages.
const EXECUTION_DEVICE_FORMS: &str = "cuda, cuda:N, cpu";

/// Checks every resolved setting; `origins` says where each came from.
pub(crate) fn validate(
    s: &Settings,
    origins: &BTreeMap<String, Origin>,
) -> Result<(), ConfigError> {
    let origin = |field: &str| origins.get(field).cloned().unwrap_or(Origin::Default);
    // Unsupported settings first: a range check on a value ddo refuses anyway would mislead.
    if let Some(found) = s.unsupported_values().into_iter().next() {
        return Err(ConfigError::Unsupported {
            field: found.field,
            value: found.value,
            origin: origin(found.field),
            instead: found.instead,
            default: found.default,
        });
    }
    for (field, value) in s.float_fields() {
        if !value.is_finite() || value < 0.0 {
            return Err(ConfigError::InvalidSize {
                field: field.into(),
                value,
                origin: origin(field),
            });
        }
    }
    let out_of_range = |field: &str, value: String, range: &str| ConfigError::OutOfRange {
        field: field.into(),
        value,
        origin: origin(field),
        range: range.into(),
    };
    if s.vmm_source_cache_gb > MAX_SOURCE_CACHE_GB {
        return Err(out_of_range(
            "vmm_source_cache_gb",
            Number(s.vmm_source_cache_gb).to_string(),
            "0 to 32 GiB",
        ));
    }
    if s.vmm_staging_buffer_gb <= 0.0 {
        return Err(out_of_range(
            "vmm_staging_buffer_gb",
            Number(s.vmm_staging_buffer_gb).to_string(),
            "more than 0 GiB (a staging buffer holds the largest unit; 0.625 by default)",
        ));
    }
    if s.prefetch_depth > MAX_PREFETCH_DEPTH {
        return Err(out_of_range("prefetch_depth", s.prefetch_depth.to_string(), "0 to 16 units"));
    }
    if s.pin_cpu_workers == 0 || s.pin_cpu_workers > 64 {
        return Err(out_of_range(
            "pin_cpu_workers",
            s.pin_cpu_workers.to_string(),
            "1 to 64 threads",
        ));
    }
    // After the settings with ranges of their own: a GiB size must be a byte count of 64 bits.
    for (field, value) in s.float_fields() {
        if field.ends_with("_gb") && value >= MAX_GIB {
            return Err(ConfigError::OutOfRange {
                field: field.into(),
                value: Number(value).to_string(),
                origin: origin(field),
                range: format!("0 to below {MAX_GIB} GiB (a 64-bit byte count)"),
            });
        }
    }
    registration(s, origin("vmm_source_registered_gb"))?;
    if !is_execution_device(&s.execution_device) {
        return Err(ConfigError::InvalidChoice {
            field: "execution_device".into(),
            value: s.execution_device.clone(),
            origin: origin("execution_device"),
            allowed: EXECUTION_DEVICE_FORMS.into(),
        });
    }
    let peer = &s.vmm_peer_store_device;
    if !peer.is_empty() && (peer == "cpu" || !is_execution_device(peer)) {
        return Err(ConfigError::InvalidChoice {
            field: "vmm_peer_store_device".into(),
            value: peer.clone(),
            origin: origin("vmm_peer_store_device"),
            allowed: "cuda, cuda:N, or empty for host memory".into(),
        });
    }
    pattern("vmm_module_pattern", &s.vmm_module_pattern, origin)?;
    for entry in &s.always_resident_modules_pattern {
        pattern("always_resident_modules_pattern", entry, origin)?;
    }
    Ok(())
}

/// The registration ceiling fits the storage and is a whole number of segments (0 = storage).
fn registration(s: &Settings, origin: Origin) -> Result<(), ConfigError> {
    let registered = s.vmm_source_registered_gb;
    if registered <= 0.0 {
        return Ok(());
    }
    if registered > s.vmm_source_cache_gb {
        return Err(ConfigError::RegistrationExceedsStorage {
            registered,
            storage: s.vmm_source_cache_gb,
            origin,
        });
    }
    let per_gib = (1024 / REGISTRATION_SEGMENT_MIB) as f64;
    let segments = registered * per_gib;
    if (segments - segments.round()).abs() > 1e-9 {
        let step = 1.0 / per_gib;
        let below = segments.floor() / per_gib;
        return Err(ConfigError::RegistrationNotWholeSegments {
            registered,
            origin,
            segment_mib: REGISTRATION_SEGMENT_MIB,
            step,
            suggestion: if below > 0.0 { below } else { step },
        });
    }
    Ok(())
}

/// `cuda`, `cuda:N` (N a decimal ordinal) or `cpu`.
fn is_execution_device(text: &str) -> bool {
    match text.strip_prefix("cuda") {
        Some("") => true,
        Some(rest) => rest.strip_prefix(':').is_some_and(|n| {
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && n.parse::<u32>().is_ok()
        }),
        None => text == "cpu",
    }
}

/// The pattern compiles as a regular expression.
fn pattern(field: &str, pattern: &str, origin: impl Fn(&str) -> Origin) -> Result<(), ConfigError> {
    match regex::Regex::new(pattern) {
        Ok(_) => Ok(()),
        Err(e) => Err(ConfigError::InvalidPattern {
            field: field.into(),
            pattern: pattern.into(),
            origin: origin(field),
            reason: regex_reason(&e),
        }),
    }
}

/// The one-line reason of a regex error: the `error:` line of a syntax error (whose full text
/// repeats the pattern with a caret over several lines), else the error itself.
fn regex_reason(e: &regex::Error) -> String {
    match e {
        regex::Error::Syntax(text) => text
            .lines()
            .find_map(|line| line.trim_start().strip_prefix("error: "))
            .unwrap_or(text)
            .trim()
            .to_owned(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_device_forms() {
        for ok in ["cuda", "cuda:0", "cuda:12", "cpu"] {
            assert!(is_execution_device(ok), "{ok}");
        }
        for bad in
            ["", "abc", "CUDA", "cuda:", "cuda:-1", "cuda:+1", "cuda0", "cuda:1a", "cpu:0", "gpu"]
        {
            assert!(!is_execution_device(bad), "{bad}");
        }
        assert!(!is_execution_device("cuda:99999999999"));
    }

    #[test]
    fn regex_reasons_are_one_line() {
        let e = regex::Regex::new(&String::from("(abc")).unwrap_err();
        assert_eq!(regex_reason(&e), "unclosed group");
        let e = regex::Regex::new(&String::from("a(?=b)")).unwrap_err();
        assert_eq!(
            regex_reason(&e),
            "look-around, including look-ahead and look-behind, is not supported"
        );
    }
}
