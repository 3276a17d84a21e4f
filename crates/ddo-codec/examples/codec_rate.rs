//! Encodes and decodes a weight-like bf16 tensor and prints the ratio and the host's rates.
//! Usage: codec_rate [MIB] [THREADS]

use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let threads: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    // A normal spread of scale 0.02, as initialised weights have.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let bytes: Vec<u8> = (0..mib << 19)
        .flat_map(|_| {
            let (u, v) = (uniform().max(1e-300), uniform());
            let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            ((((z * 0.02) as f32).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    let t = Instant::now();
    let enc = ddo_codec::encode_bf16(&bytes, threads).expect("encodes");
    let encode = t.elapsed().as_secs_f64();
    let mut out = vec![0u8; bytes.len()];
    let t = Instant::now();
    ddo_codec::decode_bf16(&enc, &mut out, threads).expect("decodes");
    let decode = t.elapsed().as_secs_f64();
    assert!(out == bytes, "round trip");
    let gb = bytes.len() as f64 / 1e9;
    println!(
        "{mib} MiB bf16, {threads} threads: ratio {:.4}, encode {:.2} GB/s, decode {:.2} GB/s (of bf16)",
        enc.ratio(),
        gb / encode,
        gb / decode
    );
}
