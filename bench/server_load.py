#!/usr/bin/env python3
"""Load test of `strata serve`: N requests from C concurrent clients (chat completions, greedy, a
set of distinct prompts), each answer checked against the one the same prompt got alone first
(slots interleaved by one thread must not disturb each other), none lost. Prints p50/p99 latency
and throughput.

    bench/server_load.py --bin build/strata --requests 200 --clients 16 --parallel 2
    bench/server_load.py --url http://127.0.0.1:8080 ...     (a server already running)
"""
import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"Write a Python function number {i} that adds {i} to its argument." for i in range(8)] + [
    "def fib(n):", "import numpy as np\n", "class Stack:", "# sort a list of dicts by key\n",
    "def read_config(path):", "for i in range(10):", "async def fetch(url):", "def main():\n    args =",
]


def request(host, port, prompt, max_tokens, timeout=600):
    body = json.dumps({"model": "strata", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None
    finally:
        conn.close()


def run_load(host, port, n_requests, n_clients, max_tokens=16, prompts=PROMPTS):
    """Returns a dict: expected answers, latencies, failures, wall time, tokens."""
    expected = {}
    for p in prompts:  # each prompt alone first: the reference answer
        status, r = request(host, port, p, max_tokens)
        if status != 200:
            raise RuntimeError(f"reference request failed: {status} {r}")
        expected[p] = r["choices"][0]["message"]["content"]
    jobs = list(range(n_requests))
    lock = threading.Lock()
    lat, failures, tokens = [], [], [0]

    def client():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop()
            p = prompts[i % len(prompts)]
            t0 = time.monotonic()
            try:
                status, r = request(host, port, p, max_tokens)
            except Exception as e:  # noqa: BLE001 - any failure is a lost request
                status, r = None, repr(e)
            dt = time.monotonic() - t0
            with lock:
                if status != 200:
                    failures.append((i, status, r))
                elif r["choices"][0]["message"]["content"] != expected[p]:
                    failures.append((i, "wrong answer", r["choices"][0]["message"]["content"], expected[p]))
                else:
                    lat.append(dt)
                    tokens[0] += r["usage"]["completion_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    lat.sort()

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    return {"requests": n_requests, "clients": n_clients, "ok": len(lat), "failures": failures, "wall_s": wall,
            "p50_s": pct(0.50), "p99_s": pct(0.99), "mean_s": statistics.mean(lat) if lat else float("nan"),
            "req_per_s": len(lat) / wall, "tokens_per_s": tokens[0] / wall, "generated_tokens": tokens[0]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, parallel, queue, extra=()):
    port = free_port()
    proc = subprocess.Popen([binary, "serve", "--port", str(port), "--parallel", str(parallel), "--queue", str(queue),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited: " + proc.stderr.read().decode(errors="replace"))
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "strata"))
    ap.add_argument("--url", help="a running server instead of starting one")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    proc = None
    if a.url:
        hp = a.url.split("//")[-1].rstrip("/").split(":")
        host, port = hp[0], int(hp[1]) if len(hp) > 1 else 80
    else:  # the queue holds every client: a 503 here would be a lost request
        proc, port = start_server(a.bin, a.parallel, a.clients)
        host = "127.0.0.1"
    try:
        r = run_load(host, port, a.requests, a.clients, a.max_tokens)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; commit {commit}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"requests {r['requests']} from {r['clients']} clients, --parallel {a.parallel}, max_tokens {a.max_tokens}: "
          f"{r['ok']} answered correctly, {len(r['failures'])} failed")
    print(f"latency p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s, mean {r['mean_s']:.2f} s; "
          f"{r['req_per_s']:.2f} requests/s, {r['tokens_per_s']:.1f} generated tokens/s; wall {r['wall_s']:.1f} s")
    for f in r["failures"][:10]:
        print("failure:", f)
    return 0 if not r["failures"] and r["ok"] == r["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
