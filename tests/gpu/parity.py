#!/usr/bin/env python3
"""GPU vs CPU logits, end to end: `strata eval` on both backends over the same tokens.

For each model (the tiny-coder and random models of both architectures made by synth_gguf.py),
runs a prompt of N tokens in chunks (the prompt path), token by token (decode: recorded graphs),
and in windows of 5 rows (verify windows), on the GPU and on the CPU, and compares: the largest
logit difference relative to the largest |logit| of its row, and top-1 agreement. Prints one
line per case and exits non-zero when a case is outside its bounds.

    tests/gpu/parity.py --bin build/strata --out /tmp/parity [--positions 1024]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent

# (name, synth_gguf.py arguments or None for a file, the file)
MODELS = [
    ("tiny-coder", None, ROOT / "models" / "tiny-coder.gguf"),
    ("moe-q8_0-q4_K", ["--preset", "tiny-moe", "--n-embd", "256", "--expert-ff", "256", "--layers", "3",
                       "--dense-type", "q8_0", "--expert-type", "q4_K"], None),
    ("next-q8_0-q4_K-mtp", ["--preset", "tiny-next", "--n-embd", "256", "--expert-ff", "256", "--layers", "4",
                            "--dense-type", "q8_0", "--expert-type", "q4_K", "--mtp"], None),
    ("next-legacy-f16-iq4_xs", ["--preset", "tiny-next", "--n-embd", "256", "--expert-ff", "256", "--layers", "4",
                                "--dense-type", "f16", "--expert-type", "iq4_xs", "--legacy-ssm-in"], None),
    ("next-shape-q8_0-q4_K-mtp", ["--preset", "tiny-next", "--n-embd", "512", "--n-head", "4", "--n-head-kv", "2",
                                  "--head-dim", "256", "--rope-dim", "64", "--ssm-d-k", "128", "--ssm-d-v", "128",
                                  "--ssm-n-k", "2", "--ssm-n-v", "4", "--n-expert", "64", "--n-expert-used", "10",
                                  "--expert-ff", "512", "--shared-ff", "512", "--layers", "4", "--mtp",
                                  "--dense-type", "q8_0", "--expert-type", "q4_K"], None),
    ("30b-shape-q8_0-q4_K", ["--preset", "tiny-moe", "--n-embd", "512", "--n-head", "8", "--n-head-kv", "2",
                             "--head-dim", "128", "--n-expert", "128", "--n-expert-used", "8", "--expert-ff", "256",
                             "--layers", "2", "--dense-type", "q8_0", "--expert-type", "q4_K"], None),
    ("moe-bf16-q6_K", ["--preset", "tiny-moe", "--n-embd", "256", "--expert-ff", "256", "--layers", "2",
                       "--dense-type", "bf16", "--expert-type", "q6_K"], None),
]


def run(cmd: list[str], log) -> None:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write("$ " + " ".join(cmd) + "\n" + r.stdout + "\n")
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed ({r.returncode}): {r.stdout[-2000:]}")


def logits(bin_: str, model: Path, toks: list[int], gpu: str, batch: int, kv: str, out: Path, log) -> np.ndarray:
    f = out / f"{model.stem}-{gpu}-{batch}-{kv}.f32"
    run([bin_, "eval", "-m", str(model), "--tokens", ",".join(map(str, toks)), "--logits", str(f),
         "--batch", str(batch), "--kv", kv, "--gpu", gpu], log)
    return np.fromfile(f, dtype=np.float32).reshape(len(toks), -1)


def compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    scale = np.maximum(np.abs(b).max(axis=1), 1e-6)
    rel = (np.abs(a - b).max(axis=1) / scale).max()
    top1 = float((a.argmax(axis=1) == b.argmax(axis=1)).mean())
    return float(rel), top1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--decode-positions", type=int, default=160)
    ap.add_argument("--max-rel", type=float, default=0.05, help="largest logit difference / max |logit| allowed")
    ap.add_argument("--min-top1", type=float, default=0.98)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "parity.log", "w")
    rng = np.random.default_rng(7)
    failed = 0
    print(f"{'model':26} {'case':24} {'rows':>5} {'max rel diff':>13} {'top-1 agree':>12}  result")
    for name, synth, path in MODELS:
        try:
            if synth is not None:
                path = out / f"{name}.gguf"
                if not path.exists():
                    run([sys.executable, str(ROOT / "tools" / "synth_gguf.py"), str(path)] + synth, log)
        except Exception as e:  # noqa: BLE001 - reported as a failed case
            print(f"{name:26} {'setup':24} {'':>5} {'':>13} {'':>12}  FAIL {e}")
            failed += 1
            continue
        # Token ids below 1000 exist in every vocabulary here (byte-level vocabularies have 256+).
        toks = [int(t) for t in rng.integers(0, 250, size=a.positions)]
        cases = [("prompt chunks of 512", toks, 512, "f16"),
                 ("prompt chunks of 64, q8_0", toks, 64, "q8_0"),
                 ("decode (1 row)", toks[: a.decode_positions], 1, "f16"),
                 ("windows of 5 rows", toks[: a.decode_positions], 5, "f16"),
                 ("windows of 16 rows", toks[: a.decode_positions], 16, "f16")]
        for case, tk, batch, kv in cases:
            try:
                g = logits(a.bin, path, tk, "0", batch, kv, out, log)
                c = logits(a.bin, path, tk, "cpu", batch, kv, out, log)
                rel, top1 = compare(g, c)
                ok = rel <= a.max_rel and top1 >= a.min_top1 and np.isfinite(g).all()
                print(f"{name:26} {case:24} {len(tk):5d} {rel:13.2e} {top1:12.4f}  {'pass' if ok else 'FAIL'}")
                failed += not ok
            except Exception as e:  # noqa: BLE001
                print(f"{name:26} {case:24} {len(tk):5d} {'':>13} {'':>12}  FAIL {str(e)[:300]}")
                failed += 1
            sys.stdout.flush()
    print(f"parity: {'all cases pass' if not failed else f'{failed} case(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
