#!/usr/bin/env python3
"""Train tiny-coder: a small Qwen3-Next (Gated DeltaNet + gated attention 3:1, routed experts with a shared
expert, one MTP layer) on the Python source found on the machine, and evaluate it.

Stages (one command, seeded): find .py files (stdlib + site-packages), deduplicate by content, split
train/validation by file -> byte-level BPE with the Qwen2 pre-tokenizer regex and ChatML specials ->
transformers' Qwen3NextForCausalLM + an MTP module with Qwen3-Next's mtp.* structure and names, trained
jointly (next token + token t+2) in bf16 autocast under a wall-clock budget -> evaluation on held-out
files (windowed perplexity as `strata perplexity` computes it, MTP draft agreement with the main model's
greedy next-next token, ast-parse share of greedy continuations of function headers, expert routing
counts) -> a Hugging Face style checkpoint (config.json, tokenizer files, sharded safetensors with
per-expert names and mtp.* weights) that tools/convert_hf.py turns into GGUF.

H200 run (docs/TINY_CODER.md):  python3 tools/train_tiny.py --preset h200 --out /tmp/tc --budget-s 540
CPU smoke test:                 python3 tools/train_tiny.py --preset smoke --out /tmp/tcs
Re-evaluate a checkpoint here:  python3 tools/train_tiny.py --eval-only DIR/hf --out DIR [--device cpu]
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import math
import os
import random
import struct
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import transformers
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

PRESETS = {
    # ~27M parameters (bf16 checkpoint ~55 MB; Q8_0 GGUF ~29 MB). Real-model proportions (shared expert as
    # wide as one routed expert, 2x-wide attention and DeltaNet values, 3:1 layers); experts a bit wider than hidden/4.
    "h200": dict(vocab=8192, hidden=256, layers=8, heads=8, kv_heads=2, head_dim=64, lin_k_heads=4,
                 lin_v_heads=8, lin_dim=64, experts=32, top_k=4, expert_ff=80, shared_ff=80,
                 seq=1024, batch=32, lr=2e-3, warmup=150, tok_sample_mb=32, max_data_mb=260,
                 val_files=300, eval_headers=200, gen_tokens=128, ppl_bytes=160_000, mtp_eval_seqs=64),
    "smoke": dict(vocab=600, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, lin_k_heads=2,
                  lin_v_heads=4, lin_dim=16, experts=8, top_k=2, expert_ff=32, shared_ff=32,
                  seq=128, batch=4, lr=3e-3, warmup=5, tok_sample_mb=1, max_data_mb=2,
                  val_files=8, eval_headers=6, gen_tokens=24, ppl_bytes=4_000, mtp_eval_seqs=4),
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Data


def source_roots() -> list[str]:
    roots = set(glob.glob("/usr/lib/python3*/"))
    for key in ("stdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(p)
    import site
    for p in site.getsitepackages():
        roots.add(p)
    return sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)})


def collect_files(roots: list[str], max_bytes: int, seed: int):
    """Deduplicated Python sources, split by file: returns (train texts, val (path, text)), shuffled, seeded."""
    seen, files = set(), []
    for root in roots:
        for dp, dn, fn in os.walk(root):
            dn.sort()
            for f in sorted(fn):
                if not f.endswith(".py"):
                    continue
                p = os.path.join(dp, f)
                try:
                    b = open(p, "rb").read()
                except OSError:
                    continue
                if not (200 <= len(b) <= 400_000):
                    continue
                try:
                    t = b.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                h = hashlib.sha1(b).digest()
                if h in seen:
                    continue
                # generated tables / minified files are poor training text
                lines = t.count("\n") + 1
                if len(b) / lines > 120 or "\x00" in t:
                    continue
                seen.add(h)
                files.append((p, t))
    files.sort(key=lambda x: x[0])
    random.Random(seed).shuffle(files)
    return files


def split_files(files, n_val: int, max_bytes: int):
    val, train, nb = files[:n_val], [], 0
    for p, t in files[n_val:]:
        if nb >= max_bytes:
            break
        train.append(t)
        nb += len(t.encode())
    return train, val


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], vocab: int, out_dir: Path):
    from tokenizers import Tokenizer, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    # specials go after the BPE ids, as in Qwen's vocabulary; <think>/<tool_call> are not "special" in HF
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS[:3]])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in SPECIALS[3:]])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): dict(content=s, lstrip=False, normalized=False, rstrip=False,
                                           single_word=False, special=i < 3) for i, s in enumerate(SPECIALS)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(dict(
        add_bos_token=False, add_prefix_space=False, added_tokens_decoder=added, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, model_max_length=32768,
        tokenizer_class="Qwen2Tokenizer", clean_up_tokenization_spaces=False, split_special_tokens=False,
        errors="replace", chat_template=CHAT_TEMPLATE), indent=2))
    return tok


def encode_all(tok, texts: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    B = 2048
    for i in range(0, len(texts), B):
        for e in tok.encode_batch(texts[i:i + B], add_special_tokens=False):
            out.append(np.asarray(e.ids, dtype=np.int32))
            out.append(np.asarray([eot], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


# ----------------------------------------------------------------------------------------------------------
# Model


def make_config(p: dict, vocab: int, bos: int, eos: int) -> Qwen3NextConfig:
    L = p["layers"]
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=p["hidden"], intermediate_size=4 * p["hidden"], num_hidden_layers=L,
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
        linear_conv_kernel_dim=4, linear_key_head_dim=p["lin_dim"], linear_value_head_dim=p["lin_dim"],
        linear_num_key_heads=p["lin_k_heads"], linear_num_value_heads=p["lin_v_heads"],
        num_experts=p["experts"], num_experts_per_tok=p["top_k"], moe_intermediate_size=p["expert_ff"],
        shared_expert_intermediate_size=p["shared_ff"], norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=32768, full_attention_interval=4, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=bos, initializer_range=0.02,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        attn_implementation="sdpa", use_cache=False)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    return cfg


class MTP(torch.nn.Module):
    """Qwen3-Next's multi-token-prediction module (REFERENCE.md §3.3; vLLM's wiring), parameter names as in the
    released checkpoints' mtp.* weights. Row i: hidden h_i (after the main final norm) + embedding of token
    i+1 -> logits for token i+2, through one full-attention decoder layer at position i+1."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg.hidden_size
        full_idx = cfg.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.layers = torch.nn.ModuleList([hfnext.Qwen3NextDecoderLayer(cfg, full_idx)])
        self.norm = hfnext.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, model, hidden, next_tokens):
        """hidden [B, T, H] (rows 0..T-1), next_tokens [B, T] (tokens 1..T); returns logits [B, T, V]."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        u = self.fc(torch.cat([e, h], dim=-1))
        T = u.shape[1]
        pos = torch.arange(1, T + 1, device=u.device)[None].expand(u.shape[0], -1)
        pe = model.model.rotary_emb(u, pos)
        # attention_mask None: transformers' sdpa path is then causal
        u = self.layers[0](u, position_embeddings=pe, attention_mask=None, position_ids=pos)
        return model.lm_head(self.norm(u))


class TinyCoder(torch.nn.Module):
    """Holds the transformers model and the MTP module; state_dict names: model.*, lm_head.*, mtp.*."""

    def __init__(self, cfg):
        super().__init__()
        self.lm = Qwen3NextForCausalLM(cfg)
        self.mtp = MTP(cfg)
        self.cfg = cfg
        self._init_mtp()

    def _init_mtp(self):
        std = self.cfg.initializer_range
        for n, p in self.mtp.named_parameters():
            with torch.no_grad():
                if n.endswith("A_log") or n.endswith("dt_bias"):
                    continue
                if "norm" in n:
                    p.zero_()                    # zero-centred norms: y = x̂ (1 + w)
                elif n.endswith("gate_up_proj") or n.endswith("down_proj") or p.dim() >= 2:
                    p.normal_(0, std)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v for k, v in self.lm.state_dict().items()}
        for k, v in self.mtp.state_dict().items():
            sd["mtp." + k] = v
        return sd


def routed_aux_loss(router_logits, n_exp: int, top_k: int) -> torch.Tensor:
    """Switch-style load-balancing loss over all layers (as transformers' load_balancing_loss_func)."""
    logits = torch.cat([r.float() for r in router_logits], 0)
    probs = logits.softmax(-1)
    _, sel = probs.topk(top_k, -1)
    mask = F.one_hot(sel, n_exp).float()           # [N, k, E]
    frac = mask.mean(0)                            # [k, E]
    pmean = probs.mean(0)                          # [E]
    return (frac * pmean[None]).sum() * n_exp


def losses(tc: TinyCoder, x: torch.Tensor):
    """x [B, T+2]: main loss over tokens 1..T, MTP loss over tokens 2..T+1 (input rows 0..T-1)."""
    out = tc.lm.model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
    h = out.last_hidden_state                                       # [B, T+1, H], after the final norm
    logits = tc.lm.lm_head(h)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().view(-1, V), x[:, 1:].reshape(-1))
    T = x.shape[1] - 2
    mlog = tc.mtp(tc.lm, h[:, :T], x[:, 1:T + 1])
    mtp = F.cross_entropy(mlog.float().reshape(-1, V), x[:, 2:T + 2].reshape(-1))
    aux = routed_aux_loss(out.router_logits, tc.cfg.num_experts, tc.cfg.num_experts_per_tok) \
        if out.router_logits else torch.zeros((), device=x.device)
    return main, mtp, aux


