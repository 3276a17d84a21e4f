//! One page-locked host copy for every device of the process: a second device (or a second
//! session's device on the same GPU) registering the same host memory joins the first one's
//! registration, copies from it at once, and the last holder unregisters it. Needs a GPU:
//! `cargo xtask test-gpu` (where the machine has two GPUs, the second device is the other GPU).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use ddo_core::{DeviceError, DeviceRange, HostBytes, HostSlice, Platform};
use ddo_platform::cuda::registration_holders;

fn platform(ordinal: u32) -> (Platform, Arc<ddo_platform::cuda::CudaDevice>) {
    ddo_platform::cuda_platform(ordinal).expect("a CUDA device (run with cargo xtask test-gpu)")
}

fn mapped(p: &Platform, len: u64) -> DeviceRange {
    let r = &p.residency;
    let len = len.next_multiple_of(r.granularity().unwrap());
    let reservation = r.reserve(len).unwrap();
    let backing = r.create_backing(len).unwrap();
    let whole = DeviceRange { start: reservation.range.start, len };
    r.map(whole, backing).unwrap();
    whole
}

/// Copies `src` to `p`'s memory and reads it back.
fn round_trip(p: &Platform, src: &HostSlice) -> Vec<u8> {
    let dst = mapped(p, src.len() as u64);
    let stream = p.residency.create_stream().unwrap();
    let range = DeviceRange { start: dst.start, len: src.len() as u64 };
    p.residency.copy_to_device(src.clone(), range, stream).unwrap();
    let f = p.fences.record(stream).unwrap();
    p.fences.wait(f).unwrap();
    let mut back = vec![0u8; src.len()];
    p.residency.read_back(range, &mut back).unwrap();
    back
}

fn second_ordinal() -> u32 {
    let count = ddo_platform::cuda::topology().expect("topology").devices.len() as u32;
    count.min(2) - 1
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_second_device_joins_the_registration_and_the_last_holder_ends_it() {
    let bytes: Vec<u8> = (0..8 << 20).map(|i: u32| (i * 29 % 251) as u8).collect();
    let host = HostSlice::whole(Arc::new(HostBytes::from(bytes.clone())));
    let ptr = host.as_bytes().as_ptr() as u64;
    let (a, _da) = platform(0);
    let (b, _db) = platform(second_ordinal());
    assert!(!b.residency.host_registered(&host));
    let ra = a.residency.register_host(host.clone(), true).unwrap();
    assert_eq!(registration_holders(ptr), 1);
    assert!(
        b.residency.host_registered(&host),
        "the process's registration is seen by every device"
    );
    // The driver refuses a second registration of the same memory; joining does not ask it.
    let rb = b.residency.register_host(host.clone(), true).expect("joins the registration");
    assert_eq!(registration_holders(ptr), 2);
    assert!(round_trip(&b, &host) == bytes);
    // The first holder lets go: the second still copies from registered memory.
    a.residency.unregister_host(&ra).unwrap();
    assert_eq!(registration_holders(ptr), 1);
    assert!(round_trip(&b, &host) == bytes);
    b.residency.unregister_host(&rb).unwrap();
    assert_eq!(registration_holders(ptr), 0);
    assert!(!a.residency.host_registered(&host));
    assert!(b.residency.unregister_host(&rb).is_err(), "a registration ends once");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_range_overlapping_a_live_registration_is_refused_by_name() {
    let host = HostSlice::whole(Arc::new(HostBytes::from(vec![3u8; 4 << 20])));
    let (a, _da) = platform(0);
    let (b, _db) = platform(second_ordinal());
    let whole = a.residency.register_host(host.clone(), true).unwrap();
    let part = host.slice(1 << 20, 1 << 20).unwrap();
    let refused = b.residency.register_host(part.clone(), true);
    assert!(
        matches!(&refused, Err(DeviceError::InvalidUse(m)) if m.contains("overlaps")),
        "{refused:?}"
    );
    assert!(!b.residency.host_registered(&part));
    a.residency.unregister_host(&whole).unwrap();
    // With the whole range gone, the part registers on its own.
    let own = b.residency.register_host(part, true).unwrap();
    b.residency.unregister_host(&own).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_device_dropped_while_holding_lets_its_hold_go() {
    let host = HostSlice::whole(Arc::new(HostBytes::from(vec![9u8; 2 << 20])));
    let ptr = host.as_bytes().as_ptr() as u64;
    let (a, da) = platform(0);
    let (b, db) = platform(second_ordinal());
    let _ra = a.residency.register_host(host.clone(), true).unwrap();
    let _rb = b.residency.register_host(host.clone(), true).unwrap();
    assert_eq!(registration_holders(ptr), 2);
    // The registering device goes first: the registration keeps its context, the other device
    // keeps copying from it.
    drop((a, da));
    assert_eq!(registration_holders(ptr), 1);
    assert!(round_trip(&b, &host) == vec![9u8; 2 << 20]);
    drop((b, db));
    assert_eq!(registration_holders(ptr), 0);
}
