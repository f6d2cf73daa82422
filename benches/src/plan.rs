//! Sizes and repetitions of a run, and the rows every bench must emit.
//!
//! Full runs use at least 5 repetitions (the machine is noisy: 2 cores);
//! `--quick` (CI smoke runs) uses 2 and smaller sizes but still produces
//! every row, so the report can check completeness without ever judging a
//! timing.

/// Fault-around sizes swept by `lazy_restore`, in KiB (0 = one page).
pub const FAULT_AROUND_KIB: [u64; 4] = [0, 16, 64, 256];

/// Fork counts measured end to end.
pub const FORK_COUNTS: [u32; 2] = [1, 10];

/// Overcommits of the reclaim bench's hot-set fleet, in tenths: its guest
/// RAM over the part of its memory limit left for guest RAM (1.0, 1.5, 2.0).
pub const RECLAIM_OVERCOMMIT_TENTHS: [u64; 3] = [10, 15, 20];

/// Key of the reclaim bench's hot-set row at overcommit `tenths` / 10.
pub fn reclaim_hot_key(tenths: u64) -> String {
    format!("reclaim.hot.over{}.{}", tenths / 10, tenths % 10)
}

/// What one run measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `--quick`: fewer repetitions, smaller sizes.
    pub quick: bool,
    /// Repetitions of every measurement.
    pub reps: usize,
    /// Guest RAM of the lazy-restore guest, MiB.
    pub lazy_mib: u64,
    /// VM sizes of the fork bench, MiB.
    pub fork_mib: Vec<u64>,
    /// Memory the Firecracker-like client touches, MiB.
    pub fc_mib: u64,
    /// Guest RAM of the VM whose dirty snapshots and rollback are measured.
    pub snap_mib: u64,
    /// VM sizes restored from a snapshot, MiB.
    pub restore_mib: Vec<u64>,
    /// Clones of one clone request.
    pub clone_count: u32,
    /// Memory each mode of the fault-cost bench touches, MiB.
    pub minor_mib: u64,
    /// Guest RAM of the snapshot restored from the object store, MiB, and
    /// the working set its guest touches, MiB.
    pub remote_mib: u64,
    pub remote_ws_mib: u64,
    /// Children counts forked from one template by the density bench.
    pub density_children: Vec<u32>,
    /// Guest RAM of the density bench's template, MiB, and what it writes
    /// and each child reads (W), MiB.
    pub density_mib: u64,
    pub density_ws_mib: u64,
    /// Sizes of the parent on a shared base whose fork copies a layer,
    /// MiB; the first is also the paused template's.
    pub lineage_mib: Vec<u64>,
    /// Counts of busy VMs whose stall the restart bench measures over a
    /// crash and a handover of the server.
    pub restart_vms: Vec<u32>,
    /// Guest RAM read per refault measurement of the reclaim bench, MiB.
    pub reclaim_refault_mib: u64,
    /// Guest RAM of each VM of the reclaim bench's hot-set fleet, MiB, and
    /// how long the fleet is timed, seconds.
    pub reclaim_hot_mib: u64,
    pub reclaim_hot_secs: u64,
    /// Guest RAM of the VM whose memory is given back at once, MiB.
    pub reclaim_giveback_mib: u64,
    /// Repetitions of the fault-path A/B against the commit before (each a
    /// fresh server of either side), and the memory its one-page-per-fault
    /// VMs write, MiB.
    pub ab_reps: usize,
    pub ab_fault_mib: u64,
}

