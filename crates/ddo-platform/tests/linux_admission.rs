//! Admission decisions on fixture trees: overcommit modes, cgroups, rlimits and unreadable
//! observations. Each refusal's message is asserted.

use std::fs;
use std::path::Path;

use ddo_core::{
    Admission, AdmissionProbe, GIB, GrowthKind, GrowthRequest, MIB, OvercommitMode, RefusalReason,
};
use ddo_platform::LinuxAdmissionProbe;

/// A fake `/` with the files the probe reads.
struct Tree {
    dir: tempfile::TempDir,
}

const KB_PER_GIB: u64 = 1024 * 1024;

impl Tree {
    /// 64 GiB total, `available_gib` available, overcommit `mode`, unlimited rlimits, root
    /// cgroup only (no memory controller on the process's path).
    fn new(available_gib: u64, mode: u8) -> Tree {
        let t = Tree { dir: tempfile::tempdir().unwrap() };
        t.meminfo(available_gib, 40, 10);
        t.write("proc/sys/vm/overcommit_memory", &format!("{mode}\n"));
        t.status(4 * KB_PER_GIB, 0, 0);
        t.limits("unlimited", "unlimited");
        t.write("proc/self/cgroup", "0::/\n");
        t.write(
            "proc/self/mountinfo",
            "24 1 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n30 1 8:1 / / rw - ext4 /dev/sda1 rw\n",
        );
        fs::create_dir_all(t.path().join("sys/fs/cgroup")).unwrap();
        t
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.path().join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    fn meminfo(&self, available_gib: u64, commit_limit_gib: u64, committed_gib: u64) {
        self.write(
            "proc/meminfo",
            &format!(
                "MemTotal:       {} kB\nMemFree:        1000 kB\nMemAvailable:   {} kB\nCommitLimit:    {} kB\nCommitted_AS:   {} kB\n",
                64 * KB_PER_GIB,
                available_gib * KB_PER_GIB,
                commit_limit_gib * KB_PER_GIB,
                committed_gib * KB_PER_GIB
            ),
        );
    }

    fn status(&self, vm_size_kb: u64, vm_lck_kb: u64, cap_eff: u64) {
        self.write(
            "proc/self/status",
            &format!(
                "Name:\tpython\nVmPeak:\t{vm_size_kb} kB\nVmSize:\t{vm_size_kb} kB\nVmLck:\t{vm_lck_kb} kB\nVmHWM:\t2048 kB\nVmRSS:\t1024 kB\nCapEff:\t{cap_eff:016x}\n"
            ),
        );
    }

    fn limits(&self, address_space: &str, memlock: &str) {
        self.write(
            "proc/self/limits",
            &format!(
                "Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax address space         {address_space:<20} unlimited            bytes     \nMax locked memory         {memlock:<20} unlimited            bytes     \n"
            ),
        );
    }

    fn cgroup(&self, path: &str, max: &str, high: Option<&str>, current: u64) {
        self.write("proc/self/cgroup", &format!("0::{path}\n"));
        let dir = format!("sys/fs/cgroup{path}");
        self.write(&format!("{dir}/memory.max"), &format!("{max}\n"));
        if let Some(h) = high {
            self.write(&format!("{dir}/memory.high"), &format!("{h}\n"));
        }
        self.write(&format!("{dir}/memory.current"), &format!("{current}\n"));
    }

    fn probe(&self) -> LinuxAdmissionProbe {
        LinuxAdmissionProbe::with_root(self.path())
    }
}

fn retained(bytes: u64) -> GrowthRequest {
    GrowthRequest { kind: GrowthKind::Retained, bytes, registered_bytes: 0 }
}

fn registration(bytes: u64, registered_bytes: u64) -> GrowthRequest {
    GrowthRequest { kind: GrowthKind::Registration, bytes, registered_bytes }
}

fn refusal(a: Admission) -> (RefusalReason, String) {
    match a {
        Admission::Refused(r) => (r.reason.clone(), r.to_string()),
        Admission::Granted { headroom } => panic!("granted with headroom {headroom}"),
    }
}

#[test]
fn heuristic_overcommit_bounds_by_mem_available_minus_margin() {
    let t = Tree::new(10, 0);
    let p = t.probe();
    assert_eq!(p.admit(&retained(8 * GIB)), Admission::Granted { headroom: GIB });
    let (reason, message) = refusal(p.admit(&retained(9 * GIB + 1)));
    assert_eq!(reason, RefusalReason::MemAvailable { available: 10 * GIB, margin: GIB });
    assert_eq!(
        message,
        "retained host storage of 9.00 GiB refused: MemAvailable is 10.00 GiB and 1.00 GiB is kept free; free host memory or lower the retained host storage ceiling"
    );
}

#[test]
fn always_overcommit_keeps_the_finite_bound() {
    let t = Tree::new(10, 1);
    assert!(matches!(
        refusal(t.probe().admit(&retained(12 * GIB))).0,
        RefusalReason::MemAvailable { .. }
    ));
    assert!(matches!(t.probe().admit(&retained(GIB)), Admission::Granted { .. }));
}

#[test]
fn strict_overcommit_also_bounds_by_commit() {
    let t = Tree::new(30, 2);
    t.meminfo(30, 40, 35); // 5 GiB of commit left
    let p = t.probe();
    assert_eq!(p.admit(&retained(3 * GIB)), Admission::Granted { headroom: GIB });
    let (reason, message) = refusal(p.admit(&retained(6 * GIB)));
    assert_eq!(
        reason,
        RefusalReason::Commit { commit_limit: 40 * GIB, committed: 35 * GIB, margin: GIB }
    );
    assert_eq!(
        message,
        "retained host storage of 6.00 GiB refused: strict overcommit (vm.overcommit_memory=2) leaves 5.00 GiB of commit (CommitLimit 40.00 GiB - Committed_AS 35.00 GiB, 1.00 GiB kept free); lower the retained host storage ceiling"
    );
    // The same request passes in mode 0, where commit is not a bound.
    t.write("proc/sys/vm/overcommit_memory", "0\n");
    assert!(matches!(p.admit(&retained(6 * GIB)), Admission::Granted { .. }));
}

#[test]
fn a_cgroup_limit_refuses() {
    let t = Tree::new(50, 0);
    t.cgroup("/ddo.slice/job", &(16 * GIB).to_string(), None, 12 * GIB);
    let p = t.probe();
    assert_eq!(p.admit(&retained(2 * GIB)), Admission::Granted { headroom: GIB });
    let (reason, message) = refusal(p.admit(&retained(4 * GIB)));
    assert_eq!(
        reason,
        RefusalReason::Cgroup {
            cgroup: "/ddo.slice/job".into(),
            limit: 16 * GIB,
            current: 12 * GIB,
            margin: GIB
        }
    );
    assert_eq!(
        message,
        "retained host storage of 4.00 GiB refused: cgroup /ddo.slice/job allows 16.00 GiB and uses 12.00 GiB (1.00 GiB kept free); raise the cgroup's memory limit or lower the retained host storage ceiling"
    );
}

#[test]
fn a_small_cgroup_keeps_an_eighth_of_its_limit_free_not_the_hosts_margin() {
    let t = Tree::new(50, 0);
    t.cgroup("/job", &(8 * GIB).to_string(), None, 2 * GIB);
    // The host's margin of 6 GiB would leave nothing of an 8 GiB cgroup; it keeps 1 GiB.
    let p = t.probe().with_safety_margin(6 * GIB);
    assert_eq!(p.admit(&retained(4 * GIB)), Admission::Granted { headroom: GIB });
    let (reason, _) = refusal(p.admit(&retained(5 * GIB + 1)));
    assert_eq!(
        reason,
        RefusalReason::Cgroup {
            cgroup: "/job".into(),
            limit: 8 * GIB,
            current: 2 * GIB,
            margin: GIB
        }
    );
}

#[test]
fn memory_high_tighter_than_max_and_parent_limits_count() {
    let t = Tree::new(50, 0);
    t.cgroup("/a", "max", Some(&(8 * GIB).to_string()), 4 * GIB);
    let (reason, _) = refusal(t.probe().admit(&retained(4 * GIB)));
    assert!(matches!(reason, RefusalReason::Cgroup { limit, .. } if limit == 8 * GIB));

    // The leaf has no limit, its parent does.
    let t = Tree::new(50, 0);
    t.cgroup("/parent", &(6 * GIB).to_string(), None, 5 * GIB);
    t.write("proc/self/cgroup", "0::/parent/leaf\n");
    t.write("sys/fs/cgroup/parent/leaf/memory.max", "max\n");
    t.write("sys/fs/cgroup/parent/leaf/memory.current", "1000\n");
    let (reason, _) = refusal(t.probe().admit(&retained(GIB)));
    assert!(
        matches!(reason, RefusalReason::Cgroup { ref cgroup, .. } if cgroup == "/parent"),
        "{reason:?}"
    );
}

#[test]
fn no_cgroup_memory_controller_is_no_limit() {
    // cgroup v2 path without memory.* files (controller not enabled).
    let t = Tree::new(50, 0);
    t.write("proc/self/cgroup", "0::/user.slice\n");
    fs::create_dir_all(t.path().join("sys/fs/cgroup/user.slice")).unwrap();
    assert_eq!(t.probe().admit(&retained(40 * GIB)), Admission::Granted { headroom: 9 * GIB });
    // cgroup v1 memory controller on the path, but no v1 memory hierarchy mounted.
    t.write("proc/self/cgroup", "4:memory:/user.slice\n");
    assert!(matches!(t.probe().admit(&retained(40 * GIB)), Admission::Granted { .. }));
    // No cgroup2 mount at all.
    t.write("proc/self/cgroup", "0::/user.slice\n");
    t.write("proc/self/mountinfo", "30 1 8:1 / / rw - ext4 /dev/sda1 rw\n");
    assert!(matches!(t.probe().admit(&retained(40 * GIB)), Admission::Granted { .. }));
    assert!(t.probe().observe().cgroups.is_empty());
}

#[test]
fn inactive_file_cache_is_room_not_use() {
    // 7 GiB charged to an 8 GiB cgroup, 5 GiB of it a checkpoint read through the page cache.
    let t = Tree::new(50, 0);
    t.cgroup("/job", &(8 * GIB).to_string(), None, 7 * GIB);
    t.write(
        "sys/fs/cgroup/job/memory.stat",
        &format!("anon 2147483648\nfile 5368709120\nactive_file 0\ninactive_file {}\n", 5 * GIB),
    );
    // Room = 8 - (7 - 5) - 1 (an eighth of the limit) = 5 GiB.
    assert_eq!(t.probe().admit(&retained(4 * GIB)), Admission::Granted { headroom: GIB });
    let (reason, _) = refusal(t.probe().admit(&retained(6 * GIB)));
    assert!(
        matches!(reason, RefusalReason::Cgroup { current, .. } if current == 2 * GIB),
        "{reason:?}"
    );
    assert_eq!(t.probe().observe().cgroups[0].reclaimable, 5 * GIB);
}

#[test]
fn a_cgroup_v1_memory_hierarchy_limits() {
    // A container's v1 memory hierarchy: the mount shows the subtree rooted at /docker/abc.
    let t = Tree::new(50, 0);
    t.write("proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc/job\n0::/\n");
    t.write(
        "proc/self/mountinfo",
        "24 1 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n\
         25 24 0:23 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
         26 24 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
    );
    t.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    t.write("sys/fs/cgroup/memory/memory.usage_in_bytes", &format!("{}\n", 3 * GIB));
    t.write("sys/fs/cgroup/memory/job/memory.limit_in_bytes", &format!("{}\n", 8 * GIB));
    t.write("sys/fs/cgroup/memory/job/memory.usage_in_bytes", &format!("{}\n", 3 * GIB));
    t.write(
        "sys/fs/cgroup/memory/job/memory.stat",
        &format!("cache 1073741824\ninactive_file {}\ntotal_inactive_file {}\n", GIB, GIB),
    );
    let levels = t.probe().observe().cgroups;
    assert_eq!(levels.len(), 2, "{levels:?}");
    assert_eq!(levels[0].path, "/docker/abc/job");
    assert_eq!(
        (levels[0].max, levels[0].current, levels[0].reclaimable),
        (Some(8 * GIB), 3 * GIB, GIB)
    );
    assert_eq!(levels[1].max, None, "the kernel's no-limit value is no limit");
    // Room = 8 - (3 - 1) - 1 = 5 GiB.
    assert_eq!(t.probe().admit(&retained(5 * GIB)), Admission::Granted { headroom: 0 });
    let (reason, _) = refusal(t.probe().admit(&retained(5 * GIB + 1)));
    assert!(
        matches!(reason, RefusalReason::Cgroup { ref cgroup, limit, .. } if cgroup == "/docker/abc/job" && limit == 8 * GIB),
        "{reason:?}"
    );
    // An unreadable usage file refuses, naming it.
    fs::remove_file(t.path().join("sys/fs/cgroup/memory/job/memory.usage_in_bytes")).unwrap();
    let (reason, _) = refusal(t.probe().admit(&retained(GIB)));
    assert!(
        matches!(reason, RefusalReason::ObservationUnavailable { ref what, .. } if what == "/docker/abc/job/memory.usage_in_bytes"),
        "{reason:?}"
    );
}

#[test]
fn unreadable_meminfo_refuses_with_the_reason() {
    let t = Tree::new(50, 0);
    fs::remove_file(t.path().join("proc/meminfo")).unwrap();
    let (reason, message) = refusal(t.probe().admit(&retained(MIB)));
    assert!(
        matches!(reason, RefusalReason::ObservationUnavailable { ref what, .. } if what == "/proc/meminfo")
    );
    assert!(
        message.starts_with("retained host storage of 1.00 MiB refused: /proc/meminfo could not be read (No such file or directory"),
        "{message}"
    );
    assert!(
        message.ends_with("growth is refused while host memory cannot be observed"),
        "{message}"
    );
    // Observation for metrics leaves the fields absent, never zero.
    let o = t.probe().observe();
    assert_eq!(o.mem_available_bytes, None);
    assert_eq!(o.rss_bytes, Some(1024 * 1024));
}

#[test]
fn missing_mem_available_or_commit_fields_refuse() {
    let t = Tree::new(50, 2);
    t.write("proc/meminfo", "MemTotal: 1000 kB\nMemAvailable: 900000000 kB\n");
    let (reason, message) = refusal(t.probe().admit(&retained(MIB)));
    assert_eq!(
        reason,
        RefusalReason::ObservationUnavailable {
            what: "/proc/meminfo CommitLimit".into(),
            error: "field missing".into()
        }
    );
    assert!(message.contains("/proc/meminfo CommitLimit could not be read (field missing)"));
    t.write("proc/meminfo", "MemTotal: 1000 kB\n");
    assert!(matches!(
        refusal(t.probe().admit(&retained(MIB))).0,
        RefusalReason::ObservationUnavailable { ref what, .. } if what == "/proc/meminfo MemAvailable"
    ));
}

#[test]
fn unreadable_cgroup_current_and_overcommit_refuse() {
    let t = Tree::new(50, 0);
    t.cgroup("/job", &(16 * GIB).to_string(), None, 0);
    fs::remove_file(t.path().join("sys/fs/cgroup/job/memory.current")).unwrap();
    assert!(matches!(
        refusal(t.probe().admit(&retained(MIB))).0,
        RefusalReason::ObservationUnavailable { ref what, .. } if what == "/job/memory.current"
    ));
    let t = Tree::new(50, 0);
    t.write("proc/sys/vm/overcommit_memory", "banana\n");
    assert!(matches!(
        refusal(t.probe().admit(&retained(MIB))).0,
        RefusalReason::ObservationUnavailable { ref what, .. } if what == "/proc/sys/vm/overcommit_memory"
    ));
}

#[test]
fn rlimit_memlock_bounds_registration() {
    let t = Tree::new(50, 0);
    t.limits("unlimited", &(64 * MIB).to_string());
    t.status(4 * KB_PER_GIB, 8 * 1024, 0); // 8 MiB locked already
    let p = t.probe();
    assert_eq!(
        p.admit(&registration(32 * MIB, 16 * MIB)),
        Admission::Granted { headroom: 8 * MIB }
    );
    let (reason, message) = refusal(p.admit(&registration(48 * MIB, 16 * MIB)));
    assert_eq!(reason, RefusalReason::Memlock { limit: 64 * MIB, locked: 24 * MIB });
    assert_eq!(
        message,
        "host registration of 48.00 MiB refused: RLIMIT_MEMLOCK is 64.00 MiB and 24.00 MiB is already locked; raise `ulimit -l` or lower the registration ceiling"
    );
    // Registration allocates nothing: MemAvailable is not a bound for it.
    t.meminfo(0, 40, 10);
    assert!(matches!(p.admit(&registration(MIB, 0)), Admission::Granted { .. }));
    // CAP_IPC_LOCK lifts the limit.
    t.status(4 * KB_PER_GIB, 8 * 1024, 1 << 14);
    assert!(matches!(p.admit(&registration(GIB, 0)), Admission::Granted { .. }));
}

#[test]
fn staging_is_bounded_by_memory_and_memlock() {
    let t = Tree::new(50, 0);
    t.limits("unlimited", &(64 * MIB).to_string());
    let request =
        GrowthRequest { kind: GrowthKind::Staging, bytes: 128 * MIB, registered_bytes: 0 };
    assert!(matches!(refusal(t.probe().admit(&request)).0, RefusalReason::Memlock { .. }));
}

#[test]
fn rlimit_as_bounds_memory_growth() {
    let t = Tree::new(50, 0);
    t.limits(&(8 * GIB).to_string(), "unlimited");
    t.status(6 * KB_PER_GIB, 0, 0);
    let (reason, message) = refusal(t.probe().admit(&retained(3 * GIB)));
    assert_eq!(reason, RefusalReason::AddressSpace { limit: 8 * GIB, vm_size: 6 * GIB });
    assert_eq!(
        message,
        "retained host storage of 3.00 GiB refused: RLIMIT_AS is 8.00 GiB and the process already maps 6.00 GiB; raise `ulimit -v` or lower the retained host storage ceiling"
    );
    assert!(matches!(t.probe().admit(&retained(GIB)), Admission::Granted { .. }));
}

#[test]
fn unreadable_limits_refuse() {
    let t = Tree::new(50, 0);
    fs::remove_file(t.path().join("proc/self/limits")).unwrap();
    assert!(matches!(
        refusal(t.probe().admit(&registration(MIB, 0))).0,
        RefusalReason::ObservationUnavailable { ref what, .. } if what == "/proc/self/limits"
    ));
    assert!(!t.probe().observe().rlimits_observed);
}

#[test]
fn a_custom_margin_is_kept_free() {
    let t = Tree::new(10, 0);
    let p = t.probe().with_safety_margin(4 * GIB);
    assert!(matches!(p.admit(&retained(6 * GIB)), Admission::Granted { .. }));
    assert!(
        matches!(refusal(p.admit(&retained(7 * GIB))).0, RefusalReason::MemAvailable { margin, .. } if margin == 4 * GIB)
    );
}

#[test]
fn probing_never_writes() {
    let t = Tree::new(10, 2);
    t.cgroup("/job", "max", None, 1);
    let snapshot = |root: &Path| {
        let mut files = Vec::new();
        for entry in walk(root) {
            files.push((
                entry.clone(),
                fs::read(&entry).unwrap(),
                fs::metadata(&entry).unwrap().modified().unwrap(),
            ));
        }
        files
    };
    let before = snapshot(t.path());
    let p = t.probe();
    let _ = p.admit(&retained(GIB));
    let _ = p.admit(&registration(GIB, 0));
    let _ = p.observe();
    assert_eq!(snapshot(t.path()), before);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn observation_of_a_fixture() {
    let t = Tree::new(10, 2);
    t.cgroup("/job", &(16 * GIB).to_string(), None, 2 * GIB);
    t.limits("unlimited", "65536");
    let o = t.probe().observe();
    assert_eq!(o.mem_available_bytes, Some(10 * GIB));
    assert_eq!(o.overcommit_mode, Some(OvercommitMode::Strict));
    assert_eq!(o.cgroups.len(), 1);
    assert_eq!(o.rlimit_memlock_bytes, Some(65536));
    assert_eq!(o.rlimit_as_bytes, None);
    assert!(o.rlimits_observed);
    assert_eq!(o.peak_rss_bytes, Some(2048 * 1024));
}

#[cfg(target_os = "linux")]
#[test]
fn this_machine_is_observable() {
    let o = LinuxAdmissionProbe::system().observe();
    assert!(o.mem_available_bytes.is_some_and(|b| b > 0));
    assert!(o.rss_bytes.is_some_and(|b| b > 0));
    assert!(o.overcommit_mode.is_some());
    assert!(o.rlimits_observed);
}
