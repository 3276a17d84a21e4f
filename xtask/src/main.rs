//! Project tasks: `cargo xtask <task>`.
//!
//! - `ci`: formatting, lints, tests and doc tests, as CI runs them.
//! - `demo`: the main job: shows what ddo decides for a Diffusers pipeline on this machine.
//! - `test-gpu`: the CUDA tests and GPU benchmarks, here or as a bundle for a GPU machine.
//! - `bench-gpu`: the side-by-side benchmark as a bundle for a GPU machine.
//! - `docs`: the book's generated references (configuration, metrics) from the code's schemas.
//! - `wheel`: the abi3 wheel of the Python package, built with maturin into `target/wheels`.
//! - `fuzz`: every fuzz target on a nightly toolchain.
//! - `kernels`: the CUDA C kernels compiled to the PTX ddo ships (NVRTC from PyPI, no toolkit).

use std::process::{Command, ExitCode};

mod demo;
mod docs;
mod fuzz;
mod gpu;
mod kernels;
mod python;

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  ci      cargo fmt --check, clippy -D warnings, the test suite (nextest), doc tests, the docs
          (generated references checked, cargo doc -D warnings, mdbook build docs) and the
          Python checks on the built wheel: ruff, mypy, pytest (creates .venv with PyTorch and
          Diffusers)
  demo    offload a Diffusers model from Python (CUDA when present, else CPU), then resolve a
          pipeline's plan and stream a checkpoint through the Rust arena
  test-gpu  every test with the CUDA ones, here or as a bundle for a GPU machine (--help)
  bench-gpu the side-by-side GPU benchmark as a bundle for a GPU machine (--help)
  docs    write the book's generated references from the code's schemas (--check: compare only)
  wheel   build the abi3 wheel of the Python package into target/wheels and print its path
  fuzz    every fuzz target on the nightly toolchain with cargo-fuzz (--help)
  kernels compile the CUDA C kernels to the PTX shipped beside them, with NVRTC from PyPI (--help)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("demo") => demo::run(&args[1..]),
        Some("test-gpu") => gpu::test_gpu(&args[1..]),
        Some("bench-gpu") => gpu::bench_gpu(&args[1..]),
        Some("wheel") => python::wheel(&args[1..]),
        Some("docs") => docs::run(&args[1..]),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("kernels") => kernels::run_task(&args[1..]),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a command, echoing it; an error names the command.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), String> {
    eprintln!("$ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .status()
        .map_err(|e| format!("could not start {program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({status})", args.join(" ")))
    }
}

fn has_nextest() -> bool {
    Command::new("cargo").args(["nextest", "--version"]).output().is_ok_and(|o| o.status.success())
}

fn ci() -> Result<(), String> {
    run("cargo", &["fmt", "--all", "--", "--check"])?;
    run(
        "cargo",
        &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"],
    )?;
    if has_nextest() {
        run("cargo", &["nextest", "run", "--workspace", "--all-features", "--no-fail-fast"])?;
    } else {
        eprintln!("cargo-nextest is not installed; running the tests with cargo test");
        run("cargo", &["test", "--workspace", "--all-features", "--lib", "--bins", "--tests"])?;
    }
    run("cargo", &["test", "--workspace", "--all-features", "--doc"])?;
    docs::check()?;
    docs::api_docs()?;
    docs::build_book()?;
    // ddo-platform builds and works without CUDA (its `cuda` feature off).
    run(
        "cargo",
        &[
            "clippy",
            "-p",
            "ddo-platform",
            "--no-default-features",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    run("cargo", &["test", "-p", "ddo-platform", "--no-default-features"])?;
    python::test()
}
