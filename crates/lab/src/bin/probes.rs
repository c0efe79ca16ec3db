//! The probes (kernels/sync_probe.cu, kernels/stream_probe.cu): each primitive's result
//! checked (the staging's sums of squares, the cluster exchange's slice sums and the
//! stream's checksums are exact; the PDL release must come after the primary's end), then
//! its cost printed for the record (docs/perf-log.md), never judged.
//!
//!   usage: probes [sync|stream|pdl|all]...   (default: all)
//!
//! Exits 1 when a result is wrong or a probe fails to run, 2 on bad arguments.

use ferrolm::backend::cuda::Cuda;
use ferrolm_lab::probe::{probe_value, StreamProbe, SyncProbe};
use ferrolm_lab::Lab;

/// A probe's verdict: Ok, or what went wrong (the others still run).
type Check = Result<(), String>;

const USAGE: &str = "usage: probes [sync|stream|pdl|all]...";

fn main() {
    let mut which: Vec<String> = std::env::args().skip(1).collect();
    if which.is_empty() || which.iter().any(|w| w == "all") {
        which = ["sync", "stream", "pdl"].map(String::from).to_vec();
    }
    if let Some(bad) = which.iter().find(|w| !["sync", "stream", "pdl"].contains(&w.as_str())) {
        eprintln!("probes: unknown probe {bad:?}\n{USAGE}");
        std::process::exit(2);
    }
    let cuda = Cuda::new(0).unwrap_or_else(|e| {
        eprintln!("probes: {e}");
        std::process::exit(1)
    });
    let lab = Lab::new(&cuda).unwrap_or_else(|e| {
        eprintln!("probes: {e}");
        std::process::exit(1)
    });
    println!("{} ({}, {} SMs, PDL {})", cuda.device_name, cuda.arch, cuda.sms, lab.pdl);
    let mut failed = Vec::new();
    for w in &which {
        let r = match w.as_str() {
            "sync" => sync_primitives(&lab),
            "stream" => weight_stream(&lab),
            _ => pdl_release(&lab),
        };
        if let Err(e) = r {
            eprintln!("probes {w}: FAILED: {e}");
            failed.push(w.as_str());
        }
    }
    if !failed.is_empty() {
        eprintln!("probes: failed: {}", failed.join(", "));
        std::process::exit(1);
    }
}

/// Each synchronization primitive (grid barrier, with the x staging after it, cluster
/// barrier, cluster exchange): its sums checked, its cost per round printed.
fn sync_primitives(g: &Lab) -> Check {
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
        let run = g.sync_probe(probe, rounds).map_err(|e| format!("{probe:?}: {e}"))?;
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
        if run.out != want {
            let b = (0..want.len().max(run.out.len())).find(|&b| run.out.get(b) != want.get(b)).unwrap_or(0);
            let (got, want) = (run.out.get(b), want.get(b));
            return Err(format!("{probe:?}: wrong sums (block {b}: {got:?}, want {want:?})"));
        }
        table.push(format!("{probe:?}: {:.2} µs per round", run.us_per_round));
    }
    println!("sync primitives ({} rounds):\n  {}", rounds, table.join("\n  "));
    Ok(())
}

/// 4-bit, group 64, bf16 scales and biases: the bytes of a rows × cols matrix.
fn q4_bytes(rows: usize, cols: usize) -> usize {
    rows * (cols / 2 + cols / 64 * 4)
}

