//! Weight-like sample bytes, for the probes and benchmarks that time the device on tensors
//! shaped like a model's.

/// `bytes` (rounded down to whole elements) of little-endian bf16 drawn from a normal spread of
/// scale 0.02, as initialised weights are, made on `threads` threads. The same arguments give
/// the same bytes.
pub fn weight_like_bf16(bytes: usize, threads: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes / 2 * 2];
    let per = (bytes / 2).div_ceil(threads.max(1)) * 2;
    std::thread::scope(|s| {
        for (part, slot) in out.chunks_mut(per.max(2)).enumerate() {
            s.spawn(move || {
                let mut state = (part as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                let mut uniform = || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 11) as f64 / (1u64 << 53) as f64
                };
                for e in slot.chunks_exact_mut(2) {
                    let (u, v) = (uniform().max(1e-300), uniform());
                    let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                    e.copy_from_slice(
                        &((((z * 0.02) as f32).to_bits() >> 16) as u16).to_le_bytes(),
                    );
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_repeatable_and_spread_like_weights() {
        let a = weight_like_bf16(1 << 16, 3);
        assert_eq!(a, weight_like_bf16(1 << 16, 3));
        let values: Vec<f32> = a
            .chunks_exact(2)
            .map(|e| f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16))
            .collect();
        let n = values.len() as f32;
        let mean = values.iter().sum::<f32>() / n;
        let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n).sqrt();
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((std - 0.02).abs() < 1e-3, "std {std}");
    }
}