# ----------------------------------------------------------------------------------------------------------
# Checkpoint (Hugging Face layout, experts per expert as on the hub; REFERENCE.md §2.5)


def save_checkpoint(tc: TinyCoder, out: Path, shard_mb: float, dtype=torch.bfloat16):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in tc.hf_state_dict().items():
        v = v.detach().to(dtype).cpu()
        if k.endswith("mlp.experts.gate_up_proj"):
            base, Fe = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :Fe].contiguous()
                sd[f"{base}{e}.up_proj.weight"] = v[e, Fe:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[:-len("down_proj")]
            for e in range(v.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            sd[k] = v.contiguous()
    limit = int(shard_mb * 2**20) - 2**16          # headroom for the safetensors header
    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        n = sd[k].numel() * sd[k].element_size()
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += n
    shards.append(cur)
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())}, "weight_map": {}}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, str(out / name), metadata={"format": "pt"})
        for k in s:
            index["weight_map"][k] = name
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg = tc.cfg.to_dict()
    cfg.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", mtp_num_hidden_layers=1,
               mtp_use_dedicated_embeddings=False, torch_dtype=str(dtype).replace("torch.", ""))
    cfg.pop("attn_implementation", None)
    cfg.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))


def load_checkpoint(d: Path, device) -> TinyCoder:
    """Inverse of save_checkpoint (any shard count), in float32."""
    from safetensors.torch import load_file
    cfgd = json.loads((d / "config.json").read_text())
    for k in ("architectures", "model_type", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
              "torch_dtype", "dtype", "transformers_version"):
        cfgd.pop(k, None)
    if torch.device(device).type == "cpu":     # transformers' grouped_mm experts crawl on CPUs
        cfgd["experts_implementation"] = "eager"
    cfg = Qwen3NextConfig(**cfgd)
    cfg._attn_implementation = "sdpa"
    tc = TinyCoder(cfg)
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    fused = {}
    for k in list(sd):
        if ".mlp.experts." in k and k.endswith("_proj.weight"):
            base, rest = k.split(".mlp.experts.")
            e, kind = rest.split(".")[0], rest.split(".")[1]
            fused.setdefault(base, {}).setdefault(kind, {})[int(e)] = sd.pop(k)
    for base, kinds in fused.items():
        E = len(kinds["gate_proj"])
        sd[base + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]], 0) for e in range(E)])
        sd[base + ".mlp.experts.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(E)])
    lm = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    mtp = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
    tc.lm.load_state_dict({k: v.float() for k, v in lm.items()}, strict=True)
    tc.mtp.load_state_dict({k: v.float() for k, v in mtp.items()}, strict=True)
    return tc.to(device).float().eval()


# ----------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def window_ppl(tc: TinyCoder, ids: list[int], ctx: int, device, amp) -> tuple[float, int]:
    """strata perplexity's definition: windows of ctx tokens from an empty context; every token after a
    window's first is scored."""
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, ctx):
        w = ids[s:s + ctx]
        if len(w) < 2:
            break
        x = torch.tensor([w], device=device)
        with amp():
            logits = tc.lm(input_ids=x, use_cache=False).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1)
        nll -= lp.gather(1, x[0, 1:, None]).sum().item()
        n += len(w) - 1
        if (s // ctx) % 10 == 9:
            log(f"  perplexity: {s + len(w)}/{len(ids)} tokens, so far {math.exp(nll / n):.4f}")
    return math.exp(nll / max(n, 1)), n


@torch.no_grad()
def mtp_agreement(tc: TinyCoder, seqs: torch.Tensor, amp) -> tuple[float, float, int]:
    """Top-1 agreement of the MTP draft for token i+2 (fed the true token i+1) with the main model's greedy
    prediction at position i+1 (what a verifier accepts), and MTP top-1 accuracy against the text."""
    agree = correct = total = 0
    for x in seqs.split(8):
        with amp():
            out = tc.lm.model(input_ids=x, use_cache=False)
            h = out.last_hidden_state
            main = tc.lm.lm_head(h).argmax(-1)                      # [B, T]: prediction for token t+1
            T = x.shape[1]
            draft = tc.mtp(tc.lm, h[:, :T - 1], x[:, 1:T]).argmax(-1)  # [B, T-1]: token t+2
        agree += (draft[:, :-1] == main[:, 1:T - 1]).sum().item()
        correct += (draft[:, :-1] == x[:, 2:T]).sum().item()
        total += draft[:, :-1].numel()
    return agree / total, correct / total, total


def function_headers(val, tok, n: int, ctx_tokens: int, seed: int):
    """Up to n (prompt ids, header, source) from held-out text: a prompt is exactly ctx_tokens tokens ending
    with a one-line `def ...:` header and its newline. Candidates are every such line in the texts (a header
    that parses with a `pass` body), sampled with a seeded RNG."""
    import textwrap
    cands = []
    for path, text in val:
        pos = 0
        for line in text.splitlines(keepends=True):
            pos += len(line)
            st = line.strip()
            if not (st.startswith(("def ", "async def ")) and st.endswith(":") and line.endswith("\n")):
                continue
            ind = line[:len(line) - len(line.lstrip())]
            try:
                ast.parse(textwrap.dedent(line + ind + "    pass\n"))
            except (SyntaxError, ValueError):
                continue
            cands.append((path, text, pos, line))
    rng = random.Random(seed)
    rng.shuffle(cands)
    out = []
    for path, text, pos, line in cands:
        ids = tok.encode(text[max(0, pos - 12 * ctx_tokens):pos], add_special_tokens=False).ids
        if len(ids) < ctx_tokens + 1:
            continue
        out.append((ids[-ctx_tokens:], line, path))
        if len(out) >= n:
            break
    return out


def cut_body(header: str, gen: str) -> str:
    """The generated body: lines until the first non-empty line indented at or left of the header."""
    gen = gen.split("<|endoftext|>")[0]
    ind = len(header) - len(header.lstrip())
    body, lines = [], gen.split("\n")
    for i, ln in enumerate(lines):
        if ln.strip() and len(ln) - len(ln.lstrip()) <= ind:
            return "\n".join(body), True
        body.append(ln)
    # ran out of tokens inside the body: the last line may be cut short, so leave it out
    return "\n".join(body[:-1]), False


def parses(header: str, body: str) -> bool:
    import textwrap
    src = textwrap.dedent(header + body.rstrip() + "\n") if body.strip() else None
    if src is None:
        return False
    try:
        ast.parse(src)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


@torch.no_grad()
def greedy(tc: TinyCoder, prompts: torch.Tensor, n_new: int, amp) -> torch.Tensor:
    """Greedy continuation of equal-length prompts (no padding needed) through transformers' cache."""
    with amp():
        out = tc.lm.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=tc.cfg.pad_token_id,
                             eos_token_id=None)
    return out[:, prompts.shape[1]:]


