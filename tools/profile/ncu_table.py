#!/usr/bin/env python3
"""Per-kernel table from an Nsight Compute CSV (`ncu --csv --metrics
gpu__time_duration.sum,dram__bytes_read.sum ...`): launches, mean duration, DRAM bytes read
and the bandwidth that implies, grouped by kernel name and grid, slowest total first.

    python3 tools/profile/ncu_table.py ncu.csv

ncu serializes kernels, so each costs a few µs more than inside a CUDA graph; compare
kernels with each other, not with end-to-end tokens/s.
"""
import collections, csv, sys

def main(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        sys.exit(f"{path}: no ncu CSV rows")
    hdr, rows = rows[0], rows[1:]
    col = {name: hdr.index(name) for name in ("ID", "Kernel Name", "Grid Size", "Metric Name", "Metric Value", "Metric Unit")}
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
    launches = {}
    for r in rows:
        k = launches.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]].split("(")[0][:32], "grid": r[col["Grid Size"]]})
        k[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", "")) * scale.get(r[col["Metric Unit"]], 1.0)
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in launches.values():
        a = agg[(k["name"], k["grid"])]
        a[0] += 1
        a[1] += k.get("gpu__time_duration.sum", 0.0)
        a[2] += k.get("dram__bytes_read.sum", 0.0)
    total = sum(a[1] for a in agg.values())
    print("| kernel | grid | launches | mean µs | share | MB read | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for (name, grid), (n, us, by) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"| {name} | {grid} | {n} | {us / n:.2f} | {100 * us / total:.1f}% | {by / n / 1e6:.2f} | {by / us / 1e3 if us else 0:.0f} |")
    print(f"\n{len(launches)} launches, {total:.1f} µs in total")

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__))
