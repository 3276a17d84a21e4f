//! `cargo xtask docs [--check]`: the book's generated references, written from the schemas the
//! code serves, so they cannot drift from it.
//!
//! - `docs/src/reference/configuration.md` from [`ddo_policy::config_schema`] (names, types,
//!   descriptions), the defaults resolution applies when nothing sets a field, the presets' value
//!   tables and the variables ([`ddo_policy::SETTING_KEYS`], [`ddo_policy::ENV_ALIASES`]);
//! - `docs/src/reference/metrics.md` from [`ddo_metrics::metrics_schema`];
//! - `docs/src/reference/crates.md` from `cargo metadata`: each workspace crate, what it is and
//!   which workspace crates it depends on (the layers the architecture page draws).
//!
//! `--check` writes nothing and fails when a file on disk differs from what would be written.
//! [`build_book`] builds the book with mdbook, installed into `target/tools` when missing, and
//! [`api_docs`] the crates' API docs with warnings denied; `cargo xtask ci` runs all three.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Map, Value};

const USAGE: &str = "usage: cargo xtask docs [--check]

  Writes the book's generated references: docs/src/reference/configuration.md (from
  ddo_policy::config_schema()) and docs/src/reference/metrics.md (from
  ddo_metrics::metrics_schema()). --check writes nothing and fails when a file differs.";

/// The generated pages, relative to the workspace root.
const CONFIGURATION_PAGE: &str = "docs/src/reference/configuration.md";
const METRICS_PAGE: &str = "docs/src/reference/metrics.md";
const CRATES_PAGE: &str = "docs/src/reference/crates.md";

/// The variable of each [`ddo_policy::ComponentPolicy`] field, read as `DDO_<COMPONENT>_<KEY>`
/// (then `DDO_RUNNER_<COMPONENT>_<KEY>`). The page refuses to generate when the schema has a
/// field this table lacks.
const COMPONENT_POLICY_KEYS: &[(&str, &str)] = &[
    ("route", "ROUTE"),
    ("group_offload", "GROUP_OFFLOAD"),
    ("dynamic_offload", "DYNAMIC_OFFLOAD"),
    ("offload_type", "OFFLOAD_TYPE"),
    ("use_stream", "OFFLOAD_STREAM"),
    ("record_stream", "OFFLOAD_RECORD_STREAM"),
    ("low_cpu_mem_usage", "OFFLOAD_LOW_CPU_MEM_USAGE"),
    ("num_blocks_per_group", "NUM_BLOCKS_PER_GROUP"),
];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    match args {
        [] => write_all(),
        [flag] if flag == "--check" => check(),
        [flag] if flag == "-h" || flag == "--help" => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(format!("unknown arguments {args:?}\n\n{USAGE}")),
    }
}

/// Fails when a generated page on disk differs from what [`run`] would write.
pub(crate) fn check() -> Result<(), String> {
    let mut stale = Vec::new();
    for (path, text) in pages()? {
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        if on_disk != text {
            stale.push(path.display().to_string());
        }
    }
    if stale.is_empty() {
        eprintln!("docs: the generated references are up to date");
        Ok(())
    } else {
        Err(format!(
            "generated references differ from the code: {}; run `cargo xtask docs`",
            stale.join(", ")
        ))
    }
}

fn write_all() -> Result<(), String> {
    for (path, text) in pages()? {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("docs: wrote {}", path.display());
    }
    Ok(())
}

fn pages() -> Result<Vec<(PathBuf, String)>, String> {
    let root =
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().ok_or("xtask has no parent folder")?;
    Ok(vec![
        (root.join(CONFIGURATION_PAGE), configuration_page()?),
        (root.join(METRICS_PAGE), metrics_page()?),
        (root.join(CRATES_PAGE), crates_page(root)?),
    ])
}

/// The mdbook version installed when none is on `PATH` (Debian packages none).
const MDBOOK_VERSION: &str = "0.5.4";

