//! Which `DDO_*` variables ddo reads, and a warning for every other one, so that a misspelt
//! variable is reported (with the closest name ddo reads) instead of silently doing nothing.
//!
//! A variable is known when it is `DDO_<KEY>` for a setting key or its alias, `DDO_PRESET`,
//! `DDO_BACKEND`, a key of a preset table (host hints such as `DDO_EXECUTION_MODE` or
//! `DDO_RUNNER_ATTENTION_BACKEND` that presets carry), a variable of ddo's test tooling or of
//! the Python package (`DDO_PROGRESS`), or `DDO_<COMPONENT>_<KEY>` for a setting key or component
//! key (`DDO_RUNNER_<COMPONENT>_<KEY>` is that form too). Component names are free, so a
//! misspelt component name cannot be told from another component.

use crate::{ENV_ALIASES, ENV_PREFIX, Environment, Preset, SETTING_KEYS};

/// Keys read per component, as `DDO_<COMPONENT>_<KEY>` then `DDO_RUNNER_<COMPONENT>_<KEY>`.
pub(crate) const COMPONENT_KEYS: &[&str] = &[
    "ROUTE",
    "GROUP_OFFLOAD",
    "DYNAMIC_OFFLOAD",
    "OFFLOAD_TYPE",
    "OFFLOAD_STREAM",
    "OFFLOAD_RECORD_STREAM",
    "OFFLOAD_LOW_CPU_MEM_USAGE",
    "NUM_BLOCKS_PER_GROUP",
];

/// Keys read to select the preset and the backend.
const SELECTION_KEYS: &[&str] = &["PRESET", "BACKEND"];

/// Keys ddo's own test and benchmark tooling reads.
const TOOLING_KEYS: &[&str] = &[
    "TEST_TMPDIR",
    "BENCH_GIB",
    "BENCH_DIR",
    "BENCH_TRACE",
    "BENCH_TIMELINE",
    "DISK_BENCH_GIB",
    "FEATURES_DEVICE",
];

/// Keys the Python package and the composition root read themselves (`DDO_PROGRESS`: its
/// progress bars; `DDO_PROFILE_DIR`: where capacity profiles are stored; `DDO_CACHE_DIR`: the
/// default folder of encoded files).
const HOST_KEYS: &[&str] = &["PROGRESS", "PROFILE_DIR", "CACHE_DIR"];

/// One warning per `DDO_*` variable of `env` that ddo does not read, in name order; variables
/// without the prefix are not ddo's business and are skipped.
/// The first [`SUGGESTED`] unknown variables get the closest name; later ones only the warning,
/// so an environment full of unknown names costs little.
pub(crate) fn unknown_variable_warnings(env: &Environment) -> Vec<String> {
    let exact = exact_keys();
    env.iter()
        .filter_map(|(name, _)| name.strip_prefix(ENV_PREFIX).map(|body| (name, body)))
        .filter(|(_, body)| !exact.contains(body) && !is_component_form(body))
        .enumerate()
        .map(|(i, (name, body))| {
            match (i < SUGGESTED).then(|| suggestion(body, &exact)).flatten() {
                Some(near) => {
                    format!("{name} is not a ddo variable; did you mean {ENV_PREFIX}{near}?")
                }
                None => format!("{name} is not a ddo variable; ddo ignores it"),
            }
        })
        .collect()
}

/// How many unknown variables of one environment are compared with the known names.
const SUGGESTED: usize = 4;

/// Every key read under its own name, without the prefix: settings, aliases, selection, preset
/// table keys, tooling and the Python package's own.
fn exact_keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = SETTING_KEYS.iter().map(|(_, key)| *key).collect();
    keys.extend(ENV_ALIASES.iter().map(|(_, alias)| *alias));
    keys.extend(SELECTION_KEYS);
    keys.extend(Preset::ALL.iter().flat_map(|p| p.values().iter().map(|(key, _)| *key)));
    keys.extend(TOOLING_KEYS);
    keys.extend(HOST_KEYS);
    let mut seen = std::collections::BTreeSet::new();
    keys.retain(|key| seen.insert(*key));
    keys
}

/// Keys that follow a component name.
fn per_component_keys() -> impl Iterator<Item = &'static str> {
    SETTING_KEYS.iter().map(|(_, key)| *key).chain(COMPONENT_KEYS.iter().copied())
}

/// `<COMPONENT>_<KEY>`: a non-empty component name as [`crate::component_env_name`] writes it,
/// then a setting key or component key.
fn is_component_form(body: &str) -> bool {
    body.match_indices('_').any(|(i, _)| {
        let (component, key) = (&body[..i], &body[i + 1..]);
        !component.is_empty()
            && component.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            && per_component_keys().any(|k| k == key)
    })
}

