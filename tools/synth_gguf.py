#!/usr/bin/env python3
"""Random-weight GGUF models (qwen3moe, qwen3next) at any shape and weight type, for tests and benchmarks.

Names, ne order and metadata keys follow REFERENCE.md §1.2 and §2; tensors are streamed to disk one slab
at a time, so real-size files (qwen3-next-80b-a3b) need no more RAM than one expert matrix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

def _qwen3_tokenizer_dir() -> Path:
    # $STRATA_QWEN3_TOKENIZER, else shared/ inside the checkout, else shared/ beside it (/work/shared)
    if os.environ.get("STRATA_QWEN3_TOKENIZER"):
        return Path(os.environ["STRATA_QWEN3_TOKENIZER"])
    root = Path(__file__).resolve().parent.parent
    for base in (root / "shared", root.parent / "shared"):
        if (base / "data" / "qwen3-tokenizer" / "tokenizer.json").exists():
            return base / "data" / "qwen3-tokenizer"
    raise ValueError("--vocab qwen3: tokenizer.json not found (set STRATA_QWEN3_TOKENIZER)")

# ----------------------------------------------------------------------------------------------------------
# Model shape


@dataclass
class Config:
    arch: str = "qwen3moe"               # "qwen3moe" | "qwen3next"
    n_layer: int = 2
    n_embd: int = 128
    n_vocab: int = 0                     # 0: exactly the tokenizer's size; larger pads with [PADn] tokens
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 256                      # feed_forward_length (informational: every layer is MoE)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_ff_shexp: int = 64                 # qwen3next only
    rope_base: float = 1e6
    rope_dim: int = 0                    # qwen3next: rotated dims (0: head_dim // 4); qwen3moe: full head
    eps: float = 1e-6
    n_ctx: int = 4096
    # qwen3next Gated DeltaNet
    ssm_conv: int = 4
    ssm_d_k: int = 32                    # ssm.state_size (linear_key_head_dim)
    ssm_n_k: int = 2                     # ssm.group_count (H_k)
    ssm_n_v: int = 4                     # ssm.time_step_rank (H_v)
    ssm_d_v: int = 32                    # linear_value_head_dim (inner_size = d_v * H_v)
    interval: int = 4                    # full_attention_interval
    legacy_ssm_in: bool = False          # write the old fused ssm_in instead of attn_qkv + attn_gate
    mtp: bool = False                    # append one MTP (nextn) layer at block index n_layer
    # weights
    dense_type: str = "f32"
    expert_type: str = "f32"
    router_type: str = "f32"
    router_skew: float = 0.0             # log-normal spread of router row scales (0: uniform traffic)
    residual_gain: float = 1.0           # scale of attn_output / ssm_out / ffn_down* on top of 1/sqrt(2L)
    vocab: str = "byte"                  # "byte" | "qwen3"
    byte_merges: int = 100
    seed: int = 0
    name: str = "synth"

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_d_k * self.ssm_n_k

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_d_v * self.ssm_n_v

    @property
    def ssm_conv_dim(self) -> int:
        return 2 * self.ssm_key_dim + self.ssm_value_dim

    def is_full_attn(self, il: int) -> bool:
        if self.arch == "qwen3moe" or il >= self.n_layer:   # the MTP layer is always full attention
            return True
        return (il + 1) % self.interval == 0


PRESETS: dict[str, dict] = {
    "tiny-moe": dict(arch="qwen3moe", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                     n_expert=8, n_expert_used=2, n_ff_exp=64, rope_base=1e6),
    "tiny-next": dict(arch="qwen3next", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                      n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64, rope_base=1e7, rope_dim=16,
                      ssm_conv=4, ssm_d_k=32, ssm_n_k=2, ssm_n_v=4, ssm_d_v=32, interval=4),
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                          n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, rope_base=1e6, n_ctx=40960,
                          vocab="qwen3", n_vocab=151936, router_skew=0.5,
                          dense_type="q8_0", expert_type="q4_K"),
    "qwen3-next-80b-a3b": dict(arch="qwen3next", n_layer=48, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256,
                               n_ff=5120, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
                               rope_base=1e7, rope_dim=64, n_ctx=262144, ssm_conv=4, ssm_d_k=128, ssm_n_k=16,
                               ssm_n_v=32, ssm_d_v=128, interval=4, vocab="qwen3", n_vocab=151936,
                               router_skew=0.5, dense_type="q8_0", expert_type="q4_K"),
}

TYPE_NAMES = {t.name.lower(): t for t in QT}
# Types gguf.quants can quantize from floats; the rest get random but valid blocks.
QUANTIZABLE = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1}
RANDOM_BLOCK = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS,
                QT.IQ3_S, QT.IQ1_S, QT.IQ1_M, QT.IQ4_NL, QT.IQ4_XS}

FTYPE_OF = {
    QT.F32: gguf.LlamaFileType.ALL_F32, QT.F16: gguf.LlamaFileType.MOSTLY_F16,
    QT.BF16: gguf.LlamaFileType.MOSTLY_BF16, QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    QT.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QT.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    QT.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, QT.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    QT.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K, QT.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_M,
    QT.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M, QT.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    QT.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K, QT.IQ2_XXS: gguf.LlamaFileType.MOSTLY_IQ2_XXS,
    QT.IQ2_XS: gguf.LlamaFileType.MOSTLY_IQ2_XS, QT.IQ2_S: gguf.LlamaFileType.MOSTLY_IQ2_S,
    QT.IQ3_XXS: gguf.LlamaFileType.MOSTLY_IQ3_XXS, QT.IQ3_S: gguf.LlamaFileType.MOSTLY_IQ3_S,
    QT.IQ1_S: gguf.LlamaFileType.MOSTLY_IQ1_S, QT.IQ1_M: gguf.LlamaFileType.MOSTLY_IQ1_M,
    QT.IQ4_NL: gguf.LlamaFileType.MOSTLY_IQ4_NL, QT.IQ4_XS: gguf.LlamaFileType.MOSTLY_IQ4_XS,
}


def parse_type(s: str) -> QT:
    t = TYPE_NAMES.get(s.lower())
    if t is None or (t not in QUANTIZABLE and t not in RANDOM_BLOCK):
        ok = sorted(n for n, v in TYPE_NAMES.items() if v in QUANTIZABLE or v in RANDOM_BLOCK)
        raise ValueError(f"weight type {s!r} not supported; choose one of {', '.join(ok)}")
    return t


# ----------------------------------------------------------------------------------------------------------
# Random but valid blocks for K and IQ types.
#
# A block's values are linear in its fp16 super-scales (d, and dmin where the type has one), so we fill
# blocks with random bytes, then overwrite the scale fields with values calibrated once per type so the
# dequantized weights have mean ~0 and the requested std. Random bytes elsewhere are always valid: every
# index field addresses a full table.

# (byte offset of d, byte offset of dmin or None) inside one block
SCALE_FIELDS = {
    QT.Q2_K: (80, 82), QT.Q3_K: (108, None), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, None),
    QT.IQ2_XXS: (0, None), QT.IQ2_XS: (0, None), QT.IQ2_S: (0, None), QT.IQ3_XXS: (0, None),
    QT.IQ3_S: (0, None), QT.IQ1_S: (0, None), QT.IQ4_NL: (0, None), QT.IQ4_XS: (0, None),
    QT.IQ1_M: (-1, None),   # super-scale spread over the top nibbles of the 4 u16 scale words
}
_calib: dict[QT, tuple[float, float]] = {}


def _set_scales(blocks: np.ndarray, qt: QT, d: float, dmin: float) -> None:
    off_d, off_m = SCALE_FIELDS[qt]
    dh = np.array([d], dtype=np.float16).view(np.uint16)[0]
    if qt == QT.IQ1_M:
        sc = blocks[:, 48:56].copy().view(np.uint16)          # 4 u16 words after qs[32], qh[16]
        nib = [(dh >> 0) & 0xF, (dh >> 4) & 0xF, (dh >> 8) & 0xF, (dh >> 12) & 0xF]
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (int(nib[i]) << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
        return
    blocks[:, off_d:off_d + 2] = np.frombuffer(np.uint16(dh).tobytes(), np.uint8)
    if off_m is not None:
        mh = np.array([dmin], dtype=np.float16).view(np.uint16)[0]
        blocks[:, off_m:off_m + 2] = np.frombuffer(np.uint16(mh).tobytes(), np.uint8)


def _calibration(qt: QT) -> tuple[float, float]:
    """(d for unit std, dmin/d ratio that cancels the mean), measured on random blocks with a fixed seed."""
    if qt in _calib:
        return _calib[qt]
    bs, ts = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(12345)
    raw = rng.integers(0, 256, size=(4096, ts), dtype=np.uint8)
    ratio = 0.0
    if SCALE_FIELDS[qt][1] is not None:
        b = raw.copy(); _set_scales(b, qt, 1.0, 0.0)
        mean_d = float(gguf.quants.dequantize(b, qt).mean())
        b = raw.copy(); _set_scales(b, qt, 0.0, 1.0)
        mean_m = float(gguf.quants.dequantize(b, qt).mean())   # = -E[m]
        ratio = -mean_d / mean_m if mean_m != 0 else 0.0
    b = raw.copy(); _set_scales(b, qt, 1.0, ratio)
    y = gguf.quants.dequantize(b, qt).astype(np.float64)
    _calib[qt] = (1.0 / float(y.std()), ratio)
    return _calib[qt]


def random_blocks(rng: np.random.Generator, n_rows: int, ne0: int, qt: QT, std: float) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, size=(n_rows * ne0 // bs, ts), dtype=np.uint8)
    unit, ratio = _calibration(qt)
    _set_scales(blocks, qt, std * unit, std * unit * ratio)
    return blocks.reshape(n_rows, ne0 // bs * ts)


# ----------------------------------------------------------------------------------------------------------
# Tensor plan: name, ne (ggml order), type, and a generator of row slabs (bytes in file order)


@dataclass
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    qtype: QT
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        bs, ts = GGML_QUANT_SIZES[self.qtype]
        n = self.ne[0] // bs * ts
        for d in self.ne[1:]:
            n *= d
        return n


def _rng(cfg: Config, *key) -> np.random.Generator:
    # One stream per tensor (and per expert), so a tensor's values do not depend on which others exist.
    words = [cfg.seed & 0xFFFFFFFF] + [zlib.crc32(str(k).encode()) for k in key]
    return np.random.default_rng(words)


def _encode(rows: np.ndarray, qt: QT) -> np.ndarray:
    """Float rows -> the bytes of type qt (rows along ne0)."""
    if qt == QT.F32:
        return rows.astype(np.float32)
    q = gguf.quants.quantize(rows.astype(np.float32), qt)
    return q


def _fit_type(want: QT, ne0: int, name: str, notes: list[str]) -> QT:
    # Like llama.cpp's quantizer: a row that is not a whole number of blocks falls back to a smaller block.
    bs = GGML_QUANT_SIZES[want][0]
    if ne0 % bs == 0:
        return want
    fb = QT.Q8_0 if ne0 % 32 == 0 and want not in (QT.F32, QT.F16, QT.BF16) else QT.F16
    notes.append(f"{name}: ne0={ne0} not a multiple of {want.name}'s block {bs}, using {fb.name}")
    return fb


def _matrix_chunks(cfg: Config, key: str, ne0: int, rows: int, qt: QT, std: float, n_slabs: int = 1,
                   row_scale: np.ndarray | None = None, slab_rows: int = 4096):
    """Yield n_slabs x rows x ne0 values (std `std`) encoded as qt, slab by slab / row-block by row-block."""
    def gen():
        for s in range(n_slabs):
            rng = _rng(cfg, key, s)
            for r0 in range(0, rows, slab_rows):
                nr = min(slab_rows, rows - r0)
                if qt in RANDOM_BLOCK:
                    if row_scale is not None:
                        raise ValueError("row scales need a float or legacy-quant type")
                    yield random_blocks(rng, nr, ne0, qt, std)
                else:
                    x = rng.standard_normal((nr, ne0), dtype=np.float32) * np.float32(std)
                    if row_scale is not None:
                        x *= row_scale[r0:r0 + nr, None].astype(np.float32)
                    yield _encode(x, qt)
    return gen


def _vector_chunks(values: np.ndarray):
    def gen():
        yield values.astype(np.float32)
    return gen


def _norm_values(cfg: Config, key: str, n: int) -> np.ndarray:
    # Stored norm weights near 1 (for qwen3next this is the stored 1+w, w ~ N(0, 0.1^2)).
    return 1.0 + 0.1 * _rng(cfg, key).standard_normal(n)


def plan(cfg: Config, notes: list[str]) -> list[TensorSpec]:
    H, V = cfg.n_embd, cfg.n_vocab
    dense, experts, router_t = parse_type(cfg.dense_type), parse_type(cfg.expert_type), parse_type(cfg.router_type)
    # Residual-branch output scale, GPT-2 style 1/sqrt(2L). Attention averaging, SwiGLU and the top-k mix
    # shrink a branch to ~half, so at gain 1 the embedding dominates the residual stream (RMS 1.0 -> 1.1
    # over 48 layers); gain 2 makes all branches together add about as much as the embedding.
    res = cfg.residual_gain / math.sqrt(2 * max(cfg.n_layer, 1))
    specs: list[TensorSpec] = []

    def mat(name, ne0, ne1, qt, std, n_slabs=1, row_scale=None):
        qt = _fit_type(qt, ne0, name, notes)
        ne = (ne0, ne1) if n_slabs == 1 and name.count("_exps") == 0 else (ne0, ne1, n_slabs)
        specs.append(TensorSpec(name, ne, qt, _matrix_chunks(cfg, name, ne0, ne1, qt, std, n_slabs, row_scale)))

    def vec(name, values, ne=None):
        specs.append(TensorSpec(name, ne or (len(values),), QT.F32, _vector_chunks(np.asarray(values))))

    mat("token_embd.weight", H, V, dense, 1.0)
    next_arch = cfg.arch == "qwen3next"
    n_blocks = cfg.n_layer + (1 if cfg.mtp else 0)
    for il in range(n_blocks):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", _norm_values(cfg, p + "attn_norm", H))
        if cfg.is_full_attn(il):
            nq = cfg.n_head * cfg.head_dim * (2 if next_arch else 1)   # qwen3next: [query | gate] per head
            mat(p + "attn_q.weight", H, nq, dense, 1 / math.sqrt(H))
            mat(p + "attn_k.weight", H, cfg.n_head_kv * cfg.head_dim, dense, 1 / math.sqrt(H))
            mat(p + "attn_v.weight", H, cfg.n_head_kv * cfg.head_dim, dense, 1 / math.sqrt(H))
            nh = cfg.n_head * cfg.head_dim
            mat(p + "attn_output.weight", nh, H, dense, res / math.sqrt(nh))
            vec(p + "attn_q_norm.weight", _norm_values(cfg, p + "attn_q_norm", cfg.head_dim))
            vec(p + "attn_k_norm.weight", _norm_values(cfg, p + "attn_k_norm", cfg.head_dim))
        else:
            _plan_deltanet(cfg, p, dense, res, specs, notes)
        if next_arch:
            vec(p + "post_attention_norm.weight", _norm_values(cfg, p + "post_attention_norm", H))
        else:
            vec(p + "ffn_norm.weight", _norm_values(cfg, p + "ffn_norm", H))
        # Router: per-expert row scales exp(skew * z) make a minority of experts win top-k most of the time.
        skew = np.exp(cfg.router_skew * _rng(cfg, p + "router_skew").standard_normal(cfg.n_expert))
        skew /= np.sqrt(np.mean(skew ** 2))
        mat(p + "ffn_gate_inp.weight", H, cfg.n_expert, router_t, 1 / math.sqrt(H), row_scale=skew)
        E, F = cfg.n_expert, cfg.n_ff_exp
        mat(p + "ffn_gate_exps.weight", H, F, experts, 1 / math.sqrt(H), n_slabs=E)
        mat(p + "ffn_up_exps.weight", H, F, experts, 1 / math.sqrt(H), n_slabs=E)
        mat(p + "ffn_down_exps.weight", F, H, experts, res / math.sqrt(F), n_slabs=E)
        if next_arch:
            # HF shared_expert_gate is [1, H]; the converter keeps it 2-D, so ne = {H, 1}
            vec(p + "ffn_gate_inp_shexp.weight", _rng(cfg, p + "shexp_gate").standard_normal(H) / math.sqrt(H),
                ne=(H, 1))
            Fs = cfg.n_ff_shexp
            mat(p + "ffn_gate_shexp.weight", H, Fs, dense, 1 / math.sqrt(H))
            mat(p + "ffn_up_shexp.weight", H, Fs, dense, 1 / math.sqrt(H))
            mat(p + "ffn_down_shexp.weight", Fs, H, dense, res / math.sqrt(Fs))
        if il == cfg.n_layer:   # MTP extras (REFERENCE §2.4)
            vec(p + "nextn.enorm.weight", _norm_values(cfg, p + "nextn.enorm", H))
            vec(p + "nextn.hnorm.weight", _norm_values(cfg, p + "nextn.hnorm", H))
            mat(p + "nextn.eh_proj.weight", 2 * H, H, dense, 1 / math.sqrt(2 * H))
            vec(p + "nextn.shared_head_norm.weight", _norm_values(cfg, p + "nextn.shared_head_norm", H))
    vec("output_norm.weight", _norm_values(cfg, "output_norm", H))
    mat("output.weight", H, V, dense, 1 / math.sqrt(H))
    return specs


def legacy_ssm_in_rows(cfg: Config) -> np.ndarray:
    """Row permutation: rows of [attn_qkv ; attn_gate] -> rows of the legacy ssm_in (grouped per key head)."""
    dk, dv, nk, r = cfg.ssm_d_k, cfg.ssm_d_v, cfg.ssm_n_k, cfg.ssm_n_v // cfg.ssm_n_k
    kd, vd = cfg.ssm_key_dim, cfg.ssm_value_dim
    z0 = cfg.ssm_conv_dim                        # z rows follow the qkv rows in the stacked matrix
    idx = []
    for g in range(nk):
        idx += range(g * dk, (g + 1) * dk)                               # q_g
        idx += range(kd + g * dk, kd + (g + 1) * dk)                     # k_g
        idx += range(2 * kd + g * r * dv, 2 * kd + (g + 1) * r * dv)     # v heads g*r .. g*r+r-1
        idx += range(z0 + g * r * dv, z0 + (g + 1) * r * dv)             # z heads g*r .. g*r+r-1
    assert len(idx) == 2 * kd + 2 * vd
    return np.array(idx)


def _plan_deltanet(cfg: Config, p: str, dense: QT, res: float, specs: list[TensorSpec], notes: list[str]):
    H, K = cfg.n_embd, cfg.ssm_conv
    if cfg.ssm_n_v % cfg.ssm_n_k:
        raise ValueError(f"ssm value heads ({cfg.ssm_n_v}) must be a multiple of key heads ({cfg.ssm_n_k})")
    cd, vd = cfg.ssm_conv_dim, cfg.ssm_value_dim
    qt = _fit_type(dense, H, p + "attn_qkv.weight", notes)
    std = 1 / math.sqrt(H)
    qkv_gen = _matrix_chunks(cfg, p + "attn_qkv.weight", H, cd, qt, std, slab_rows=1 << 30)
    z_gen = _matrix_chunks(cfg, p + "attn_gate.weight", H, vd, qt, std, slab_rows=1 << 30)
    if cfg.legacy_ssm_in:
        # Same underlying rows as the attn_qkv/attn_gate layout, gathered into the grouped order, so both
        # layouts describe one model (quant blocks run along ne0, so whole rows move unchanged).
        def gen():
            both = np.concatenate([next(qkv_gen()), next(z_gen())], axis=0)
            yield both[legacy_ssm_in_rows(cfg)]
        specs.append(TensorSpec(p + "ssm_in.weight", (H, cd + vd), qt, gen))
    else:
        specs.append(TensorSpec(p + "attn_qkv.weight", (H, cd), qt, qkv_gen))
        specs.append(TensorSpec(p + "attn_gate.weight", (H, vd), qt, z_gen))
    qt_ba = _fit_type(dense, H, p + "ssm_ba.weight", notes)
    specs.append(TensorSpec(p + "ssm_ba.weight", (H, 2 * cfg.ssm_n_v), qt_ba,
                            _matrix_chunks(cfg, p + "ssm_ba.weight", H, 2 * cfg.ssm_n_v, qt_ba, std)))
    conv = _rng(cfg, p + "ssm_conv1d").standard_normal((cd, K)) / math.sqrt(K)
    specs.append(TensorSpec(p + "ssm_conv1d.weight", (K, cd), QT.F32, _vector_chunks(conv)))
    # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]; A uniform in [1, 16] (as HF initialises)
    rng = _rng(cfg, p + "ssm_dt_a")
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), cfg.ssm_n_v))
    specs.append(TensorSpec(p + "ssm_dt.bias", (cfg.ssm_n_v,), QT.F32, _vector_chunks(dt + np.log(-np.expm1(-dt)))))
    a_log = np.log(rng.uniform(1.0, 16.0, cfg.ssm_n_v))
    specs.append(TensorSpec(p + "ssm_a", (cfg.ssm_n_v,), QT.F32, _vector_chunks(-np.exp(a_log))))
    specs.append(TensorSpec(p + "ssm_norm.weight", (cfg.ssm_d_v,), QT.F32,
                            _vector_chunks(_norm_values(cfg, p + "ssm_norm", cfg.ssm_d_v))))
    qt_o = _fit_type(dense, vd, p + "ssm_out.weight", notes)
    specs.append(TensorSpec(p + "ssm_out.weight", (vd, H), qt_o,
                            _matrix_chunks(cfg, p + "ssm_out.weight", vd, H, qt_o, res / math.sqrt(vd))))


# ----------------------------------------------------------------------------------------------------------
# Tokenizer block

SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]
CHATML_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A model reads tokens, one after another, and predicts "
    "the next one. Experts in a mixture of experts layer are chosen by a router; the router picks the top "
    "few experts for every token, and their outputs are added together with weights. def main():\n"
    "    return 0\n"
    "for i in range(10):\n    print(i)\n")


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table (REFERENCE §5.2 step 3)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def byte_vocab(n_merges: int):
    """256 byte tokens + merges learned greedily from SAMPLE_TEXT + Qwen-style special tokens."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    words = []
    for w in SAMPLE_TEXT.replace("\n", " \n ").split(" "):
        if w:
            words.append([b2u[b] for b in (" " + w).encode()])
    merges, vocab = [], set(tokens)
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in vocab:
            vocab.add(merged)
            tokens.append(merged)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [merged]
                else:
                    i += 1
    types = [1] * len(tokens)
    ids = {}
    for s, t in SPECIALS:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(t)
    return dict(tokens=tokens, types=types, merges=merges, bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"],
                pad=ids["<|endoftext|>"], template=CHATML_TEMPLATE)


