//! `cargo xtask fuzz [--seconds N] [TARGET...]`: every fuzz target (checkpoint headers and
//! indexes, GGUF headers, checkpoint folders, configuration resolution, planning, the weight
//! codec) on a nightly toolchain with
//! cargo-fuzz, each for a time budget; prints the executions each ran.

use std::path::{Path, PathBuf};
use std::process::Command;

const USAGE: &str = "usage: cargo xtask fuzz [--seconds N] [--runs N] [TARGET...]

  Runs each fuzz target for N seconds (default 60), or until it ran --runs N inputs, with
  cargo-fuzz on the nightly toolchain (installed into target/fuzz-tools when missing) and prints
  how many inputs each ran.
  Targets: header, index, gguf (crates/ddo-source/fuzz); config, planning, folder, codec
  (fuzz/).";

/// `(fuzz crate folder, target, sanitizer)`. Targets whose code forbids `unsafe` (configuration
/// resolution, planning) run without AddressSanitizer, ten times faster: a panic is what they
/// look for.
const TARGETS: &[(&str, &str, &str)] = &[
    ("crates/ddo-source/fuzz", "header", "address"),
    ("crates/ddo-source/fuzz", "index", "address"),
    ("crates/ddo-source/fuzz", "gguf", "address"),
    ("fuzz", "config", "none"),
    ("fuzz", "planning", "none"),
    ("fuzz", "folder", "address"),
    ("fuzz", "codec", "none"),
];

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut seconds = 60u64;
    let mut runs_limit: Option<u64> = None;
    let mut chosen: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or(format!("--seconds takes a number\n\n{USAGE}"))?
            }
            "--runs" => {
                runs_limit = Some(
                    it.next()
                        .and_then(|s| s.parse().ok())
                        .ok_or(format!("--runs takes a number\n\n{USAGE}"))?,
                )
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            t if TARGETS.iter().any(|(_, n, _)| *n == t) => chosen.push(t.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
    }
    let nightly = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("nightly"));
    if !nightly {
        return Err("fuzzing needs a nightly toolchain: rustup toolchain install nightly".into());
    }
    let path = cargo_fuzz_path()?;
    let mut rows = Vec::new();
    for (dir, target, sanitizer) in TARGETS {
        if !chosen.is_empty() && !chosen.iter().any(|c| c == target) {
            continue;
        }
        eprintln!("$ cargo +nightly fuzz run {target} --fuzz-dir {dir} --sanitizer {sanitizer}");
        // New inputs go to target/fuzz-corpus; the committed seeds are read only.
        let found = Path::new("target/fuzz-corpus").join(target);
        std::fs::create_dir_all(&found).map_err(|e| format!("{}: {e}", found.display()))?;
        let seeds = Path::new(dir).join("corpus").join(target);
        let mut corpora = vec![found.to_string_lossy().into_owned()];
        if seeds.is_dir() {
            corpora.push(seeds.to_string_lossy().into_owned());
        }
        let mut limits = vec![format!("-max_total_time={seconds}")];
        if let Some(n) = runs_limit {
            limits = vec![format!("-runs={n}")];
        }
        let out = Command::new("cargo")
            .env("PATH", &path)
            .args(["+nightly", "fuzz", "run", target, "--fuzz-dir", dir, "--sanitizer", sanitizer])
            .args(&corpora)
            .arg("--")
            .args(&limits)
            .output()
            .map_err(|e| format!("could not start cargo-fuzz: {e}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let runs = log
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("Done ").and_then(|r| r.split_whitespace().next()))
            .unwrap_or("?")
            .to_owned();
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(format!("fuzz target {target} failed:\n{}", tail.join("\n")));
        }
        rows.push((*target, runs));
    }
    match runs_limit {
        Some(n) => println!("| fuzz target | inputs run (limit {n}) | result |"),
        None => println!("| fuzz target | inputs run in {seconds} s | result |"),
    }
    println!("|---|---|---|");
    for (target, runs) in rows {
        println!("| {target} | {runs} | no crash |");
    }
    Ok(())
}

/// The `PATH` under which `cargo fuzz` works: the current one when cargo-fuzz is installed,
/// else one starting with `target/fuzz-tools/bin`, where it is installed first.
fn cargo_fuzz_path() -> Result<std::ffi::OsString, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let ok = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Ok(path);
    }
    let root = Path::new("target/fuzz-tools");
    let bin = root.join("bin");
    if !bin.join("cargo-fuzz").exists() {
        crate::run(
            "cargo",
            &["install", "cargo-fuzz", "--locked", "--root", &root.to_string_lossy()],
        )?;
    }
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.insert(0, bin.canonicalize().map_err(|e| e.to_string())?);
    std::env::join_paths(dirs).map_err(|e| e.to_string())
}