@torch.no_grad()
def routing_counts(tc: TinyCoder, seqs: torch.Tensor, amp) -> np.ndarray:
    """Top-k selections per (layer, expert) over seqs: main layers 0..L-1, then the MTP layer as layer L."""
    L, E = tc.cfg.num_hidden_layers, tc.cfg.num_experts
    counts = np.zeros((L + 1, E), np.uint64)
    hooks = []

    def hook(layer):
        def f(mod, inp, outp):
            idx = outp[2].reshape(-1).cpu().numpy()
            counts[layer] += np.bincount(idx, minlength=E).astype(np.uint64)
        return f
    for i, layer in enumerate(tc.lm.model.layers):
        hooks.append(layer.mlp.gate.register_forward_hook(hook(i)))
    hooks.append(tc.mtp.layers[0].mlp.gate.register_forward_hook(hook(L)))
    try:
        for x in seqs.split(8):
            with amp():
                h = tc.lm.model(input_ids=x, use_cache=False).last_hidden_state
                tc.mtp(tc.lm, h[:, :-1], x[:, 1:])
    finally:
        for hk in hooks:
            hk.remove()
    return counts


def write_profile(path: Path, counts: np.ndarray):
    """docs/EXPERT_PROFILE.md, version 1."""
    L, E = counts.shape
    with open(path, "wb") as f:
        f.write(b"STXP")
        f.write(struct.pack("<III", 1, L, E))
        f.write(counts.astype("<u8").tobytes())


