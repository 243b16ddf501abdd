#!/usr/bin/env python3
"""Summarizes where a kernel's warps stall, from Nsight Compute's per-instruction source page:
the share of warp-stall samples of each reason over the whole kernel, then the kernel's SASS in
windows of consecutive instructions (the phases of a straight-line decode kernel: prologue,
routing, products, barriers) with each window's share, its top reasons and the instructions
that took the samples, and the single instructions that took the most.

    ncu --graph-profiling node --kernel-name-base demangled -k 'regex:attn_kernel<4, 1, true' \\
        --launch-skip 40 --launch-count 1 --section SourceCounters -o rep strata bench ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 tools/ncu_stalls.py src.csv [--window N] [--top N]

--window: instructions a window (default 100; windows under 1% of the samples are left out);
--top: how many single instructions to list (default 10)."""
import argparse
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    """The instruction's opcode, past a predicate (@P0, @!P1)."""
    t = sass.split()
    return t[1] if len(t) > 1 and t[0].startswith("@") else t[0] if t else "?"


def kernels(path):
    """(kernel name, header, rows) of each kernel in the export."""
    out, name, header, rows = [], None, None, []
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                if header:
                    out.append((name, header, rows))
                name, header, rows = r[1] if len(r) > 1 else "?", None, []
            elif header is None and r and r[0] == "Address":
                header = r
            elif header and len(r) == len(header):
                rows.append(r)
    if header:
        out.append((name, header, rows))
    return out


def summarize(name, header, rows, window, top):
    col = {h: i for i, h in enumerate(header)}
    if ALL not in col or "Source" not in col:
        raise ValueError(f"{name}: no '{ALL}' or 'Source' column (export with --page source --print-source sass)")
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [num(r[col[ALL]]) for r in rows]
    total = sum(samples)
    print(f"{name}: {len(rows)} instructions, {total:.0f} samples")
    if total == 0:
        return
    share = sorted(((sum(num(r[col[k]]) for r in rows), k[6:]) for k in reasons), reverse=True)
    print("  " + "  ".join(f"{k} {100 * v / total:.1f}%" for v, k in share if v >= 0.01 * total))
    executed = col.get("Instructions Executed")
    for i in range(0, len(rows), window):
        seg, s = rows[i:i + window], sum(samples[i:i + window])
        if s < 0.01 * total:
            continue
        why = sorted(((sum(num(r[col[k]]) for r in seg), k[6:]) for k in reasons), reverse=True)[:3]
        ops = [opcode(r[col["Source"]]) for j, r in enumerate(seg) if samples[i + j] >= 0.05 * s]
        ex = sum(num(r[executed]) for r in seg) if executed is not None else 0
        print(f"  {i:5d}-{i + len(seg) - 1:<5d} {100 * s / total:5.1f}%  executed {ex:9.0f}  "
              + " ".join(f"{k} {100 * v / s:.0f}%" for v, k in why) + "  | " + " ".join(ops[:8]))
    print("  the instructions with the most samples:")
    for j in sorted(range(len(rows)), key=lambda j: -samples[j])[:top]:
        r = rows[j]
        why = max(((num(r[col[k]]), k[6:]) for k in reasons), default=(0, "-"))
        print(f"  {j:5d} {100 * samples[j] / total:5.1f}%  {why[1]:<18} {r[col['Source']].strip()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    if a.window < 1 or a.top < 0:
        sys.exit("ncu_stalls: --window must be at least 1 and --top at least 0")
    try:
        found = kernels(a.csv)
        if not found:
            sys.exit(f"ncu_stalls: {a.csv}: no kernel's source page in it (ncu -i REP --page source --csv "
                     "--print-source sass)")
        for name, header, rows in found:
            summarize(name, header, rows, a.window, a.top)
    except (OSError, ValueError) as e:
        sys.exit(f"ncu_stalls: {e}")


if __name__ == "__main__":
    main()
