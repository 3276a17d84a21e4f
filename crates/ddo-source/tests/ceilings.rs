//! Retained storage and registration ceilings, admission refusals and release failures.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::{
    Admission, DeviceError, GrowthKind, HostSlice, MockAdmissionProbe, MockResidency, ReadRequest,
    Refusal, RefusalReason, Registration, SourceError, WeightSource,
};
use ddo_source::{
    Checkpoint, CheckpointSource, REGISTRATION_SEGMENT, ReadOptions, Registrar, RetainedStore,
};

fn granting() -> Arc<MockAdmissionProbe> {
    let mut p = MockAdmissionProbe::new();
    p.expect_admit().returning(|_| Admission::Granted { headroom: 1 << 40 });
    Arc::new(p)
}

fn refusing() -> Arc<MockAdmissionProbe> {
    let mut p = MockAdmissionProbe::new();
    p.expect_admit().returning(|r| {
        Admission::Refused(Refusal {
            request: *r,
            reason: RefusalReason::MemAvailable { available: 1 << 30, margin: 1 << 30 },
        })
    });
    Arc::new(p)
}

fn source() -> (tempfile::TempDir, CheckpointSource) {
    let dir = scratch();
    let path = write(&dir.path().join("m.safetensors"), &[("a", vec![512]), ("b", vec![256])]);
    let c = Arc::new(Checkpoint::open(&path).unwrap());
    (dir, CheckpointSource::new(c, ReadOptions::default()).unwrap())
}

fn whole(source: &CheckpointSource) -> (Vec<ReadRequest>, u64) {
    let mut at = 0;
    let reqs = source
        .slices()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let r = ReadRequest { slice: i, dst_offset: at };
            at += s.len;
            r
        })
        .collect();
    (reqs, at)
}

#[test]
fn retained_bytes_are_the_checkpoints_and_count_until_dropped() {
    let (_d, src) = source();
    let store = RetainedStore::new(4096, granting());
    let (reqs, len) = whole(&src);
    let buf = store.retain(&src, &reqs, len).unwrap();
    assert_eq!(&ddo_core::HostRegion::bytes(&*buf)[..1024], pattern("a", 1024).as_slice());
    assert_eq!(store.used(), len);
    let held = buf.clone();
    drop(buf);
    assert_eq!(store.used(), len, "an Arc still holds it");
    drop(held);
    assert_eq!(store.used(), 0);
}

#[test]
fn the_storage_ceiling_refuses_and_changes_nothing() {
    let (_d, src) = source();
    let store = RetainedStore::new(2000, granting());
    let (reqs, len) = whole(&src);
    let first = store.retain(&src, &reqs[..1], 1024).unwrap();
    let e = store.retain(&src, &reqs, len).unwrap_err();
    assert_eq!(
        e.to_string(),
        "retained storage ceiling of 1.95 KiB would be exceeded: 1.00 KiB in use, 1.50 KiB requested; raise the ceiling or lower what is kept"
    );
    assert_eq!(store.used(), 1024);
    drop(first);
}

