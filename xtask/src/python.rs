//! The Python side: a venv with PyTorch and Diffusers, the `ddo-offload` wheel built with maturin,
//! the package's lint (ruff) and type check (mypy), and its tests.

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
    "ruff",
    "mypy",
];

/// The Python package's folder.
const PACKAGE_DIR: &str = "crates/ddo-py";

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
            "import torch, diffusers, transformers, safetensors, accelerate, peft, gguf, maturin, pytest, ruff, mypy",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ready {
        let py_s = py.to_string_lossy().into_owned();
        pip(&py_s, &["--upgrade", "pip"])?;
        pip(&py_s, REQUIREMENTS)?;
    }
    Ok(())
}

/// `pip install` without pip's wheel cache (PyTorch's wheels would sit on disk twice) and with its
/// unpacking under `target/pip-tmp`, on the repository's disk rather than a possibly small `/tmp`.
/// A failure reports the free space where the venv lives.
fn pip(py: &str, packages: &[&str]) -> Result<(), String> {
    let tmp = Path::new("target/pip-tmp");
    std::fs::create_dir_all(tmp).map_err(|e| format!("could not create {}: {e}", tmp.display()))?;
    let tmp = tmp.canonicalize().map_err(|e| e.to_string())?;
    let mut args = vec!["-m", "pip", "install", "--quiet", "--no-cache-dir"];
    args.extend_from_slice(packages);
    eprintln!("$ TMPDIR={} {py} {}", tmp.display(), args.join(" "));
    let status = Command::new(py)
        .args(&args)
        .env("TMPDIR", &tmp)
        .env("PIP_NO_CACHE_DIR", "1")
        .status()
        .map_err(|e| format!("could not start {py}: {e}"));
    let _ = std::fs::remove_dir_all(&tmp);
    match status? {
        s if s.success() => Ok(()),
        s => {
            let free = Command::new("df")
                .args(["-h", VENV, "/tmp"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            Err(format!(
                "`{py} {}` failed ({s}); PyTorch with Diffusers needs about 6 GB free where the \
                 venv lives; free space now:\n{free}",
                args.join(" ")
            ))
        }
    }
}

/// Builds the abi3 wheel into `target/wheels` with the venv's maturin; returns its path.
pub(crate) fn build_wheel() -> Result<PathBuf, String> {
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    let maturin = root.join(VENV).join("bin").join("maturin");
    let out = root.join("target/wheels");
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(&maturin)
        .env("VIRTUAL_ENV", root.join(VENV))
        .args(["build", "--release", "--quiet", "-o"])
        .arg(&out)
        .current_dir(PACKAGE_DIR)
        .status()
        .map_err(|e| format!("could not start {}: {e}", maturin.display()))?;
    if !status.success() {
        return Err("maturin build failed".into());
    }
    std::fs::read_dir(&out)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| "maturin wrote no wheel".into())
}

/// Installs `wheel` into the venv in place of any earlier build (its dependencies are the venv's).
fn install_wheel(wheel: &Path) -> Result<(), String> {
    let py = python().to_string_lossy().into_owned();
    let wheel_s = wheel.to_string_lossy().into_owned();
    run(&py, &["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", &wheel_s])
}

/// Builds the abi3 wheel into `target/wheels` and installs it into the venv; returns its path.
pub(crate) fn build_and_install_wheel() -> Result<PathBuf, String> {
    let wheel = build_wheel()?;
    install_wheel(&wheel)?;
    Ok(wheel)
}

/// `cargo xtask wheel`: the abi3 wheel for `pip install` into any environment, built into
/// `target/wheels`; prints its path. Needs only maturin (installed into `.venv` when missing).
pub(crate) fn wheel(args: &[String]) -> Result<(), String> {
    if let Some(arg) = args.first() {
        return Err(format!(
            "wheel takes no arguments (got {arg:?}): it builds the abi3 wheel into target/wheels"
        ));
    }
    let py = python();
    if !py.exists() {
        run("python3", &["-m", "venv", VENV])?;
    }
    if !Path::new(VENV).join("bin").join("maturin").exists() {
        pip(&py.to_string_lossy(), &["maturin>=1.5,<2"])?;
    }
    let wheel = build_wheel()?;
    println!("{}", wheel.display());
    Ok(())
}

/// The package's lint and type check: ruff and mypy, configured in its `pyproject.toml`.
fn lint() -> Result<(), String> {
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    let py = root.join(python());
    let cache = root.join("target");
    let checks: [(&str, Vec<String>); 2] = [
        (
            "ruff",
            vec![
                "check".into(),
                "--cache-dir".into(),
                cache.join("ruff-cache").display().to_string(),
                "python".into(),
            ],
        ),
        ("mypy", vec!["--cache-dir".into(), cache.join("mypy-cache").display().to_string()]),
    ];
    for (tool, args) in checks {
        eprintln!("$ (cd {PACKAGE_DIR} && {} -m {tool} {})", py.display(), args.join(" "));
        let status = Command::new(&py)
            .arg("-m")
            .arg(tool)
            .args(&args)
            .current_dir(PACKAGE_DIR)
            .status()
            .map_err(|e| format!("could not start {}: {e}", py.display()))?;
        if !status.success() {
            return Err(format!("{tool} found problems in {PACKAGE_DIR}/python ({status})"));
        }
    }
    Ok(())
}

/// The Python tests, on the installed wheel.
pub(crate) fn test() -> Result<(), String> {
    ensure_env()?;
    build_and_install_wheel()?;
    lint()?;
    let py = python().to_string_lossy().into_owned();
    run(&py, &["-m", "pytest", "-q", "-p", "no:cacheprovider", "crates/ddo-py/tests"])
}
