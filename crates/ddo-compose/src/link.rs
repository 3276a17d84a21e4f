//! The host-to-device link speed, measured through the ports: the copy floor of a pass is the
//! bytes it streams over this speed.

use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DeviceError, DeviceRange, HostBytes, HostRegion, HostSlice, Platform};

/// Bytes per copy: large enough to reach link speed.
const PROBE_BYTES: usize = 64 << 20;

/// Best of three registered 64 MiB host-to-device copies, bytes per second. Whatever fails,
/// what the probe took (registration, reservation, backing, mapping) is given back.
pub fn measure_host_link(platform: &Platform) -> Result<f64, DeviceError> {
    let r = &platform.residency;
    let granularity = r.granularity()?;
    let len = (PROBE_BYTES as u64).div_ceil(granularity) * granularity;
    let host =
        HostSlice::whole(Arc::new(HostBytes::from(vec![1u8; PROBE_BYTES])) as Arc<dyn HostRegion>);
    let registration = r.register_host(host.clone(), true)?;
    let reservation = r.reserve(len)?;
    let backing = r.create_backing(len)?;
    let range = DeviceRange { start: reservation.range.start, len: PROBE_BYTES as u64 };
    let mapped = DeviceRange { start: reservation.range.start, len };
    let result = (|| {
        r.map(mapped, backing)?;
        let stream = r.create_stream()?;
        let timed = (|| -> Result<f64, DeviceError> {
            let mut best = 0.0f64;
            for _ in 0..3 {
                let t = Instant::now();
                r.copy_to_device(host.clone(), range, stream)?;
                let f = platform.fences.record(stream)?;
                platform.fences.wait(f)?;
                best = best.max(PROBE_BYTES as f64 / t.elapsed().as_secs_f64());
            }
            Ok(best)
        })();
        // Work still queued on the stream reads the range: wait before unmapping.
        let _ = platform.fences.record(stream).and_then(|f| platform.fences.wait(f));
        let released = r.release_stream(stream);
        let best = timed?;
        released?;
        r.unmap(mapped)?;
        Ok(best)
    })();
    r.release_backing(backing)?;
    r.release_reservation(reservation)?;
    r.unregister_host(&registration)?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_backend_copies_at_a_finite_positive_speed_and_keeps_no_stream() {
        let device = Arc::new(ddo_platform::host::HostDevice::new());
        let platform = ddo_platform::host_platform(device.clone());
        let speed = measure_host_link(&platform).unwrap();
        assert!(speed > 0.0 && speed.is_finite(), "{speed}");
        assert_eq!(device.live_streams(), 0, "the probe releases the stream it made");
    }
}