def evaluate(tc: TinyCoder, tok, val, p: dict, out: Path, device, amp, seed: int, ppl_only=False) -> dict:
    res: dict = {}
    for part in (eval_ppl,) if ppl_only else (eval_ppl, eval_mtp_and_routing, eval_headers):
        try:
            res.update(part(tc, tok, val, p, out, device, amp, seed))
        except Exception as e:                 # keep the other measurements (and the saved checkpoint)
            import traceback
            traceback.print_exc()
            res[part.__name__ + "_error"] = repr(e)
    return res


def eval_ppl(tc, tok, val, p, out, device, amp, seed) -> dict:
    t0 = time.time()
    tc.eval()
    res = {}
    # held-out text for perplexity: whole validation files, concatenated, up to ppl_bytes
    parts, nb = [], 0
    for _, t in val:
        if nb >= p["ppl_bytes"]:
            break
        parts.append(t)
        nb += len(t.encode())
    text = "\n".join(parts)
    (out / "val.txt").write_text(text)
    ids = tok.encode(text, add_special_tokens=False).ids
    ppl, n = window_ppl(tc, ids, 512, device, amp)
    res.update(val_ppl_ctx512=ppl, val_ppl_tokens=n, val_bytes=len(text.encode()))
    log(f"eval: validation perplexity {ppl:.4f} over {n} tokens (windows of 512) [{time.time() - t0:.0f}s]")
    return res