impl Plan {
    /// The plan for a full or a quick run.
    pub fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                quick,
                reps: 2,
                lazy_mib: 64,
                fork_mib: vec![256, 1024],
                fc_mib: 64,
                snap_mib: 256,
                restore_mib: vec![256, 1024],
                clone_count: 10,
                minor_mib: 8,
                remote_mib: 64,
                remote_ws_mib: 16,
                density_children: vec![1, 20, 100],
                density_mib: 32,
                density_ws_mib: 8,
                lineage_mib: vec![64],
                restart_vms: vec![1, 10],
                reclaim_refault_mib: 16,
                reclaim_hot_mib: 32,
                reclaim_hot_secs: 2,
                reclaim_giveback_mib: 64,
                ab_reps: 2,
                ab_fault_mib: 8,
            }
        } else {
            Plan {
                quick,
                reps: 5,
                lazy_mib: 256,
                fork_mib: vec![256, 1024, 4096],
                fc_mib: 256,
                snap_mib: 1024,
                restore_mib: vec![256, 1024, 4096],
                clone_count: 100,
                minor_mib: 64,
                remote_mib: 1024,
                remote_ws_mib: 256,
                density_children: vec![1, 100, 1000],
                density_mib: 64,
                density_ws_mib: 16,
                lineage_mib: vec![256, 1024],
                restart_vms: vec![1, 100, 1000],
                reclaim_refault_mib: 64,
                reclaim_hot_mib: 64,
                reclaim_hot_secs: 10,
                reclaim_giveback_mib: 256,
                ab_reps: 20,
                ab_fault_mib: 64,
            }
        }
    }

    /// The plan chosen by the command line: `--quick` anywhere, or
    /// `PAGEFORK_BENCH_QUICK=1`.
    pub fn from_args() -> Plan {
        let quick = std::env::args().skip(1).any(|a| a == "--quick")
            || std::env::var("PAGEFORK_BENCH_QUICK").is_ok_and(|v| v == "1");
        Plan::new(quick)
    }

    /// Keys of the rows `bench` must emit under this plan.
    pub fn expected_keys(&self, bench: &str) -> Vec<String> {
        match bench {
            "lazy_restore" => {
                let mut k: Vec<String> = FAULT_AROUND_KIB
                    .iter()
                    .map(|fa| format!("lazy.touch.fa{fa}"))
                    .collect();
                k.push("lazy.touch.readahead".into());
                k.push("lazy.touch.readahead_whole".into());
                k.push("lazy.touch.piece_gain".into());
                k.push("lazy.touch.warm".into());
                k.push("lazy.touch.observed".into());
                k.push("lazy.touch.huge".into());
                k.push("lazy.wall.fa64".into());
                k
            }
            "fork" => self
                .fork_mib
                .iter()
                .flat_map(|s| {
                    let mut k: Vec<String> = [
                        "table",
                        "table_vs_memcpy",
                        "server_fork_us",
                        "pause",
                        "wp_huge",
                        "pause_huge",
                        "first_write_huge",
                    ]
                    .iter()
                    .map(|m| format!("fork.{m}.{s}"))
                    .collect();
                    k.extend(FORK_COUNTS.iter().map(|n| format!("fork.e2e{n}.{s}")));
                    k.push(format!("fork.shmem_per_child.{s}"));
                    k.push(format!("fork.rss_per_child.{s}"));
                    k
                })
                .collect(),
            "fc_restore" => {
                let mut k: Vec<String> = ["fc.seq", "fc.rand"]
                    .iter()
                    .flat_map(|o| {
                        [
                            "single",
                            "around",
                            "readahead",
                            "ws",
                            "single_poll",
                            "poll_gain",
                        ]
                        .map(|m| format!("{o}.{m}"))
                    })
                    .collect();
                k.extend(
                    ["latency_p50", "latency_p99", "service_p50", "install_p50"]
                        .map(|m| format!("fc.seq.{m}")),
                );
                k
            }
            "volume_snapshot" => vec![
                "volume.snap16_vs_snap1".into(),
                "volume.snap1_vs_cp".into(),
                "volume.clone_vs_cp".into(),
            ],
            "vm_snapshot" => {
                let mut k: Vec<String> = [1, 10, 50, 100]
                    .iter()
                    .flat_map(|p| ["pause", "total", "bytes"].map(|m| format!("snap.{m}.{p}")))
                    .collect();
                k.extend(self.restore_mib.iter().map(|m| format!("snap.restore.{m}")));
                k.extend(
                    [
                        "rollback",
                        "rollback_huge",
                        "clone",
                        "clone_rss",
                        "chain_extents",
                        "clone_pool",
                    ]
                    .map(|m| format!("snap.{m}")),
                );
                k
            }
            "qcow2_interchange" => ["import", "export", "snapshot_create"]
                .map(|m| format!("qcow2.{m}"))
                .to_vec(),
            "disk_throughput" => {
                let mut k: Vec<String> = ["write", "read"]
                    .iter()
                    .flat_map(|d| ["multi", "one"].map(|m| format!("disk.{d}.{m}")))
                    .collect();
                k.push("disk.write.pages".into());
                k
            }
            "zstd_image" => {
                let mut k: Vec<String> = [4, 64, 256, 2048]
                    .iter()
                    .map(|f| format!("zst.restore.{f}"))
                    .collect();
                k.extend(["zst.restore.prefetch", "zst.fc", "zst.others"].map(String::from));
                k
            }
            "vmm_pool" => [
                "template",
                "restore",
                "live",
                "fanout_small",
                "fanout_large",
                "child_memory",
            ]
            .map(|m| format!("pool.{m}"))
            .to_vec(),
            "minor_fault" => [
                "continue",
                "copy_private",
                "continue16",
                "continue512",
                "continue_write",
                "ioctl",
            ]
            .map(|m| format!("minor.{m}"))
            .to_vec(),
            "remote_restore" => [
                "answer",
                "answer_lazy",
                "ws",
                "ws_lazy",
                "ws_gets",
                "fetched_answer",
                "fetched_ws",
                "push",
            ]
            .map(|m| format!("remote.{m}"))
            .to_vec(),
            "density" => {
                let mut k: Vec<String> = self
                    .density_children
                    .iter()
                    .flat_map(|n| ["read", "start"].map(|m| format!("density.{m}.{n}")))
                    .collect();
                k.extend(
                    [
                        "child",
                        "write_half",
                        "restore_time",
                        "restore_mem",
                        "fork_p50",
                        "restore_p50",
                    ]
                    .map(|m| format!("density.{m}")),
                );
                k
            }
            "lineage" => {
                let mut k: Vec<String> = self
                    .lineage_mib
                    .iter()
                    .flat_map(|s| {
                        ["pause", "e2e", "copy", "shmem", "rss", "orphan_read"]
                            .map(|m| format!("lineage.{m}.{s}"))
                    })
                    .collect();
                k.extend(["template_first", "template_later"].map(|m| format!("lineage.{m}")));
                if let Some(first) = self.lineage_mib.first() {
                    k.extend([1, 2, 10].map(|n| format!("lineage.again.{n}.{first}")));
                }
                k
            }
            "restart" => {
                let mut k: Vec<String> = self
                    .restart_vms
                    .iter()
                    .flat_map(|n| ["crash", "upgrade"].map(|m| format!("restart.{m}.{n}")))
                    .collect();
                k.extend(["fault_crash", "fault_upgrade"].map(|m| format!("restart.{m}")));
                k
            }
            "reclaim" => {
                let mut k: Vec<String> = ["image", "dropped", "swapped"]
                    .map(|m| format!("reclaim.refault.{m}"))
                    .to_vec();
                k.extend(RECLAIM_OVERCOMMIT_TENTHS.map(reclaim_hot_key));
                k.extend(["swapped", "dropped"].map(|m| format!("reclaim.giveback.{m}")));
                k
            }
            "fault_ab" => ["fault_rtt", "lazy_restore", "fork_child"]
                .map(|m| format!("ab.{m}"))
                .to_vec(),
            _ => Vec::new(),
        }
    }
}

/// The benches the report expects, in report order.
pub const BENCHES: [&str; 16] = [
    "lazy_restore",
    "fork",
    "vmm_pool",
    "volume_snapshot",
    "vm_snapshot",
    "qcow2_interchange",
    "disk_throughput",
    "fc_restore",
    "zstd_image",
    "minor_fault",
    "remote_restore",
    "density",
    "lineage",
    "restart",
    "fault_ab",
    "reclaim",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_plan_keeps_every_row_kind() {
        let (q, f) = (Plan::new(true), Plan::new(false));
        assert!(q.reps >= 2 && f.reps >= 5);
        for b in BENCHES {
            assert!(!q.expected_keys(b).is_empty(), "{b} has no rows");
        }
        // Quick drops a size, never a kind of row.
        assert_eq!(
            q.expected_keys("fork").len() / q.fork_mib.len(),
            f.expected_keys("fork").len() / f.fork_mib.len()
        );
    }
}
