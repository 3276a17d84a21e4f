//! Decoding rate of bf16 encodings on the device, beside the host-to-device link: for weight-like
//! tensors of each size, encoded with ddo-codec and uploaded once, it times repeated decodes on
//! the device (checking that every byte comes back) and pinned copies of the same bf16 bytes,
//! and prints the ratio, both rates (GB/s of bf16) and decode/link. CUDA device 0 when a driver
//! is present, else the host backend (which parses and decodes on the CPU).
//!
//! ```sh
//! cargo run --release -p ddo-platform --example decode_rate -- [--quick] [--host]
//!     [--sizes 1,4,16,64,256] [--repeat N]
//! ```
//!
//! `--quick`: 1 and 4 MiB, few repeats (the default on the host backend); `--sizes`: MiB each;
//! `--repeat`: decodes and copies per timed round (by default about 2 GiB of output a round).

use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DeviceRange, HostBytes, HostSlice, Platform, StreamId};

struct Args {
    quick: bool,
    host: bool,
    sizes: Option<Vec<usize>>,
    repeat: Option<usize>,
}

fn args() -> Result<Args, String> {
    let mut a = Args { quick: false, host: false, sizes: None, repeat: None };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--quick" => a.quick = true,
            "--host" => a.host = true,
            "--sizes" => {
                let list = value()?;
                let sizes: Result<Vec<usize>, _> = list.split(',').map(str::parse).collect();
                a.sizes = Some(sizes.map_err(|_| format!("--sizes takes MiB like 1,4,16: {list}"))?)
            }
            "--repeat" => a.repeat = Some(value()?.parse().map_err(|_| "--repeat takes a number")?),
            "-h" | "--help" => {
                println!("usage: decode_rate [--quick] [--host] [--sizes MIB,...] [--repeat N]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// Seconds per operation of the fastest of three rounds of `repeat` operations, each round
/// timed from the first enqueue to the completion of the last.
fn seconds_each(
    platform: &Platform,
    stream: StreamId,
    repeat: usize,
    mut op: impl FnMut() -> Result<(), String>,
) -> Result<f64, String> {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..repeat {
            op()?;
        }
        let fence = platform.fences.record(stream).map_err(|e| e.to_string())?;
        platform.fences.wait(fence).map_err(|e| e.to_string())?;
        best = best.min(t.elapsed().as_secs_f64() / repeat as f64);
    }
    Ok(best)
}

fn main() -> Result<(), String> {
    let a = args()?;
    let (platform, _device): (Platform, Arc<dyn std::any::Any>) =
        if !a.host && ddo_platform::cuda::driver_present() {
            let (p, d) = ddo_platform::cuda_platform(0).map_err(|e| e.to_string())?;
            (p, d)
        } else {
            let d = Arc::new(ddo_platform::host::HostDevice::new());
            (ddo_platform::host_platform(d.clone()), d)
        };
    let quick = a.quick || platform.name == "host";
    let sizes = a.sizes.clone().unwrap_or(if quick { vec![1, 4] } else { vec![1, 4, 16, 64, 256] });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let r = &platform.residency;
    if !r.decodes() {
        return Err(format!("the {} device does not decode encoded weights", platform.name));
    }
    let stream = r.create_stream().map_err(|e| e.to_string())?;
    let g = r.granularity().map_err(|e| e.to_string())?;
    let largest = sizes.iter().copied().max().unwrap_or(0) << 20;
    let all = ddo_platform::samples::weight_like_bf16(largest, threads);
    println!(
        "decode_rate on the {} device: weight-like bf16 (normal, scale 0.02); GB/s of bf16 bytes",
        platform.name
    );
    println!(
        "{:>9} {:>8} {:>7} {:>12} {:>10} {:>12}",
        "size", "ratio", "repeat", "decode GB/s", "link GB/s", "decode/link"
    );
    for mib in sizes {
        let bytes = &all[..mib << 20];
        let repeat = a.repeat.unwrap_or(if quick { 3 } else { ((2 << 30) >> 20) / mib.max(1) });
        let repeat = repeat.clamp(1, 1000);
        let enc = ddo_codec::encode_bf16(bytes, threads).map_err(|e| e.to_string())?;
        let encoding = enc.to_bytes();
        let at = (encoding.len() as u64).next_multiple_of(256);
        let len = (at + bytes.len() as u64).next_multiple_of(g);
        let reservation = r.reserve(len).map_err(|e| e.to_string())?;
        let backing = r.create_backing(len).map_err(|e| e.to_string())?;
        let whole = DeviceRange { start: reservation.range.start, len };
        r.map(whole, backing).map_err(|e| e.to_string())?;
        let src = DeviceRange { start: whole.start, len: encoding.len() as u64 };
        let dst = DeviceRange { start: whole.start.offset(at), len: bytes.len() as u64 };
        let pinned = |b: Vec<u8>| HostSlice::whole(Arc::new(HostBytes::from(b)));
        let (encoded, decoded) = (pinned(encoding), pinned(bytes.to_vec()));
        let registrations = [
            r.register_host(encoded.clone(), true).map_err(|e| e.to_string())?,
            r.register_host(decoded.clone(), true).map_err(|e| e.to_string())?,
        ];
        r.copy_to_device(encoded.clone(), src, stream).map_err(|e| e.to_string())?;
        let decode = || r.decode(src, dst, stream).map_err(|e| e.to_string());
        let decode_s = seconds_each(&platform, stream, repeat, decode)?;
        let mut out = vec![0u8; bytes.len()];
        r.read_back(dst, &mut out).map_err(|e| e.to_string())?;
        if out != bytes {
            let i = out.iter().zip(bytes).position(|(x, y)| x != y).unwrap_or(0);
            return Err(format!("{mib} MiB: decoded byte {i} differs from the input"));
        }
        let copy = || r.copy_to_device(decoded.clone(), dst, stream).map_err(|e| e.to_string());
        let link_s = seconds_each(&platform, stream, repeat, copy)?;
        for registration in &registrations {
            r.unregister_host(registration).map_err(|e| e.to_string())?;
        }
        r.unmap(whole).map_err(|e| e.to_string())?;
        r.release_backing(backing).map_err(|e| e.to_string())?;
        r.release_reservation(reservation).map_err(|e| e.to_string())?;
        let gb = bytes.len() as f64 / 1e9;
        println!(
            "{:>5} MiB {:>8.4} {:>7} {:>12.2} {:>10.2} {:>12.2}",
            mib,
            enc.ratio(),
            repeat,
            gb / decode_s,
            gb / link_s,
            link_s / decode_s
        );
    }
    Ok(())
}
