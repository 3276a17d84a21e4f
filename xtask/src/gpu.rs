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
  --bench        also run the GPU benchmarks (stream_gemm --bench, read_bench, session_gemm,
                 disk_gemm, decode_rate, p2p_rate)";

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
                run(
                    "cargo",
                    &["run", "--release", "-p", "ddo-session", "--example", "session_gemm"],
                )?;
                run("cargo", &["run", "--release", "-p", "ddo-session", "--example", "disk_gemm"])?;
                run(
                    "cargo",
                    &["run", "--release", "-p", "ddo-platform", "--example", "decode_rate"],
                )?;
                run("cargo", &["run", "--release", "-p", "ddo-platform", "--example", "p2p_rate"])?;
            }
            Ok(())
        }
    }
}

/// Builds the device examples (decode_rate, p2p_rate) into `dir`, stripped: both bundles run
/// them.
fn build_device_examples(dir: &Path) -> Result<(), String> {
    for example in ["decode_rate", "p2p_rate"] {
        run("cargo", &["build", "--release", "-p", "ddo-platform", "--example", example])?;
        let program = dir.join(example);
        copy(&Path::new("target/release/examples").join(example), &program)?;
        if Command::new("strip").arg(&program).status().is_ok_and(|s| s.success()) {
            eprintln!("stripped {}", program.display());
        }
    }
    Ok(())
}

