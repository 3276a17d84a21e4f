//! The module tree as data, and the one rule that finds execution units in it.
//!
//! A host describes its model as a [`ModuleTree`]: every module's path (marked when it is a list
//! of repeated blocks) and every parameter name with a storage key (aliases of one shared
//! parameter share the key). A Rust program with only a checkpoint builds the same tree from
//! tensor names ([`ModuleTree::from_tensor_names`]). [`ModuleTree::assign`] then decides, once,
//! for everyone: which blocks are streamed units and which parameters stay resident.

use std::collections::{BTreeMap, HashMap};

use ddo_core::{Dtype, TensorSlice};
use regex::Regex;

use crate::{ArenaError, UnitSpec};

/// One module of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleNode {
    /// Dotted path from the root (`transformer_blocks.3`); the root is `""`.
    pub path: String,
    /// A list of repeated blocks (PyTorch's `ModuleList`).
    pub is_list: bool,
    /// A leaf layer whose weights a [`UnitKind::Layers`] rule streams on their own (a
    /// convolution or linear layer).
    pub layer: bool,
}

/// One parameter name. Aliases of a shared (tied) parameter carry the same `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParameterRef {
    /// Dotted name (`transformer_blocks.3.attn.to_q.weight`).
    pub name: String,
    /// Identity of the parameter's storage: equal keys are one parameter.
    pub key: u64,
    /// The parameter's element type, when the host knows it (checked against the weights).
    pub dtype: Option<Dtype>,
    /// The parameter's shape, when the host knows it (checked against the weights).
    pub shape: Option<Vec<u64>>,
}

/// A model's structure: modules in definition order (root first) and parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleTree {
    /// Modules in definition order.
    pub modules: Vec<ModuleNode>,
    /// Parameters in definition order, every alias listed.
    pub parameters: Vec<ParameterRef>,
}

/// What one execution unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnitKind {
    /// A child of an outermost list of repeated blocks (a transformer block).
    #[default]
    Blocks,
    /// One layer ([`ModuleNode::layer`]) on its own, for modules without repeated blocks (a VAE):
    /// its own parameters larger than `resident_bytes` stream, smaller ones (biases) and those of
    /// every other module (norms) stay resident.
    Layers {
        /// Parameters of at most this many bytes stay resident.
        resident_bytes: u64,
    },
}

/// Which modules are streamed and which are kept on the device (regexes with search semantics
/// on module paths, as Python's `re.search`).
#[derive(Debug, Clone)]
pub struct UnitRule {
    /// Only units whose path matches are streamed (`vmm_module_pattern`; `.*` = all).
    pub streamed: Regex,
    /// Parameters of modules matching any of these stay resident
    /// (`always_resident_modules_pattern`).
    pub always_resident: Vec<Regex>,
    /// Blocks or layers.
    pub kind: UnitKind,
}

impl Default for UnitRule {
    fn default() -> Self {
        UnitRule {
            streamed: Regex::new(".*").expect("valid"),
            always_resident: Vec::new(),
            kind: UnitKind::Blocks,
        }
    }
}

impl UnitRule {
    /// The rule from the settings' patterns; an invalid regex names the setting.
    pub fn from_patterns(streamed: &str, always_resident: &[String]) -> Result<Self, ArenaError> {
        let compile = |setting: &'static str, p: &str| {
            Regex::new(p).map_err(|e| {
                ArenaError::InvalidUnits(format!(
                    "{setting}: {p:?} is not a valid regular expression: {e}"
                ))
            })
        };
        Ok(UnitRule {
            streamed: compile("vmm_module_pattern", streamed)?,
            always_resident: always_resident
                .iter()
                .map(|p| compile("always_resident_modules_pattern", p))
                .collect::<Result<_, _>>()?,
            kind: UnitKind::Blocks,
        })
    }

    /// The same rule with one unit per layer; parameters of at most `resident_bytes` stay
    /// resident.
    pub fn by_layers(self, resident_bytes: u64) -> Self {
        UnitRule { kind: UnitKind::Layers { resident_bytes }, ..self }
    }
}

/// One distinct parameter: its names (the first is canonical) and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parameter {
    /// Every name of the parameter, first one canonical.
    pub names: Vec<String>,
    /// The storage key.
    pub key: u64,
    /// The streamed unit that owns it, or `None` when it stays resident.
    pub unit: Option<usize>,
    /// Element type as the host declared it.
    pub dtype: Option<Dtype>,
    /// Shape as the host declared it.
    pub shape: Option<Vec<u64>>,
}

