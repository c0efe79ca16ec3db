#!/usr/bin/env python3
"""Where a decode step's time goes, from a kernel timeline (FERROLM_TRACE=<file>, written by
backend/cuda/trace.rs; layout in crates/engine/kernels/trace.cuh):

    FERROLM_TRACE=/tmp/t.bin ferrolm bench --device cuda --model M --repeats 1
    python3 tools/profile/trace_table.py /tmp/t.bin [--steps 32]

Launches are the records grouped by %gridid, in order of their first start. Decode steps
start at the one-block embedding launch; the last --steps of them are aligned launch by
launch, and a repeating layer pattern (q/k/v, attention, o, gate/up, down, …) is folded so
each role is one row. Per role, means over steps and layers, in µs:
  early   share of the sampled blocks that started before the previous launch's end (they
          were resident beside it, so their loads before pdl_wait overlapped it)
  start   first sampled block's start minus the previous launch's end (negative: it started
          early, under PDL, while the previous kernel ran)
  waited  when the last sampled block's pdl_wait returned, from the previous launch's end
          (the dependency's release as this kernel saw it)
  first   when the first sampled block's pdl_wait returned, from the previous launch's end:
          the release itself (later returns are blocks that started late, or slow to see it)
  after   the launch's end minus its last pdl_wait return (work once released)
  path    this launch's end minus the previous launch's end: its share of the step
The sum of `path` over a step is the step time."""
import argparse
import os
import re
import struct
import sys
from collections import defaultdict

FILES = {1: "gemv.cu", 2: "attention_decode.cu", 3: "sample.cu", 4: "affine.cu", 5: "gemv_ring.cuh", 6: "decode_layers.cuh", 7: "attention_block.cuh", 8: "ffn_layer_end.cuh"}
KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "engine", "kernels")


def kernel_name(file_id, line, cache={}):
    """The kernel whose TRACE_KERNEL() is at `line` of the file (1-based)."""
    name = FILES.get(file_id, f"file{file_id}")
    if (file_id, line) not in cache:
        found = "?"
        try:
            src = open(os.path.join(KERNELS, name)).read().splitlines()
        except OSError:
            src = []
        # A kernel defined by a macro records the line where the macro is used.
        m = re.search(r"\bGEMV_KERNELS\((\d+)\)", src[line - 1]) if 0 < line <= len(src) else None
        if m:
            cache[(file_id, line)] = f"gemv r{m.group(1)} ({name}:{line})"
            return cache[(file_id, line)]
        # Other kernel families expanded on one line (GEMV_KS_KERNELS, GEMV_STAGED_KERNELS, …).
        m = re.match(r"\s*(GEMV_\w+_KERNELS)\s*$", src[line - 1]) if 0 < line <= len(src) else None
        if m:
            cache[(file_id, line)] = f"{m.group(1).lower()} ({name}:{line})"
            return cache[(file_id, line)]
        for i in range(min(line, len(src)) - 1, -1, -1):
            if "#define GEMV_CALL" in src[i]:
                found = "gemv"
                break
            if "__global__" in src[i]:
                text = " ".join(src[i:line])
                m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", text)
                found = m.group(1) if m else "?"
                break
        cache[(file_id, line)] = f"{found} ({name}:{line})"
    return cache[(file_id, line)]


def read(path, gap_ns):
    data = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", data, 0)
    by_grid = defaultdict(list)
    for i in range(n):
        t, meta = struct.unpack_from("<QQ", data, 8 + 16 * i)
        by_grid[meta >> 36].append((t, meta))
    # A grid id names one launch; should replays of a graph reuse ids, a pause of gap_ns
    # between one grid id's events starts another launch (--gap-us: longer than any decode
    # kernel, shorter than a step).
    new = lambda: {"start": [], "wait": [], "end": [], "line": None, "file": None, "blocks": set(), "events": []}
    out = []
    for events in by_grid.values():
        events.sort()
        L, last = new(), None
        for t, meta in events:
            if last is not None and t - last > gap_ns:
                out.append(L)
                L = new()
            last = t
            file_id, line = (meta >> 32) & 0xF, (meta >> 22) & 0x3FF
            ev, blk = (meta >> 20) & 3, meta & 0xFFF
            L[("start", "wait", "end")[ev] if ev < 3 else "end"].append(t)
            L["blocks"].add(blk)
            L["events"].append((t, meta))
            if ev != 1:
                L["line"], L["file"] = line, file_id
        out.append(L)
    out = [L for L in out if L["start"] and L["end"]]
    out.sort(key=lambda L: min(L["start"]))
    return n, out


