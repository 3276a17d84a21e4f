//! `cargo xtask kernels [--check]`: compiles the CUDA C kernels to the PTX ddo ships, with NVRTC
//! from PyPI's `nvidia-cuda-nvrtc-cu12` wheel (downloaded into `target/`), so neither building
//! ddo nor compiling its kernels needs a CUDA toolkit.

use std::path::{Path, PathBuf};

use crate::run;

const USAGE: &str = "usage: cargo xtask kernels [--check]

  compiles every CUDA C kernel to the PTX next to it (NVRTC 12.0, compute_80), recording the
  source's SHA-256 on the PTX's first line
  --check   writes nothing; fails when a committed PTX is not what its source compiles to";

/// NVRTC 12.0: its PTX (8.0) loads on every driver from CUDA 12.0 on.
const NVRTC: &str = "nvidia-cuda-nvrtc-cu12==12.0.76";
const WHEEL_PREFIX: &str = "nvidia_cuda_nvrtc_cu12-12.0.76-";
const WHEEL_DIR: &str = "target/nvrtc";
/// Each kernel's source and the PTX compiled from it.
const KERNELS: &[(&str, &str)] =
    &[("crates/ddo-platform/src/cuda/decode.cu", "crates/ddo-platform/src/cuda/decode.ptx")];

pub(crate) fn run_task(args: &[String]) -> Result<(), String> {
    let mut check = false;
    for a in args {
        match a.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
    }
    let wheel = wheel()?;
    let wheel = wheel.to_string_lossy().into_owned();
    for (source, ptx) in KERNELS {
        let mut args = vec!["xtask/kernels.py", &wheel, source, ptx];
        if check {
            args.push("--check");
        }
        run("python3", &args)?;
    }
    Ok(())
}

/// The NVRTC wheel under `target/nvrtc`, downloaded with pip when missing.
fn wheel() -> Result<PathBuf, String> {
    if let Some(found) = find_wheel(Path::new(WHEEL_DIR)) {
        return Ok(found);
    }
    std::fs::create_dir_all(WHEEL_DIR).map_err(|e| format!("creating {WHEEL_DIR}: {e}"))?;
    run(
        "python3",
        &[
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux1_x86_64",
            "-d",
            WHEEL_DIR,
            NVRTC,
        ],
    )?;
    find_wheel(Path::new(WHEEL_DIR))
        .ok_or(format!("pip downloaded no {NVRTC} wheel to {WHEEL_DIR}"))
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir).ok()?.filter_map(Result::ok).map(|e| e.path()).find(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(WHEEL_PREFIX) && n.ends_with(".whl"))
    })
}
