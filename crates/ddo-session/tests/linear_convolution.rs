//! Route `linear_convolution` on the host backend: each layer of a VAE-shaped module is a unit,
//! small parameters and norms stay resident, and the arena's budget is two layers plus them.

use std::sync::Arc;

use ddo_core::{Dtype, HostBytes, HostRegion, HostSlice, StreamId};
use ddo_session::{
    ComponentSession, ModuleNode, ModuleTree, ParameterRef, SessionSpec, Weights, testing,
};
use ddo_source::{HostTensor, MmapChoice};

const S: StreamId = StreamId(0);

/// Blocks of the list `down`.
const DOWN: usize = 8;

/// `(name, shape)` of the module's BF16 parameters, VAE-shaped: layers `conv_in`,
/// `down.N.conv` (4.5 MiB each), `mid.attn.to_q` (a linear layer) and `conv_out` (9 KiB, under
/// the route's 16 KiB threshold), with biases; norms between them.
fn parameters() -> Vec<(String, Vec<u64>)> {
    let mut out = vec![("conv_in.weight".to_owned(), vec![512, 16, 3, 3])];
    out.push(("conv_in.bias".into(), vec![512]));
    for b in 0..DOWN {
        out.push((format!("down.{b}.norm.weight"), vec![512]));
        out.push((format!("down.{b}.conv.weight"), vec![512, 512, 3, 3]));
        out.push((format!("down.{b}.conv.bias"), vec![512]));
    }
    out.push(("mid.attn.to_q.weight".into(), vec![512, 512]));
    out.push(("conv_out.weight".into(), vec![1, 512, 3, 3]));
    out
}

fn layers() -> Vec<String> {
    let mut out = vec!["conv_in".to_owned()];
    out.extend((0..DOWN).map(|b| format!("down.{b}.conv")));
    out.extend(["mid.attn.to_q".to_owned(), "conv_out".to_owned()]);
    out
}

fn bytes(shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() * 2
}

fn tree() -> ModuleTree {
    let mut paths: Vec<String> = vec![String::new()];
    for (name, _) in parameters() {
        let parts: Vec<&str> = name.split('.').collect();
        for depth in 1..parts.len() {
            let path = parts[..depth].join(".");
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
    }
    ModuleTree {
        modules: paths
            .into_iter()
            .map(|path| ModuleNode {
                is_list: path == "down",
                layer: layers().contains(&path),
                path,
            })
            .collect(),
        parameters: parameters()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| ParameterRef {
                name,
                key: i as u64,
                dtype: Some(Dtype::BF16),
                shape: Some(shape),
            })
            .collect(),
    }
}

fn weights() -> Weights {
    let storages = parameters()
        .iter()
        .enumerate()
        .map(|(t, (_, shape))| {
            let data = testing::expected_bytes(t, bytes(shape));
            HostSlice::whole(Arc::new(HostBytes::from(data)) as Arc<dyn HostRegion>)
        })
        .collect();
    let tensors = parameters()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| HostTensor {
            name,
            dtype: Dtype::BF16,
            shape,
            storage: i,
            offset: 0,
        })
        .collect();
    Weights::Host { storages, tensors, mmap: MmapChoice::never() }
}

fn open(extra: &[(&str, &str)]) -> ComponentSession {
    let mut args = vec![("execution_device", "cpu"), ("route", "linear_convolution")];
    args.extend_from_slice(extra);
    let plan = ddo_session::resolve("vae", &args).unwrap();
    ddo_compose::open(SessionSpec { plan, weights: weights(), tree: Some(tree()) }).unwrap()
}

#[test]
fn each_layer_is_a_unit_and_small_parameters_stay_resident() {
    let session = open(&[]);
    let units = session.units().unwrap();
    let streamed: Vec<&str> = units.iter().filter(|u| !u.pinned).map(|u| u.name.as_str()).collect();
    // conv_out's weight is under the route's 16 KiB threshold: it stays resident.
    let layers = layers();
    assert_eq!(streamed, layers[..layers.len() - 1]);
    let a = session.assignment();
    let resident: Vec<&str> =
        a.resident().iter().map(|&i| a.parameters[i].names[0].as_str()).collect();
    assert!(
        resident
            .iter()
            .all(|n| n.ends_with(".bias") || n.contains("norm") || *n == "conv_out.weight"),
        "{resident:?}"
    );
    assert_eq!(resident.len(), 2 * DOWN + 2);

    let m = session.metrics(None);
    assert_eq!(m.route, "dynamic_offload");
    assert_eq!(m.runtime_route(), "linear_convolution");
    assert_eq!(m.setup.streamed_units, Some(layers.len() as u64 - 1));
    // The budget is a few slots of the largest layer plus the resident rest, not the module.
    let total: u64 = parameters().iter().map(|(_, s)| bytes(s)).sum();
    let budget = m.setup.gpu_budget_bytes.unwrap();
    assert!(budget < total, "budget {budget} of {total} bytes");
    assert_eq!(m.setup.slot_bytes, Some(6 << 20), "a 4.5 MiB layer in 2 MiB granules");
    let all = parameters();
    let expect = |name: &str| {
        let t = all.iter().position(|(n, _)| n == name).unwrap();
        testing::expected_bytes(t, bytes(&all[t].1))
    };
    for _ in 0..2 {
        session.begin_pass(S).unwrap();
        for unit in units.iter().filter(|u| !u.pinned) {
            let lease = session.acquire(unit.id, S).unwrap();
            let name = format!("{}.weight", unit.name);
            assert!(session.read_tensor(&name).unwrap() == expect(&name), "{name}");
            session.release(lease, S).unwrap();
        }
        for name in ["conv_in.bias", "down.3.norm.weight", "conv_out.weight"] {
            assert_eq!(session.read_tensor(name).unwrap(), expect(name), "{name}");
        }
        session.end_pass(S).unwrap();
    }
    let m = session.metrics(None);
    m.validate().unwrap();
    assert_eq!(m.runtime.passes, Some(2));
    assert!(m.runtime.peak_bytes.unwrap() <= budget);
    session.close().unwrap();
}

#[test]
fn the_threshold_decides_which_parameters_stream() {
    let session = open(&[("small_tensor_threshold_kb", "0")]);
    let streamed = session.units().unwrap().into_iter().filter(|u| !u.pinned).count();
    assert_eq!(streamed, layers().len(), "every layer, biases with their weights");
    assert!(session.warnings().is_empty(), "{:?}", session.warnings());
    session.close().unwrap();
    let session = open(&[("small_tensor_threshold_kb", "8192")]);
    assert_eq!(session.units().unwrap().into_iter().filter(|u| !u.pinned).count(), 0);
    assert!(session.warnings().iter().any(|w| w.contains("every parameter stays resident")));
    session.close().unwrap();
}
