//! Read-path benchmark: reads one generated checkpoint through every path and, in the same run,
//! with a plain sequential read of the same file; prints GB/s and the ratio, cold and warm page
//! cache separately.
//!
//! ```sh
//! cargo run --release -p ddo-source --example read_bench -- [--size-gib 4] [--dir DIR] [--repeat 3]
//!     [--workers N] [--chunk-mib N] [--batch-units 8] [--methods pread,direct,mmap]
//!
//! Each path uses its own defaults (`ReadOptions::pread()`, `ReadOptions::direct()`) unless
//! `--workers` / `--chunk-mib` override them.
//! ```
//!
//! "Cold" evicts the file from the page cache first (fsync, then `posix_fadvise(DONTNEED)` on
//! the file only; no system setting is touched).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{ReadRequest, WeightSource};
use ddo_source::{Checkpoint, CheckpointSource, ReadMethod, ReadOptions};

const BLOCKS: usize = 57;

fn main() {
    let mut size_gib = 4.0f64;
    let mut dir = std::env::temp_dir();
    let mut repeat = 3usize;
    let mut workers: Option<usize> = None;
    let mut chunk_mib: Option<usize> = None;
    let mut batch_units = 8usize;
    let mut only: Option<String> = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        match a.as_str() {
            "--size-gib" => {
                size_gib = value().parse().unwrap_or_else(|_| usage("--size-gib takes a number"))
            }
            "--dir" => dir = PathBuf::from(value()),
            "--repeat" => {
                repeat = value().parse().unwrap_or_else(|_| usage("--repeat takes a count"))
            }
            "--workers" => {
                workers = Some(value().parse().unwrap_or_else(|_| usage("--workers takes a count")))
            }
            "--methods" => only = Some(value().to_owned()),
            "--batch-units" => {
                batch_units =
                    value().parse().unwrap_or_else(|_| usage("--batch-units takes a count"))
            }
            "--chunk-mib" => {
                chunk_mib =
                    Some(value().parse().unwrap_or_else(|_| usage("--chunk-mib takes a size")))
            }
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let path = dir.join("ddo-read-bench.safetensors");
    let t = Instant::now();
    let bytes = write_checkpoint(&path, (size_gib * (1u64 << 30) as f64) as u64);
    eprintln!(
        "wrote {} ({:.2} GiB) in {:.1} s",
        path.display(),
        bytes as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
    let checkpoint = Arc::new(Checkpoint::open(&path).expect("open"));
    let units = units(&checkpoint, batch_units);
    let file_len = std::fs::metadata(&path).unwrap().len();

    println!("| path | page cache | GB/s | ratio to plain read |");
    println!("|---|---|---|---|");
    let methods: Vec<ReadMethod> = [ReadMethod::Pread, ReadMethod::Direct, ReadMethod::Mmap]
        .into_iter()
        .filter(|m| only.as_deref().is_none_or(|o| o.contains(&format!("{m:?}").to_lowercase())))
        .collect();
    for cold in [true, false] {
        let cache = if cold { "cold" } else { "warm" };
        if !cold {
            plain_read(&path); // warm it
        }
        // Interleave the paths and take medians, so drift of the disk hits every path alike.
        let mut plain = Vec::new();
        let mut by_method: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
        for _ in 0..repeat.max(1) {
            if cold {
                evict(&path);
            }
            let t = Instant::now();
            plain_read(&path);
            plain.push(file_len as f64 / t.elapsed().as_secs_f64() / 1e9);
            for (m, method) in methods.iter().enumerate() {
                if cold {
                    evict(&path);
                }
                // A fresh source each time: a live mapping would keep its pages cached.
                let source = match method {
                    ReadMethod::Mmap => {
                        // SAFETY: the benchmark does not modify the file while it is mapped.
                        unsafe {
                            CheckpointSource::with_mmap(checkpoint.clone(), workers.unwrap_or(16))
                        }
                        .unwrap()
                    }
                    m => CheckpointSource::new(checkpoint.clone(), options(*m, workers, chunk_mib))
                        .unwrap(),
                };
                by_method[m].push(read_units(&source, &units, checkpoint.total_bytes()));
            }
        }
        let plain = median(&mut plain);
        println!("| plain sequential read | {cache} | {plain:.2} | 1.00 |");
        for (m, method) in methods.iter().enumerate() {
            let gbs = median(&mut by_method[m]);
            let name = format!("{method:?}").to_lowercase();
            let o = options(*method, workers, chunk_mib);
            let (w, c) = (o.workers, o.chunk_bytes >> 20);
            println!(
                "| {name} ({w} workers, {c} MiB reads, {batch_units} units per batch) | {cache} | {gbs:.2} | {:.2} |",
                gbs / plain
            );
        }
    }
    std::fs::remove_file(&path).ok();
}

fn usage(message: &str) -> ! {
    eprintln!(
        "read_bench: {message}\nusage: read_bench [--size-gib N] [--dir DIR] [--repeat N] [--workers N] [--chunk-mib N] [--batch-units N] [--methods pread,direct,mmap]"
    );
    std::process::exit(2)
}

fn options(method: ReadMethod, workers: Option<usize>, chunk_mib: Option<usize>) -> ReadOptions {
    let base = match method {
        ReadMethod::Direct => ReadOptions::direct(),
        _ => ReadOptions { method, ..ReadOptions::pread() },
    };
    ReadOptions {
        workers: workers.unwrap_or(base.workers),
        chunk_bytes: chunk_mib.map_or(base.chunk_bytes, |c| c << 20),
        ..base
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Batches of `per_batch` units; a unit is every tensor of one block (`blocks.N.`), packed at
/// 256-byte aligned offsets.
fn units(checkpoint: &Checkpoint, per_batch: usize) -> Vec<(Vec<ReadRequest>, usize)> {
    let per_batch = per_batch.max(1);
    (0..BLOCKS.div_ceil(per_batch))
        .map(|batch| {
            let blocks: Vec<String> = (batch * per_batch..((batch + 1) * per_batch).min(BLOCKS))
                .map(|b| format!("blocks.{b}."))
                .collect();
            let mut at = 0u64;
            let reqs = checkpoint
                .slices()
                .iter()
                .enumerate()
                .filter(|(_, s)| blocks.iter().any(|p| s.name.starts_with(p.as_str())))
                .map(|(i, s)| {
                    let r = ReadRequest { slice: i, dst_offset: at };
                    at = (at + s.len).div_ceil(256) * 256;
                    r
                })
                .collect();
            (reqs, at as usize)
        })
        .collect()
}

fn read_units(source: &CheckpointSource, units: &[(Vec<ReadRequest>, usize)], total: u64) -> f64 {
    let largest = units.iter().map(|u| u.1).max().unwrap_or(0);
    let mut buf = vec![0u8; largest];
    let t = Instant::now();
    for (reqs, len) in units {
        source.read_batch(reqs, &mut buf[..*len]).expect("read");
    }
    total as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn plain_read(path: &Path) {
    let mut f = File::open(path).unwrap();
    let mut buf = vec![0u8; 64 << 20];
    while f.read(&mut buf).unwrap() > 0 {}
}

fn evict(path: &Path) {
    let f = File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a plain syscall on a valid open descriptor; it only drops this file's clean pages.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise failed");
}

/// Writes a BF16 checkpoint of about `target` bytes: BLOCKS blocks of four tensors.
fn write_checkpoint(path: &Path, target: u64) -> u64 {
    let per_block = target / BLOCKS as u64;
    let sizes = [per_block * 3 / 8, per_block * 3 / 8, per_block / 4 - 4096, 4096];
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for b in 0..BLOCKS {
        for (i, size) in sizes.iter().enumerate() {
            let elems = size / 2;
            let name = format!("blocks.{b}.t{i}");
            header.insert(
                name,
                serde_json::json!({"dtype": "BF16", "shape": [elems], "data_offsets": [offset, offset + elems * 2]}),
            );
            offset += elems * 2;
        }
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut w = BufWriter::with_capacity(8 << 20, File::create(path).unwrap());
    w.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    w.write_all(&json).unwrap();
    let chunk: Vec<u8> =
        (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let mut left = offset;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        w.write_all(&chunk[..n]).unwrap();
        left -= n as u64;
    }
    w.into_inner().unwrap().sync_all().unwrap();
    offset
}
