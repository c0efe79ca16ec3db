#!/usr/bin/env python3
"""Per-block timelines of one kernel from a decode kernel trace (FERROLM_TRACE; layout in
crates/engine/kernels/trace.cuh): for the launches of `--file` (a TRACE_FILE number), the
`--pick`th from the end, each sampled block's events (start, every pdl_wait/phase mark,
end) in µs from the launch's first start, and the previous launch's end on that scale.

    python3 tools/profile/trace_blocks.py /tmp/t.bin --file 7 --pick 5 [--min-events N]"""
import argparse
import struct
from collections import defaultdict

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("trace")
ap.add_argument("--file", type=int, required=True)
ap.add_argument("--pick", type=int, default=5)
ap.add_argument("--min-events", type=int, default=0, help="only blocks with at least this many events")
a = ap.parse_args()
data = open(a.trace, "rb").read()
n = struct.unpack_from("<Q", data, 0)[0]
grids = defaultdict(list)
for i in range(n):
    t, meta = struct.unpack_from("<QQ", data, 8 + 16 * i)
    grids[meta >> 36].append((t, meta))
# A graph replays a launch under one grid id: a pause of 150 µs separates two launches.
launches = []
for ev in grids.values():
    ev.sort()
    cur = [ev[0]]
    for e in ev[1:]:
        if e[0] - cur[-1][0] > 150_000:
            launches.append(cur)
            cur = []
        cur.append(e)
    launches.append(cur)
launches.sort(key=lambda ev: min(t for t, _ in ev))
idx = [i for i, L in enumerate(launches) if any(((m >> 32) & 0xF) == a.file for _, m in L)]
k = idx[-a.pick]
L, prev = launches[k], launches[k - 1]
t0 = min(t for t, _ in L)
prev_end = max(t for t, m in prev if (m >> 20) & 3 == 2)
print(f"previous launch ends at {(prev_end - t0) / 1e3:+.2f} µs")
blocks, sms = defaultdict(list), {}
for t, m in sorted(L):
    blocks[m & 0xFFF].append(("S", "w", "E", "?")[(m >> 20) & 3] + f"{(t - t0) / 1e3:.2f}")
    sms[m & 0xFFF] = (m >> 12) & 0xFF
for b in sorted(blocks):
    if len(blocks[b]) < a.min_events:
        continue
    print(f"block {b:4d} sm {sms[b]:3d}:", " ".join(blocks[b]))
