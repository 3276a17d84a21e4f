//! Peer buffers (a weight store in a device's memory the computing device copies from), one test
//! body per backend: the host backend always, CUDA under `cargo xtask test-gpu` (the peer there
//! is the last GPU the driver lists: another GPU where the machine has two, else the same one).

use std::sync::Arc;

use ddo_core::{DeviceError, DeviceOrdinal, DeviceRange, Platform};
use ddo_platform::host::HostDevice;

struct Env {
    platform: Platform,
    peer: DeviceOrdinal,
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

fn host_env() -> Env {
    let device = Arc::new(HostDevice::with_granularity(64 << 10));
    Env {
        platform: ddo_platform::host_platform(device.clone()),
        peer: DeviceOrdinal(1),
        _keep: Some(device),
    }
}

fn cuda_env() -> Env {
    let (platform, device) =
        ddo_platform::cuda_platform(0).expect("a CUDA device (run with cargo xtask test-gpu)");
    let count = ddo_platform::cuda::topology().expect("topology").devices.len() as u32;
    Env { platform, peer: DeviceOrdinal(count - 1), _keep: Some(device) }
}

macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod host_backend {
            $( #[test] fn $name() { super::$name(&super::host_env()) } )*
        }
        mod cuda_backend {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
                fn $name() { super::$name(&super::cuda_env()) }
            )*
        }
    };
}

backend_tests!(
    bytes_written_to_a_peer_buffer_copy_into_mapped_memory,
    copies_past_a_peer_buffer_or_from_a_released_one_are_refused,
);

fn mapped(env: &Env, len: u64) -> DeviceRange {
    let r = &env.platform.residency;
    let len = len.next_multiple_of(r.granularity().unwrap());
    let reservation = r.reserve(len).unwrap();
    let backing = r.create_backing(len).unwrap();
    let whole = DeviceRange { start: reservation.range.start, len };
    r.map(whole, backing).unwrap();
    whole
}

fn bytes_written_to_a_peer_buffer_copy_into_mapped_memory(env: &Env) {
    let r = &env.platform.residency;
    let len = 3 << 20;
    let store = r.create_peer_buffer(env.peer, len + 17).unwrap();
    assert_eq!((store.device, store.range.len), (env.peer, len + 17));
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
    // Written in two pieces, the second at an odd offset.
    r.write_peer_buffer(store, 0, &bytes[..1 << 20]).unwrap();
    r.write_peer_buffer(store, 1 << 20, &bytes[1 << 20..]).unwrap();
    let dst = mapped(env, len);
    let stream = r.create_stream().unwrap();
    // Two copies: the tail first, then the head, into their places.
    let half = len / 2 + 1;
    let tail = DeviceRange { start: dst.start.offset(half), len: len - half };
    r.copy_from_peer(store, half, tail, stream).unwrap();
    r.copy_from_peer(store, 0, DeviceRange { start: dst.start, len: half }, stream).unwrap();
    let fence = env.platform.fences.record(stream).unwrap();
    env.platform.fences.wait(fence).unwrap();
    let mut back = vec![0u8; len as usize];
    r.read_back(DeviceRange { start: dst.start, len }, &mut back).unwrap();
    assert!(back == bytes, "the copies give the written bytes back");
    r.release_peer_buffer(store).unwrap();
}

fn copies_past_a_peer_buffer_or_from_a_released_one_are_refused(env: &Env) {
    let r = &env.platform.residency;
    let store = r.create_peer_buffer(env.peer, 1 << 20).unwrap();
    let dst = mapped(env, 2 << 20);
    let stream = r.create_stream().unwrap();
    let past = r.copy_from_peer(store, 1, DeviceRange { start: dst.start, len: 1 << 20 }, stream);
    assert!(matches!(&past, Err(DeviceError::InvalidUse(m)) if m.contains("run past")), "{past:?}");
    let written = r.write_peer_buffer(store, (1 << 20) - 1, &[1, 2]);
    assert!(matches!(written, Err(DeviceError::InvalidUse(_))), "{written:?}");
    // A destination outside any mapping is refused before anything is copied.
    let outside = DeviceRange { start: dst.start.offset(dst.len), len: 16 };
    assert!(r.copy_from_peer(store, 0, outside, stream).is_err());
    r.release_peer_buffer(store).unwrap();
    let gone = r.copy_from_peer(store, 0, DeviceRange { start: dst.start, len: 16 }, stream);
    assert!(matches!(&gone, Err(DeviceError::InvalidUse(m)) if m.contains("not live")), "{gone:?}");
    assert!(r.release_peer_buffer(store).is_err(), "a buffer is released once");
    assert!(r.create_peer_buffer(env.peer, 0).is_err(), "an empty buffer is refused");
}
