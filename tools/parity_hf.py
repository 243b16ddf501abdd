#!/usr/bin/env python3
"""Validate tests/reference against Hugging Face transformers on tiny random models.

Builds Qwen3MoeForCausalLM / Qwen3NextForCausalLM with random weights, converts them to GGUF with this
file's own writer (REFERENCE.md §2: names, ne order, +1 norms, -exp(A_log), qkvz split, ...), runs the
numpy reference on the GGUF and compares logits with transformers (prompt and step-by-step with cache).
The Qwen3-Next MTP step (not in transformers) is checked against a composite built from transformers'
own modules (Qwen3NextRMSNorm, Qwen3NextDecoderLayer) wired as vLLM wires it.

Needs torch + transformers (not part of tools/requirements.txt), e.g. a venv under /tmp:
    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers gguf numpy
    /tmp/hf/bin/python tools/parity_hf.py [--report bench/results/....md]
"""
from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import gguf
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from tests.reference.model import Model  # noqa: E402
import synth_gguf  # noqa: E402  (only for its byte-level tokenizer block)

VOCAB = 400


# ----------------------------------------------------------------------------------------------------------
# Tiny HF models with weights that exercise everything (HF's init leaves norms at 1 and weights tiny)


def moe_config(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
             tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    c.update(kw)
    cfg = Qwen3MoeConfig(**c)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    return cfg


def next_config(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
             linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
             num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=4096, full_attention_interval=4,
             tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    c.update(kw)
    cfg = Qwen3NextConfig(**c)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    return cfg


def reinit(module: torch.nn.Module, zero_centred: bool, n_layer: int, seed: int):
    """Random weights at O(1)-preserving scales. zero_centred: Qwen3-Next norms hold w with y = x̂(1+w)."""
    g = torch.Generator().manual_seed(seed)
    res = 1 / math.sqrt(2 * n_layer)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    with torch.no_grad():
        for name, p in module.named_parameters():
            s = p.shape
            if name.endswith("linear_attn.norm.weight"):
                v = 1 + 0.1 * rn(*s)
            elif "norm" in name:
                v = 0.1 * rn(*s) + (0 if zero_centred else 1)
            elif name.endswith("A_log"):
                v = torch.log(1 + 15 * torch.rand(*s, generator=g, dtype=torch.float64))
            elif name.endswith("dt_bias"):
                dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(*s, generator=g,
                                                                                           dtype=torch.float64))
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("conv1d.weight"):
                v = rn(*s) / math.sqrt(s[-1])
            elif name.endswith("embed_tokens.weight"):
                v = rn(*s)
            elif name.endswith("experts.gate_up_proj"):
                v = rn(*s) / math.sqrt(s[-1])
            elif name.endswith("experts.down_proj"):
                v = rn(*s) * res / math.sqrt(s[-1])
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                v = rn(*s) * res / math.sqrt(s[-1])
            elif p.dim() == 2:
                v = rn(*s) / math.sqrt(s[-1])
            else:
                raise ValueError(f"reinit: no rule for {name} {tuple(s)}")
            p.copy_(v.to(p.dtype))


# ----------------------------------------------------------------------------------------------------------
# Our own HF -> GGUF writer (REFERENCE.md §1.2, §2)


def _np(t):
    return t.detach().to(torch.float32).cpu().numpy()


def convert(sd: dict, cfg, arch: str, path: Path, legacy_ssm_in=False, mtp: dict | None = None):
    """sd: transformers state_dict (in-memory names; experts fused). mtp: HF mtp.* tensors without prefix."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    nxt = arch == "qwen3next"
    out: dict[str, np.ndarray] = {}
    norm = (lambda t: _np(t) + 1) if nxt else _np    # the converter adds 1 to zero-centred norms

    out["token_embd.weight"] = _np(sd["model.embed_tokens.weight"])
    out["output_norm.weight"] = norm(sd["model.norm.weight"])
    out["output.weight"] = _np(sd["lm_head.weight"])

    def layer(src: str, il: int, full_attn: bool):
        d = f"blk.{il}."
        out[d + "attn_norm.weight"] = norm(sd[src + "input_layernorm.weight"])
        out[d + ("post_attention_norm.weight" if nxt else "ffn_norm.weight")] = \
            norm(sd[src + "post_attention_layernorm.weight"])
        if full_attn:
            a = src + "self_attn."
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
                out[d + gg + ".weight"] = _np(sd[a + hf + ".weight"])
            out[d + "attn_q_norm.weight"] = norm(sd[a + "q_norm.weight"])
            out[d + "attn_k_norm.weight"] = norm(sd[a + "k_norm.weight"])
        else:
            la = src + "linear_attn."
            qkvz = _np(sd[la + "in_proj_qkvz.weight"])                     # [rows grouped per key head, H]
            if legacy_ssm_in:
                out[d + "ssm_in.weight"] = qkvz
            else:
                nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
                r = cfg.linear_num_value_heads // nk
                grp = qkvz.reshape(nk, 2 * dk + 2 * r * dv, H)
                q, k = grp[:, :dk], grp[:, dk:2 * dk]
                v, z = grp[:, 2 * dk:2 * dk + r * dv], grp[:, 2 * dk + r * dv:]
                out[d + "attn_qkv.weight"] = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
                out[d + "attn_gate.weight"] = z.reshape(-1, H)
            out[d + "ssm_ba.weight"] = _np(sd[la + "in_proj_ba.weight"])
            out[d + "ssm_conv1d.weight"] = _np(sd[la + "conv1d.weight"]).squeeze(1)   # [conv_dim, K]
            out[d + "ssm_dt.bias"] = _np(sd[la + "dt_bias"])
            out[d + "ssm_a"] = -np.exp(_np(sd[la + "A_log"]))
            out[d + "ssm_norm.weight"] = _np(sd[la + "norm.weight"])                   # not +1
            out[d + "ssm_out.weight"] = _np(sd[la + "out_proj.weight"])
        m = src + "mlp."
        out[d + "ffn_gate_inp.weight"] = _np(sd[m + "gate.weight"])
        gu = _np(sd[m + "experts.gate_up_proj"])                                       # [E, 2F, H]
        F = gu.shape[1] // 2
        out[d + "ffn_gate_exps.weight"] = np.ascontiguousarray(gu[:, :F])
        out[d + "ffn_up_exps.weight"] = np.ascontiguousarray(gu[:, F:])
        out[d + "ffn_down_exps.weight"] = _np(sd[m + "experts.down_proj"])             # [E, H, F]
        if nxt:
            out[d + "ffn_gate_inp_shexp.weight"] = _np(sd[m + "shared_expert_gate.weight"])   # [1, H]
            for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                           ("down_proj", "ffn_down_shexp")):
                out[d + gg + ".weight"] = _np(sd[m + "shared_expert." + hf + ".weight"])

    for il in range(L):
        full = (not nxt) or cfg.layer_types[il] == "full_attention"
        layer(f"model.layers.{il}.", il, full)
    if mtp is not None:                  # REFERENCE §2.4
        msd = {**sd, **{"mtp." + k: v for k, v in mtp.items()}}
        sd = msd
        layer("mtp.layers.0.", L, True)
        d = f"blk.{L}.nextn."
        out[d + "enorm.weight"] = norm(sd["mtp.pre_fc_norm_embedding.weight"])
        out[d + "hnorm.weight"] = norm(sd["mtp.pre_fc_norm_hidden.weight"])
        out[d + "eh_proj.weight"] = _np(sd["mtp.fc.weight"])
        out[d + "shared_head_norm.weight"] = norm(sd["mtp.norm.weight"])

    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.ALL_F32))
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", H)
    w.add_uint32(f"{a}.block_count", L)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_uint32(f"{a}.expert_count", cfg.num_experts)
    w.add_uint32(f"{a}.expert_used_count", cfg.num_experts_per_tok)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    if nxt:
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
        w.add_uint32(f"{a}.rope.dimension_count",
                     int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
        w.add_uint32(f"{a}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
        w.add_uint32(f"{a}.ssm.state_size", cfg.linear_key_head_dim)
        w.add_uint32(f"{a}.ssm.group_count", cfg.linear_num_key_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", cfg.linear_num_value_heads)
        w.add_uint32(f"{a}.ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_uint32(f"{a}.full_attention_interval", 4)
        if mtp is not None:
            w.add_uint32(f"{a}.nextn_predict_layers", 1)
    voc = synth_gguf.make_vocab(synth_gguf.Config(n_vocab=cfg.vocab_size))
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", voc["tokens"])
    w.add_array("tokenizer.ggml.token_type", voc["types"])
    w.add_array("tokenizer.ggml.merges", voc["merges"])
    for name, arr in out.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------------------------
# HF side


def hf_prompt_logits(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False, output_hidden_states=True)
    return out.logits[0].double().numpy(), out.hidden_states[-1][0]


def hf_step_logits(model, tokens):
    rows, cache = [], None
    with torch.no_grad():
        for t in tokens:
            out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].double().numpy())
    return np.stack(rows)


class HFMtp(torch.nn.Module):
    """vLLM's Qwen3-Next MTP step assembled from transformers modules (transformers itself has no MTP)."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg.hidden_size
        full_idx = cfg.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.layers = torch.nn.ModuleList([hfnext.Qwen3NextDecoderLayer(cfg, full_idx)])
        self.norm = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, model, hidden, next_tokens, positions):
        with torch.no_grad():
            e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_tokens))
            h = self.pre_fc_norm_hidden(hidden)
            u = self.fc(torch.cat([e, h], dim=-1))[None]
            pe = model.model.rotary_emb(u, positions[None])
            T = u.shape[1]
            mask = torch.full((T, T), float("-inf"), dtype=u.dtype).triu(1)[None, None]
            u = self.layers[0](u, position_embeddings=pe, attention_mask=mask, position_ids=positions[None])
            out = self.norm(u)[0]
            return model.lm_head(out).double().numpy()


