#!/usr/bin/env python3
"""Validate tests/reference against Hugging Face transformers on tiny random models.

Builds Qwen3MoeForCausalLM / Qwen3NextForCausalLM with random weights, converts them to GGUF with
tools/convert_hf.py (REFERENCE.md §2: names, ne order, +1 norms, -exp(A_log), qkvz split, ...), runs the
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
import convert_hf  # noqa: E402
import train_tiny  # noqa: E402  (its tokenizer trainer gives the checkpoints a real tokenizer.json)

VOCAB = 400
TOKENIZER_TEXT = "def f(x):\n    return x + 1\n\nfor i in range(3):\n    print(f(i))\n" * 8


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
# HF -> GGUF through tools/convert_hf.py (the project's converter; REFERENCE.md §1.2, §2)


def convert(sd: dict, cfg, arch: str, path: Path, legacy_ssm_in=False, mtp: dict | None = None):
    """sd: transformers state_dict (in-memory names; experts fused). mtp: HF mtp.* tensors without prefix.
    Saved as a Hugging Face checkpoint beside path (config.json, safetensors, a small BPE tokenizer), then
    converted to an f32 GGUF by convert_hf."""
    from safetensors.torch import save_file
    d = Path(path).with_suffix(".hf")
    d.mkdir(exist_ok=True)
    cfg.to_json_file(str(d / "config.json"))
    tensors = {k: v.detach().contiguous() for k, v in sd.items()}
    tensors.update({"mtp." + k: v.detach().contiguous() for k, v in (mtp or {}).items()})
    save_file(tensors, str(d / "model.safetensors"))
    train_tiny.train_tokenizer([TOKENIZER_TEXT], min(VOCAB, 300), d)
    convert_hf.convert(d, path, "f32", legacy_ssm_in=legacy_ssm_in)


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
`Qwen3NextForCausalLM` on tiny random models, converted to GGUF by `tools/convert_hf.py`
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