def held_out_seqs(tok, val, p, device):
    vids = encode_all(tok, [t for _, t in val])
    S = p["seq"]
    ns = min(p["mtp_eval_seqs"], len(vids) // S)
    return torch.tensor(vids[:ns * S].reshape(ns, S).astype(np.int64), device=device)


def eval_mtp_and_routing(tc, tok, val, p, out, device, amp, seed) -> dict:
    t0, res = time.time(), {}
    tc.eval()
    seqs = held_out_seqs(tok, val, p, device)
    agree, acc, nt = mtp_agreement(tc, seqs, amp)
    res.update(mtp_agreement=agree, mtp_accuracy=acc, mtp_positions=nt)
    log(f"eval: MTP draft agrees with the main model's greedy next-next token {100 * agree:.1f}% "
        f"(text accuracy {100 * acc:.1f}%) over {nt} positions [{time.time() - t0:.0f}s]")
    counts = routing_counts(tc, seqs, amp)
    write_profile(out / "tiny-coder.profile", counts)
    res["routing_tokens"] = int(counts[0].sum() // tc.cfg.num_experts_per_tok)
    return res


def eval_headers(tc, tok, val, p, out, device, amp, seed) -> dict:
    t0, res, S = time.time(), {}, p["seq"]
    tc.eval()
    # greedy continuations of held-out function headers
    heads = function_headers(val, tok, p["eval_headers"], 192 if S >= 192 else S // 2, seed)
    ok, ended_n, ok_ended, samples = 0, 0, 0, []
    if heads:
        prompts = torch.tensor([h[0] for h in heads], device=device)
        gens = []
        for chunk in prompts.split(64):
            gens.append(greedy(tc, chunk, p["gen_tokens"], amp))
        gens = torch.cat(gens).tolist()
        for (ids_, header, path), g in zip(heads, gens):
            text_g = tok.decode(g, skip_special_tokens=False)
            body, ended = cut_body(header, text_g)
            good = parses(header, body)
            ok += good
            ended_n += ended
            ok_ended += good and ended
            if len(samples) < 8:
                samples.append(dict(file=path, header=header, body=body, parses=good, ended=ended))
    res.update(ast_parse_share=ok / max(len(heads), 1), ast_headers=len(heads), samples=samples,
               ast_ended=ended_n, ast_parse_and_ended=ok_ended)
    log(f"eval: {ok}/{len(heads)} greedy continuations of held-out function headers parse; {ended_n} ended "
        f"(dedent) within {p['gen_tokens']} tokens, {ok_ended} of those parse [{time.time() - t0:.0f}s]")
    return res


# ----------------------------------------------------------------------------------------------------------
# The same measurements through Strata (the shipped GGUF), no PyTorch model needed


def strata_eval_all(exe: str, gguf_path: str, tok, text: str, p: dict, out: Path, seed: int) -> dict:
    """Greedy continuations of held-out function headers with `strata generate --temp 0` (ast share) and MTP
    draft agreement with `strata eval --mtp-logits` on held-out windows of the training length."""
    import subprocess
    import tempfile
    res: dict = {}
    t0 = time.time()
    heads = function_headers([("val", text)], tok, p["eval_headers"], 192, seed)
    ok = ended_n = ok_ended = 0
    samples = []
    for ids_, header, _ in heads:
        prompt = tok.decode(ids_, skip_special_tokens=False)
        r = subprocess.run([exe, "generate", "-m", gguf_path, "-p", prompt, "-n", str(p["gen_tokens"]),
                            "--temp", "0", "-t", "2"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"strata generate failed: {r.stderr.strip()}")
        body, ended = cut_body(header, r.stdout)
        good = parses(header, body)
        ok += good
        ended_n += ended
        ok_ended += good and ended
        if len(samples) < 8:
            samples.append(dict(header=header, body=body, parses=good, ended=ended))
    res.update(strata_ast_parse_share=ok / max(len(heads), 1), strata_ast_headers=len(heads),
               strata_ast_ended=ended_n, strata_ast_parse_and_ended=ok_ended, strata_samples=samples)
    log(f"strata: {ok}/{len(heads)} greedy continuations of held-out function headers parse; {ended_n} ended "
        f"within {p['gen_tokens']} tokens, {ok_ended} of those parse [{time.time() - t0:.0f}s]")
    ids = tok.encode(text, add_special_tokens=False).ids
    S, V = p["seq"], tok.get_vocab_size()
    agree = total = 0
    with tempfile.TemporaryDirectory() as td:
        for k in range(min(p["mtp_eval_seqs"], len(ids) // S)):
            w = ids[k * S:(k + 1) * S]
            lf, mf = Path(td) / "l.f32", Path(td) / "m.f32"
            r = subprocess.run([exe, "eval", "-m", gguf_path, "--tokens", ",".join(map(str, w)), "--logits",
                                str(lf), "--mtp-logits", str(mf), "-t", "2"], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"strata eval failed: {r.stderr.strip()}")
            main = np.fromfile(lf, "<f4").reshape(S, -1).argmax(-1)
            draft = np.fromfile(mf, "<f4").reshape(S - 1, -1).argmax(-1)     # row t drafts token t+2
            agree += int((draft[:-1] == main[1:S - 1]).sum())
            total += S - 2
    res.update(strata_mtp_agreement=agree / max(total, 1), strata_mtp_positions=total)
    log(f"strata: MTP draft agrees with the main model's greedy next-next token {100 * agree / max(total, 1):.1f}% "
        f"over {total} positions [{time.time() - t0:.0f}s]")
    return res


# ----------------------------------------------------------------------------------------------------------
# Training


def plot_loss(hist: list, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no loss plot")
        return
    h = np.array(hist)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(h[:, 1] / 1e6, h[:, 2], label="main (next token)", lw=1)
    ax.plot(h[:, 1] / 1e6, h[:, 3], label="MTP (token t+2)", lw=1)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(0, min(10, float(np.max(h[:, 2:4])) + 0.5))
    ax.grid(alpha=.3)
    ax.legend()
    ax.set_title("tiny-coder training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--out", required=True, help="output folder (hf/ checkpoint, metrics.json, loss.png, ...)")
    ap.add_argument("--src", action="append", help="source folder (repeatable; default: stdlib + site-packages)")
    ap.add_argument("--budget-s", type=float, default=0, help="total wall-clock budget; 0: use --steps")
    ap.add_argument("--eval-reserve-s", type=float, default=80, help="part of the budget kept for evaluation")
    ap.add_argument("--steps", type=int, default=0, help="fixed optimizer steps (reproduces a run exactly)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard-mb", type=float, default=14.5)
    ap.add_argument("--ckpt-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="checkpoint dtype (float32: the GGUF holds exactly the weights PyTorch evaluated)")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset field, e.g. --set max_data_mb=80 (recorded in metrics.json)")
    ap.add_argument("--eval-only", help="evaluate this hf/ checkpoint (with its tokenizer) instead of training")
    ap.add_argument("--val-text", help="with --eval-only / --strata: held-out text to evaluate on (a run's val.txt)")
    ap.add_argument("--ppl-only", action="store_true", help="with --eval-only: only the perplexity")
    ap.add_argument("--strata", nargs=2, metavar=("BIN", "GGUF"),
                    help="measure the ast share and MTP agreement of GGUF through the strata binary BIN "
                         "(needs --val-text and --eval-only HF_DIR for the tokenizer)")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    for kv in args.set:
        k, _, v = kv.partition("=")
        if k not in p:
            ap.error(f"--set {kv}: no preset field {k!r} ({', '.join(p)})")
        p[k] = type(p[k])(float(v)) if isinstance(p[k], (int, float)) else v
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
        (lambda: torch.autocast("cpu", enabled=False))
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if cuda else "") + f", preset {args.preset}")

    if args.strata:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(args.eval_only) / "tokenizer.json"))
        res = strata_eval_all(args.strata[0], args.strata[1], tok, Path(args.val_text).read_text(), p, out,
                              args.seed)
        res.update(gguf=args.strata[1], val_text=args.val_text, params=p)
        (out / "metrics-strata.json").write_text(json.dumps(res, indent=2))
        return 0
    if args.eval_only and args.val_text:
        from tokenizers import Tokenizer
        src = Path(args.eval_only)
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        tc = load_checkpoint(src, device)
        text = Path(args.val_text).read_text()
        p["ppl_bytes"] = len(text.encode()) + 1
        res = evaluate(tc, tok, [(args.val_text, text)], p, out, device, amp, args.seed, args.ppl_only)
        res.update(val_text=args.val_text, device=str(device), params=p)
        (out / "metrics-eval.json").write_text(json.dumps(res, indent=2))
        return 0
    roots = args.src or source_roots()
    log("sources:", ", ".join(roots))
    files = collect_files(roots, 0, args.seed)
    train_texts, val = split_files(files, p["val_files"], int(p["max_data_mb"] * 2**20))
    log(f"data: {len(files)} unique .py files; validation {len(val)} files "
        f"({sum(len(t) for _, t in val) / 1e6:.1f} MB), training {len(train_texts)} files "
        f"({sum(len(t) for t in train_texts) / 1e6:.1f} MB) [{time.time() - t_start:.0f}s]")
    (out / "val_files.txt").write_text("".join(pth + "\n" for pth, _ in val))
    hf_dir = out / "hf"

    if args.eval_only:
        from tokenizers import Tokenizer
        src = Path(args.eval_only)
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        tc = load_checkpoint(src, device)
        res = evaluate(tc, tok, val, p, out, device, amp, args.seed)
        (out / "metrics-eval.json").write_text(json.dumps(res, indent=2))
        return 0

    # tokenizer on a sample of the training files
    sample, nb = [], 0
    for t in train_texts:
        if nb > p["tok_sample_mb"] * 2**20:
            break
        sample.append(t)
        nb += len(t)
    tok = train_tokenizer(sample, p["vocab"], hf_dir)
    V = tok.get_vocab_size()
    log(f"tokenizer: {V} tokens from {nb / 1e6:.1f} MB [{time.time() - t_start:.0f}s]")
    data = encode_all(tok, train_texts)
    log(f"tokens: {len(data) / 1e6:.2f} M training tokens ({sum(len(t) for t in train_texts) / max(len(data), 1):.2f}"
        f" chars/token) [{time.time() - t_start:.0f}s]")

    cfg = make_config(p, V, tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>"))
    tc = TinyCoder(cfg).to(device)
    n_par = sum(q.numel() for q in tc.parameters())
    n_exp = sum(q.numel() for n, q in tc.named_parameters() if ".experts." in n)
    act = n_par - n_exp + n_exp * cfg.num_experts_per_tok // cfg.num_experts
    log(f"model: {n_par / 1e6:.2f} M parameters ({n_exp / 1e6:.2f} M in routed experts, ~{act / 1e6:.2f} M active "
        f"per token), MTP {sum(q.numel() for q in tc.mtp.parameters()) / 1e6:.2f} M")

    decay = [q for n, q in tc.named_parameters() if q.dim() >= 2 and "embed" not in n]
    other = [q for n, q in tc.named_parameters() if not (q.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=p["lr"], betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    S, B = p["seq"], p["batch"]
    n_win = (len(data) - 1) // (S + 2)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n_win, generator=gen)
    data_t = torch.from_numpy(data.astype(np.int64))
    train_deadline = t_start + args.budget_s - args.eval_reserve_s if args.budget_s else None
    total_steps = args.steps or 10**9
    hist, step, toks, t_train = [], 0, 0, time.time()
    tc.train()
    while step < total_steps:
        if step * B % n_win + B > n_win:
            order = torch.randperm(n_win, generator=gen)
        off = (step * B) % n_win
        idx = order[off:off + B] if off + B <= n_win else order[:B]
        x = torch.stack([data_t[i * (S + 2):(i + 1) * (S + 2)] for i in idx.tolist()]).to(device, non_blocking=True)
        warm = min(1.0, (step + 1) / p["warmup"])
        frac = step / total_steps if total_steps < 10**9 else 0.0
        lr = p["lr"] * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        with amp():
            main_l, mtp_l, aux = losses(tc, x)
            loss = main_l + args.mtp_weight * mtp_l + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tc.parameters(), 1.0)
        opt.step()
        step += 1
        toks += B * S
        if step % 10 == 0 or step == total_steps:
            ml, mt = main_l.item(), mtp_l.item()
            el = time.time() - t_train
            hist.append((step, toks, ml, mt, lr))
            if step % 50 == 0 or step == total_steps or step == 10:
                log(f"step {step}/{total_steps if total_steps < 10**9 else '?'}  loss {ml:.4f}  mtp {mt:.4f}  "
                    f"aux {aux.item():.3f}  lr {lr:.2e}  {toks / el:,.0f} tok/s  {el:.0f}s")
        # fix the schedule's length from measured speed once it has settled (budget mode)
        if train_deadline and total_steps >= 10**9 and step == 40:
            if cuda:
                torch.cuda.synchronize()
            rate = step / (time.time() - t_train)
            total_steps = max(step + 1, int(step + rate * (train_deadline - time.time())))
            log(f"budget: {rate:.2f} steps/s -> {total_steps} steps in total (rerun with --steps {total_steps})")
    if cuda:
        torch.cuda.synchronize()
    el = time.time() - t_train
    log(f"trained {step} steps, {toks / 1e6:.1f} M tokens in {el:.0f}s ({toks / el:,.0f} tok/s) "
        f"[{time.time() - t_start:.0f}s]")
    save_checkpoint(tc, hf_dir, args.shard_mb, getattr(torch, args.ckpt_dtype))
    (out / "loss_history.json").write_text(json.dumps(hist))
    try:
        plot_loss(hist, out / "loss.png")
    except Exception as e:
        log(f"loss plot failed: {e!r}")
    res = evaluate(tc, tok, val, p, out, device, amp, args.seed)
    res.update(preset=args.preset, params=p, n_params=n_par, n_expert_params=n_exp, active_params=act,
               steps=step, train_tokens=toks, train_seconds=el, tokens_per_s=toks / el, seed=args.seed,
               n_files=len(files), n_val_files=len(val), n_train_files=len(train_texts),
               train_token_count=int(len(data)), final_loss=hist[-1][2] if hist else None,
               final_mtp_loss=hist[-1][3] if hist else None, vocab=V, torch=torch.__version__,
               transformers=transformers.__version__, total_seconds=time.time() - t_start,
               device_name=torch.cuda.get_device_name(0) if cuda else "cpu")
    (out / "metrics.json").write_text(json.dumps(res, indent=2))
    log(f"done in {time.time() - t_start:.0f}s: {json.dumps({k: res.get(k) for k in ('val_ppl_ctx512', 'mtp_agreement', 'ast_parse_share')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