/// The known key closest to `body` (case ignored), when it is close enough to be a misspelling:
/// at most two edits, or a third of the name's length for long names. For `<COMPONENT>_<KEY>`
/// forms only the key part is compared (the component name is free). Exact keys win ties.
const MAX_COMPONENT_LEN: usize = 40;
/// Underscores a component name (with its `RUNNER_` form) may hold, plus one.
const MAX_COMPONENT_PARTS: usize = 5;

fn suggestion(body: &str, exact: &[&'static str]) -> Option<String> {
    let upper = body.to_ascii_uppercase();
    // Within a third of the real name's length; names further apart in length are not
    // compared (a long garbage name costs nothing).
    let near = |written: &str, candidate: &str| {
        let limit = (candidate.len() / 3).max(2);
        edit_distance_within(written, candidate, limit)
    };
    let exact_matches =
        exact.iter().filter_map(|key| near(&upper, key).map(|d| (d, (*key).to_owned())));
    // A component name is short (`TRANSFORMER`, `RUNNER_TEXT_ENCODER_2`): a split further in is
    // not one.
    let component_matches = upper
        .match_indices('_')
        .filter(|(i, _)| (1..=MAX_COMPONENT_LEN).contains(i))
        .take(MAX_COMPONENT_PARTS)
        .flat_map(|(i, _)| {
            let (component, written) = (&upper[..i], &upper[i + 1..]);
            per_component_keys().filter_map(move |key| {
                near(written, key).map(|d| (d, format!("{component}_{key}")))
            })
        });
    let mut best: Option<(usize, String)> = None;
    for (d, candidate) in exact_matches.chain(component_matches) {
        if best.as_ref().is_none_or(|(bd, _)| d < *bd) {
            best = Some((d, candidate));
        }
    }
    best.map(|(_, candidate)| candidate)
}

/// A lower bound of the edit distance, linear in the lengths: each edit changes the count of
/// at most one byte value in either direction, so the larger of the bytes `a` has beyond `b`
/// and `b` beyond `a` (as multisets) needs at least as many edits. Bytes outside `0`..`_`
/// (digits, upper-case letters, `_`) count as one value, which keeps it a lower bound.
fn bag_distance(a: &[u8], b: &[u8]) -> usize {
    let bucket = |c: u8| if (b'0'..=b'_').contains(&c) { usize::from(c - b'0') } else { 48 };
    let mut counts = [0i64; 49];
    for &c in a {
        counts[bucket(c)] += 1;
    }
    for &c in b {
        counts[bucket(c)] -= 1;
    }
    let more: i64 = counts.iter().filter(|n| **n > 0).sum();
    let fewer: i64 = counts.iter().filter(|n| **n < 0).map(|n| -n).sum();
    more.max(fewer) as usize
}

/// Levenshtein distance over bytes (names are ASCII).
#[cfg(test)]
fn edit_distance(a: &str, b: &str) -> usize {
    edit_distance_within(a, b, a.len().max(b.len())).expect("within the longer length")
}

/// The Levenshtein distance of `a` and `b` when it is at most `limit`, else `None`: only the
/// band of cells within `limit` of the diagonal is computed, and a row whose every cell exceeds
/// `limit` ends the search.
fn edit_distance_within(a: &str, b: &str, limit: usize) -> Option<usize> {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len().abs_diff(b.len()) > limit || bag_distance(a, b) > limit {
        return None;
    }
    let far = limit + 1;
    let mut row: Vec<usize> = (0..=b.len()).map(|j| j.min(far)).collect();
    for (i, ca) in a.iter().enumerate() {
        let (lo, hi) = ((i + 1).saturating_sub(limit), (i + 1 + limit).min(b.len()));
        let mut diagonal = row[lo.saturating_sub(1).min(row.len() - 1)];
        if lo == 0 {
            diagonal = row[0];
            row[0] = (i + 1).min(far);
        } else {
            row[lo - 1] = far;
        }
        let mut best = if lo == 0 { row[0] } else { far };
        for j in lo.max(1)..=hi {
            let above = row[j];
            let cost = diagonal + usize::from(*ca != b[j - 1]);
            row[j] = cost.min(above + 1).min(row[j - 1] + 1).min(far);
            diagonal = above;
            best = best.min(row[j]);
        }
        if hi < b.len() {
            row[hi + 1] = far;
        }
        if best > limit {
            return None;
        }
    }
    let d = row[b.len()];
    (d <= limit).then_some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(names: &[&str]) -> Vec<String> {
        unknown_variable_warnings(&Environment::from_pairs(names.iter().map(|n| (*n, "1"))))
    }

    #[test]
    fn a_long_unknown_name_gets_no_suggestion() {
        // Compared only with names of a similar length (a fuzzed name of thousands of
        // underscores once took seconds).
        let name = format!("DDO_{}", "K_".repeat(5000));
        let w = warnings(&[&name]);
        assert!(w.len() == 1 && !w[0].contains("did you mean"), "{}", &w[0][w[0].len() - 60..]);
    }

    #[test]
    fn only_the_first_unknown_names_are_compared() {
        let names: Vec<String> = (0..40).map(|i| format!("DDO_PREFETCH_DEPT{i:02}")).collect();
        let w = warnings(&names.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(w.len(), 40);
        let suggested = w.iter().filter(|w| w.contains("did you mean DDO_PREFETCH_DEPTH?")).count();
        assert_eq!(suggested, SUGGESTED, "{w:?}");
        assert!(w[SUGGESTED..].iter().all(|w| w.ends_with("ddo ignores it")), "{w:?}");
    }

    #[test]
    fn distances() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("PREFETCH_DEPT", "PREFETCH_DEPTH"), 1);
        assert_eq!(edit_distance("AB", ""), 2);
        assert_eq!(bag_distance(b"DEPTH_PREFETCH", b"PREFETCH_DEPTH"), 0);
        assert_eq!(bag_distance(b"KITTEN", b"SITTING"), 3);
        // The banded search agrees with the full one, within and beyond its limit.
        let words = [
            "",
            "A",
            "AB",
            "KITTEN",
            "SITTING",
            "PREFETCH_DEPTH",
            "PREFETCH_DEPT",
            "DEPTH_PREFETCH",
            "XYZ",
            "ZYX",
            "prefetch_depth",
            "é_DEPTH",
        ];
        for a in words {
            for b in words {
                let full = edit_distance(a, b);
                for limit in 0..8 {
                    assert_eq!(
                        edit_distance_within(a, b, limit),
                        (full <= limit).then_some(full),
                        "{a} {b} {limit}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_form_that_resolution_reads_is_known() {
        let known = [
            "DDO_PRESET",
            "DDO_BACKEND",
            "DDO_PREFETCH_DEPTH",
            "DDO_SAFETENSORS_BACKEND",
            "DDO_TRANSFORMER_PREFETCH_DEPTH",
            "DDO_VAE_ROUTE",
            "DDO_TEXT_ENCODER_2_OFFLOAD_STREAM",
            "DDO_RUNNER_TRANSFORMER_NUM_BLOCKS_PER_GROUP",
            "DDO_MODEL_ROUTE",
            "DDO_EXECUTION_MODE",
            "DDO_PLAN",
            "DDO_RUNNER_ATTENTION_BACKEND",
            "DDO_PURGE_WINDOWS_STANDBY_BEFORE_RUN",
            "DDO_TEST_TMPDIR",
            "DDO_BENCH_TRACE",
            "DDO_BENCH_TIMELINE",
            "DDO_DISK_BENCH_GIB",
            "DDO_FEATURES_DEVICE",
            "DDO_PROGRESS",
            "DDO_PROFILE_DIR",
            "DDO_CACHE_DIR",
        ];
        assert_eq!(warnings(&known), Vec::<String>::new());
    }

    #[test]
    fn misspellings_get_the_closest_name() {
        assert_eq!(
            warnings(&[
                "DDO_PREFETCH_DEPT",
                "DDO_TRANSFORMER_PREFETCH_DEPHT",
                "DDO_prefetch_depth"
            ]),
            [
                "DDO_PREFETCH_DEPT is not a ddo variable; did you mean DDO_PREFETCH_DEPTH?",
                "DDO_TRANSFORMER_PREFETCH_DEPHT is not a ddo variable; did you mean DDO_TRANSFORMER_PREFETCH_DEPTH?",
                "DDO_prefetch_depth is not a ddo variable; did you mean DDO_PREFETCH_DEPTH?",
            ]
        );
        assert_eq!(
            warnings(&["DDO_VMM_LIBRARY_PATH", "DDO_", "PATH", "DDOX"]),
            [
                "DDO_ is not a ddo variable; ddo ignores it",
                "DDO_VMM_LIBRARY_PATH is not a ddo variable; ddo ignores it",
            ]
        );
        // A lower-case component name is never read (names are upper-cased).
        assert_eq!(warnings(&["DDO_vae_ROUTE"]).len(), 1);
        // The longest component form: the runner's, of a numbered component.
        assert_eq!(
            warnings(&["DDO_RUNNER_TEXT_ENCODER_2_PREFETCH_DEPT"]),
            ["DDO_RUNNER_TEXT_ENCODER_2_PREFETCH_DEPT is not a ddo variable; did you mean \
              DDO_RUNNER_TEXT_ENCODER_2_PREFETCH_DEPTH?"]
        );
    }
}
