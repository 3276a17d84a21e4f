//! Small checkpoints for tests, examples and demos: written by hand in the safetensors format,
//! with deterministic bytes, so nothing needs model weights.

use std::io::Write;
use std::path::Path;

/// Writes a Flux-like checkpoint of `blocks` repeated blocks (`blocks.N.attn.weight` of `width`
/// x `width` BF16 and `blocks.N.norm.weight` of `width`) plus `embed.weight` and `norm_out.weight`
/// outside them. Byte `i` of tensor `t` is `(t * 31 + i) % 251`.
pub fn write_blocks(path: &Path, blocks: usize, width: u64) -> std::io::Result<()> {
    let mut tensors: Vec<(String, Vec<u64>)> = vec![("embed.weight".into(), vec![width, 8])];
    for b in 0..blocks {
        tensors.push((format!("blocks.{b}.attn.weight"), vec![width, width]));
        tensors.push((format!("blocks.{b}.norm.weight"), vec![width]));
    }
    tensors.push(("norm_out.weight".into(), vec![width]));
    write(path, &tensors)
}

/// Writes BF16 tensors `(name, shape)` in order; byte `i` of tensor `t` is `(t * 31 + i) % 251`.
pub fn write(path: &Path, tensors: &[(String, Vec<u64>)]) -> std::io::Result<()> {
    write_with(path, tensors, |t, i| ((t as u64 * 31 + i) % 251) as u8)
}

/// Writes BF16 tensors `(name, shape)` in order; byte `i` of tensor `t` is `byte(t, i)`.
pub fn write_with(
    path: &Path,
    tensors: &[(String, Vec<u64>)],
    byte: impl Fn(usize, u64) -> u8,
) -> std::io::Result<()> {
    write_dtype(path, ddo_core::Dtype::BF16, tensors, byte)
}

/// Writes tensors `(name, shape)` of `dtype` in order; byte `i` of tensor `t` is `byte(t, i)`.
pub fn write_dtype(
    path: &Path,
    dtype: ddo_core::Dtype,
    tensors: &[(String, Vec<u64>)],
    byte: impl Fn(usize, u64) -> u8,
) -> std::io::Result<()> {
    let typed: Vec<_> = tensors.iter().map(|(n, s)| (n.clone(), dtype, s.clone())).collect();
    write_typed(path, &typed, byte)
}

/// Writes tensors `(name, dtype, shape)` in order; byte `i` of tensor `t` is `byte(t, i)`.
pub fn write_typed(
    path: &Path,
    tensors: &[(String, ddo_core::Dtype, Vec<u64>)],
    byte: impl Fn(usize, u64) -> u8,
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let len = shape.iter().product::<u64>() * dtype.size_bytes();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.as_str(), "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(text.len() as u64).to_le_bytes())?;
    f.write_all(text.as_bytes())?;
    for (t, (_, dtype, shape)) in tensors.iter().enumerate() {
        let len = shape.iter().product::<u64>() * dtype.size_bytes();
        let bytes: Vec<u8> = (0..len).map(|i| byte(t, i)).collect();
        f.write_all(&bytes)?;
    }
    f.flush()
}

/// The bytes [`write()`] stores for tensor number `t` of `len` bytes.
pub fn expected_bytes(t: usize, len: u64) -> Vec<u8> {
    (0..len).map(|i| ((t as u64 * 31 + i) % 251) as u8).collect()
}

/// Resolves the plan of a `transformer` component from settings given as they are written on a
/// command line (`("prefetch_depth", "2")`: a JSON value, else a string), as explicit arguments.
///
/// # Panics
///
/// When a value has the wrong type for its setting (a test's own mistake).
pub fn resolve_plan(args: &[(&str, &str)]) -> Result<ddo_policy::Plan, ddo_policy::ConfigError> {
    let arguments: serde_json::Map<String, serde_json::Value> = args
        .iter()
        .map(|(k, v)| {
            let value = serde_json::from_str(v).unwrap_or(serde_json::Value::String((*v).into()));
            ((*k).to_owned(), value)
        })
        .collect();
    let arguments = serde_json::from_value(serde_json::Value::Object(arguments))
        .unwrap_or_else(|e| panic!("settings {args:?}: {e}"));
    ddo_policy::resolve(&ddo_policy::Request {
        component: "transformer",
        arguments,
        ..ddo_policy::Request::default()
    })
}