fn write_bundle(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let dir = dir.canonicalize().map_err(|e| format!("{}: {e}", dir.display()))?;
    let archive = dir.join("tests.tar.zst");
    let archive_s = archive.to_string_lossy().into_owned();
    // Test binaries without debug info or symbols keep the bundle small enough to carry.
    let status = Command::new("cargo")
        .args(["nextest", "archive", "--workspace", "--all-features", "--archive-file", &archive_s])
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .env("CARGO_PROFILE_TEST_DEBUG", "0")
        .env("CARGO_PROFILE_DEV_STRIP", "symbols")
        .env("CARGO_PROFILE_TEST_STRIP", "symbols")
        .status()
        .map_err(|e| format!("cargo nextest archive: {e}"))?;
    if !status.success() {
        return Err("cargo nextest archive failed".into());
    }
    shrink_archive(&archive);
    let nextest = which("cargo-nextest")?;
    copy(&nextest, &dir.join("cargo-nextest"))?;
    run("cargo", &["build", "--release", "-p", "ddo-arena", "--example", "stream_gemm"])?;
    run("cargo", &["build", "--release", "-p", "ddo-source", "--example", "read_bench"])?;
    run("cargo", &["build", "--release", "-p", "ddo-session", "--example", "session_gemm"])?;
    run("cargo", &["build", "--release", "-p", "ddo-session", "--example", "disk_gemm"])?;
    build_device_examples(&dir)?;
    for example in ["stream_gemm", "read_bench", "session_gemm", "disk_gemm"] {
        copy(&Path::new("target/release/examples").join(example), &dir.join(example))?;
    }
    // A bundle travels to the GPU machine: symbols are not needed there.
    for program in ["cargo-nextest", "stream_gemm", "read_bench", "session_gemm", "disk_gemm"] {
        let path = dir.join(program);
        if Command::new("strip").arg(&path).status().is_ok_and(|s| s.success()) {
            eprintln!("stripped {}", path.display());
        }
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

/// Recompresses the nextest archive at zstd level 19 (about half the size) when `zstd` is
/// installed; otherwise leaves it as it is.
fn shrink_archive(archive: &Path) {
    let tar = archive.with_extension("");
    let smaller = archive.with_extension("19.zst");
    let ok =
        Command::new("zstd").args(["-d", "-q", "-f"]).arg(archive).arg("-o").arg(&tar).status();
    if !ok.is_ok_and(|s| s.success()) {
        eprintln!("zstd not found: the archive stays at its default compression");
        return;
    }
    let ok = Command::new("zstd")
        .args(["-19", "-T0", "-q", "-f"])
        .arg(&tar)
        .arg("-o")
        .arg(&smaller)
        .status();
    if ok.is_ok_and(|s| s.success()) && std::fs::rename(&smaller, archive).is_ok() {
        eprintln!("recompressed {}", archive.display());
    }
    let _ = std::fs::remove_file(&tar);
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
  "$bundle/session_gemm" --size-gib 4 --dir "$DDO_TEST_TMPDIR" || status=1
  # The disk route against the disk's own O_DIRECT speed (DDO_DISK_BENCH_GIB: the checkpoint).
  "$bundle/disk_gemm" --size-gib "${DDO_DISK_BENCH_GIB:-16}" --dir "$DDO_TEST_TMPDIR" || status=1
  # Decoding encoded weights on the GPU against the pinned upload of the same bytes.
  "$bundle/decode_rate" || status=1
  # Copy paths between GPUs (peer access) beside pinned host memory into each.
  "$bundle/p2p_rate" || status=1
fi
exit $status
"#;

const BENCH_USAGE: &str =
    "usage: cargo xtask bench-gpu --bundle DIR [--configs 5:512,5:1024,5:2048,12:1024]

  Writes DIR with the ddo-offload wheel, the Diffusers wheels a GPU machine without network needs,
  the benchmark and check scripts, and run.sh. On the GPU machine, from a copy of this repository:
  bash DIR/run.sh native          the native route's fidelity checks
  bash DIR/run.sh features        pipelines, text encoders, LoRA and conversion against resident runs
  bash DIR/run.sh pipeline [GIB]  a full-size Flux pipeline (12 B + T5-XXL) in one call under GIB
  bash DIR/run.sh generation [ARGS]  whole generations (Flux 12 B or Wan 14B: encode, steps, decode)
                                   by ddo and Diffusers' offloads on simulated cards (ARGS go to
                                   gpu_generation.py: --model, --rows, --card-gb, --host-gb, --steps)
  bash DIR/run.sh dropin          the host example, timer, phase helpers, profiles, doctor and bench
  bash DIR/run.sh decode [ARGS]   the GPU decoding rate of encoded weights beside the pinned link
                                   (1 to 256 MiB; ARGS go to decode_rate: --sizes, --repeat)
  bash DIR/run.sh p2p [ARGS]      copies between every pair of GPUs beside pinned host copies
                                   (ARGS go to p2p_rate: --mib)
  bash DIR/run.sh bench [CONFIGS] [VARIANTS]  rows of the side-by-side table (one model size per
                                   call fits a 10-minute limit; rows accumulate under target/)
  bash DIR/run.sh table           the table of every row measured so far
  bash DIR/run.sh lowram [GIB]    a Wan-14B-shaped bf16 model (26.6 GiB) through ddo with its host
                                   memory held under GIB (default 8), against a resident run
  bash DIR/run.sh shared          one host copy of a Flux 5 B checkpoint feeding two sessions (one
                                   per GPU where there are two), then two processes
  bash DIR/run.sh arena-memory [ARGS]  an SD3-shaped step on arena memory against the same
                                   weights in PyTorch's allocations, by alignment
  (the log is appended to $OUT/bench.log when OUT is set, else DIR/bench.log)";

/// `cargo xtask bench-gpu --bundle DIR`: the side-by-side benchmark as a bundle.
pub(crate) fn bench_gpu(args: &[String]) -> Result<(), String> {
    let mut bundle: Option<PathBuf> = None;
    let mut configs = "5:512,5:1024,5:2048,12:1024".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bundle" => {
                bundle = Some(PathBuf::from(
                    it.next().ok_or(format!("--bundle needs a folder\n\n{BENCH_USAGE}"))?,
                ))
            }
            "--configs" => {
                configs =
                    it.next().ok_or(format!("--configs needs a list\n\n{BENCH_USAGE}"))?.clone()
            }
            "-h" | "--help" => {
                println!("{BENCH_USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n\n{BENCH_USAGE}")),
        }
    }
    let dir = bundle.ok_or(format!("--bundle is required\n\n{BENCH_USAGE}"))?;
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| format!("creating {}: {e}", wheels.display()))?;
    crate::python::ensure_env()?;
    let wheel = crate::python::build_and_install_wheel()?;
    copy(&wheel, &wheels.join(wheel.file_name().ok_or("wheel without a name")?))?;
    let py = crate::python::python().to_string_lossy().into_owned();
    let wheels_s = wheels.to_string_lossy().into_owned();
    run(
        &py,
        &[
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "-d",
            &wheels_s,
            "diffusers",
            "importlib_metadata",
            "gguf",
        ],
    )?;
    // The benchmarks, and the fixtures of the examples they share, side by side in one folder.
    for script in [
        "bench_gpu.py",
        "gpu_native.py",
        "gpu_linear.py",
        "flux_workload.py",
        "gpu_features.py",
        "gpu_boundaries.py",
        "gpu_pipeline.py",
        "gpu_generation.py",
        "gpu_compile.py",
        "gpu_dropin.py",
        "gpu_lowram.py",
        "gpu_shared.py",
        "gpu_contention.py",
        "gpu_copy_beside.py",
        "gpu_interleaved.py",
        "gpu_arena_memory.py",
        "host_costs.py",
    ] {
        copy(&Path::new("crates/ddo-py/benches").join(script), &dir.join(script))?;
    }
    for fixture in ["host.py", "tiny_pipelines.py"] {
        copy(&Path::new("crates/ddo-py/examples").join(fixture), &dir.join(fixture))?;
    }
    build_device_examples(&dir)?;
    let run_sh = BENCH_RUN_SH.replace("@CONFIGS@", &configs);
    std::fs::write(dir.join("run.sh"), run_sh).map_err(|e| format!("writing run.sh: {e}"))?;
    println!(
        "bundle written to {}; on the GPU machine: bash {}/run.sh",
        dir.display(),
        dir.display()
    );
    Ok(())
}

