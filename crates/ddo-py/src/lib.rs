//! The Python extension module `ddo._native`: the Rust core of the `ddo` package for Diffusers
//! hosts. Configuration resolution and validation live in `ddo-policy`; this module exposes them
//! to Python so the package holds no second copy of the rules.

use pyo3::prelude::*;

/// The version of the native extension.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The `ddo._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    Ok(())
}
