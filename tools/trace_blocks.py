#!/usr/bin/env python3
"""Summarizes the CSV that STRATA_CUDA_TRACE_BLOCKS=FILE writes (one line a block of one replayed
decode graph; docs/GPU.md): for each op and launch number, over the model's layers, how many
blocks a launch had, when its blocks' waits returned and when they ended (us after the launch's
release: the median and the slowest), and how the blocks that ended last differ from the others
(their multiprocessors' load, their block index).

    python3 tools/trace_blocks.py FILE [--op TEXT] [--late N]

--op keeps the labels that contain TEXT; --late N lists the N latest blocks of each label's
launches with where they ran (default 0: none)."""
import argparse
import csv
import statistics
import sys
from collections import defaultdict


def read(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({"launch": int(r["launch"]), "label": r["label"], "x": int(r["block_x"]),
                         "y": int(r["block_y"]), "z": int(r["block_z"]), "sm": int(r["sm"]),
                         "release": float(r["release_us"]), "end": float(r["end_us"])})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--op", default="", help="only labels that contain this text")
    ap.add_argument("--late", type=int, default=0, help="list the N latest blocks of each label's launches")
    a = ap.parse_args()
    try:
        rows = read(a.file)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"trace_blocks: {a.file}: {e}")
    if not rows:
        sys.exit(f"trace_blocks: {a.file}: no blocks")
    launches = defaultdict(list)
    for r in rows:
        launches[r["launch"]].append(r)
    by_label = defaultdict(list)  # label -> [blocks of one launch]
    for blocks in launches.values():
        if a.op in blocks[0]["label"]:
            by_label[blocks[0]["label"]].append(blocks)
    print(f"{'op #launch':<58} {'launches':>8} {'blocks':>7} {'release med/max':>16} {'end med/max':>14} "
          f"{'last end: blocks on its SM vs mean':>36}")
    for label, ls in sorted(by_label.items(), key=lambda kv: -statistics.mean(max(b["end"] for b in l) for l in kv[1])):
        nb = statistics.mean(len(l) for l in ls)
        rel_med = statistics.mean(statistics.median(b["release"] for b in l) for l in ls)
        rel_max = statistics.mean(max(b["release"] for b in l) for l in ls)
        end_med = statistics.mean(statistics.median(b["end"] for b in l) for l in ls)
        end_max = statistics.mean(max(b["end"] for b in l) for l in ls)
        # Does the last block share its multiprocessor with more blocks of its launch than most?
        last_load, mean_load = [], []
        for l in ls:
            per_sm = defaultdict(int)
            for b in l:
                per_sm[b["sm"]] += 1
            last = max(l, key=lambda b: b["end"])
            last_load.append(per_sm[last["sm"]])
            mean_load.append(statistics.mean(per_sm[b["sm"]] for b in l))
        print(f"{label[:58]:<58} {len(ls):>8} {nb:>7.0f} {rel_med:>7.2f} {rel_max:>8.2f} {end_med:>6.2f} {end_max:>7.2f} "
              f"{statistics.mean(last_load):>18.2f} vs {statistics.mean(mean_load):<8.2f}")
        if a.late:
            for l in ls[:3]:
                for b in sorted(l, key=lambda b: -b["end"])[:a.late]:
                    print(f"    launch {b['launch']}: block ({b['x']},{b['y']},{b['z']}) on SM {b['sm']}: "
                          f"released {b['release']:.2f}, ended {b['end']:.2f}")


if __name__ == "__main__":
    main()