const BENCH_RUN_SH: &str = r#"#!/usr/bin/env bash
# Side-by-side GPU benchmark of ddo from a bundle made by `cargo xtask bench-gpu --bundle`.
set -uo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
log="${OUT:-$bundle}/bench.log"
site="${TMPDIR:-/tmp}/ddo-site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$bundle"/wheels/*.whl || exit 1
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
# Models and rows live under the repository's target/ (kept between commands on one machine).
work="${DDO_BENCH_DIR:-$(pwd)/target/ddo-bench}"
# One command per part keeps each under a machine's per-command limit:
#   bash run.sh native            fidelity of the native route (Flux 512/1024/2048, SD3, AutoencoderKL)
#   bash run.sh features          pipelines, text encoders, LoRA and conversion against resident runs
#   bash run.sh boundaries        kept weights, reads between passes, refusals, interrupts, threads, rewrites
#   bash run.sh pipeline [GIB]    a full-size Flux pipeline (12 B + T5-XXL) in one call under GIB
#   bash run.sh generation [ARGS] whole generations by ddo and Diffusers' offloads on simulated cards
#   bash run.sh compile [ARGS]    regional torch.compile of an offloaded transformer against resident compiled
#   bash run.sh dropin            the host example, timer, phase helpers, profiles, doctor and bench
#   bash run.sh decode [ARGS]     the GPU decoding rate of encoded weights beside the pinned link
#   bash run.sh p2p [ARGS]        copies between every pair of GPUs beside pinned host copies
#   bash run.sh bench [CONFIGS] [VARIANTS]   rows of the side-by-side table (default @CONFIGS@)
#   bash run.sh table             the table of every row measured so far
#   bash run.sh lowram [GIB]      Wan-14B-shaped bf16 (26.6 GiB) through ddo under GIB of host memory (default 8)
#   bash run.sh shared            one host copy of Flux 5 B feeding two sessions, then two processes
#   bash run.sh contention [ARGS] what host-to-device copies cost kernel launches, by host memory kind
#   bash run.sh copy-beside [ARGS] what copies beside a GPU-bound workload cost its kernels, by kind, size and rate
#   bash run.sh interleaved [ARGS] resident and ddo budgets stepped in turn in one process (--model sd3|flux12|q8)
#   bash run.sh host-costs [ARGS] ddo's host work per step and per block on a tiny host-bound model
#   bash run.sh arena-memory [ARGS] the kernels on arena memory against PyTorch's, by weight alignment
case "${1:-bench}" in
  native) cmd=(python3 "$bundle/gpu_native.py" --resolutions 512,1024,2048 --dir "$work") ;;
  features) cmd=(python3 "$bundle/gpu_features.py") ;;
  boundaries) cmd=(python3 "$bundle/gpu_boundaries.py") ;;
  pipeline) cmd=(python3 "$bundle/gpu_pipeline.py" --dir "$work" --budget-gb "${2:-10}") ;;
  generation) cmd=(python3 "$bundle/gpu_generation.py" --dir "$work" "${@:2}") ;;
  compile) cmd=(python3 "$bundle/gpu_compile.py" "${@:2}") ;;
  dropin) cmd=(python3 "$bundle/gpu_dropin.py") ;;
  decode) cmd=("$bundle/decode_rate" "${@:2}") ;;
  p2p) cmd=("$bundle/p2p_rate" "${@:2}") ;;
  bench) cmd=(python3 "$bundle/bench_gpu.py" --configs "${2:-@CONFIGS@}" --dir "$work")
         [ -n "${3:-}" ] && cmd+=(--variants "$3") ;;
  table) cmd=(python3 "$bundle/bench_gpu.py" --table --dir "$work") ;;
  lowram) cmd=(python3 "$bundle/gpu_lowram.py" --dir "$work" --ceiling-gb "${2:-8}") ;;
  shared) cmd=(python3 "$bundle/gpu_shared.py" --dir "$work") ;;
  contention) mkdir -p "$work"; cmd=(python3 "$bundle/gpu_contention.py" --dir "$work" "${@:2}") ;;
  copy-beside) cmd=(python3 "$bundle/gpu_copy_beside.py" "${@:2}") ;;
  interleaved) cmd=(python3 "$bundle/gpu_interleaved.py" --dir "$work" "${@:2}") ;;
  host-costs) mkdir -p "$work"; cmd=(python3 "$bundle/host_costs.py" --dir "$work" "${@:2}") ;;
  arena-memory) cmd=(python3 "$bundle/gpu_arena_memory.py" --dir "$work" "${@:2}") ;;
  *) echo "usage: run.sh native | features | boundaries | pipeline [GIB] | generation [ARGS] | dropin | decode [ARGS] | p2p [ARGS] | bench [CONFIGS] [VARIANTS] | table | lowram [GIB] | shared | contention [ARGS] | copy-beside [ARGS] | interleaved [ARGS] | host-costs [ARGS] | arena-memory [ARGS]" >&2; exit 2 ;;
esac
"${cmd[@]}" 2>&1 | grep --line-buffered -vE "Warning|warn\(|Loading checkpoint" | tee -a "$log"
status=${PIPESTATUS[0]}
[ -n "${OUT:-}" ] && [ -f "$work/rows.jsonl" ] && cp "$work/rows.jsonl" "$OUT/"
exit "$status"
"#;
