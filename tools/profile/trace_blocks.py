#!/usr/bin/env python3
"""Per-block timelines of one kernel from a decode kernel trace (FERROLM_TRACE; layout in
crates/engine/kernels/trace.cuh): for the launches of `--file` (a TRACE_FILE number), the
`--pick`th from the end, each sampled block's events (start, every pdl_wait/phase mark,
end) in µs from the launch's first start, and the previous launch's end on that scale.

    python3 tools/profile/trace_blocks.py /tmp/t.bin --file 7 --pick 5 [--min-events N]"""
import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_table import read  # noqa: E402  (the launches, split as trace_table splits them)

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("trace")
ap.add_argument("--file", type=int, required=True)
ap.add_argument("--pick", type=int, default=5)
ap.add_argument("--min-events", type=int, default=0, help="only blocks with at least this many events")
ap.add_argument("--gap-us", type=float, default=150.0, help="a pause that separates two launches of one grid id")
a = ap.parse_args()
_, launches = read(a.trace, int(a.gap_us * 1000))
idx = [i for i, L in enumerate(launches) if L["file"] == a.file]
k = idx[-a.pick]
L, prev = launches[k], launches[k - 1]
t0 = min(L["start"])
print(f"previous launch ends at {(max(prev['end']) - t0) / 1e3:+.2f} µs")
blocks, sms = defaultdict(list), {}
for t, m in sorted(L["events"]):
    blocks[m & 0xFFF].append(("S", "w", "E", "?")[(m >> 20) & 3] + f"{(t - t0) / 1e3:.2f}")
    sms[m & 0xFFF] = (m >> 12) & 0xFF
for b in sorted(blocks):
    if len(blocks[b]) < a.min_events:
        continue
    print(f"block {b:4d} sm {sms[b]:3d}:", " ".join(blocks[b]))
