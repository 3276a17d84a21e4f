//! How fast the device decodes entropy-coded weights, measured through the ports: what
//! `vmm_weight_encoding = auto` weighs against the link's speed.

use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DeviceError, DeviceRange, HostBytes, HostRegion, HostSlice, Platform};

/// Tensor sizes the decoding probe times: a launch's latency dominates the first, the rate the
/// last.
const DECODE_PROBE_BYTES: [usize; 3] = [1 << 20, 4 << 20, 16 << 20];

/// How long the device takes to decode one encoded tensor, measured on weight-like bf16 at a few
/// sizes and interpolated between them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DecodeSpeed {
    /// (bf16 bytes, seconds from enqueue to completion), by size.
    points: Vec<(u64, f64)>,
}

impl DecodeSpeed {
    /// Seconds to decode a tensor of `bytes`: the smallest size's time below it (a launch costs
    /// that much), linear between sizes, and the largest size's rate beyond it (larger tensors
    /// decode at least that fast).
    pub(crate) fn seconds(&self, bytes: u64) -> f64 {
        let Some(&(b0, s0)) = self.points.first() else { return f64::INFINITY };
        if bytes <= b0 {
            return s0;
        }
        for w in self.points.windows(2) {
            let ((b1, s1), (b2, s2)) = (w[0], w[1]);
            if bytes <= b2 {
                return s1 + (s2 - s1) * (bytes - b1) as f64 / (b2 - b1) as f64;
            }
        }
        let &(bn, sn) = self.points.last().expect("one point");
        sn * bytes as f64 / bn as f64
    }

    /// Bytes of bf16 per second at the largest size measured.
    pub(crate) fn rate(&self) -> f64 {
        self.points.last().map_or(0.0, |&(b, s)| b as f64 / s)
    }

    #[cfg(test)]
    pub(crate) fn of(points: Vec<(u64, f64)>) -> Self {
        DecodeSpeed { points }
    }
}

/// Best of three decodes of each probe size, each timed from enqueue to completion.
pub(crate) fn decode_speed(platform: &Platform) -> Result<DecodeSpeed, DeviceError> {
    let r = &platform.residency;
    let granularity = r.granularity()?;
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let largest = DECODE_PROBE_BYTES[DECODE_PROBE_BYTES.len() - 1];
    let weights = ddo_platform::samples::weight_like_bf16(largest, threads);
    let stream = r.create_stream()?;
    let measured = time_decodes(platform, &weights, granularity, threads, stream);
    // Every probe waited for its work: the stream is idle.
    let released = r.release_stream(stream);
    let speed = measured?;
    released?;
    Ok(speed)
}

/// The decoding probe's timings on `stream`, one point per probe size.
fn time_decodes(
    platform: &Platform,
    weights: &[u8],
    granularity: u64,
    threads: usize,
    stream: ddo_core::StreamId,
) -> Result<DecodeSpeed, DeviceError> {
    let r = &platform.residency;
    let mut points = Vec::new();
    for bytes in DECODE_PROBE_BYTES {
        let encoding = ddo_codec::encode_bf16(&weights[..bytes], threads)
            .map_err(|e| DeviceError::Unsupported(format!("the decoding probe: {e}")))?
            .to_bytes();
        let at = (encoding.len() as u64).next_multiple_of(256);
        let len = (at + bytes as u64).next_multiple_of(granularity);
        let encoded_len = encoding.len() as u64;
        let host = HostSlice::whole(Arc::new(HostBytes::from(encoding)) as Arc<dyn HostRegion>);
        let registration = r.register_host(host.clone(), true)?;
        // Whatever fails, what was taken is given back.
        let result = (|| -> Result<f64, DeviceError> {
            let reservation = r.reserve(len)?;
            let timed = (|| -> Result<f64, DeviceError> {
                let backing = r.create_backing(len)?;
                let whole = DeviceRange { start: reservation.range.start, len };
                let mapped = (|| -> Result<f64, DeviceError> {
                    r.map(whole, backing)?;
                    let src = DeviceRange { start: whole.start, len: encoded_len };
                    let dst = DeviceRange { start: whole.start.offset(at), len: bytes as u64 };
                    let best = (|| -> Result<f64, DeviceError> {
                        r.copy_to_device(host.clone(), src, stream)?;
                        platform.fences.wait(platform.fences.record(stream)?)?;
                        let mut best = f64::INFINITY;
                        // The first decode loads the kernel; it is not counted.
                        for round in 0..4 {
                            let t = Instant::now();
                            r.decode(src, dst, stream)?;
                            platform.fences.wait(platform.fences.record(stream)?)?;
                            if round > 0 {
                                best = best.min(t.elapsed().as_secs_f64());
                            }
                        }
                        Ok(best)
                    })();
                    // Work still queued on the stream reads the range: wait before unmapping.
                    let _ = platform.fences.record(stream).and_then(|f| platform.fences.wait(f));
                    let unmapped = r.unmap(whole);
                    let best = best?;
                    unmapped?;
                    Ok(best)
                })();
                let released = r.release_backing(backing);
                let best = mapped?;
                released?;
                Ok(best)
            })();
            let released = r.release_reservation(reservation);
            let best = timed?;
            released?;
            Ok(best)
        })();
        let unregistered = r.unregister_host(&registration);
        let result = result.and_then(|best| unregistered.map(|()| best));
        points.push((bytes as u64, result?));
    }
    Ok(DecodeSpeed { points })
}

/// How fast `platform`'s device decodes entropy-coded bf16 weights, bytes of bf16 per second
/// at the largest probe size (what a whole-generation plan weighs against the link).
pub fn measure_decode_rate(platform: &Platform) -> Result<f64, DeviceError> {
    decode_speed(platform).map(|s| s.rate())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_time_is_the_launch_below_the_probes_and_the_last_rate_above() {
        let s = DecodeSpeed::of(vec![(1 << 20, 30e-6), (4 << 20, 40e-6), (16 << 20, 50e-6)]);
        assert_eq!(s.seconds(1000), 30e-6);
        assert!((s.seconds(((1 << 20) + (4 << 20)) / 2) - 35e-6).abs() < 1e-12);
        assert!((s.seconds(32 << 20) - 100e-6).abs() < 1e-12);
        assert!((s.rate() - (16 << 20) as f64 / 50e-6).abs() < 1.0);
        assert_eq!(DecodeSpeed::of(Vec::new()).seconds(1), f64::INFINITY);
    }

    #[test]
    fn the_host_backend_is_timed_at_every_probe_size() {
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let platform = ddo_platform::host_platform(device.clone());
        let speed = decode_speed(&platform).unwrap();
        assert_eq!(speed.points.len(), DECODE_PROBE_BYTES.len());
        assert!(speed.points.iter().all(|&(_, s)| s > 0.0 && s.is_finite()));
        assert_eq!(device.live_streams(), 0, "the probe releases the stream it made");
    }
}
