//! The copy paths a weight store can stream over, measured on this machine: for every ordered
//! pair of GPUs, copies from one's memory into the other's (over peer access where the driver
//! allows it), beside pinned host memory into each GPU. Bandwidth of large copies and latency of
//! 4 KiB ones; the topology first. Needs a CUDA driver.
//!
//! ```sh
//! cargo run --release -p ddo-platform --example p2p_rate -- [--mib 256]
//! ```

use ddo_platform::cuda;

fn main() -> Result<(), String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = match argv.as_slice() {
        [] => 256,
        [flag, v] if flag == "--mib" => v.parse().map_err(|_| format!("--mib takes MiB: {v}"))?,
        _ => return Err("usage: p2p_rate [--mib MIB]".into()),
    };
    let bytes = mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or(format!("--mib takes a size from 1 MiB up: {mib}"))?;
    let t = cuda::topology().map_err(|e| e.to_string())?;
    for d in &t.devices {
        println!(
            "device {}: {} ({:.1} GiB)",
            d.ordinal,
            d.name,
            d.total_bytes as f64 / 1073741824.0
        );
    }
    let show = |m: ddo_core::LinkMeasurement| {
        format!(
            "{:.1} GB/s ({} MiB copies), {:.1} us per 4 KiB copy",
            m.bytes_per_second / 1e9,
            m.copy_bytes >> 20,
            m.latency_seconds * 1e6
        )
    };
    for d in &t.devices {
        let m = cuda::measure_host_link(d.ordinal, bytes).map_err(|e| e.to_string())?;
        println!("pinned host -> device {}: {}", d.ordinal, show(m));
    }
    if t.devices.len() < 2 {
        println!("one device: peer links need a second GPU");
    }
    for p in &t.peers {
        let m = cuda::measure_peer_link(p.from, p.to, bytes).map_err(|e| e.to_string())?;
        let path = if p.allowed { "peer access" } else { "no peer access (driver's path)" };
        println!("device {} memory -> device {} ({path}): {}", p.to, p.from, show(m));
    }
    Ok(())
}
