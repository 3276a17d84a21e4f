//! The device topology and the measured copy paths: on a machine without a driver every call
//! says so; on a GPU machine the devices, their peer pairs and the links are real.

use ddo_core::DeviceError;
use ddo_platform::cuda;

#[test]
fn without_a_driver_every_topology_call_says_so() {
    if cuda::driver_present() {
        return; // A GPU machine: the test below covers it.
    }
    let answers = [
        cuda::topology().map(|_| ()),
        cuda::measure_host_link(0, 1 << 20).map(|_| ()),
        cuda::measure_peer_link(0, 1, 1 << 20).map(|_| ()),
    ];
    for answer in answers {
        let e = answer.unwrap_err();
        if cfg!(feature = "cuda") {
            assert!(matches!(e, DeviceError::DriverNotFound), "{e}");
        } else {
            assert!(e.to_string().contains("built without CUDA"), "{e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn the_topology_lists_every_device_and_pair_and_the_links_carry_bytes() {
    let t = cuda::topology().unwrap();
    let n = t.devices.len();
    assert!(n >= 1, "{t:?}");
    for (i, d) in t.devices.iter().enumerate() {
        assert_eq!(d.ordinal as usize, i);
        assert!(!d.name.is_empty() && d.total_bytes > 1 << 30, "{d:?}");
    }
    assert_eq!(t.peers.len(), n * (n - 1), "every ordered pair of distinct devices: {t:?}");
    let host = cuda::measure_host_link(0, 64 << 20).unwrap();
    assert!(host.bytes_per_second > 1e9, "pinned host to device: {host:?}");
    assert!(host.latency_seconds > 0.0 && host.latency_seconds < 1e-2, "{host:?}");
    assert!(matches!(cuda::measure_peer_link(0, 0, 1 << 20), Err(DeviceError::InvalidUse(_))));
    let missing = n as u32;
    assert!(matches!(
        cuda::measure_host_link(missing, 1 << 20),
        Err(DeviceError::InvalidDevice { ordinal, .. }) if ordinal == missing
    ));
    if n >= 2 {
        let link = cuda::measure_peer_link(0, 1, 64 << 20).unwrap();
        assert!(link.bytes_per_second > 1e9, "device 1 to device 0: {link:?}");
    }
}
