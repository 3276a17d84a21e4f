//! Resolution for Python: the plan stays a Rust value the session takes; Python reads its JSON.

use std::collections::BTreeMap;

use ddo_session::policy::{ComponentPolicy, DynamicOffloadConfig, Environment, Plan, Request};
use pyo3::prelude::*;

use crate::errors::config_error;

fn parse<T: serde::de::DeserializeOwned>(what: &str, json: &str) -> PyResult<T> {
    serde_json::from_str(json).map_err(|e| config_error(format!("invalid {what}: {e}")))
}

/// A configuration object (JSON text) given as `origin`; errors name the field.
pub(crate) fn typed_config(
    what: &str,
    json: &str,
    origin: ddo_session::policy::Origin,
) -> PyResult<DynamicOffloadConfig> {
    let value: serde_json::Value = parse(what, json)?;
    DynamicOffloadConfig::from_json_value(&value, origin).map_err(config_error)
}

/// One component's resolved plan.
#[pyclass(module = "ddo._native", frozen)]
pub(crate) struct ResolvedPlan {
    pub(crate) plan: Plan,
}

#[pymethods]
impl ResolvedPlan {
    /// The plan as JSON: component, backend, presets, mode, route, settings, origins,
    /// configuration (the metrics section), warnings.
    fn json(&self) -> PyResult<String> {
        let plan = &self.plan;
        let mut json = serde_json::to_value(plan).map_err(config_error)?;
        json["configuration"] = serde_json::to_value(plan.configuration()).map_err(config_error)?;
        json["origins"] = serde_json::to_value(
            plan.origins
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        )
        .map_err(config_error)?;
        json["route_facts"] = serde_json::to_value(plan.route.facts()).map_err(config_error)?;
        json["reads_ahead"] = serde_json::Value::Bool(plan.reads_ahead());
        json["session_route"] =
            serde_json::Value::Bool(ddo_session::SessionRoute::of(&plan.route).is_ok());
        let device = ddo_compose::plan_device(plan).map_err(crate::errors::session_error)?;
        json["device"] = serde_json::Value::String(device.torch_name());
        Ok(json.to_string())
    }

    /// The metrics snapshot of a route the host applies itself (Diffusers' hooks, none): the
    /// route and configuration from the plan, `setup` and `runtime` (JSON objects) as the host
    /// observed them, and the host-memory observation labelled `phase`.
    #[pyo3(signature = (setup, runtime, phase=None))]
    fn host_route_metrics(
        &self,
        setup: &str,
        runtime: &str,
        phase: Option<&str>,
    ) -> PyResult<String> {
        let mut m = ddo_session::plan_snapshot(&self.plan, phase);
        let observed: ddo_session::metrics::SetupSection = parse("setup", setup)?;
        m.setup = ddo_session::metrics::SetupSection {
            group_offload: observed.group_offload.clone().or(m.setup.group_offload),
            placement: observed.placement.clone().or(m.setup.placement),
            warnings: m.setup.warnings,
            ..observed
        };
        m.runtime = parse("runtime", runtime)?;
        m.validate().map_err(config_error)?;
        Ok(m.as_dict().to_string())
    }
}

/// Resolves one component's plan. `arguments`, `group` and `config` are JSON objects (config may
/// be `None`); `environ` maps variable names to values; `running_on_wsl` `None` detects it.
#[pyfunction]
#[pyo3(signature = (component, arguments, group, config, environ, running_on_wsl=None))]
pub(crate) fn resolve(
    component: &str,
    arguments: &str,
    group: &str,
    config: Option<&str>,
    environ: BTreeMap<String, String>,
    running_on_wsl: Option<bool>,
) -> PyResult<ResolvedPlan> {
    let arguments = typed_config("arguments", arguments, ddo_session::policy::Origin::Argument)?;
    let group: ComponentPolicy = parse("component arguments", group)?;
    let config = config
        .map(|c| typed_config("config", c, ddo_session::policy::Origin::Config))
        .transpose()?;
    let request = Request {
        component,
        arguments,
        group,
        config,
        environment: Environment::from_pairs(environ),
        running_on_wsl: running_on_wsl.unwrap_or_else(ddo_compose::running_on_wsl),
    };
    let plan = ddo_session::policy::resolve(&request).map_err(config_error)?;
    Ok(ResolvedPlan { plan })
}
