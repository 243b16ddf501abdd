#!/usr/bin/env python3
# Session 48: simulations of the window-exact patch (2026-12-07-window-exact.md): part 1 the
# per-row cut of attn_kernel, part 2 the canonical merge in float32. Prints "bad 0" and
# "mismatches 0". Run: python3 bench/results/2026-12-07-window-exact-sim.py
# Part 1: the per-row cut: every query's positions in every split equal its row's own, the
# block's tiles cover them, and no block past act holds any.
import random
PLANS=20
def plan_of(T):
    k = 0 if T <= 256 else (T-1).bit_length() - 8
    return min(k, PLANS-1)
def host_plan(k): return (256<<k)
def chunk_of(T, ns, align):
    c = -(-T//ns); return -(-c//align)*align
def row_cut(nsrow, pos0, r, n, ns):
    T = pos0 + r + 1 if nsrow else pos0 + n
    nss = nsrow[plan_of(T)] if nsrow else ns
    c = chunk_of(T, nss, 32)
    return c, min(nss, -(-T//c))
random.seed(1)
bad = 0
for trial in range(20000):
    n_ctx = random.choice([64, 120, 300, 700, 1024, 2000, 4096, 9000, 40960])
    G = random.choice([1,2,4,8,16]); QPW = random.choice([1,2,4]); QB = 8*QPW
    cap = random.choice([8, 22, 33, 66, 99, 256])
    def ns_for(ctx):
        ns = min(cap, -(-ctx//32), 256); ns = max(ns, 1)
        if ns >= 8 and random_cluster: ns = ns//8*8
        return ns
    random_cluster = random.random() < 0.7
    table = []
    for k in range(PLANS):
        ctx = min(256<<k, n_ctx); table.append(ns_for(ctx))
    n = random.randint(2, 16)
    pos0 = random.randint(0, n_ctx - n)
    nq = n*G
    ns_w = max(table)
    if random_cluster and ns_w >= 8: ns_w = -(-ns_w//8)*8
    # the row alone: its splits and ranges
    for r in range(n):
        Tr = pos0 + r + 1
        nsr = table[plan_of(Tr)]
        cr = chunk_of(Tr, nsr, 32); actr = min(nsr, -(-Tr//cr))
        own = {s: (s*cr, min(Tr, (s+1)*cr)) for s in range(actr)}
        for qb in range(0, nq, QB):
            last_q = min(qb+QB, nq)-1; r0 = qb//G; r1 = last_q//G
            if not (r0 <= r <= r1): continue
            cuts = [row_cut(table, pos0, rr, n, ns_w) for rr in range(r0, r1+1)]
            c_lo = min(c for c,_ in cuts); c_hi = max(c for c,_ in cuts); act = max(a for _,a in cuts)
            assert act <= ns_w
            for split in range(ns_w):
                if split >= act:
                    if split in own: bad += 1; print('lost split', trial, r, split)
                    continue
                t_begin = split*c_lo; t_end = max(t_begin, min(pos0 + r1 + 1, (split+1)*c_hi))
                c, a = row_cut(table, pos0, r, n, ns_w)
                lo = split*c; lim = min(pos0 + r, (split+1)*c - 1)
                seen = (lo, lim+1) if lim >= lo else None
                want = own.get(split)
                if want != seen and not (want is None and seen is None):
                    bad += 1; print('range', trial, r, split, want, seen); break
                if seen and (seen[0] < t_begin or seen[1] > t_end or t_begin % 32):
                    bad += 1; print('cover', trial, seen, t_begin, t_end)
print('bad', bad)

# Part 2: the canonical merge in float32 (fma through float64): a row merged over its own splits
# against a window's merge over more, the extra splits neutral (m -inf, l 0, acc 0).
import numpy as np, random
f32 = np.float32
def fma(a, b, c): return f32(np.float64(a)*np.float64(b) + np.float64(c))
def butterfly(v):  # v: 32 lane values, xor shuffles 16..1
    v = [f32(x) for x in v]
    for o in (16, 8, 4, 2, 1):
        v = [f32(v[i] + v[i ^ o]) for i in range(32)]
    return v[0]
def merge(ml, ns, acc_of):  # attn_merge for one dim
    ms = [ml[i][0] if i < ns else f32(-np.inf) for i in range(32)]
    mx = max(ms)
    f = [f32(np.exp(f32(ml[i][0] - mx))) if i < ns and ml[i][0] != -np.inf else f32(0) for i in range(32)]
    ls = butterfly([f32(ml[i][1] * f[i]) if i < ns else f32(0) for i in range(32)])
    s = f32(0)
    for i in range(ns): s = fma(f[i], acc_of(i), s)
    return (mx, ls), s
def canonical(parts, act):  # parts[s] = (m, l, acc) ; returns output
    ng = -(-act // 8)
    groups = []
    for c in range(ng):
        here = min(8, act - 8*c)
        ml = [(parts[8*c+i][0], parts[8*c+i][1]) for i in range(here)] + [(f32(-np.inf), f32(0))]*(32-here)
        ML, a = merge(ml, here, lambda i: parts[8*c+i][2])
        groups.append((ML[0], ML[1], a))
    if ng == 1: return f32(groups[0][2] / groups[0][1])
    ml = [(g[0], g[1]) for g in groups] + [(f32(-np.inf), f32(0))]*(32-ng)
    ML, a = merge(ml, ng, lambda i: groups[i][2])
    return f32(a / ML[1])
random.seed(2); rng = np.random.default_rng(3); bad = 0
for t in range(3000):
    act_r = random.randint(1, 40); act = random.randint(act_r, 48)
    parts = []
    for s in range(act_r):
        m = f32(rng.normal()*3); l = f32(abs(rng.normal())*5 + 0.1); a = f32(rng.normal()*4)
        parts.append((m, l, a))
    neutral = (f32(-np.inf), f32(0), f32(0))
    w = parts + [neutral]*(act - act_r)
    if canonical(parts, act_r) != canonical(w, act): bad += 1
print('mismatches', bad)
