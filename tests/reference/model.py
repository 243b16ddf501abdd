"""Independent numpy reference forward for qwen3moe and qwen3next GGUF files (REFERENCE.md §3).

Written from the math, not from any C code: the oracle the C forward is tested against. Weights are
dequantized with gguf.quants (so both sides see the same numbers) and all math runs in float64 by default
(pass dtype=np.float32 for a float32 run); float64 makes this an "exact" reference, so differences seen by a
float32 or quantized-activation implementation are its own rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import gguf
from gguf import GGUFReader

CHUNK = 64   # Gated DeltaNet chunk size (REFERENCE §3.3 step 8)


def limit_blas_threads(n=1):
    """The reference does many small matmuls; BLAS threads only spin on them (3x slower on a busy 2-core
    machine). Limits BLAS threads for the whole process if threadpoolctl is installed; returns the limiter."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(n, user_api="blas")


# ----------------------------------------------------------------------------------------------------------
# Small pieces (REFERENCE §3.1)

def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))   # PyTorch: linear above 20


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)    # HF/FLA form


def rope_neox(x, pos, n_rot, base):
    """x [T, heads, d]; rotate dims i and i + n_rot/2 for i < n_rot/2 by pos * base^(-2i/n_rot)."""
    half = n_rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]           # [T, half]
    cos, sin = np.cos(ang)[:, None, :].astype(x.dtype), np.sin(ang)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:n_rot]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., n_rot:]], axis=-1)


# ----------------------------------------------------------------------------------------------------------
# Weights and hyperparameters


