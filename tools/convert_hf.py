#!/usr/bin/env python3
"""Hugging Face Qwen3-MoE / Qwen3-Next checkpoint -> GGUF, with llama.cpp's names and metadata.

Reads config.json, tokenizer.json, tokenizer_config.json (or chat_template.jinja) and the safetensors
shards (any count, with or without model.safetensors.index.json), and writes one GGUF:
- names, ne order, metadata keys and tensor transforms of REFERENCE.md §1.2 and §2 (qwen3next: +1 on the
  zero-centred norms, A = -exp(A_log), in_proj_qkvz split into attn_qkv + attn_gate, squeezed conv1d);
- experts accepted per expert (`mlp.experts.E.gate_proj.weight`, as on the hub) or fused
  (`mlp.experts.gate_up_proj`, as transformers 5 holds them in memory), written stacked;
- Qwen3-Next MTP weights (`mtp.*`) as block `block_count` with Strata's nextn names (REFERENCE.md §2.4);
- the byte-level BPE tokenizer (gpt2 / qwen2) and the chat template.

Tensors are read one at a time from memory-mapped shards (bf16 is widened without torch) and written as
they are produced, so a checkpoint larger than RAM converts with about one tensor (one expert slab for
stacked experts) in memory.

Types: --outtype f32|f16|bf16|q8_0 for weight matrices; 1-D tensors, conv kernels, routers and the shared-
expert gate stay f32, as llama.cpp's converter keeps them. --expert-type / --dense-type override per class;
K and IQ types (q4_K, q5_K, q6_K, iq4_xs, ...) are made by `strata quantize` from an f32/f16 intermediate.

    python3 tools/convert_hf.py MODEL_DIR OUT.gguf --outtype q8_0 [--expert-type q4_K] [--strata build/strata]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth_gguf  # noqa: E402  (metadata writer, vocabulary reader, ftype table)

PY_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
# made in C by `strata quantize` (names as the C tool spells them)
C_TYPES = {"q6_k": "q6_K", "q5_k": "q5_K", "q4_k": "q4_K", "q3_k": "q3_K", "q2_k": "q2_K", "q5_0": "q5_0",
           "q5_1": "q5_1", "q4_0": "q4_0", "q4_1": "q4_1", "iq4_nl": "iq4_nl", "iq4_xs": "iq4_xs"}


# ----------------------------------------------------------------------------------------------------------
# safetensors, read lazily without torch


class Shards:
    """Name -> lazily read float32 array over every *.safetensors file in a folder (mmap, one tensor at a time)."""

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: no *.safetensors files")
        self.where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or n > 100 << 20:
                    raise ValueError(f"{f}: bad safetensors header length {n}")
                hdr = json.loads(fh.read(n))
            base = 8 + n
            for name, info in hdr.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in self.DTYPES:
                    raise ValueError(f"{f}: tensor {name}: dtype {info['dtype']} not supported")
                if name in self.where:
                    raise ValueError(f"{f}: tensor {name} also in {self.where[name][0]}")
                a, b = info["data_offsets"]
                self.where[name] = (f, info["dtype"], info["shape"], base + a, base + b)
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> list[int]:
        return list(self.where[name][2])

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ValueError(f"checkpoint has no tensor {name}")
        f, dt, shape, a, b = self.where[name]
        mm = self._maps.get(f)
        if mm is None:
            mm = self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        raw = mm[a:b]
        if dt == "BF16":
            x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            x = raw.view(self.DTYPES[dt]).astype(np.float32)
        return x.reshape(shape)


# ----------------------------------------------------------------------------------------------------------
# Config -> synth_gguf.Config (so metadata is written by one function for synthetic and converted files)


def read_config(d: Path) -> dict:
    c = json.loads((d / "config.json").read_text())
    if "text_config" in c:               # multimodal wrappers keep the language model's config inside
        c = {**c, **c["text_config"]}
    if "num_experts" not in c and "num_local_experts" in c:   # newer transformers' name for Qwen3-MoE
        c["num_experts"] = c["num_local_experts"]
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size"):
        if k not in c:
            raise ValueError(f"{d / 'config.json'}: {k} missing")
    return c


def arch_of(c: dict) -> str:
    mt = c.get("model_type", "")
    archs = c.get("architectures") or []
    if mt == "qwen3_next" or "Qwen3NextForCausalLM" in archs:
        return "qwen3next"
    if mt == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs:
        return "qwen3moe"
    raise ValueError(f"config.json: model_type {mt!r} / architectures {archs}: only qwen3_moe and qwen3_next")


def rope_of(c: dict) -> tuple[float, float, dict | None]:
    rp = c.get("rope_parameters") or {}
    theta = rp.get("rope_theta", c.get("rope_theta", 1e6 if c.get("model_type") == "qwen3_moe" else 1e7))
    prf = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    scaling = c.get("rope_scaling")
    if scaling is None and rp.get("rope_type") not in (None, "default"):
        scaling = rp
    return float(theta), float(prf), scaling


def synth_config(c: dict, arch: str, n_vocab: int, mtp: bool, ftype_type: str, name: str) -> synth_gguf.Config:
    H = c["hidden_size"]
    n_head = c["num_attention_heads"]
    head_dim = c.get("head_dim") or H // n_head
    theta, prf, _ = rope_of(c)
    kw = dict(arch=arch, n_layer=c["num_hidden_layers"], n_embd=H, n_vocab=n_vocab, n_head=n_head,
              n_head_kv=c.get("num_key_value_heads", n_head), head_dim=head_dim,
              n_ff=c.get("intermediate_size", 0), n_expert=c["num_experts"], n_expert_used=c["num_experts_per_tok"],
              n_ff_exp=c["moe_intermediate_size"], rope_base=theta, eps=c.get("rms_norm_eps", 1e-6),
              n_ctx=c.get("max_position_embeddings", 4096), mtp=mtp, expert_type=ftype_type, name=name)
    if arch == "qwen3next":
        if not c.get("norm_topk_prob", True):
            raise ValueError("config.json: norm_topk_prob false is not what llama.cpp computes for qwen3next")
        kw.update(n_ff_shexp=c["shared_expert_intermediate_size"], rope_dim=int(head_dim * prf),
                  ssm_conv=c["linear_conv_kernel_dim"], ssm_d_k=c["linear_key_head_dim"],
                  ssm_n_k=c["linear_num_key_heads"], ssm_n_v=c["linear_num_value_heads"],
                  ssm_d_v=c["linear_value_head_dim"], interval=c.get("full_attention_interval", 4))
        lt = c.get("layer_types")
        want = ["full_attention" if (i + 1) % kw["interval"] == 0 else "linear_attention"
                for i in range(kw["n_layer"])]
        if lt is not None and list(lt) != want:
            raise ValueError("config.json: layer_types differ from every full_attention_interval-th layer; "
                             "llama.cpp's qwen3next cannot express that")
        for k in ("decoder_sparse_step",):
            if c.get(k, 1) != 1 or c.get("mlp_only_layers"):
                raise ValueError("config.json: dense (non-MoE) layers are not supported for qwen3next")
    return synth_gguf.Config(**kw)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def read_vocab(d: Path, c: dict, n_vocab: int) -> dict:
    if not (d / "tokenizer.json").exists():
        raise ValueError(f"{d}: tokenizer.json missing")
    t = json.loads((d / "tokenizer.json").read_text())
    if t.get("model", {}).get("type") != "BPE":
        raise ValueError(f"{d}/tokenizer.json: model type {t.get('model', {}).get('type')}, expected BPE")
    v = synth_gguf.qwen3_vocab(d)             # tokens, types (CONTROL / USER_DEFINED), merges, template
    tc = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
    ids = {s: i for i, s in enumerate(v["tokens"])}

    def tok_id(x):
        if isinstance(x, dict):
            x = x.get("content")
        return ids.get(x) if isinstance(x, str) else None

    eos = tok_id(tc.get("eos_token"))
    if eos is None:
        eos = c.get("eos_token_id") if isinstance(c.get("eos_token_id"), int) else v["eos"]
    bos = c.get("bos_token_id") if isinstance(c.get("bos_token_id"), int) else tok_id(tc.get("bos_token"))
    pad = tok_id(tc.get("pad_token"))
    v.update(bos=v["bos"] if bos is None else bos, eos=eos, pad=bos if pad is None else pad)
    tmpl = tc.get("chat_template")
    if (d / "chat_template.jinja").exists():
        tmpl = (d / "chat_template.jinja").read_text()
    if isinstance(tmpl, list):              # [{"name": "default", "template": ...}, ...]
        tmpl = next((x["template"] for x in tmpl if x.get("name") == "default"), tmpl[0]["template"])
    v["template"] = tmpl or ""
    n = len(v["tokens"])
    if n > n_vocab:
        raise ValueError(f"tokenizer has {n} tokens but the embedding has only {n_vocab} rows")
    for i in range(n, n_vocab):             # filler ids up to the embedding size, as Qwen's own files
        v["tokens"].append(f"[PAD{i}]")
        v["types"].append(5)
    return v


# ----------------------------------------------------------------------------------------------------------
# Tensor plan


@dataclass
class Out:
    name: str
    ne: tuple[int, ...]           # ggml order
    kind: str                     # "keep32" | "dense" | "experts"
    slabs: Callable[[], Iterator[np.ndarray]]   # float32 row blocks in file order


class Planner:
    def __init__(self, sh: Shards, c: dict, arch: str, legacy_ssm_in: bool = False):
        self.sh, self.c, self.arch, self.legacy = sh, c, arch, legacy_ssm_in
        self.nxt = arch == "qwen3next"
        self.outs: list[Out] = []

    # -- helpers
    def add(self, name, shape_pt, kind, fn):
        self.outs.append(Out(name, tuple(reversed(shape_pt)), kind, fn))

    def plain(self, gg, hf, kind="dense", plus1=False):
        sh = self.sh
        shape = sh.shape(hf)

        def fn():
            x = sh.get(hf)
            yield x + 1 if plus1 else x
        self.add(gg, shape, "keep32" if len(shape) == 1 else kind, fn)

    def norm(self, gg, hf):
        self.plain(gg, hf, plus1=self.nxt)

    def layer(self, src: str, il: int, full: bool):
        d = f"blk.{il}."
        sh, c = self.sh, self.c
        self.norm(d + "attn_norm.weight", src + "input_layernorm.weight")
        self.norm(d + ("post_attention_norm.weight" if self.nxt else "ffn_norm.weight"),
                  src + "post_attention_layernorm.weight")
        if full:
            a = src + "self_attn."
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
                self.plain(d + gg + ".weight", a + hf + ".weight")
            self.norm(d + "attn_q_norm.weight", a + "q_norm.weight")
            self.norm(d + "attn_k_norm.weight", a + "k_norm.weight")
        else:
            self.deltanet(src + "linear_attn.", d)
        self.moe(src + "mlp.", d)

    def deltanet(self, la: str, d: str):
        sh, c = self.sh, self.c
        nk, dk, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
        nv = c["linear_num_value_heads"]
        if nv % nk:
            raise ValueError(f"config.json: linear_num_value_heads {nv} not a multiple of linear_num_key_heads {nk}")
        r = nv // nk
        H = c["hidden_size"]
        hf = la + "in_proj_qkvz.weight"
        want = [2 * nk * dk + 2 * nv * dv, H]
        if sh.shape(hf) != want:
            raise ValueError(f"{hf}: shape {sh.shape(hf)}, expected {want}")

        if self.legacy:                      # older llama.cpp files: the raw grouped projection (tests only)
            self.plain(d + "ssm_in.weight", hf)
        else:
            self.add(d + "attn_qkv.weight", [2 * nk * dk + nv * dv, H], "dense", self._qkv(hf, nk, dk, r, dv, H))
            self.add(d + "attn_gate.weight", [nv * dv, H], "dense", self._z(hf, nk, dk, r, dv, H))
        self._deltanet_rest(la, d)

    def _groups(self, hf, nk, dk, r, dv, H):
        g = self.sh.get(hf).reshape(nk, 2 * dk + 2 * r * dv, H)        # grouped per key head (REFERENCE §2.2)
        return g[:, :dk], g[:, dk:2 * dk], g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]

    def _qkv(self, hf, nk, dk, r, dv, H):
        def fn():
            q, k, v, _ = self._groups(hf, nk, dk, r, dv, H)
            yield np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
        return fn

    def _z(self, hf, nk, dk, r, dv, H):
        def fn():
            yield np.ascontiguousarray(self._groups(hf, nk, dk, r, dv, H)[3].reshape(-1, H))
        return fn

    def _deltanet_rest(self, la: str, d: str):
        sh = self.sh
        self.plain(d + "ssm_ba.weight", la + "in_proj_ba.weight")
        cw = la + "conv1d.weight"
        cs = sh.shape(cw)                                           # [conv_dim, 1, K]

        def conv():
            yield sh.get(cw).reshape(cs[0], cs[-1])
        self.add(d + "ssm_conv1d.weight", [cs[0], cs[-1]], "keep32", conv)
        self.plain(d + "ssm_dt.bias", la + "dt_bias")

        def a():
            yield -np.exp(sh.get(la + "A_log"))
        self.add(d + "ssm_a", sh.shape(la + "A_log"), "keep32", a)
        self.plain(d + "ssm_norm.weight", la + "norm.weight")      # gated norm: not zero-centred
        self.plain(d + "ssm_out.weight", la + "out_proj.weight")

    def moe(self, m: str, d: str):
        sh, c = self.sh, self.c
        E, Fe, H = c["num_experts"], c["moe_intermediate_size"], c["hidden_size"]
        self.plain(d + "ffn_gate_inp.weight", m + "gate.weight", kind="keep32")
        fused = m + "experts.gate_up_proj" in sh
        if fused:
            gu, dn = m + "experts.gate_up_proj", m + "experts.down_proj"
            if sh.shape(gu) != [E, 2 * Fe, H] or sh.shape(dn) != [E, H, Fe]:
                raise ValueError(f"{gu}/{dn}: shapes {sh.shape(gu)} / {sh.shape(dn)}, expected "
                                 f"[{E}, {2 * Fe}, {H}] / [{E}, {H}, {Fe}]")

            def part(lo):
                def fn():
                    x = sh.get(gu)
                    for e in range(E):
                        yield x[e, lo:lo + Fe]
                return fn

            def down():
                x = sh.get(dn)
                for e in range(E):
                    yield x[e]
            self.add(d + "ffn_gate_exps.weight", [E, Fe, H], "experts", part(0))
            self.add(d + "ffn_up_exps.weight", [E, Fe, H], "experts", part(Fe))
            self.add(d + "ffn_down_exps.weight", [E, H, Fe], "experts", down)
        else:
            for hf, gg, shape in (("gate_proj", "ffn_gate_exps", [Fe, H]), ("up_proj", "ffn_up_exps", [Fe, H]),
                                  ("down_proj", "ffn_down_exps", [H, Fe])):
                names = [f"{m}experts.{e}.{hf}.weight" for e in range(E)]
                for n in names:
                    if n not in sh:
                        raise ValueError(f"checkpoint has neither {m}experts.gate_up_proj nor {n}")
                    if sh.shape(n) != shape:
                        raise ValueError(f"{n}: shape {sh.shape(n)}, expected {shape}")

                def fn(names=names):
                    for n in names:
                        yield sh.get(n)
                self.add(d + gg + ".weight", [E] + shape, "experts", fn)
        if self.nxt:
            g = m + "shared_expert_gate.weight"                      # [1, H] -> ne {H, 1}
            self.plain(d + "ffn_gate_inp_shexp.weight", g, kind="keep32")
            for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                           ("down_proj", "ffn_down_shexp")):
                self.plain(d + gg + ".weight", m + "shared_expert." + hf + ".weight")

    def build(self, mtp: bool) -> list[Out]:
        c, L = self.c, self.c["num_hidden_layers"]
        self.plain("token_embd.weight", "model.embed_tokens.weight")
        interval = c.get("full_attention_interval", 4)
        for il in range(L):
            self.layer(f"model.layers.{il}.", il, not self.nxt or (il + 1) % interval == 0)
        if mtp:                                                      # REFERENCE §2.4
            self.layer("mtp.layers.0.", L, True)
            d = f"blk.{L}.nextn."
            self.norm(d + "enorm.weight", "mtp.pre_fc_norm_embedding.weight")
            self.norm(d + "hnorm.weight", "mtp.pre_fc_norm_hidden.weight")
            self.plain(d + "eh_proj.weight", "mtp.fc.weight")
            self.norm(d + "shared_head_norm.weight", "mtp.norm.weight")
        self.norm("output_norm.weight", "model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in self.sh else "model.embed_tokens.weight"
        self.plain("output.weight", head)
        return self.outs


# ----------------------------------------------------------------------------------------------------------
# Writing


def fit(qt: QT, ne0: int) -> QT:
    bs = GGML_QUANT_SIZES[qt][0]
    if ne0 % bs == 0:
        return qt
    return QT.F16 if qt in (QT.Q8_0,) else QT.F32


def encode(x: np.ndarray, qt: QT) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qt == QT.F32:
        return x
    if qt == QT.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x, qt)


def nbytes(ne, qt: QT) -> int:
    bs, ts = GGML_QUANT_SIZES[qt]
    n = ne[0] // bs * ts
    for d in ne[1:]:
        n *= d
    return n


def write_gguf(path: Path, scfg: synth_gguf.Config, vocab: dict, outs: list[Out], dense: QT, experts: QT,
               rope_scaling: dict | None, verbose: bool) -> None:
    w = gguf.GGUFWriter(str(path), scfg.arch)
    synth_gguf.add_metadata(w, scfg, vocab)
    a = scfg.arch
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", float(rope_scaling["factor"]))
        w.add_uint32(f"{a}.rope.scaling.original_context_length",
                     int(rope_scaling["original_max_position_embeddings"]))
    elif rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise ValueError(f"config.json: rope scaling {rope_scaling} not supported")
    types = []
    for o in outs:
        qt = QT.F32 if o.kind == "keep32" else fit(experts if o.kind == "experts" else dense, o.ne[0])
        types.append(qt)
        w.add_tensor_info(o.name, tuple(reversed(o.ne)), np.dtype(np.float32), nbytes(o.ne, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    total = sum(nbytes(o.ne, t) for o, t in zip(outs, types))
    done = 0
    for o, qt in zip(outs, types):
        w.write_padding(fout, fout.tell())
        n = 0
        for slab in o.slabs():
            b = encode(slab, qt)
            b.tofile(fout)
            n += b.nbytes
        if n != nbytes(o.ne, qt):
            raise AssertionError(f"{o.name}: wrote {n} bytes, expected {nbytes(o.ne, qt)}")
        w.write_padding(fout, n)
        done += n
        if verbose:
            print(f"\r{done / 2**20:10.1f} / {total / 2**20:.1f} MiB  {o.name:40s}", end="", file=sys.stderr)
    if verbose:
        print(file=sys.stderr)
    w.close()


def find_strata(given: str | None) -> str:
    cands = [given, os.environ.get("STRATA_BIN"), str(Path(__file__).resolve().parent.parent / "build" / "strata"),
             shutil.which("strata")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    raise ValueError("K/IQ types are made by `strata quantize`: build it or pass --strata PATH")


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32",
            expert_type: str | None = None, dense_type: str | None = None, strata: str | None = None,
            name: str | None = None, mtp: str = "auto", verbose: bool = False, legacy_ssm_in: bool = False) -> dict:
    """Convert; returns a summary dict. mtp: auto (if mtp.* weights exist) | yes | no. legacy_ssm_in: write
    qwen3next's older fused ssm_in instead of attn_qkv + attn_gate (for tests of readers)."""
    d, out = Path(model_dir), Path(out)
    c = read_config(d)
    arch = arch_of(c)
    sh = Shards(d)
    has_mtp = any(n.startswith("mtp.") for n in sh.names())
    if mtp == "yes" and not has_mtp:
        raise ValueError(f"{d}: --mtp yes but the checkpoint has no mtp.* weights")
    if has_mtp and arch != "qwen3next":
        raise ValueError(f"{d}: mtp.* weights are only understood for qwen3next")
    use_mtp = has_mtp and mtp != "no"
    n_vocab = sh.shape("model.embed_tokens.weight")[0]
    req = {k: (v or outtype).lower() for k, v in (("dense", dense_type), ("experts", expert_type))}
    for k, v in req.items():
        if v not in PY_TYPES and v not in C_TYPES:
            raise ValueError(f"--{k} type {v!r}: choose from {', '.join(list(PY_TYPES) + list(C_TYPES))}")
    need_c = [v for v in req.values() if v in C_TYPES]
    # pass 1 types: the Python-made types, or f16 intermediates for what C will quantize
    first = {k: PY_TYPES.get(v, QT.F16) for k, v in req.items()}
    ft = req["experts"] if req["experts"] in PY_TYPES else "f16"
    scfg = synth_config(c, arch, n_vocab, use_mtp, ft if ft in PY_TYPES else "f16", name or d.name)
    vocab = read_vocab(d, c, n_vocab)
    outs = Planner(sh, c, arch, legacy_ssm_in).build(use_mtp)
    _, _, scaling = rope_of(c)
    if not need_c:
        write_gguf(out, scfg, vocab, outs, first["dense"], first["experts"], scaling, verbose)
    else:
        exe = find_strata(strata)
        with tempfile.TemporaryDirectory(dir=out.parent) as td:
            tmp = Path(td) / "f16.gguf"
            write_gguf(tmp, scfg, vocab, outs, first["dense"], first["experts"], scaling, verbose)
            cmd = [exe, "quantize", str(tmp), str(out), "--type", C_TYPES.get(req["dense"], req["dense"]),
                   "--experts", C_TYPES.get(req["experts"], req["experts"]),
                   "--dense", C_TYPES.get(req["dense"], req["dense"])]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise ValueError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return dict(arch=arch, mtp=use_mtp, tensors=len(outs), vocab=n_vocab, bytes=out.stat().st_size,
                dense=req["dense"], experts=req["experts"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", default="f16", help="f32, f16, bf16, q8_0 (or a K/IQ type via strata quantize)")
    ap.add_argument("--expert-type", help="type of the routed experts (default: --outtype), e.g. q4_K, iq4_xs")
    ap.add_argument("--dense-type", help="type of the other weight matrices (default: --outtype)")
    ap.add_argument("--mtp", choices=["auto", "yes", "no"], default="auto", help="write the mtp.* layer")
    ap.add_argument("--strata", help="strata binary for K/IQ types (default: $STRATA_BIN, build/strata, PATH)")
    ap.add_argument("--name", help="general.name (default: the folder's name)")
    ap.add_argument("--legacy-ssm-in", action="store_true", help="qwen3next: write the older fused ssm_in")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    try:
        s = convert(a.model_dir, a.out, a.outtype, a.expert_type, a.dense_type, a.strata, a.name, a.mtp, a.verbose,
                    a.legacy_ssm_in)
    except (ValueError, OSError, KeyError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 1
    print(f"convert_hf: wrote {a.out}: {s['arch']}, {s['tensors']} tensors, vocab {s['vocab']}, "
          f"MTP {'yes' if s['mtp'] else 'no'}, dense {s['dense']}, experts {s['experts']}, "
          f"{s['bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
