//! The synchronization probe (kernels/sync_probe.cu): each primitive's result checked
//! (the staging's sums of squares and the cluster exchange's slice sums are exact), then its
//! cost per round printed for the record (docs/perf.md), never asserted.

use super::gpu;
use ferrolm::backend::cuda::probe::{probe_value, SyncProbe};

#[test]
fn sync_primitives_work_and_their_costs() {
    let g = gpu();
    let rounds = 2000;
    let mut table = Vec::new();
    for probe in [
        SyncProbe::GridBarrier,
        SyncProbe::GridBarrierStaging { parts: 0 },
        SyncProbe::GridBarrierStaging { parts: 8 },
        SyncProbe::GridBarrierStaging { parts: 16 },
        SyncProbe::ClusterBarrier { cluster: 8 },
        SyncProbe::ClusterBarrier { cluster: 16 },
        SyncProbe::ClusterExchange { cluster: 8 },
        SyncProbe::ClusterExchange { cluster: 16 },
    ] {
        let run = g.sync_probe(probe, rounds).unwrap();
        // One round's sums, as thread 0 of each block forms them.
        let want: Vec<f32> = match probe {
            SyncProbe::GridBarrierStaging { parts } => {
                let ss: f32 = (0..2048).map(|i| (0..=parts).map(|p| probe_value(p, i)).sum::<f32>().powi(2)).sum();
                vec![ss; run.out.len()]
            }
            SyncProbe::ClusterExchange { cluster } => {
                let slice = 2048 / cluster as usize;
                (0..cluster as usize)
                    .map(|r| (0..slice).step_by(256).map(|i| (cluster as usize * (r * slice + i)) as f32).sum())
                    .collect()
            }
            _ => vec![0.0; run.out.len()],
        };
        assert_eq!(run.out, want, "{probe:?}: wrong sums");
        table.push(format!("{probe:?}: {:.2} µs per round", run.us_per_round));
    }
    eprintln!("sync primitives ({} rounds):\n  {}", rounds, table.join("\n  "));
}
