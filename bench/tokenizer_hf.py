#!/usr/bin/env python3
"""The Hugging Face side of `strata bench tokenizer`: tokenizes each document of a corpus (split
on the byte 0x1E) with `tokenizers`, single-threaded, best of N passes, and prints one line:
  hf mbs=<MB/s> s=<seconds> tokens=<count> hash=<FNV-1a of the ids, as strata computes it>
Run with RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false (the bench sets them).
usage: tokenizer_hf.py TOKENIZER_JSON CORPUS [REPEAT]
"""
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from tokenizers import Tokenizer  # noqa: E402


def main():
    tok = Tokenizer.from_file(sys.argv[1])
    data = open(sys.argv[2], "rb").read()
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    docs = [d.decode("utf-8") for d in data.split(b"\x1e")]
    best, ids_all = 1e30, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = [tok.encode(d, add_special_tokens=False).ids for d in docs]
        dt = time.perf_counter() - t0
        if dt < best:
            best, ids_all = dt, out
    h, n, mask = 1469598103934665603, 0, (1 << 64) - 1
    for ids in ids_all:
        n += len(ids)
        for i in ids:
            h = ((h ^ i) * 1099511628211) & mask
    print("hf mbs=%.3f s=%.4f tokens=%d hash=%016x" % (len(data) / 1e6 / best, best, n, h))


if __name__ == "__main__":
    main()