# ----------------------------------------------------------------------------------------------------------


def max_rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_case(name, arch, cfg, tokens, seed, dtype, tmp: Path, legacy=False, with_mtp=False):
    torch.manual_seed(seed)
    model = (Qwen3NextForCausalLM if arch == "qwen3next" else Qwen3MoeForCausalLM)(cfg).eval()
    reinit(model, arch == "qwen3next", cfg.num_hidden_layers, seed)
    mtp = None
    if with_mtp:
        mtp = HFMtp(cfg).eval()
        reinit(mtp, True, cfg.num_hidden_layers, seed + 1)
    model = model.to(dtype)
    path = tmp / f"{name}.gguf"
    convert(model.state_dict(), cfg, arch, path, legacy_ssm_in=legacy,
            mtp=None if mtp is None else mtp.state_dict())
    hf_logits, hf_hidden = hf_prompt_logits(model, tokens)
    hf_step = hf_step_logits(model, tokens)
    ref = Model(path)
    cache = ref.new_cache()
    ref_logits, ref_hidden = ref.forward(tokens, cache, return_hidden=True)
    res = dict(name=name, arch=arch, dtype=str(dtype).replace("torch.", ""), T=len(tokens),
               prompt=float(np.abs(ref_logits - hf_logits).max()), prompt_rel=max_rel(ref_logits, hf_logits),
               step=float(np.abs(ref_logits - hf_step).max()), scale=float(np.abs(hf_logits).max()),
               argmax=float(np.mean(ref_logits.argmax(-1) == hf_logits.argmax(-1))))
    if mtp is not None:
        mtp = mtp.to(dtype)
        pos = torch.arange(1, len(tokens))            # row i drafts token i+2 at position i+1
        hf_d = mtp(model, hf_hidden[:-1], torch.tensor(tokens[1:]), pos)
        ref_d, _ = ref.mtp(ref_hidden[:-1], tokens[1:], ref.new_cache(), pos=np.arange(1, len(tokens)))
        res["mtp"] = float(np.abs(ref_d - hf_d).max())
        res["mtp_scale"] = float(np.abs(hf_d).max())
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100, help="prompt length (>64 exercises two DeltaNet chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", help="write a markdown table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    tokens = [int(t) for t in rng.integers(0, VOCAB, args.tokens)]
    cases = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for dtype in (torch.float64, torch.float32):
            tag = "f64" if dtype == torch.float64 else "f32"
            cases.append(run_case(f"moe-{tag}", "qwen3moe", moe_config(), tokens, args.seed, dtype, tmp))
            cases.append(run_case(f"next-{tag}", "qwen3next", next_config(), tokens, args.seed, dtype, tmp,
                                  with_mtp=True))
            cases.append(run_case(f"next-legacy-{tag}", "qwen3next", next_config(), tokens, args.seed, dtype, tmp,
                                  legacy=True))
            cases.append(run_case(f"next-8L-{tag}", "qwen3next", next_config(num_hidden_layers=8), tokens,
                                  args.seed + 7, dtype, tmp))
    hdr = ("| case | arch | HF dtype | T | max abs diff, prompt | rel. to max logit | max abs diff, HF step-by-step"
           " | max abs diff, MTP draft | argmax agree | max logit |")
    lines = [hdr, "|" + "---|" * 10]
    for c in cases:
        mtp = f"{c['mtp']:.2e}" if "mtp" in c else "-"
        lines.append(f"| {c['name']} | {c['arch']} | {c['dtype']} | {c['T']} | {c['prompt']:.2e} | "
                     f"{c['prompt_rel']:.1e} | {c['step']:.2e} | {mtp} | {100 * c['argmax']:.0f}% | "
                     f"{c['scale']:.2f} |")
    table = "\n".join(lines)
    print(table)
    print(f"({time.time() - t0:.1f} s)")
    if args.report:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        Path(args.report).write_text(REPORT.format(
            table=table, torch=torch.__version__, tf=transformers.__version__, gguf=gguf.__version__
            if hasattr(gguf, "__version__") else "?", np=np.__version__, host=platform.processor() or
            platform.machine(), commit=commit, T=args.tokens, seed=args.seed))
    worst = max(c["prompt"] for c in cases if c["dtype"] == "float64")
    return 0 if worst < 1e-4 else 1


