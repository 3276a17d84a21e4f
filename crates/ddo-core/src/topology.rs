//! The devices of one host and the links between them: what planning needs to hold weights in a
//! peer GPU's memory, and what a profile reports of where each byte crosses.

use serde::{Deserialize, Serialize};

/// One GPU as the driver enumerates it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DeviceInfo {
    /// The driver's ordinal.
    pub ordinal: u32,
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Device memory, bytes.
    pub total_bytes: u64,
}

/// Whether one device can read another's memory directly (NVLink or PCIe peer-to-peer), as the
/// driver answers it (`cuDeviceCanAccessPeer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PeerAccess {
    /// The device that reads (the compute device).
    pub from: u32,
    /// The device whose memory it reads (the weight store).
    pub to: u32,
    /// The driver allows direct access.
    pub allowed: bool,
}

/// The devices of this host and which pairs have peer access.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DeviceTopology {
    /// Every device, by ordinal.
    pub devices: Vec<DeviceInfo>,
    /// Every ordered pair of distinct devices.
    pub peers: Vec<PeerAccess>,
}

impl DeviceTopology {
    /// Whether `from` may read `to`'s memory directly; `false` for a pair the topology lacks.
    pub fn peer_access(&self, from: u32, to: u32) -> bool {
        self.peers.iter().any(|p| p.from == from && p.to == to && p.allowed)
    }

    /// The devices `from` may read directly, in ordinal order.
    pub fn peers_of(&self, from: u32) -> Vec<u32> {
        let mut peers: Vec<u32> =
            self.peers.iter().filter(|p| p.from == from && p.allowed).map(|p| p.to).collect();
        peers.sort_unstable();
        peers
    }
}

/// A copy path's speed as measured: large copies for bandwidth, small ones for latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct LinkMeasurement {
    /// Bytes of each large copy.
    pub copy_bytes: u64,
    /// Bytes per second of the large copies (the fastest round).
    pub bytes_per_second: f64,
    /// Seconds one small copy takes, enqueue to completion on the device (the fastest round).
    pub latency_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two() -> DeviceTopology {
        let device = |ordinal| DeviceInfo { ordinal, name: "GPU".into(), total_bytes: 1 << 30 };
        DeviceTopology {
            devices: vec![device(0), device(1), device(2)],
            peers: vec![
                PeerAccess { from: 0, to: 1, allowed: true },
                PeerAccess { from: 1, to: 0, allowed: true },
                PeerAccess { from: 0, to: 2, allowed: false },
                PeerAccess { from: 2, to: 0, allowed: false },
                PeerAccess { from: 1, to: 2, allowed: false },
                PeerAccess { from: 2, to: 1, allowed: true },
            ],
        }
    }

    #[test]
    fn peer_access_is_per_ordered_pair() {
        let t = two();
        assert!(t.peer_access(0, 1) && t.peer_access(1, 0));
        assert!(!t.peer_access(0, 2) && !t.peer_access(1, 2));
        assert!(t.peer_access(2, 1), "access is directional");
        assert!(!t.peer_access(0, 0) && !t.peer_access(0, 7), "pairs the topology lacks");
        assert_eq!(t.peers_of(0), vec![1]);
        assert_eq!(t.peers_of(2), vec![1]);
        assert!(DeviceTopology::default().peers_of(0).is_empty());
    }

    #[test]
    fn a_topology_round_trips_through_json() {
        let t = two();
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<DeviceTopology>(&json).unwrap(), t);
    }
}