class Weights:
    """Tensors of a GGUF by name, dequantized on first use (an expert slab at a time for stacked experts)."""

    def __init__(self, path, dtype):
        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.dtype = dtype
        self._cache = {}

    def has(self, name):
        return name in self.tensors

    def meta(self, key, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _deq(self, t, data):
        return gguf.quants.dequantize(np.asarray(data), t.tensor_type).astype(self.dtype)

    def __call__(self, name):
        """Whole tensor in numpy order (reverse of ne): a linear weight is [out, in]."""
        if name not in self._cache:
            if name not in self.tensors:
                raise KeyError(f"tensor {name!r} missing from the GGUF")
            t = self.tensors[name]
            self._cache[name] = self._deq(t, t.data)
        return self._cache[name]

    def rows(self, name, idx):
        """Rows idx of a matrix (an embedding lookup) without dequantizing the whole tensor."""
        if name in self._cache:
            return self._cache[name][idx]
        t = self.tensors[name]
        return self._deq(t, t.data[np.asarray(idx)])

    def expert(self, name, e):
        key = (name, e)
        if key not in self._cache:
            t = self.tensors[name]
            self._cache[key] = self._deq(t, t.data[e])
        return self._cache[key]


@dataclass
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: list
    head_dim: int
    n_expert: int
    n_expert_used: int
    eps: float
    rope_base: float
    n_rot: int
    # qwen3next
    interval: int = 0
    ssm_conv: int = 0
    d_k: int = 0
    n_k: int = 0
    n_v: int = 0
    d_v: int = 0
    n_mtp: int = 0

    def is_full_attn(self, il):
        return self.arch == "qwen3moe" or il >= self.n_layer or (il + 1) % self.interval == 0


def read_hparams(w: Weights) -> HParams:
    a = w.meta("general.architecture")
    if a not in ("qwen3moe", "qwen3next"):
        raise ValueError(f"general.architecture {a!r}: reference supports qwen3moe and qwen3next")
    g = lambda k, d=None: w.meta(f"{a}.{k}", d)
    n_layer = int(g("block_count"))
    kv = g("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * (n_layer + 1)
    head_dim = int(g("attention.key_length", g("embedding_length") // g("attention.head_count")))
    hp = HParams(arch=a, n_layer=n_layer, n_embd=int(g("embedding_length")),
                 n_vocab=int(w.tensors["token_embd.weight"].shape[1]), n_head=int(g("attention.head_count")),
                 n_head_kv=kv, head_dim=head_dim, n_expert=int(g("expert_count")),
                 n_expert_used=int(g("expert_used_count")), eps=float(g("attention.layer_norm_rms_epsilon")),
                 rope_base=float(g("rope.freq_base", 10000.0)), n_rot=int(g("rope.dimension_count", head_dim)))
    if a == "qwen3next":
        hp.interval = int(g("full_attention_interval", 4))
        hp.ssm_conv = int(g("ssm.conv_kernel"))
        hp.d_k = int(g("ssm.state_size"))
        hp.n_k = int(g("ssm.group_count"))
        hp.n_v = int(g("ssm.time_step_rank"))
        hp.d_v = int(g("ssm.inner_size")) // hp.n_v
        hp.n_mtp = int(g("nextn_predict_layers", 0))
        # REFERENCE §2.4 keeps block_count = main layers with MTP at blk.{block_count}; newer llama.cpp
        # (Qwen3.5 MTP) counts the MTP layers in block_count instead. Accept both.
        if hp.n_mtp and not w.has(f"blk.{n_layer}.nextn.eh_proj.weight") \
                and w.has(f"blk.{n_layer - hp.n_mtp}.nextn.eh_proj.weight"):
            hp.n_layer = n_layer - hp.n_mtp
    return hp


# ----------------------------------------------------------------------------------------------------------
# Caches


@dataclass
class LayerCache:
    k: np.ndarray | None = None        # [T_seen, n_kv, head_dim] (post norm + rope)
    v: np.ndarray | None = None
    pos: np.ndarray | None = None      # absolute position of each cached key
    conv: np.ndarray | None = None     # [K-1, conv_dim]: last raw (pre-conv) qkv rows
    state: np.ndarray | None = None    # [H_v, d_k, d_v] delta-rule state (rows are key dims)


@dataclass
class Cache:
    layers: dict = field(default_factory=dict)
    n_past: int = 0                    # tokens already run through the main model
    mtp: LayerCache = field(default_factory=LayerCache)

    def layer(self, il):
        return self.layers.setdefault(il, LayerCache())


# ----------------------------------------------------------------------------------------------------------
# Model


class Model:
    def __init__(self, path, dtype=np.float64, deltanet="chunked"):
        self.w = Weights(path, dtype)
        self.hp = read_hparams(self.w)
        self.dtype = dtype
        self.deltanet = deltanet          # "chunked" or "recurrent" for multi-token calls
        self.next = self.hp.arch == "qwen3next"

    def new_cache(self):
        return Cache()

    # --- whole model ------------------------------------------------------------------------------------

    def forward(self, tokens, cache=None, return_hidden=False, router_log=None):
        """Run tokens from position cache.n_past; returns logits [T, n_vocab] (and the post-final-norm
        hidden states [T, n_embd] that feed the head and MTP). The cache is updated in place."""
        hp, w = self.hp, self.w
        cache = cache if cache is not None else self.new_cache()
        tokens = np.asarray(tokens, dtype=np.int64)
        pos = cache.n_past + np.arange(len(tokens))
        x = w.rows("token_embd.weight", tokens)
        for il in range(hp.n_layer):
            x = self.layer(il, x, cache.layer(il), pos, router_log)
        cache.n_past += len(tokens)
        h = rmsnorm(x, w("output_norm.weight"), hp.eps)
        logits = self.head(h)
        return (logits, h) if return_hidden else logits

    def head(self, h):
        name = "output.weight" if self.w.has("output.weight") else "token_embd.weight"
        return h @ self.w(name).T

    def layer(self, il, x, lc, pos, router_log=None):
        hp, w, p = self.hp, self.w, f"blk.{il}."
        xn = rmsnorm(x, w(p + "attn_norm.weight"), hp.eps)
        if hp.is_full_attn(il):
            h = x + self.attention(il, xn, lc, pos)
        else:
            h = x + self.gated_deltanet(il, xn, lc)
        norm2 = "post_attention_norm.weight" if self.next else "ffn_norm.weight"
        return h + self.moe(il, rmsnorm(h, w(p + norm2), hp.eps), router_log)

    # --- attention (REFERENCE §3.2 and the gated form of §3.3) -------------------------------------------

    def attention(self, il, xn, lc, pos):
        hp, w, p = self.hp, self.w, f"blk.{il}."
        T, nh, nkv, d = len(xn), hp.n_head, hp.n_head_kv[il], hp.head_dim
        qa = xn @ w(p + "attn_q.weight").T
        if self.next:                                   # per head [query(d) | gate(d)]
            qa = qa.reshape(T, nh, 2 * d)
            q, gate = qa[..., :d], qa[..., d:].reshape(T, nh * d)
        else:
            q, gate = qa.reshape(T, nh, d), None
        k = (xn @ w(p + "attn_k.weight").T).reshape(T, nkv, d)
        v = (xn @ w(p + "attn_v.weight").T).reshape(T, nkv, d)
        q = rmsnorm(q, w(p + "attn_q_norm.weight"), hp.eps)    # norm before RoPE
        k = rmsnorm(k, w(p + "attn_k_norm.weight"), hp.eps)
        q = rope_neox(q, pos, hp.n_rot, hp.rope_base)
        k = rope_neox(k, pos, hp.n_rot, hp.rope_base)
        lc.k = k if lc.k is None else np.concatenate([lc.k, k])
        lc.v = v if lc.v is None else np.concatenate([lc.v, v])
        lc.pos = pos if lc.pos is None else np.concatenate([lc.pos, pos])
        mask = lc.pos[None, :] <= pos[:, None]                   # causal, by absolute position
        o = np.empty((T, nh, d), dtype=xn.dtype)
        for h in range(nh):
            kvh = h // (nh // nkv)                               # GQA
            s = q[:, h] @ lc.k[:, kvh].T / np.sqrt(d)
            s = np.where(mask, s, -np.inf)
            o[:, h] = softmax(s) @ lc.v[:, kvh]
        o = o.reshape(T, nh * d)
        if gate is not None:
            o = o * sigmoid(gate)
        return o @ w(p + "attn_output.weight").T

    # --- MoE (REFERENCE §3.2 and §3.3) ------------------------------------------------------------------

    def moe(self, il, xn, router_log=None):
        hp, w, p = self.hp, self.w, f"blk.{il}."
        probs = softmax(xn @ w(p + "ffn_gate_inp.weight").T)          # [T, E]
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :hp.n_expert_used]
        wt = np.take_along_axis(probs, top, axis=-1)
        wt = wt / wt.sum(axis=-1, keepdims=True)                       # norm_topk_prob
        if router_log is not None:
            router_log.append((il, top.copy()))
        y = np.zeros_like(xn)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            xe = xn[rows]
            g = xe @ w.expert(p + "ffn_gate_exps.weight", e).T
            u = xe @ w.expert(p + "ffn_up_exps.weight", e).T
            y[rows] += wt[rows, slot][:, None] * ((silu(g) * u) @ w.expert(p + "ffn_down_exps.weight", e).T)
        if self.next:
            sg = sigmoid(xn @ w(p + "ffn_gate_inp_shexp.weight").reshape(-1))     # scalar gate per token
            s = silu(xn @ w(p + "ffn_gate_shexp.weight").T) * (xn @ w(p + "ffn_up_shexp.weight").T)
            y = y + sg[:, None] * (s @ w(p + "ffn_down_shexp.weight").T)
        return y

    # --- Gated DeltaNet (REFERENCE §3.3) ----------------------------------------------------------------

    def gdn_inputs(self, il, xn):
        """Projections in canonical order: qkv [T, conv_dim] (q | k | v), z [T, value_dim], b, a [T, H_v]."""
        hp, w, p = self.hp, self.w, f"blk.{il}."
        T, dk, dv, nk, nv = len(xn), hp.d_k, hp.d_v, hp.n_k, hp.n_v
        r = nv // nk
        if w.has(p + "attn_qkv.weight"):
            qkv = xn @ w(p + "attn_qkv.weight").T
            z = xn @ w(p + "attn_gate.weight").T
        else:   # legacy ssm_in: per key head g, [q_g, k_g, v (r heads), z (r heads)]
            m = (xn @ w(p + "ssm_in.weight").T).reshape(T, nk, 2 * dk + 2 * r * dv)
            q, k = m[..., :dk], m[..., dk:2 * dk]
            v, z = m[..., 2 * dk:2 * dk + r * dv], m[..., 2 * dk + r * dv:]
            qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
            z = z.reshape(T, -1)
        ba = (xn @ w(p + "ssm_ba.weight").T).reshape(T, nk, 2 * r)       # per key head [b(r), a(r)]
        b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
        return qkv, z, b, a

    def gated_deltanet(self, il, xn, lc, mode=None):
        hp, w, p = self.hp, self.w, f"blk.{il}."
        T, dk, dv, nk, nv, K = len(xn), hp.d_k, hp.d_v, hp.n_k, hp.n_v, hp.ssm_conv
        kd = dk * nk
        qkv, z, b, a = self.gdn_inputs(il, xn)
        cd = qkv.shape[1]

        # causal depthwise conv over [state ; new], then SiLU
        if lc.conv is None:
            lc.conv = np.zeros((K - 1, cd), dtype=xn.dtype)
        xs = np.concatenate([lc.conv, qkv])                              # [K-1+T, cd]
        cw = w(p + "ssm_conv1d.weight")                                   # [cd, K]; cw[:, K-1] = current
        u = np.zeros((T, cd), dtype=xn.dtype)
        for j in range(K):
            u += cw[:, j] * xs[j:j + T]
        u = silu(u)
        lc.conv = xs[T:]                                                  # last K-1 raw rows

        q = l2norm(u[:, :kd].reshape(T, nk, dk)) / np.sqrt(dk)
        k = l2norm(u[:, kd:2 * kd].reshape(T, nk, dk))
        v = u[:, 2 * kd:].reshape(T, nv, dv)
        q = np.repeat(q, nv // nk, axis=1)                                # v-head j uses key head j // r
        k = np.repeat(k, nv // nk, axis=1)
        beta = sigmoid(b)
        g = w(p + "ssm_a") * softplus(a + w(p + "ssm_dt.bias"))          # log-decay <= 0

        if lc.state is None:
            lc.state = np.zeros((nv, dk, dv), dtype=xn.dtype)
        mode = mode or (self.deltanet if T > 1 else "recurrent")
        fn = delta_rule_chunked if mode == "chunked" else delta_rule_recurrent
        o, lc.state = fn(q, k, v, g, beta, lc.state)

        o = rmsnorm(o, w(p + "ssm_norm.weight"), hp.eps) * silu(z.reshape(T, nv, dv))
        return o.reshape(T, nv * dv) @ w(p + "ssm_out.weight").T

    # --- MTP (REFERENCE §3.3, vLLM structure, names of §2.4) ---------------------------------------------

    def mtp(self, hidden, next_tokens, cache, pos=None, router_log=None):
        """One MTP step for each row: hidden = main model's post-final-norm state at position i,
        next_tokens = token i+1. Returns (draft logits for token i+2, MTP hidden for chaining).
        pos defaults to i+1 (REFERENCE §3.3); vLLM uses i, which gives the same numbers because RoPE
        attention depends only on position differences."""
        hp, w = self.hp, self.w
        if hp.n_mtp < 1 or not w.has(f"blk.{hp.n_layer}.nextn.eh_proj.weight"):
            raise ValueError("model has no MTP layer (blk.N.nextn.*)")
        L, p = hp.n_layer, f"blk.{hp.n_layer}."
        T = len(next_tokens)
        if pos is None:
            n_seen = 0 if cache.mtp.pos is None else len(cache.mtp.pos)
            pos = n_seen + 1 + np.arange(T)
        pos = np.asarray(pos)
        e = rmsnorm(w.rows("token_embd.weight", next_tokens), w(p + "nextn.enorm.weight"), hp.eps)
        h = rmsnorm(hidden, w(p + "nextn.hnorm.weight"), hp.eps)
        u = np.concatenate([e, h], axis=-1) @ w(p + "nextn.eh_proj.weight").T   # [embedding, hidden]
        u = self.layer(L, u, cache.mtp, pos, router_log)
        out = rmsnorm(u, w(p + "nextn.shared_head_norm.weight"), hp.eps)
        return self.head(out), out


# ----------------------------------------------------------------------------------------------------------
# The delta rule, two ways. Shapes: q, k [T, H, d_k]; v [T, H, d_v]; g, beta [T, H]; S [H, d_k, d_v].


def delta_rule_recurrent(q, k, v, g, beta, S):
    S = S.copy()
    o = np.empty_like(v)
    for t in range(len(q)):
        S *= np.exp(g[t])[:, None, None]
        m = np.einsum("hkv,hk->hv", S, k[t])                  # memory read for k_t
        delta = beta[t][:, None] * (v[t] - m)
        S += np.einsum("hk,hv->hkv", k[t], delta)
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def delta_rule_chunked(q, k, v, g, beta, S, C=CHUNK):
    T, H, dk = q.shape
    dv = v.shape[-1]
    n = -(-T // C) * C
    pad = lambda x: np.concatenate([x, np.zeros((n - T,) + x.shape[1:], dtype=x.dtype)])
    q, k, v, g, beta = map(pad, (q, k, v, g, beta))            # padded steps: g = 0, beta = 0 -> no-ops
    S = S.copy()
    o = np.empty((n, H, dv), dtype=v.dtype)
    lower = np.tril(np.ones((C, C), dtype=bool))
    strict = np.tril(np.ones((C, C), dtype=bool), -1)
    eye = np.eye(C, dtype=v.dtype)
    for c0 in range(0, n, C):
        sl = slice(c0, c0 + C)
        for h in range(H):
            Q, K, V = q[sl, h], k[sl, h], v[sl, h]
            be, gam = beta[sl, h], np.cumsum(g[sl, h])
            D = np.exp(np.where(lower, gam[:, None] - gam[None, :], -np.inf))
            Kb, Vb = be[:, None] * K, be[:, None] * V
            L = np.where(strict, (Kb @ K.T) * D, 0.0)
            Tm = np.linalg.solve(eye + L, eye)                 # (I + L)^-1, unit lower-triangular
            U = Tm @ Vb
            W = Tm @ (Kb * np.exp(gam)[:, None])
            Vp = U - W @ S[h]
            o[sl, h] = (Q * np.exp(gam)[:, None]) @ S[h] + np.where(lower, (Q @ K.T) * D, 0.0) @ Vp
            S[h] = np.exp(gam[-1]) * S[h] + (K * np.exp(gam[-1] - gam)[:, None]).T @ Vp
    return o[:T], S


def main(argv=None):
    """CLI: logits of a token list, saved as .npy (and the MTP drafts with --mtp)."""
    import argparse
    ap = argparse.ArgumentParser(description="numpy reference forward (float64) of a qwen3moe/qwen3next GGUF")
    ap.add_argument("model")
    ap.add_argument("tokens", type=int, nargs="+")
    ap.add_argument("--out", help="save logits [T, vocab] here (.npy)")
    ap.add_argument("--step", action="store_true", help="one token at a time through the caches")
    ap.add_argument("--recurrent", action="store_true", help="recurrent DeltaNet for the prompt")
    ap.add_argument("--mtp-out", help="save MTP draft logits [T-1, vocab] here (.npy)")
    a = ap.parse_args(argv)
    m = Model(a.model, deltanet="recurrent" if a.recurrent else "chunked")
    cache = m.new_cache()
    if a.step:
        pairs = [m.forward([t], cache, return_hidden=True) for t in a.tokens]
        logits, hidden = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    else:
        logits, hidden = m.forward(a.tokens, cache, return_hidden=True)
    print("argmax:", logits.argmax(-1).tolist())
    if a.out:
        np.save(a.out, logits)
    if a.mtp_out:
        draft, _ = m.mtp(hidden[:-1], a.tokens[1:], cache)
        print("mtp argmax:", draft.argmax(-1).tolist())
        np.save(a.mtp_out, draft)


if __name__ == "__main__":
    main()