REPORT = """# Reference forward vs Hugging Face transformers (2026-11-29)

What: `tests/reference/model.py` (numpy, float64) against transformers' `Qwen3MoeForCausalLM` and
`Qwen3NextForCausalLM` on tiny random models, converted to GGUF by `tools/parity_hf.py`'s own writer
(REFERENCE.md §2). Logits for a {T}-token random prompt (seed {seed}); "prompt" is the reference's
full-prompt forward (chunked DeltaNet) vs HF's full-prompt forward; "HF step-by-step" compares the same
reference logits with HF decoding one token at a time through its cache (recurrent DeltaNet path in HF).
The MTP row compares the reference's MTP step with vLLM's Qwen3-Next MTP module assembled from
transformers' own `Qwen3NextRMSNorm` / `Qwen3NextDecoderLayer` (transformers has no MTP).

Command: `/tmp/pyref-venv/bin/python tools/parity_hf.py --report bench/results/2026-11-29-reference-parity.md`
Machine: {host}, CPU only. torch {torch}, transformers {tf}, numpy {np}. Commit {commit}.

Models: qwen3moe: hidden 64, 3 layers, 4/2 heads of 16, 8 experts top-3 (F_e 32).
qwen3next: hidden 64, 4 layers (8 for the "8L" case), 4/2 heads of 32 (rotary 8 of 32), DeltaNet 2 key heads
of 16 / 4 value heads of 24, conv 4, 8 experts top-3 (F_e 32), shared expert 48.
Weights: normal, std 1/sqrt(fan_in) (residual outputs / sqrt(2L)), norms 1 + 0.1·N (Qwen3-Next: w = 0.1·N
stored as 1 + w), A = U(1,16), dt log-uniform [1e-3, 0.1].

{table}

Notes:
- HF computes norms, the router softmax and the DeltaNet kernels in float32 even when the model is float64,
  so the float64 rows are limited by those float32 islands (~1e-6 relative), not by the reference.
- The float32 rows are what a float32 implementation should expect against the float64 reference.
"""

if __name__ == "__main__":
    sys.exit(main())
