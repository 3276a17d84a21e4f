//! The Python side: a venv with PyTorch and Diffusers, the `ddo-offload` wheel built with maturin.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::run;

/// The venv every task shares.
pub(crate) const VENV: &str = ".venv";

/// Packages the tests and the demo need, from the package index.
const REQUIREMENTS: &[&str] = &[
    "torch",
    "diffusers",
    "transformers",
    "safetensors",
    "accelerate",
    "peft",
    "gguf",
    "maturin>=1.5,<2",
    "pytest",
];

pub(crate) fn python() -> PathBuf {
    Path::new(VENV).join("bin").join("python")
}

/// Creates `.venv` if needed and installs what is missing (PyTorch takes a few minutes the first
/// time).
pub(crate) fn ensure_env() -> Result<(), String> {
    let py = python();
    if !py.exists() {
        run("python3", &["-m", "venv", VENV])?;
    }
    let ready = Command::new(&py)
        .args([
            "-c",
            "import torch, diffusers, transformers, safetensors, accelerate, peft, gguf, maturin, pytest",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ready {
        let py_s = py.to_string_lossy().into_owned();
        run(&py_s, &["-m", "pip", "install", "--quiet", "--upgrade", "pip"])?;
        let mut args = vec!["-m", "pip", "install", "--quiet"];
        args.extend_from_slice(REQUIREMENTS);
        run(&py_s, &args)?;
    }
    Ok(())
}

/// Builds the abi3 wheel into `target/wheels` and installs it into the venv; returns its path.
pub(crate) fn build_and_install_wheel() -> Result<PathBuf, String> {
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    let maturin = root.join(VENV).join("bin").join("maturin");
    let out = root.join("target/wheels");
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(&maturin)
        .env("VIRTUAL_ENV", root.join(VENV))
        .args(["build", "--release", "--quiet", "-o"])
        .arg(&out)
        .current_dir("crates/ddo-py")
        .status()
        .map_err(|e| format!("could not start maturin: {e}"))?;
    if !status.success() {
        return Err("maturin build failed".into());
    }
    let wheel = std::fs::read_dir(&out)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("maturin wrote no wheel")?;
    let py = python().to_string_lossy().into_owned();
    let wheel_s = wheel.to_string_lossy().into_owned();
    run(&py, &["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", &wheel_s])?;
    Ok(wheel)
}

/// The Python tests, on the installed wheel.
pub(crate) fn test() -> Result<(), String> {
    ensure_env()?;
    build_and_install_wheel()?;
    let py = python().to_string_lossy().into_owned();
    run(&py, &["-m", "pytest", "-q", "-p", "no:cacheprovider", "crates/ddo-py/tests"])
}