/// The weight stream of a persistent decode kernel with no math (kernels/stream_probe.cu),
/// over one token of the Llama-3.2-1B shape (16 layers and the tied head, 4-bit g64: the
/// bytes the bench counts), with 0, 2, 4 or 5 grid barriers per layer (or barriers of block
/// groups or clusters, relaxed ones, the spins alone, tagged exchanges) and a spin after
/// each barrier standing in for a phase's chain, or the chain itself (row dots: a 4-bit
/// GEMV's math, x staged from each tagged exchange; attention's cached K/V on the attending
/// blocks). Each run's checksum over every byte the consumers read is checked against the
/// host's; the rates are printed for docs/perf-log.md (sessions 17 and 21 say what they mean),
/// never judged. A run that fails or sums wrong is reported and the others still run.
fn weight_stream(g: &Lab) -> Check {
    let (hidden, inter, kv, vocab, layers) = (2048, 8192, 512, 128_256, 16);
    let (qkv, o) = (q4_bytes(hidden + 2 * kv, hidden), q4_bytes(hidden, hidden));
    let (gate_up, down, head) = (q4_bytes(2 * inter, hidden), q4_bytes(hidden, inter), q4_bytes(vocab, hidden));
    let token = |phases: &[(usize, bool)]| -> Vec<(usize, bool)> {
        let mut s: Vec<(usize, bool)> = (0..layers).flat_map(|_| phases.iter().copied()).collect();
        s.push((head, true));
        s
    };
    let none = token(&[(qkv + o + gate_up + down, false)]);
    let two = token(&[(qkv + o, true), (gate_up + down, true)]);
    let five = token(&[(qkv, true), (0, true), (o, true), (gate_up, true), (down, true)]);
    // A Llama layer's fewest all-to-all exchanges: after attention (whose kv group's q/k/v
    // rows its own blocks compute), o, gate/up and down.
    let four = token(&[(qkv, true), (o, true), (gate_up, true), (down, true)]);
    let copy = g.measure_copy_bandwidth().map_err(|e| format!("copy bandwidth: {e}"))?;
    let base = StreamProbe {
        segments: two.clone(),
        tokens: 8,
        chunk: 16 << 10,
        stages: 12,
        work: true,
        delay_ns: 0,
        spin_sleep: false,
        relaxed_barriers: false,
        barrier_group: 0,
        cluster: 0,
        blocks: 0,
        producers: 1,
        grid_barriers: true,
        lanes_copy: false,
        free_run: false,
        poll: false,
        tagged: false,
        dots: false,
        segment_blocks: Vec::new(),
    };
    let mut runs = vec![("no barriers", StreamProbe { segments: none.clone(), ..base.clone() })];
    for stages in [2, 4, 6] {
        runs.push(("no barriers, a smaller ring", StreamProbe { segments: none.clone(), stages, ..base.clone() }));
    }
    // Fewer SMs streaming the same token: the rate one SM pulls when the memory system has
    // room (the cap on how far an SM catches up after a stall). Each run's tokens are
    // fewer, so that the few blocks' launch stays short.
    for blocks in [1, 8, 33, 66] {
        let p = StreamProbe { segments: none.clone(), blocks, tokens: 2, ..base.clone() };
        runs.push(("no barriers, fewer SMs", p));
    }
    // Whether larger copies or the lanes' cp.async lift one SM's rate.
    let eight = StreamProbe { segments: none.clone(), blocks: 8, tokens: 2, ..base.clone() };
    for (chunk, stages) in [(32 << 10, 6), (64 << 10, 3)] {
        runs.push(("no barriers, fewer SMs, larger copies", StreamProbe { chunk, stages, ..eight.clone() }));
    }
    runs.push(("no barriers, fewer SMs", StreamProbe { lanes_copy: true, ..eight.clone() }));
    // Or two lanes issuing the bulk copies (alternate stages), alone and on every SM.
    runs.push(("no barriers, fewer SMs, 2 producer lanes", StreamProbe { producers: 2, ..eight }));
    runs.push(("no barriers, 2 producer lanes", StreamProbe { segments: none.clone(), producers: 2, ..base.clone() }));
    runs.extend([
        ("2 barriers per layer", base.clone()),
        ("5 barriers per layer", StreamProbe { segments: five.clone(), ..base.clone() }),
        ("2 per layer, consumers read nothing", StreamProbe { work: false, ..base.clone() }),
        ("2 per layer, 8 KB stages × 24", StreamProbe { chunk: 8 << 10, stages: 24, ..base.clone() }),
        ("2 per layer, 32 KB stages × 6", StreamProbe { chunk: 32 << 10, stages: 6, ..base.clone() }),
        ("2 per layer, 16 KB stages × 6 (96 KB ring)", StreamProbe { stages: 6, ..base.clone() }),
        ("2 per layer, 16 KB stages × 13 (208 KB ring)", StreamProbe { stages: 13, ..base.clone() }),
    ]);
    for (ns, stages) in [(1000, 12), (2000, 12), (4000, 12), (2000, 4), (2000, 13)] {
        let p = StreamProbe { delay_ns: ns, stages, grid_barriers: false, ..base.clone() };
        runs.push(("2 per layer, the spin alone (no grid barrier)", p));
    }
    for (what, p) in [
        ("no barriers", StreamProbe { segments: none.clone(), ..base.clone() }),
        ("2 per layer", base.clone()),
        ("2 per layer, spin after each barrier", StreamProbe { delay_ns: 2000, ..base.clone() }),
        (
            "2 per layer, the spin alone (no grid barrier)",
            StreamProbe { delay_ns: 2000, grid_barriers: false, ..base.clone() },
        ),
    ] {
        runs.push((what, StreamProbe { lanes_copy: true, ..p }));
    }
    for ns in [0, 2000, 4000] {
        let p = StreamProbe { delay_ns: ns, free_run: true, work: false, ..base.clone() };
        runs.push(("2 per layer, free-running stream (no consumer reads)", p));
    }
    for (what, p) in [
        ("no barriers, stage waits polled", StreamProbe { segments: none.clone(), ..base.clone() }),
        ("2 per layer, stage waits polled", base.clone()),
        ("2 per layer, spin after each barrier, stage waits polled", StreamProbe { delay_ns: 2000, ..base.clone() }),
        (
            "2 per layer, 8 KB stages × 24, stage waits polled",
            StreamProbe { chunk: 8 << 10, stages: 24, ..base.clone() },
        ),
    ] {
        runs.push((what, StreamProbe { poll: true, ..p }));
    }
    for ns in [1000, 2000, 4000, 6000] {
        runs.push(("2 per layer, spin after each barrier", StreamProbe { delay_ns: ns, ..base.clone() }));
    }
    // The same chains sleeping instead of spinning busy: whether a busy spin's issue slots
    // (or power) slow the producer beside it, or the stall itself does.
    for ns in [2000, 4000] {
        let sleep = StreamProbe { delay_ns: ns, spin_sleep: true, ..base.clone() };
        runs.push((
            "2 per layer, free-running stream, sleeping spin",
            StreamProbe { free_run: true, work: false, ..sleep.clone() },
        ));
        runs.push((
            "2 per layer, sleeping spin alone (no grid barrier)",
            StreamProbe { grid_barriers: false, ..sleep.clone() },
        ));
        runs.push(("2 per layer, sleeping spin after each barrier", sleep));
    }
    for ns in [1000, 3000] {
        runs.push((
            "5 per layer, spin after each barrier",
            StreamProbe { delay_ns: ns, segments: five.clone(), ..base.clone() },
        ));
    }
    // Barriers without release/acquire (no fence beside the bulk copies in flight).
    for (what, p) in [
        ("2 per layer, relaxed barriers", base.clone()),
        ("2 per layer, relaxed barriers, spin after each", StreamProbe { delay_ns: 2000, ..base.clone() }),
        (
            "2 per layer, relaxed barriers, free-running stream",
            StreamProbe { free_run: true, work: false, ..base.clone() },
        ),
        (
            "2 per layer, relaxed barriers, free-running stream, spin after each",
            StreamProbe { delay_ns: 2000, free_run: true, work: false, ..base.clone() },
        ),
        ("5 per layer, relaxed barriers", StreamProbe { segments: five.clone(), ..base.clone() }),
    ] {
        runs.push((what, StreamProbe { relaxed_barriers: true, ..p }));
    }
    // The same barriers with no bytes in flight (a token of empty segments): what the fence
    // costs by itself, against beside the stream.
    let empty = token(&[(0, true), (0, true)]);
    for relaxed_barriers in [false, true] {
        let p = StreamProbe { segments: empty.clone(), relaxed_barriers, ..base.clone() };
        runs.push(("2 per layer, no weights (barriers alone)", p));
    }
    // Barriers met by groups of blocks only (a phase waiting for a few producers' flags).
    for group in [2, 8, 16] {
        for ns in [0, 2000, 4000] {
            let p = StreamProbe { barrier_group: group, delay_ns: ns, ..base.clone() };
            runs.push(("2 per layer, barriers of block groups", p));
        }
    }
    // Barriers over clusters of blocks only (mbarriers at cluster scope, as an exchange
    // through DSMEM would meet): whether a chain after one is hidden.
    // Clusters of 2 only: 33 clusters of 4 one-block-per-SM blocks do not all fit at once
    // on the H200 (the probe refuses such a shape).
    for ns in [0, 2000, 4000] {
        let p = StreamProbe { cluster: 2, delay_ns: ns, ..base.clone() };
        runs.push(("2 per layer, cluster barriers", p));
    }
    // Larger bulk copies lift one SM's rate (8 SMs alone: 41.8 / 77.2 / 127.3 GB/s per SM at
    // 16 / 32 / 64 KB, session 18): whether that lets an SM catch up after a stall, so that
    // the chains after barriers hide.
    for (chunk, stages) in [(32 << 10, 6), (64 << 10, 3)] {
        let big = StreamProbe { chunk, stages, ..base.clone() };
        runs.push(("no barriers, larger copies", StreamProbe { segments: none.clone(), ..big.clone() }));
        for ns in [0, 2000, 4000, 6000] {
            let p = StreamProbe { delay_ns: ns, ..big.clone() };
            runs.push(("2 per layer, spin after each barrier, larger copies", p.clone()));
            if ns > 0 {
                let alone = StreamProbe { grid_barriers: false, ..p.clone() };
                runs.push(("2 per layer, the spin alone (no grid barrier), larger copies", alone));
                runs.push(("2 per layer, cluster barriers, larger copies", StreamProbe { cluster: 2, ..p }));
            }
        }
        for ns in [0, 1000, 3000] {
            let p = StreamProbe { delay_ns: ns, segments: five.clone(), ..big.clone() };
            runs.push(("5 per layer, spin after each barrier, larger copies", p));
        }
    }
    // All-to-all exchanges by tagged words instead of grid barriers (session 20): a
    // persistent kernel's hand-off with no counter or fence, each block's words checked.
    for (ns, segments) in
        [(0, two.clone()), (2000, two.clone()), (4000, two.clone()), (0, five.clone()), (1000, five.clone())]
    {
        let p = StreamProbe { delay_ns: ns, segments, tagged: true, ..base.clone() };
        runs.push(("tagged exchanges instead of grid barriers", p));
    }
    // Four per layer, tagged and grid, with chains of up to 2 µs (session 21).
    runs.push(("4 barriers per layer", StreamProbe { segments: four.clone(), ..base.clone() }));
    for ns in [0, 1000, 2000] {
        let p = StreamProbe { delay_ns: ns, segments: four.clone(), tagged: true, ..base.clone() };
        runs.push(("4 per layer, tagged exchanges", p));
    }
    // The chain measured instead of spun: a 4-bit GEMV's math on every row, x staged from
    // each exchange (session 21). Its checksum is checked against the host's below.
    let dots = StreamProbe { dots: true, tagged: true, ..base.clone() };
    runs.push(("no barriers, row dots", StreamProbe { segments: none.clone(), ..dots.clone() }));
    for (what, segments) in [
        ("2 per layer, tagged, row dots", two.clone()),
        ("4 per layer, tagged, row dots", four.clone()),
        ("5 per layer, tagged, row dots", five.clone()),
    ] {
        runs.push((what, StreamProbe { segments, ..dots.clone() }));
    }
    // Attention inside: after q/k/v's exchange, the n_kv blocks that attend (one per kv
    // head) stream their head's cached K/V (640 positions, bf16 K and V) and do row dots on
    // it (a stand-in for the scores and the weighted sum), then the exchange into o: five
    // per layer, the attention phase's bytes on those blocks only.
    let positions = 640;
    let kv_heads = kv / 64;
    // Blocks streaming each segment of a token whose layers have five phases (0: all), the
    // head streamed by all: StreamProbe::segment_blocks beside `token`'s segments.
    let blocks_per_phase = |phases: [usize; 5]| -> Vec<usize> { (0..layers).flat_map(|_| phases).chain([0]).collect() };
    let attention = blocks_per_phase([0, kv_heads, 0, 0, 0]);
    let with_kv =
        token(&[(qkv, true), (kv_heads * positions * 64 * 2 * 2, true), (o, true), (gate_up, true), (down, true)]);
    let p = StreamProbe { segments: with_kv.clone(), segment_blocks: attention, ..dots.clone() };
    runs.push(("5 per layer, tagged, row dots, the cached K/V on the attending blocks", p));
    // The same K/V split over 8 blocks per kv head (positions in 8 splits; their merge,
    // which would be one more exchange, left out): how much of the cost above is the few
    // attending SMs' ingest.
    let split = blocks_per_phase([0, 8 * kv_heads, 0, 0, 0]);
    let p = StreamProbe { segments: with_kv, segment_blocks: split, ..dots.clone() };
    runs.push(("5 per layer, tagged, row dots, the cached K/V split over 8 blocks per kv head", p));
    // Larger bulk copies lift one SM's ingest (session 18): whether they shorten the
    // measured chains' cost.
    for (chunk, stages) in [(32 << 10, 6), (64 << 10, 3)] {
        let p = StreamProbe { segments: four.clone(), chunk, stages, ..dots.clone() };
        runs.push(("4 per layer, tagged, row dots, larger copies", p));
    }
    let mut table = Vec::new();
    let mut failures = Vec::new();
    let mut weights = None;
    for (what, p) in &runs {
        let r = match g.stream_probe(p, &mut weights) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{what}: {e}"));
                continue;
            }
        };
        if r.sum != r.want {
            failures.push(format!("{what}: the consumers' sum over the streamed bytes is {}, want {}", r.sum, r.want));
        }
        let bw = r.bytes_per_token as f64 / (r.us_per_token * 1e-6);
        let traced = r.trace.map_or(String::new(), |t| {
            format!(
                "; per barrier: wait {:.2} µs, spin {:.2} µs at {:.0} MHz, next stage {:.2} µs after the spin, {:.1} stages issued ahead, {:.1} landed, ring full at {:.0}% of releases",
                t.barrier_us,
                t.spin_us,
                t.spin_mhz,
                t.data_wait_us,
                t.issued_ahead,
                t.landed_ahead,
                100.0 * t.ring_full
            )
        });
        let skew = r.skew.as_ref().map_or(String::new(), |s| {
            let latest: Vec<String> = s.latest.iter().map(|(sm, l)| format!("SM {sm} +{l:.2}")).collect();
            format!(
                "; arrivals: last {:.2} µs after the median, first {:.2} before; lateness correlation {:.2}; latest {}",
                s.last_us,
                s.first_us,
                s.corr,
                latest.join(", ")
            )
        });
        table.push(format!(
            "{what} (chunk {} KB, {} stages, spin {} ns, {}{}): {:.1} µs per token, {:.2} TB/s, {:.1}% of copy, {:.1} GB/s per block; traced launch per token: producer {:.1} µs, consumers {:.1}{traced}",
            p.chunk >> 10,
            p.stages,
            p.delay_ns,
            match (p.lanes_copy, p.free_run) {
                (true, _) => "32 lanes' cp.async",
                (false, true) => "bulk copies, free-running",
                _ => "bulk copies",
            },
            if p.barrier_group > 0 { format!(", groups of {}", p.barrier_group) } else { String::new() }
                + if p.relaxed_barriers { ", relaxed" } else { "" }
                + &if p.cluster > 0 { format!(", clusters of {}", p.cluster) } else { String::new() }
            + &if p.blocks > 0 { format!(", {} blocks", p.blocks) } else { String::new() },
            r.us_per_token,
            bw / 1e12,
            100.0 * bw / copy,
            bw / 1e9 / r.blocks as f64,
            r.ends.producer_us,
            r.ends.consumers_us
        ) + &skew);
    }
    println!(
        "weight stream, Llama-3.2-1B shape 4-bit g64 ({:.1} MB per token; copy bandwidth {:.2} TB/s):\n  {}",
        runs[0].1.segments.iter().map(|s| s.0).sum::<usize>() as f64 / 1e6,
        copy / 1e12,
        table.join("\n  ")
    );
    match failures.is_empty() {
        true => Ok(()),
        false => Err(failures.join("; ")),
    }
}

/// The PDL release against the dependent's own loads in flight (kernels/sync_probe.cu's
/// pdl_dependent; docs/perf-log.md, session 20): no block may be released before the primary
/// has ended, and the table says whether loads issued just before the end delay it.
fn pdl_release(g: &Lab) -> Check {
    let mut table = Vec::new();
    for lead_ns in [500u64, 2000] {
        for (loads, l2) in [(0, false), (4, false), (8, false), (16, false), (16, true)] {
            let r = g.pdl_release_probe(loads, l2, lead_ns, 20).map_err(|e| e.to_string())?;
            // Released before the primary's last block ended: a broken dependency. (Allow
            // the two timers' skew: globaltimer is one clock, read on different SMs.)
            if r.release_us <= -0.2 {
                return Err(format!("released {:.2} µs before the primary ended", -r.release_us));
            }
            table.push(format!(
                "issued {lead_ns} ns before the end, {} KB per block{}: release {:.2} µs (last block {:.2}), loads landed {:.2} µs after it",
                4 * loads,
                if l2 { " (L2 prefetch)" } else { "" },
                r.release_us,
                r.last_release_us,
                r.landed_after_us
            ));
        }
    }
    println!("PDL release:\n  {}", table.join("\n  "));
    Ok(())
}