/// `mdbook build docs`, with mdbook from `PATH`, else from `target/tools/bin` (installed there
/// with `cargo install` first when missing).
pub(crate) fn build_book() -> Result<(), String> {
    let mdbook = mdbook_program()?;
    crate::run(&mdbook, &["build", "docs"])
}

/// `cargo doc --workspace --no-deps` with warnings denied: a doc link to an item that does not
/// exist fails.
pub(crate) fn api_docs() -> Result<(), String> {
    eprintln!("$ RUSTDOCFLAGS=\"-D warnings\" cargo doc --workspace --no-deps");
    let status = Command::new("cargo")
        .env("RUSTDOCFLAGS", "-D warnings")
        .args(["doc", "--workspace", "--no-deps"])
        .status()
        .map_err(|e| format!("could not start cargo doc: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("`cargo doc` failed ({status})")) }
}

fn mdbook_program() -> Result<String, String> {
    let on_path =
        Command::new("mdbook").arg("--version").output().is_ok_and(|o| o.status.success());
    if on_path {
        return Ok("mdbook".to_owned());
    }
    let root = Path::new("target/tools");
    let bin = root.join("bin").join("mdbook");
    if !bin.exists() {
        crate::run(
            "cargo",
            &[
                "install",
                "mdbook",
                "--version",
                MDBOOK_VERSION,
                "--locked",
                "--root",
                &root.to_string_lossy(),
            ],
        )?;
    }
    Ok(bin.to_string_lossy().into_owned())
}

/// The configuration reference.
fn configuration_page() -> Result<String, String> {
    let schema = ddo_policy::config_schema();
    let defs = schema.get("$defs").and_then(Value::as_object).cloned().unwrap_or_default();
    let properties = object(&schema, "properties")?;
    let defaults = declared_defaults()?;
    let unsupported: BTreeMap<&str, &str> =
        ddo_policy::UNSUPPORTED_SETTINGS.iter().copied().collect();
    let keys: BTreeMap<&str, &str> = ddo_policy::SETTING_KEYS.iter().copied().collect();

    let mut out = String::new();
    out.push_str(&generated_note("ddo_policy::config_schema()"));
    out.push_str(
        "# Configuration reference\n\n\
         Every field of `DynamicOffloadConfig` (Python: `ddo.DynamicOffloadConfig`; Rust:\n\
         `ddo_policy::DynamicOffloadConfig`). Every field is optional: an unset field is decided by\n\
         the layers below it (see [Configuration](../guide/configuration.md) for the precedence).\n\
         *Default* is the value when no argument, configuration, variable or preset sets it;\n\
         *Presets* lists the presets whose value table sets the field (what a preset sets wins over\n\
         the default). Every setting is also read per component as\n\
         `DDO_<COMPONENT>_<KEY>` (for example `DDO_TRANSFORMER_PREFETCH_DEPTH`), which beats\n\
         `DDO_<KEY>`.\n\n",
    );

    out.push_str("## Choosing the route\n\n");
    out.push_str("| field | type | variable | description |\n|---|---|---|---|\n");
    for (name, variable) in [
        ("preset", "`DDO_PRESET`"),
        ("backend", "`DDO_BACKEND`"),
        ("route", "`DDO_<COMPONENT>_ROUTE`"),
        ("execution_mode", "`DDO_EXECUTION_MODE` (a preset key)"),
        ("components", "per component, below"),
    ] {
        let field = properties.get(name).ok_or(format!("config_schema() has no field {name}"))?;
        let _ = writeln!(
            out,
            "| `{name}` | {} | {variable} | {} |",
            type_text(field, &defs, None),
            cell(&description(field))
        );
    }

    out.push_str("\n## Settings\n\n");
    out.push_str(
        "| setting | type | default | presets | variable | description |\n|---|---|---|---|---|---|\n",
    );
    let mut refused = String::new();
    for (name, field) in properties {
        let Some(key) = keys.get(name.as_str()) else {
            continue;
        };
        let default = defaults
            .get(name.as_str())
            .ok_or(format!("resolution decided no default for {name}"))?;
        // The variable has its own column.
        let full = description(field);
        let text: Vec<&str> = full
            .split("\n\n")
            .map(str::trim)
            .filter(|p| !p.starts_with("Variable: `DDO_"))
            .collect();
        let text = text.join("\n\n");
        let (text, instead) = match text.split_once("Not supported by ddo:") {
            Some((own, _)) => (own.trim().to_owned(), unsupported.get(name.as_str()).copied()),
            None => (text, None),
        };
        let row = format!(
            "| `{name}` | {} | `{}` | {} | {} | {} |\n",
            type_text(field, &defs, None),
            compact(default),
            preset_values(key),
            variables(key),
            cell(&text),
        );
        match instead {
            Some(instead) => {
                let _ = writeln!(
                    refused,
                    "| `{name}` | `{}` | {} | {} | {} |",
                    compact(default),
                    variables(key),
                    cell(&text),
                    cell(instead)
                );
            }
            None => out.push_str(&row),
        }
    }
    for (name, _) in ddo_policy::SETTING_KEYS {
        if !properties.contains_key(*name) {
            return Err(format!("config_schema() lacks the setting {name}"));
        }
    }

    out.push_str(
        "\n## Published names ddo does not implement\n\n\
         Accepted at their default, refused with what ddo does instead otherwise\n\
         (`ddo_policy::UNSUPPORTED_SETTINGS`).\n\n\
         | setting | default | variable | the published meaning | what ddo does instead |\n\
         |---|---|---|---|---|\n",
    );
    out.push_str(&refused);

    let policy = defs.get("ComponentPolicy").ok_or("config_schema() has no ComponentPolicy")?;
    out.push_str(
        "\n## Component policies\n\n\
         `components={\"vae\": ComponentPolicy(...)}` in the configuration, or per component in\n\
         the environment as `DDO_<COMPONENT>_<KEY>` (then `DDO_RUNNER_<COMPONENT>_<KEY>`).\n\n\
         | field | type | variable | description |\n|---|---|---|---|\n",
    );
    let policy_keys: BTreeMap<&str, &str> = COMPONENT_POLICY_KEYS.iter().copied().collect();
    for (name, field) in object(policy, "properties")? {
        let key = policy_keys
            .get(name.as_str())
            .ok_or(format!("ComponentPolicy's field {name} has no variable in xtask's table"))?;
        let _ = writeln!(
            out,
            "| `{name}` | {} | `DDO_<COMPONENT>_{key}` | {} |",
            type_text(field, &defs, None),
            cell(&description(field))
        );
    }
    Ok(out)
}

/// Every setting's value when nothing sets it: a resolution with an empty environment under the
/// preset `off`, whose value table sets no setting (checked: every origin must be the default).
fn declared_defaults() -> Result<BTreeMap<String, Value>, String> {
    let request = ddo_policy::Request {
        component: "model",
        arguments: ddo_policy::DynamicOffloadConfig {
            preset: Some("off".to_owned()),
            ..Default::default()
        },
        environment: ddo_policy::Environment::empty(),
        ..Default::default()
    };
    let plan = ddo_policy::resolve(&request).map_err(|e| format!("resolving the defaults: {e}"))?;
    let mut out = BTreeMap::new();
    for (name, value) in plan.settings.to_json_pairs() {
        match plan.origins.get(name) {
            Some(ddo_policy::Origin::Default) => {
                out.insert(name.to_owned(), value);
            }
            other => {
                return Err(format!(
                    "{name}: under preset off its value came from {other:?}, not the default"
                ));
            }
        }
    }
    Ok(out)
}

/// The presets whose value table sets `key` (`auto` is `one_shot_fast` on the linear backend and
/// `vmm_fast` on vmm, listed under those names).
fn preset_values(key: &str) -> String {
    let found: Vec<String> = ddo_policy::Preset::ALL
        .iter()
        .filter(|p| **p != ddo_policy::Preset::Auto)
        .filter_map(|p| p.value(key).map(|v| format!("{}: `{v}`", p.as_str())))
        .collect();
    if found.is_empty() { "-".to_owned() } else { found.join("<br>") }
}

/// `DDO_<KEY>` and its aliases.
fn variables(key: &str) -> String {
    let mut names = vec![format!("`DDO_{key}`")];
    names.extend(
        ddo_policy::ENV_ALIASES
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, alias)| format!("`DDO_{alias}`")),
    );
    names.join("<br>")
}