#[test]
fn an_admission_refusal_carries_the_reason_and_changes_nothing() {
    let (_d, src) = source();
    let store = RetainedStore::new(1 << 20, refusing());
    let (reqs, len) = whole(&src);
    let e = store.retain(&src, &reqs, len).unwrap_err();
    match &e {
        SourceError::Refused(r) => {
            assert_eq!(r.request.kind, GrowthKind::Retained);
            assert_eq!(r.request.bytes, len);
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().starts_with("host memory growth refused: retained host storage of 1.50 KiB refused: MemAvailable is 1.00 GiB"));
    assert_eq!(store.used(), 0);
}

#[test]
fn a_failed_read_releases_the_reservation() {
    let (_d, src) = source();
    let store = RetainedStore::new(1 << 20, granting());
    let bad = [ReadRequest { slice: 0, dst_offset: 100 }];
    assert!(store.retain(&src, &bad, 64).is_err());
    assert_eq!(store.used(), 0);
}

fn slice(len: usize) -> HostSlice {
    HostSlice::whole(Arc::new(ddo_core::HostBytes::from(vec![5u8; len])))
}

fn registering(unregister_fails: bool) -> Arc<MockResidency> {
    registering_with(unregister_fails, false)
}

/// A residency that registers everything; `shared`: every slice is already registered in the
/// process (another session's registration of the same mapping).
fn registering_with(unregister_fails: bool, shared: bool) -> Arc<MockResidency> {
    let mut r = MockResidency::new();
    r.expect_host_registered().returning(move |_| shared);
    r.expect_register_host().returning(|slice, _| Ok(Registration { slice, handle: 1 }));
    r.expect_unregister_host().returning(move |_| {
        if unregister_fails { Err(DeviceError::Lost("injected".into())) } else { Ok(()) }
    });
    Arc::new(r)
}

#[test]
fn registration_is_charged_in_whole_pages_under_a_ceiling_of_whole_segments() {
    let reg = Registrar::new(REGISTRATION_SEGMENT + 5, registering(false), granting());
    assert_eq!(reg.ceiling(), REGISTRATION_SEGMENT);
    let a = reg.register(slice(1000), true).unwrap();
    assert_eq!(a.charged(), 4096);
    // Ranges smaller than a segment fill the ceiling: 16383 more pages fit, not one more.
    let b = reg.register(slice(REGISTRATION_SEGMENT as usize - 8192), true).unwrap();
    let c = reg.register(slice(4096), true).unwrap();
    let e = reg.register(slice(1), false).unwrap_err();
    assert_eq!(
        e.to_string(),
        "registration ceiling of 64.00 MiB would be exceeded: 64.00 MiB in use, 4.00 KiB requested; raise the ceiling or lower what is kept"
    );
    assert_eq!(reg.charged(), REGISTRATION_SEGMENT);
    let bytes = a.slice().clone();
    reg.unregister(a).unwrap();
    assert_eq!(reg.charged(), REGISTRATION_SEGMENT - 4096);
    // Unregistering keeps the stored bytes.
    assert_eq!(bytes.as_bytes(), vec![5u8; 1000].as_slice());
    reg.unregister(b).unwrap();
    reg.unregister(c).unwrap();
    assert_eq!(reg.charged(), 0);
}

#[test]
fn memlock_refusal_leaves_the_ledger_unchanged() {
    let mut probe = MockAdmissionProbe::new();
    probe.expect_admit().returning(|r| {
        assert_eq!(r.kind, GrowthKind::Registration);
        Admission::Refused(Refusal {
            request: *r,
            reason: RefusalReason::Memlock { limit: 8 << 20, locked: 0 },
        })
    });
    let reg = Registrar::new(8 * REGISTRATION_SEGMENT, registering(false), Arc::new(probe));
    let e = reg.register(slice(4096), true).unwrap_err();
    assert!(e.to_string().contains("RLIMIT_MEMLOCK is 8.00 MiB"), "{e}");
    assert_eq!(reg.charged(), 0);
}

#[test]
fn a_failed_unregistration_retains_ownership() {
    let reg = Registrar::new(4 * REGISTRATION_SEGMENT, registering(true), granting());
    let a = reg.register(slice(4096), true).unwrap();
    let e = reg.unregister(a).unwrap_err();
    assert!(matches!(e, SourceError::Device(DeviceError::Lost(_))));
    assert_eq!(reg.charged(), 4096, "still charged: never reused");
    assert_eq!(reg.unsafe_retained(), 4096);
}

#[test]
fn joining_a_registration_the_process_holds_asks_the_host_for_nothing() {
    // A host that admits no more page-locked memory still lets a session join the registration
    // another session made of the same mapping: no new memory is locked.
    let reg = Registrar::new(4 * REGISTRATION_SEGMENT, registering_with(false, true), refusing());
    let joined = reg.register(slice(4096), true).expect("joining is not a new registration");
    assert_eq!(reg.charged(), 4096);
    reg.unregister(joined).unwrap();
    // The same host refuses a registration of memory no one has registered.
    let reg = Registrar::new(4 * REGISTRATION_SEGMENT, registering_with(false, false), refusing());
    assert!(matches!(reg.register(slice(4096), true), Err(SourceError::Refused(_))));
    assert_eq!(reg.charged(), 0);
}