def fold_period(sigs):
    """The layer period: the p in 2..8 under which the middle of the sequence repeats best."""
    best, best_score = 1, 0.0
    for p in range(2, 9):
        pairs = [(sigs[i], sigs[i + p]) for i in range(1, len(sigs) - p - 2)]
        if not pairs:
            continue
        score = sum(a == b for a, b in pairs) / len(pairs)
        if score > best_score + 1e-9:
            best, best_score = p, score
    return best if best_score > 0.9 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=32, help="last decode steps to average")
    ap.add_argument("--gap-us", type=float, default=150.0, help="a pause that separates two launches of one grid id")
    a = ap.parse_args()
    n, launches = read(a.trace, int(a.gap_us * 1000))
    print(f"{n} records, {len(launches)} launches")
    # A decode step opens with the embedding of one token: one block.
    starts = [i for i, L in enumerate(launches) if L["file"] == 4 and L["blocks"] == {0}]
    if len(starts) < 2:
        sys.exit("no decode steps found (a step starts with a one-block embed launch)")
    steps = [launches[s:e] for s, e in zip(starts, starts[1:])][-a.steps :]
    shape = max(set(len(s) for s in steps), key=[len(s) for s in steps].count)
    steps = [s for s in steps if len(s) == shape]
    sig = [(L["file"], L["line"], len(L["blocks"])) for L in steps[0]]
    period = fold_period(sig)
    rows = defaultdict(lambda: defaultdict(list))
    order = []
    totals = []
    prev_end_of_step = None
    for s in steps:
        prev_end = None
        for i, L in enumerate(s):
            # Roles: 0 the embedding, 1..period a layer's launches, then the step's last
            # launches counted from its end (-2 the head, -1 sampling).
            role = i
            if period and 1 <= i < 1 + period * ((len(s) - 3) // period):
                role = 1 + (i - 1) % period
            elif period and i > 0:
                role = i - len(s)
            key = (role, kernel_name(L["file"], L["line"]), len(L["blocks"]))
            if key not in rows:
                order.append(key)
            start, end = min(L["start"]), max(L["end"])
            waited = max(L["wait"]) if L["wait"] else None
            r = rows[key]
            base = prev_end if prev_end is not None else prev_end_of_step
            if base is not None:
                r["start"].append(start - base)
                r["early"].append(sum(t < base for t in L["start"]) / len(L["start"]))
                r["path"].append(end - base)
                if waited is not None:
                    r["waited"].append(waited - base)
                    r["first"].append(min(L["wait"]) - base)
            if waited is not None:
                r["after"].append(end - waited)
            r["count"].append(1)
            prev_end = end
        if prev_end_of_step is not None:
            totals.append(prev_end - prev_end_of_step)
        prev_end_of_step = prev_end
    mean = lambda v: sum(v) / len(v) / 1000 if v else float("nan")
    early = lambda v: f"{100 * sum(v) / len(v):.0f}%" if v else "–"
    per_step = len(steps)
    print(f"{per_step} decode steps of {shape} launches" + (f", layer period {period}" if period else ""))
    print("| role | kernel | sampled blocks | launches/step | early | start | first | waited | after | path | path/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in order:
        r = rows[key]
        k = len(r["count"]) / per_step
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {k:g} | {early(r['early'])} | {mean(r['start']):.2f} | {mean(r['first']):.2f} | {mean(r['waited']):.2f} | "
            f"{mean(r['after']):.2f} | {mean(r['path']):.2f} | {mean(r['path']) * k:.1f} |"
        )
    if totals:
        print(f"step: {mean(totals):.1f} µs mean over {len(totals)} steps ({1e6 / mean(totals):.1f} tok/s)")


if __name__ == "__main__":
    main()