/// The workspace's crates and their dependencies on each other, from `cargo metadata`.
fn crates_page(root: &Path) -> Result<String, String> {
    let out = Command::new("cargo")
        .current_dir(root)
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .output()
        .map_err(|e| format!("could not start cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let metadata: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: {e}"))?;
    let packages = metadata["packages"].as_array().ok_or("cargo metadata lists no packages")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut crates = Vec::new();
    for package in packages {
        let name = package["name"].as_str().unwrap_or_default();
        let manifest = package["manifest_path"].as_str().unwrap_or_default();
        let folder = Path::new(manifest)
            .parent()
            .and_then(|p| p.strip_prefix(root).ok())
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let mut normal = Vec::new();
        let mut dev = Vec::new();
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or_default();
            if !members.contains(&dep_name) || dep_name == name {
                continue;
            }
            match dep["kind"].as_str() {
                Some("dev") => dev.push(dep_name),
                Some("build") => {}
                _ => normal.push(dep_name),
            }
        }
        normal.sort();
        normal.dedup();
        dev.sort();
        dev.dedup();
        dev.retain(|d| !normal.contains(d));
        let description = package["description"].as_str().unwrap_or_default();
        crates.push((name, folder, normal, dev, description));
    }
    // A crate's layer: 0 without workspace dependencies, else one above its highest dependency.
    let mut layer: BTreeMap<&str, usize> = BTreeMap::new();
    while layer.len() < crates.len() {
        let before = layer.len();
        for (name, _, normal, _, _) in &crates {
            if layer.contains_key(name) {
                continue;
            }
            let below: Option<Vec<usize>> = normal.iter().map(|d| layer.get(d).copied()).collect();
            if let Some(below) = below {
                layer.insert(name, below.into_iter().max().map_or(0, |m| m + 1));
            }
        }
        if layer.len() == before {
            return Err("the workspace's crates depend on each other in a circle".into());
        }
    }
    crates.sort_by_key(|(name, ..)| (layer[name], *name));
    let list = |names: &[&str]| {
        if names.is_empty() {
            "-".to_owned()
        } else {
            names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        }
    };
    let mut page = generated_note("cargo metadata");
    page.push_str(
        "# Crates\n\n\
         The workspace's crates, the workspace crates each depends on (dependencies of tests and\n\
         examples apart) and what each is, from the crates' manifests. *Layer* 0 has no\n\
         workspace dependency; every other crate sits one layer above its highest dependency.\n\
         What the layers mean: [Architecture](../architecture.md).\n\n\
         | layer | crate | folder | depends on | tests also use | what it is |\n\
         |---|---|---|---|---|---|\n",
    );
    for (name, folder, normal, dev, description) in &crates {
        let _ = writeln!(
            page,
            "| {} | `{name}` | `{folder}` | {} | {} | {} |",
            layer[name],
            list(normal),
            list(dev),
            cell(description)
        );
    }
    Ok(page)
}

