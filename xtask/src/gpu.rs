//! `cargo xtask test-gpu [--bundle DIR] [--bench]`: the CUDA tests (and optionally the GPU
//! benchmarks), run here or packed into a bundle for a GPU machine without Rust.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::run;

const USAGE: &str = "usage: cargo xtask test-gpu [--bundle DIR] [--bench]

  (no flags)     run every test, the CUDA ones included, on this machine's GPU
  --bundle DIR   write a self-contained bundle to DIR instead: the nextest archive, the
                 cargo-nextest binary, the benchmark programs and run.sh; on the GPU machine,
                 from a copy of this repository: bash DIR/run.sh [--bench]
  --bench        also run the GPU benchmarks (stream_gemm --bench, read_bench)";

pub(crate) fn test_gpu(args: &[String]) -> Result<(), String> {
    let mut bundle: Option<PathBuf> = None;
    let mut bench = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bundle" => {
                bundle = Some(PathBuf::from(
                    it.next().ok_or(format!("--bundle needs a folder\n\n{USAGE}"))?,
                ))
            }
            "--bench" => bench = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
    }
    match bundle {
        Some(dir) => write_bundle(&dir),
        None => {
            run(
                "cargo",
                &[
                    "nextest",
                    "run",
                    "--workspace",
                    "--all-features",
                    "--run-ignored",
                    "all",
                    "--no-fail-fast",
                ],
            )?;
            if bench {
                run(
                    "cargo",
                    &[
                        "run",
                        "--release",
                        "-p",
                        "ddo-arena",
                        "--example",
                        "stream_gemm",
                        "--",
                        "--bench",
                    ],
                )?;
                run("cargo", &["run", "--release", "-p", "ddo-source", "--example", "read_bench"])?;
            }
            Ok(())
        }
    }
}

fn write_bundle(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let dir = dir.canonicalize().map_err(|e| format!("{}: {e}", dir.display()))?;
    let archive = dir.join("tests.tar.zst");
    let archive_s = archive.to_string_lossy().into_owned();
    // Test binaries without debug info keep the bundle small enough to carry.
    let status = Command::new("cargo")
        .args(["nextest", "archive", "--workspace", "--all-features", "--archive-file", &archive_s])
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .env("CARGO_PROFILE_TEST_DEBUG", "0")
        .status()
        .map_err(|e| format!("cargo nextest archive: {e}"))?;
    if !status.success() {
        return Err("cargo nextest archive failed".into());
    }
    let nextest = which("cargo-nextest")?;
    copy(&nextest, &dir.join("cargo-nextest"))?;
    run("cargo", &["build", "--release", "-p", "ddo-arena", "--example", "stream_gemm"])?;
    run("cargo", &["build", "--release", "-p", "ddo-source", "--example", "read_bench"])?;
    for example in ["stream_gemm", "read_bench"] {
        copy(&Path::new("target/release/examples").join(example), &dir.join(example))?;
    }
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| format!("writing {}: {e}", script.display()))?;
    println!(
        "bundle written to {}; on the GPU machine, from a copy of this repository: bash {}/run.sh [--bench]",
        dir.display(),
        dir.display()
    );
    Ok(())
}

fn which(program: &str) -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|p| p.join(program)).find(|p| p.is_file()).ok_or(format!(
        "{program} is not on PATH; install it with `cargo install cargo-nextest --locked`"
    ))
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

/// Runs on the GPU machine from the repository root (the nextest archive maps its workspace
/// there, so snapshot files are found).
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs ddo's tests, CUDA ones included, from a bundle made by `cargo xtask test-gpu --bundle`.
# Usage (from the repository root): bash BUNDLE/run.sh [--bench]
set -uo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
repo="$(pwd)"
export DDO_TEST_TMPDIR="${DDO_TEST_TMPDIR:-$repo/target/gpu-tmp}"
# Snapshot files live in this copy of the repository, not where the tests were built.
export INSTA_WORKSPACE_ROOT="$repo" INSTA_UPDATE=no
mkdir -p "$DDO_TEST_TMPDIR"
# cuBLAS for the GEMM benchmark: expose an unversioned libcublas.so from the CUDA libraries here.
libs="$bundle/lib"; mkdir -p "$libs"
for name in cublas cublasLt; do
  found=$(find /opt /usr/local /usr/lib -name "lib${name}.so*" 2>/dev/null | grep -v stubs | sort | tail -n 1)
  [ -n "$found" ] && ln -sf "$found" "$libs/lib${name}.so"
done
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$bundle/cargo-nextest" nextest run --archive-file "$bundle/tests.tar.zst" --workspace-remap "$repo" \
  --run-ignored all --no-fail-fast
status=$?
if [ "${1:-}" = "--bench" ]; then
  "$bundle/stream_gemm" --bench --size-gib "${DDO_BENCH_GIB:-8}" --dir "$DDO_TEST_TMPDIR" || status=1
  "$bundle/read_bench" --size-gib 4 --dir "$DDO_TEST_TMPDIR" --repeat 5 || status=1
fi
exit $status
"#;