/// A streamed unit: one repeated block, or one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundUnit {
    /// The unit's module path (`transformer_blocks.3`, or a layer's: `decoder.conv_in`).
    pub path: String,
    /// Indices into [`Assignment::parameters`].
    pub parameters: Vec<usize>,
}

/// The outcome of the unit rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Streamed units in module order.
    pub units: Vec<FoundUnit>,
    /// Every distinct parameter, in order of first appearance.
    pub parameters: Vec<Parameter>,
}

impl Assignment {
    /// Indices of the parameters that stay resident.
    pub fn resident(&self) -> Vec<usize> {
        (0..self.parameters.len()).filter(|&i| self.parameters[i].unit.is_none()).collect()
    }
}

impl ModuleTree {
    /// The tree implied by dotted tensor names: every proper prefix is a module; a module whose
    /// children are all numbered (`blocks.0`, `blocks.1`) is a list. Each name is its own
    /// parameter (key = its index).
    pub fn from_tensor_names<'a>(names: impl IntoIterator<Item = &'a str>) -> ModuleTree {
        let mut modules: Vec<String> = vec![String::new()];
        let mut seen: HashMap<String, ()> = HashMap::from([(String::new(), ())]);
        let mut children: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut parameters = Vec::new();
        for (i, name) in names.into_iter().enumerate() {
            let parts: Vec<&str> = name.split('.').collect();
            for depth in 1..parts.len() {
                let path = parts[..depth].join(".");
                if seen.insert(path.clone(), ()).is_none() {
                    let parent = parts[..depth - 1].join(".");
                    children.entry(parent).or_default().push(parts[depth - 1].to_owned());
                    modules.push(path);
                }
            }
            parameters.push(ParameterRef {
                name: name.to_owned(),
                key: i as u64,
                dtype: None,
                shape: None,
            });
        }
        let modules = modules
            .into_iter()
            .map(|path| {
                let is_list = children
                    .get(&path)
                    .is_some_and(|c| !c.is_empty() && c.iter().all(|s| s.parse::<u64>().is_ok()));
                ModuleNode { path, is_list, layer: false }
            })
            .collect();
        ModuleTree { modules, parameters }
    }

    /// Applies the unit rule. Blocks: the children of every list with at least two children
    /// that hold parameters become units, outermost lists only, in module order. Layers: every
    /// layer holding a parameter larger than the rule's resident size is a unit, in module
    /// order. Either way, units the rule does not stream, parameters of always-resident modules,
    /// and parameters shared between units or with the rest stay resident.
    pub fn assign(&self, rule: &UnitRule) -> Assignment {
        let unit_paths = match rule.kind {
            UnitKind::Blocks => self.block_paths(),
            UnitKind::Layers { .. } => {
                self.modules.iter().filter(|m| m.layer).map(|m| m.path.clone()).collect()
            }
        };
        let layer_index: HashMap<&str, usize> =
            unit_paths.iter().enumerate().map(|(i, u)| (u.as_str(), i)).collect();
        let unit_of = |p: &ParameterRef| -> Option<usize> {
            // The parameter's module and every module above it.
            let module = p.name.rsplit_once('.').map_or("", |(m, _)| m);
            let mut ancestors = module.match_indices('.').map(|(i, _)| &module[..i]);
            let resident = |m: &str| rule.always_resident.iter().any(|r| r.is_match(m));
            if resident(module) || ancestors.any(resident) {
                return None;
            }
            match rule.kind {
                UnitKind::Blocks => {
                    unit_paths.iter().position(|u| p.name.starts_with(&format!("{u}.")))
                }
                // A layer's own parameters; a size the host did not give counts as large.
                UnitKind::Layers { resident_bytes } => {
                    let bytes = match (p.dtype, &p.shape) {
                        (Some(d), Some(shape)) => {
                            shape.iter().product::<u64>().saturating_mul(d.size_bytes())
                        }
                        _ => u64::MAX,
                    };
                    if bytes <= resident_bytes {
                        return None;
                    }
                    layer_index.get(module).copied()
                }
            }
        };
        // One entry per key; a key whose names fall in different places stays resident.
        let mut parameters: Vec<Parameter> = Vec::new();
        let mut by_key: HashMap<u64, usize> = HashMap::new();
        for p in &self.parameters {
            let unit = unit_of(p);
            match by_key.get(&p.key) {
                Some(&i) => {
                    let entry = &mut parameters[i];
                    if entry.unit != unit {
                        entry.unit = None;
                    }
                    entry.names.push(p.name.clone());
                }
                None => {
                    by_key.insert(p.key, parameters.len());
                    parameters.push(Parameter {
                        names: vec![p.name.clone()],
                        key: p.key,
                        unit,
                        dtype: p.dtype,
                        shape: p.shape.clone(),
                    });
                }
            }
        }
        Self::group(unit_paths, parameters, rule)
    }

    /// The paths of the blocks: children of the outermost lists with at least two children
    /// that hold parameters, in module order.
    fn block_paths(&self) -> Vec<String> {
        let holds_params = |path: &str| {
            let prefix = format!("{path}.");
            self.parameters.iter().any(|p| p.name.starts_with(&prefix))
        };
        let mut unit_paths: Vec<String> = Vec::new();
        for m in &self.modules {
            let inside = unit_paths.iter().any(|u| m.path.starts_with(&format!("{u}.")));
            if inside || !m.is_list {
                continue;
            }
            let depth = if m.path.is_empty() { 0 } else { m.path.split('.').count() };
            let mut children: Vec<&str> = self
                .modules
                .iter()
                .map(|c| c.path.as_str())
                .filter(|c| {
                    let direct = if m.path.is_empty() {
                        !c.is_empty()
                    } else {
                        c.starts_with(&format!("{}.", m.path))
                    };
                    direct && c.split('.').count() == depth + 1 && holds_params(c)
                })
                // A list of lists is only iterated, never called: its lists' children are the
                // blocks (found when the inner lists are visited).
                .filter(|c| !self.modules.iter().any(|n| n.path == *c && n.is_list))
                .collect();
            // Blocks run in index order (names may list them otherwise).
            let index = |c: &str| c.rsplit('.').next().and_then(|i| i.parse::<u64>().ok());
            if children.iter().all(|c| index(c).is_some()) {
                children.sort_by_key(|c| index(c));
            }
            if children.len() >= 2 {
                unit_paths.extend(children.into_iter().map(str::to_owned));
            }
        }
        unit_paths
    }

    /// Units in module order from the parameters' unit indices into `unit_paths`; units the
    /// rule does not stream give their parameters back to the resident rest.
    fn group(
        unit_paths: Vec<String>,
        mut parameters: Vec<Parameter>,
        rule: &UnitRule,
    ) -> Assignment {
        let streamed: Vec<bool> = unit_paths.iter().map(|u| rule.streamed.is_match(u)).collect();
        let mut units: Vec<FoundUnit> = Vec::new();
        let mut index = vec![None; unit_paths.len()];
        for (i, p) in parameters.iter_mut().enumerate() {
            let Some(u) = p.unit else { continue };
            if !streamed[u] {
                p.unit = None;
                continue;
            }
            let slot = *index[u].get_or_insert_with(|| {
                units.push(FoundUnit { path: unit_paths[u].clone(), parameters: Vec::new() });
                units.len() - 1
            });
            units[slot].parameters.push(i);
            p.unit = Some(slot);
        }
        // Units in module order (the first parameter seen may belong to a later block).
        let mut order: Vec<usize> = (0..units.len()).collect();
        order.sort_by_key(|&u| unit_paths.iter().position(|p| *p == units[u].path));
        let mut remap = vec![0; units.len()];
        for (new, &old) in order.iter().enumerate() {
            remap[old] = new;
        }
        for p in &mut parameters {
            if let Some(u) = p.unit.as_mut() {
                *u = remap[*u];
            }
        }
        let mut sorted = vec![None; units.len()];
        for (old, u) in units.into_iter().enumerate() {
            sorted[remap[old]] = Some(u);
        }
        Assignment { units: sorted.into_iter().flatten().collect(), parameters }
    }
}