/// The metrics reference.
fn metrics_page() -> Result<String, String> {
    let schema = ddo_metrics::metrics_schema();
    let defs = object(&schema, "$defs")?.clone();
    let current = defs.get("MetricsVersion2").ok_or("metrics_schema() has no MetricsVersion2")?;
    let previous = defs.get("MetricsVersion1").ok_or("metrics_schema() has no MetricsVersion1")?;

    let mut out = String::new();
    out.push_str(&generated_note("ddo_metrics::metrics_schema()"));
    out.push_str(
        "# Metrics reference\n\n\
         A metrics document is `DynamicOffloadMetrics.as_dict()` (Rust:\n\
         `ddo_metrics::DynamicOffloadMetrics`), one component's snapshot. Its JSON Schema is\n\
         `ddo_metrics::metrics_schema()` (Python: `ddo.DynamicOffloadMetrics.json_schema()`):\n\
         `oneOf` the two layouts below, told apart by `schema_version`. A counter a route does not\n\
         have is absent, never zero: *Default* says `absent` for every field a snapshot may leave\n\
         out. See [Metrics and profiles](../guide/metrics.md) for what the counters mean together.\n\n",
    );
    let _ = writeln!(out, "{}\n", description(&schema));

    // Version 2: the document, then every section it refers to, in the order first referred to.
    out.push_str("## Version 2 (what `as_dict()` writes)\n\n");
    let _ = writeln!(out, "{}\n", description(current));
    let mut order = Vec::new();
    out.push_str(&field_table(current, &defs, &mut order)?);
    let mut done = std::collections::BTreeSet::new();
    let mut i = 0;
    while i < order.len() {
        let name = order[i].clone();
        i += 1;
        if !done.insert(name.clone()) {
            continue;
        }
        let def = defs.get(&name).ok_or(format!("metrics_schema() has no definition {name}"))?;
        let _ = writeln!(out, "\n### {name}\n\n{}\n", description(def));
        out.push_str(&field_table(def, &defs, &mut order)?);
    }

    out.push_str("\n## Version 1 (still read)\n\n");
    let _ = writeln!(out, "{}\n", description(previous));
    let mut none = Vec::new();
    out.push_str(&field_table(previous, &defs, &mut none)?);
    Ok(out)
}