def qwen3_vocab(tok_dir: Path | None = None):
    tok_dir = tok_dir or _qwen3_tokenizer_dir()
    t = json.loads((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab = dict(t["model"]["vocab"])
    types = {i: 1 for i in vocab.values()}
    for a in t["added_tokens"]:
        vocab[a["content"]] = a["id"]
        looks_special = a["content"].startswith("<|") and a["content"].endswith("|>")
        types[a["id"]] = 3 if (a["special"] or looks_special) else 4
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for s, i in vocab.items():
        tokens[i] = s
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in t["model"]["merges"]]
    return dict(tokens=tokens, types=[types[i] for i in range(n)], merges=merges, bos=vocab["<|endoftext|>"],
                eos=vocab["<|im_end|>"], pad=vocab["<|endoftext|>"], template=cfg.get("chat_template", ""))


def make_vocab(cfg: Config) -> dict:
    v = qwen3_vocab() if cfg.vocab == "qwen3" else byte_vocab(cfg.byte_merges)
    n = len(v["tokens"])
    # The released Qwen3 models pad their vocabulary to 151936 rows with [PADn] tokens.
    want = cfg.n_vocab or (max(n, 151936) if cfg.vocab == "qwen3" else n)
    if want < n:
        raise ValueError(f"--vocab-size {want} is smaller than the {cfg.vocab} tokenizer ({n} tokens)")
    for i in range(n, want):        # filler ids, as the Qwen3 files carry past the last added token
        v["tokens"].append(f"[PAD{i}]")
        v["types"].append(5)
    return v


# ----------------------------------------------------------------------------------------------------------
# Writing


def add_metadata(w: gguf.GGUFWriter, cfg: Config, vocab: dict) -> None:
    a = cfg.arch
    w.add_name(cfg.name)
    w.add_uint32("general.file_type", int(FTYPE_OF[parse_type(cfg.expert_type)]))
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{a}.context_length", cfg.n_ctx)
    w.add_uint32(f"{a}.embedding_length", cfg.n_embd)
    w.add_uint32(f"{a}.block_count", cfg.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", cfg.n_ff)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.n_ff_exp)
    w.add_uint32(f"{a}.expert_count", cfg.n_expert)
    w.add_uint32(f"{a}.expert_used_count", cfg.n_expert_used)
    w.add_uint32(f"{a}.attention.head_count", cfg.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.eps)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_base)
    if a == "qwen3next":
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg.n_ff_shexp)
        w.add_uint32(f"{a}.rope.dimension_count", cfg.rope_dim or cfg.head_dim // 4)
        w.add_uint32(f"{a}.ssm.conv_kernel", cfg.ssm_conv)
        w.add_uint32(f"{a}.ssm.state_size", cfg.ssm_d_k)
        w.add_uint32(f"{a}.ssm.group_count", cfg.ssm_n_k)
        w.add_uint32(f"{a}.ssm.time_step_rank", cfg.ssm_n_v)
        w.add_uint32(f"{a}.ssm.inner_size", cfg.ssm_value_dim)
        w.add_uint32(f"{a}.full_attention_interval", cfg.interval)
        if cfg.mtp:
            w.add_uint32(f"{a}.nextn_predict_layers", 1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", vocab["tokens"])
    w.add_array("tokenizer.ggml.token_type", vocab["types"])
    w.add_array("tokenizer.ggml.merges", vocab["merges"])
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab["bos"])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab["eos"])
    w.add_uint32("tokenizer.ggml.padding_token_id", vocab["pad"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    if vocab["template"]:
        w.add_string("tokenizer.chat_template", vocab["template"])


def validate(cfg: Config) -> None:
    if cfg.arch not in ("qwen3moe", "qwen3next"):
        raise ValueError(f"--arch {cfg.arch!r}: expected qwen3moe or qwen3next")
    if cfg.mtp and cfg.arch != "qwen3next":
        raise ValueError("--mtp is only defined for qwen3next")
    if cfg.n_head % cfg.n_head_kv:
        raise ValueError(f"--n-head {cfg.n_head} must be a multiple of --n-head-kv {cfg.n_head_kv}")
    if not 0 < cfg.n_expert_used <= cfg.n_expert:
        raise ValueError(f"--n-expert-used {cfg.n_expert_used} must be in 1..{cfg.n_expert}")
    for t in (cfg.dense_type, cfg.expert_type, cfg.router_type):
        parse_type(t)


_SPECS: list[TensorSpec] = []  # the plan being written, for worker processes (inherited by fork)


def _tensor_bytes(i: int) -> bytes:
    return b"".join(np.ascontiguousarray(c).tobytes() for c in _SPECS[i].chunks())


def write(cfg: Config, path: str | os.PathLike, verbose: bool = False, jobs: int = 1) -> list[str]:
    """Write the model; returns notes (type fallbacks). Deterministic for a given cfg: every tensor
    has its own random stream, so jobs > 1 (tensors made in worker processes) writes the same bytes."""
    validate(cfg)
    vocab = make_vocab(cfg)
    cfg = dataclasses.replace(cfg, n_vocab=len(vocab["tokens"]))
    notes: list[str] = []
    specs = plan(cfg, notes)
    w = gguf.GGUFWriter(str(path), cfg.arch)
    add_metadata(w, cfg, vocab)
    for s in specs:
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    total = sum(s.nbytes for s in specs)
    done = 0
    global _SPECS
    _SPECS = specs
    pool = None
    if jobs > 1:
        import multiprocessing
        pool = multiprocessing.get_context("fork").Pool(jobs)
        made = pool.imap(_tensor_bytes, range(len(specs)))
    for s in specs:
        w.write_padding(fout, fout.tell())
        n = 0
        for chunk in ([next(made)] if pool else s.chunks()):
            if isinstance(chunk, bytes):
                fout.write(chunk)
                n += len(chunk)
                continue
            b = np.ascontiguousarray(chunk)
            b.tofile(fout)
            n += b.nbytes
        if n != s.nbytes:
            raise AssertionError(f"{s.name}: wrote {n} bytes, expected {s.nbytes}")
        w.write_padding(fout, n)
        done += n
        if verbose:
            print(f"\r{done / 2**30:8.2f} / {total / 2**30:.2f} GiB  {s.name:40s}", end="", file=sys.stderr)
    if verbose:
        print(file=sys.stderr)
    if pool:
        pool.close()
        pool.join()
    w.close()
    return notes


# ----------------------------------------------------------------------------------------------------------
# CLI

FLAG_FIELDS = {  # flag -> Config field (ints/floats/strings are parsed by the field's type)
    "--layers": "n_layer", "--n-embd": "n_embd", "--vocab-size": "n_vocab", "--n-head": "n_head",
    "--n-head-kv": "n_head_kv", "--head-dim": "head_dim", "--n-ff": "n_ff", "--n-expert": "n_expert",
    "--n-expert-used": "n_expert_used", "--expert-ff": "n_ff_exp", "--shared-ff": "n_ff_shexp",
    "--rope-base": "rope_base", "--rope-dim": "rope_dim", "--eps": "eps", "--ctx": "n_ctx",
    "--ssm-conv": "ssm_conv", "--ssm-d-k": "ssm_d_k", "--ssm-n-k": "ssm_n_k", "--ssm-n-v": "ssm_n_v",
    "--ssm-d-v": "ssm_d_v", "--interval": "interval", "--dense-type": "dense_type",
    "--expert-type": "expert_type", "--router-type": "router_type", "--router-skew": "router_skew",
    "--residual-gain": "residual_gain",
    "--vocab": "vocab", "--byte-merges": "byte_merges", "--seed": "seed", "--arch": "arch", "--name": "name",
}


def config_from_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny-moe")
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for flag, fld in FLAG_FIELDS.items():
        t = {"int": int, "float": float, "str": str}[types[fld]]
        ap.add_argument(flag, dest=fld, type=t, default=None)
    ap.add_argument("--mtp", action="store_true", default=None, help="add an MTP layer (qwen3next)")
    ap.add_argument("--legacy-ssm-in", dest="legacy_ssm_in", action="store_true", default=None,
                    help="write the legacy fused ssm_in instead of attn_qkv + attn_gate")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="worker processes making tensors (same bytes)")
    args = ap.parse_args(argv)
    cfg = Config(**PRESETS[args.preset])
    over = {f: getattr(args, f) for f in list(FLAG_FIELDS.values()) + ["mtp", "legacy_ssm_in"]
            if getattr(args, f) is not None}
    return dataclasses.replace(cfg, **over), args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = config_from_args(argv)
        notes = write(cfg, args.out, verbose=args.verbose, jobs=max(1, args.jobs))
    except (ValueError, OSError) as e:
        print(f"synth_gguf: {e}", file=sys.stderr)
        return 1
    for n in notes:
        print(f"synth_gguf: note: {n}", file=sys.stderr)
    print(f"synth_gguf: wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