impl Assignment {
    /// The arena's units for `slices` (tensors named like the parameters): the resident rest as
    /// one pinned unit (first), then one unit per block. Parameters without a tensor are left
    /// out.
    pub fn unit_specs(&self, slices: &[TensorSlice]) -> Vec<UnitSpec> {
        let index: HashMap<&str, usize> =
            slices.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let slice_of =
            |p: usize| self.parameters[p].names.iter().find_map(|n| index.get(n.as_str()).copied());
        let mut specs = Vec::with_capacity(self.units.len() + 1);
        let rest: Vec<usize> = self.resident().into_iter().filter_map(slice_of).collect();
        if !rest.is_empty() {
            specs.push(UnitSpec { name: "resident".into(), tensors: rest, pinned: true });
        }
        for u in &self.units {
            let tensors: Vec<usize> = u.parameters.iter().filter_map(|&p| slice_of(p)).collect();
            if !tensors.is_empty() {
                specs.push(UnitSpec { name: u.path.clone(), tensors, pinned: false });
            }
        }
        specs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(lists: &[&str], modules: &[&str], params: &[(&str, u64)]) -> ModuleTree {
        let mut m = vec![ModuleNode { path: String::new(), is_list: false, layer: false }];
        m.extend(modules.iter().map(|p| ModuleNode {
            path: (*p).to_owned(),
            is_list: lists.contains(p),
            layer: false,
        }));
        ModuleTree {
            modules: m,
            parameters: params
                .iter()
                .map(|(n, k)| ParameterRef {
                    name: (*n).to_owned(),
                    key: *k,
                    dtype: None,
                    shape: None,
                })
                .collect(),
        }
    }

    fn names(a: &Assignment) -> Vec<&str> {
        a.units.iter().map(|u| u.path.as_str()).collect()
    }

    #[test]
    fn blocks_of_outermost_lists_become_units_in_module_order() {
        let t = ModuleTree::from_tensor_names([
            "embed.weight",
            "blocks.0.attn.weight",
            "blocks.0.inner.0.w",
            "blocks.0.inner.1.w",
            "blocks.1.attn.weight",
            "single.0.w",
            "single.1.w",
            "norm.weight",
        ]);
        let a = t.assign(&UnitRule::default());
        assert_eq!(names(&a), vec!["blocks.0", "blocks.1", "single.0", "single.1"]);
        assert_eq!(a.units[0].parameters.len(), 3, "a nested list stays inside its block");
        let resident: Vec<&str> =
            a.resident().iter().map(|&i| a.parameters[i].names[0].as_str()).collect();
        assert_eq!(resident, vec!["embed.weight", "norm.weight"]);
    }

    #[test]
    fn a_list_with_one_block_is_no_unit_but_lists_inside_it_are() {
        let t = tree(
            &["outer", "outer.0.inner"],
            &["outer", "outer.0", "outer.0.inner", "outer.0.inner.0", "outer.0.inner.1"],
            &[("outer.0.inner.0.w", 1), ("outer.0.inner.1.w", 2)],
        );
        assert_eq!(
            names(&t.assign(&UnitRule::default())),
            vec!["outer.0.inner.0", "outer.0.inner.1"]
        );
    }

    #[test]
    fn shared_parameters_stay_resident_wherever_their_aliases_are() {
        let t = tree(
            &["blocks"],
            &["blocks", "blocks.0", "blocks.1", "blocks.2", "head"],
            &[
                ("blocks.0.w", 1),
                ("blocks.0.tied", 9),
                ("blocks.1.w", 2),
                ("blocks.1.tied", 9),
                ("blocks.2.w", 3),
                ("blocks.2.own", 7),
                ("head.own_alias", 7),
            ],
        );
        let a = t.assign(&UnitRule::default());
        let resident: Vec<Vec<&str>> = a
            .resident()
            .iter()
            .map(|&i| a.parameters[i].names.iter().map(String::as_str).collect())
            .collect();
        assert_eq!(
            resident,
            vec![vec!["blocks.0.tied", "blocks.1.tied"], vec!["blocks.2.own", "head.own_alias"]]
        );
        assert_eq!(a.units.iter().map(|u| u.parameters.len()).collect::<Vec<_>>(), vec![1, 1, 1]);
    }

    #[test]
    fn patterns_choose_streamed_blocks_and_resident_modules() {
        let t = ModuleTree::from_tensor_names([
            "double.0.attn.w",
            "double.0.proj_out.w",
            "double.1.attn.w",
            "single.0.w",
            "single.1.w",
        ]);
        let rule =
            UnitRule::from_patterns("^single", &[r"(^|\.)proj_out(\.|$)".to_owned()]).unwrap();
        let a = t.assign(&rule);
        assert_eq!(names(&a), vec!["single.0", "single.1"]);
        let rule = UnitRule::from_patterns(".*", &[r"(^|\.)proj_out(\.|$)".to_owned()]).unwrap();
        let a = t.assign(&rule);
        let resident: Vec<&str> =
            a.resident().iter().map(|&i| a.parameters[i].names[0].as_str()).collect();
        assert_eq!(resident, vec!["double.0.proj_out.w"]);
        let err = UnitRule::from_patterns("(", &[]).unwrap_err();
        assert!(err.to_string().contains("vmm_module_pattern"), "{err}");
    }

    #[test]
    fn the_blocks_of_a_list_of_lists_are_the_inner_lists_children() {
        let t = ModuleTree::from_tensor_names([
            "blocks.0.0.w",
            "blocks.0.1.w",
            "blocks.1.0.w",
            "blocks.1.1.w",
        ]);
        assert_eq!(
            names(&t.assign(&UnitRule::default())),
            vec!["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1"]
        );
    }

    #[test]
    fn always_resident_covers_a_module_and_everything_inside_it() {
        let t = ModuleTree::from_tensor_names(["blocks.0.a.w", "blocks.1.a.w", "blocks.2.a.w"]);
        let rule = UnitRule::from_patterns(".*", &[r"^blocks\.0$".to_owned()]).unwrap();
        assert_eq!(names(&t.assign(&rule)), vec!["blocks.1", "blocks.2"]);
    }

    /// A VAE-shaped tree: layers (`conv*`, `attn.to_q`) with weights and biases, norms, a repeated
    /// list of resnets, a tiny layer and a layer whose weight is tied to another's.
    fn vae() -> ModuleTree {
        let layers = [
            "conv_in",
            "down.0.conv1",
            "down.1.conv1",
            "mid.attn.to_q",
            "quant_conv",
            "conv_out",
            "tied_out",
        ];
        let modules = [
            "conv_in",
            "down",
            "down.0",
            "down.0.norm",
            "down.0.conv1",
            "down.1",
            "down.1.norm",
            "down.1.conv1",
            "mid",
            "mid.attn",
            "mid.attn.to_q",
            "quant_conv",
            "conv_out",
            "tied_out",
        ];
        let mut nodes = vec![ModuleNode { path: String::new(), is_list: false, layer: false }];
        nodes.extend(modules.iter().map(|p| ModuleNode {
            path: (*p).to_owned(),
            is_list: *p == "down",
            layer: layers.contains(p),
        }));
        let param = |name: &str, key: u64, shape: &[u64]| ParameterRef {
            name: name.to_owned(),
            key,
            dtype: Some(Dtype::F32),
            shape: Some(shape.to_vec()),
        };
        ModuleTree {
            modules: nodes,
            parameters: vec![
                param("conv_in.weight", 1, &[32, 3, 3, 3]),
                param("conv_in.bias", 2, &[32]),
                param("down.0.norm.weight", 3, &[32]),
                param("down.0.conv1.weight", 4, &[32, 32, 3, 3]),
                param("down.0.conv1.bias", 5, &[32]),
                param("down.1.norm.weight", 6, &[32]),
                param("down.1.conv1.weight", 7, &[64, 32, 3, 3]),
                param("mid.attn.to_q.weight", 8, &[64, 64]),
                param("quant_conv.weight", 9, &[8, 8, 1, 1]),
                param("conv_out.weight", 10, &[3, 64, 3, 3]),
                param("tied_out.weight", 10, &[3, 64, 3, 3]),
            ],
        }
    }

    fn resident_names(a: &Assignment) -> Vec<&str> {
        a.resident().iter().map(|&i| a.parameters[i].names[0].as_str()).collect()
    }

    #[test]
    fn layers_are_units_in_module_order_and_small_parameters_stay_resident() {
        let a = vae().assign(&UnitRule::default().by_layers(1024));
        // Layers, not the repeated list's children; the tiny layer and the tied weight stay.
        assert_eq!(names(&a), vec!["conv_in", "down.0.conv1", "down.1.conv1", "mid.attn.to_q"]);
        assert!(a.units.iter().all(|u| u.parameters.len() == 1), "weights only: biases stay");
        assert_eq!(
            resident_names(&a),
            vec![
                "conv_in.bias",
                "down.0.norm.weight",
                "down.0.conv1.bias",
                "down.1.norm.weight",
                "quant_conv.weight",
                "conv_out.weight"
            ]
        );
        // The same tree by blocks: the repeated list's children.
        assert_eq!(names(&vae().assign(&UnitRule::default())), vec!["down.0", "down.1"]);
    }

    #[test]
    fn with_no_resident_size_every_layer_parameter_streams() {
        let a = vae().assign(&UnitRule::default().by_layers(0));
        assert_eq!(
            names(&a),
            vec!["conv_in", "down.0.conv1", "down.1.conv1", "mid.attn.to_q", "quant_conv"]
        );
        assert_eq!(a.units[0].parameters.len(), 2, "weight and bias");
    }

    #[test]
    fn layer_units_follow_the_patterns_and_unknown_sizes_stream() {
        let rule = UnitRule::from_patterns("^down", &[r"(^|\.)down\.1(\.|$)".to_owned()])
            .unwrap()
            .by_layers(1024);
        assert_eq!(names(&vae().assign(&rule)), vec!["down.0.conv1"]);
        let mut t = vae();
        t.parameters.iter_mut().for_each(|p| p.shape = None);
        let a = t.assign(&UnitRule::default().by_layers(1 << 30));
        assert_eq!(names(&a)[0], "conv_in");
        assert_eq!(a.units[0].parameters.len(), 2, "sizes unknown: the bias streams too");
    }
}