/// A table of an object schema's properties; nested objects with properties of their own add
/// rows under a dotted name. Definitions of objects it refers to are pushed onto `refs`.
fn field_table(
    schema: &Value,
    defs: &Map<String, Value>,
    refs: &mut Vec<String>,
) -> Result<String, String> {
    let mut out = String::from("| field | type | default | description |\n|---|---|---|---|\n");
    rows(&mut out, "", schema, defs, refs);
    Ok(out)
}

fn rows(
    out: &mut String,
    prefix: &str,
    schema: &Value,
    defs: &Map<String, Value>,
    refs: &mut Vec<String>,
) {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (name, field) in properties {
        let path = format!("{prefix}{name}");
        let default = if required.contains(&name.as_str()) {
            "required".to_owned()
        } else if let Some(d) = field.get("default") {
            format!("`{}`", compact(d))
        } else {
            "absent".to_owned()
        };
        let _ = writeln!(
            out,
            "| `{path}` | {} | {default} | {} |",
            type_text(field, defs, Some(refs)),
            cell(&description(field))
        );
        let nested = inline_object(field);
        if let Some(nested) = nested {
            rows(out, &format!("{path}."), nested, defs, refs);
        }
    }
}

/// The inline object schema of a field (itself, or a variant of `oneOf`/`anyOf`), when it has
/// properties of its own.
fn inline_object(field: &Value) -> Option<&Value> {
    if field.get("properties").is_some() {
        return Some(field);
    }
    ["oneOf", "anyOf"]
        .iter()
        .find_map(|k| field.get(*k)?.as_array()?.iter().find(|v| v.get("properties").is_some()))
}

/// A field's type in words: `integer`, `number`, `one of `a`, `b``, `[Section](#section)`, ...
/// With `refs`, object definitions become links and are pushed for their own tables.
fn type_text(
    field: &Value,
    defs: &Map<String, Value>,
    mut refs: Option<&mut Vec<String>>,
) -> String {
    if let Some(c) = field.get("const") {
        return format!("`{}` (constant)", compact(c));
    }
    if let Some(target) = field.get("$ref").and_then(Value::as_str) {
        let name = target.rsplit('/').next().unwrap_or(target);
        let Some(def) = defs.get(name) else {
            return format!("`{name}`");
        };
        if let Some(choices) = choices(def) {
            return choices;
        }
        if let Some(refs) = refs.as_deref_mut() {
            refs.push(name.to_owned());
            return format!("[{name}](#{})", name.to_ascii_lowercase());
        }
        return format!("`{name}`");
    }
    if let Some(choices) = choices(field) {
        return choices;
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(variants) = field.get(key).and_then(Value::as_array) {
            let texts: Vec<String> = variants
                .iter()
                .filter(|v| v.get("type").and_then(Value::as_str) != Some("null"))
                .map(|v| type_text(v, defs, refs.as_deref_mut()))
                .collect();
            return texts.join(" or ");
        }
    }
    let types: Vec<&str> = match field.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => {
            ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect()
        }
        _ => Vec::new(),
    };
    let texts: Vec<String> = types
        .iter()
        .map(|t| match *t {
            "array" => match field.get("items") {
                Some(items) => format!("array of {}", type_text(items, defs, refs.as_deref_mut())),
                None => "array".to_owned(),
            },
            "object" => match field.get("additionalProperties") {
                Some(v @ Value::Object(_)) => {
                    format!("map of names to {}", type_text(v, defs, refs.as_deref_mut()))
                }
                _ => "object".to_owned(),
            },
            "integer" if field.get("minimum").and_then(Value::as_i64) == Some(0) => {
                "integer >= 0".to_owned()
            }
            other => other.to_owned(),
        })
        .collect();
    if texts.is_empty() { "any".to_owned() } else { texts.join(" or ") }
}

/// `one of `a`, `b`` for a schema of string constants (`oneOf` of `const`s, or `enum`).
fn choices(schema: &Value) -> Option<String> {
    let values: Vec<String> = if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        e.iter()
            .map(|v| format!("`{}`", v.as_str().map(str::to_owned).unwrap_or(v.to_string())))
            .collect()
    } else {
        let variants = schema.get("oneOf")?.as_array()?;
        variants
            .iter()
            .map(|v| v.get("const").map(|c| format!("`{}`", c.as_str().unwrap_or_default())))
            .collect::<Option<Vec<_>>>()?
    };
    (!values.is_empty()).then(|| format!("one of {}", values.join(", ")))
}

fn description(schema: &Value) -> String {
    let text = schema.get("description").and_then(Value::as_str).unwrap_or_default();
    // Rust intra-doc links (`[`x`](crate::y)`) mean nothing on a page: keep their text.
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("](") {
        let Some(len) = rest[start..].find(')') else { break };
        let target = &rest[start + 2..start + len];
        let (before, after) = rest.split_at(start);
        match before.rfind('[') {
            Some(open) if !target.contains("://") => {
                out.push_str(&before[..open]);
                out.push_str(&before[open + 1..]);
            }
            _ => out.push_str(&rest[..start + len + 1]),
        }
        rest = &after[len + 1..];
    }
    out.push_str(rest);
    // Rustdoc's bare intra-doc links, `[`name`]`.
    out.replace("[`", "`").replace("`]", "`")
}

/// Text in one table cell: paragraphs joined by line breaks, lines by spaces, pipes escaped.
fn cell(text: &str) -> String {
    text.split("\n\n")
        .map(|p| escape_html(&p.split_whitespace().collect::<Vec<_>>().join(" ")))
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("<br>")
        .replace('|', "\\|")
}

/// `<` and `>` outside code spans as entities, so `dynamic_offload_<field>` is not a tag.
fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_code = false;
    for c in text.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '<' if !in_code => out.push_str("&lt;"),
            '>' if !in_code => out.push_str("&gt;"),
            _ => out.push(c),
        }
    }
    out
}

/// A JSON value as one line.
fn compact(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default().replace('|', "\\|")
}

fn object<'a>(value: &'a Value, key: &str) -> Result<&'a Map<String, Value>, String> {
    value.get(key).and_then(Value::as_object).ok_or(format!("the schema has no object {key:?}"))
}

fn generated_note(source: &str) -> String {
    format!(
        "<!-- Generated by `cargo xtask docs` from `{source}`; do not edit. \
         `cargo xtask ci` fails when this file differs from what the code would write. -->\n\n"
    )
}
