"""tools/convert_hf.py against Hugging Face transformers, and tools/train_tiny.py's CPU smoke run.

Random-weight Qwen3-MoE / Qwen3-Next models are saved as HF checkpoints (save_pretrained: per-expert
names; and the in-memory fused names), with a BPE tokenizer and, for Qwen3-Next, MTP weights; the converted
GGUF's `strata eval` logits must match transformers', and the MTP layer must match vLLM's wiring built
from transformers' modules (through the numpy reference, and through `strata eval --mtp-logits`).

Needs torch + transformers, which CI does not install (tools/requirements.txt leaves them out on purpose):
without them every test here is skipped. tests/gpu/run.sh runs this file on the GPU machine, where both
are installed; locally: STRATA_BIN=build/strata /tmp/pyref-venv/bin/python -m pytest tests/integration/test_convert.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (not in tools/requirements.txt); "
                                            "tests/gpu/run.sh runs these tests on the GPU machine")
pytest.importorskip("transformers", reason="transformers is not installed (not in tools/requirements.txt); "
                                           "tests/gpu/run.sh runs these tests on the GPU machine")
gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import convert_hf  # noqa: E402
import parity_hf  # noqa: E402
import train_tiny  # noqa: E402
from tests.reference.model import Model  # noqa: E402
from transformers import Qwen3MoeForCausalLM, Qwen3NextForCausalLM  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nfor i in range(10):\n    print(i, add(i, 2))\n") * 20


def run(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stderr}"
    return r


def strata_eval(model, tokens, tmp, mtp=False):
    out, mout = tmp / "l.f32", tmp / "m.f32"
    extra = ["--mtp-logits", mout] if mtp else []
    run(BIN, "eval", "-m", model, "--tokens", ",".join(map(str, tokens)), "--logits", out, "-t", "2", *extra)
    return np.fromfile(out, "<f4"), (np.fromfile(mout, "<f4") if mtp else None)


def strata_has_mtp():
    r = subprocess.run([BIN, "eval", "--help"], capture_output=True, text=True)
    return "--mtp-logits" in r.stdout


def make_checkpoint(tmp: Path, arch: str, fused: bool, seed: int = 0, **cfg_kw):
    """A random HF model saved to tmp/hf (+ tokenizer, + mtp.* for qwen3next); returns (dir, model, mtp)."""
    # d_v = d_k, as in the released models (the engine checks inner_size = d_k * time_step_rank)
    cfg = parity_hf.next_config(linear_value_head_dim=16, **cfg_kw) if arch == "qwen3next" else \
        parity_hf.moe_config(**cfg_kw)
    torch.manual_seed(seed)
    model = (Qwen3NextForCausalLM if arch == "qwen3next" else Qwen3MoeForCausalLM)(cfg).eval()
    parity_hf.reinit(model, arch == "qwen3next", cfg.num_hidden_layers, seed)
    d = tmp / ("hf-fused" if fused else "hf")
    if fused:                       # transformers' in-memory names (experts.gate_up_proj), one shard
        d.mkdir()
        cfg.to_json_file(str(d / "config.json"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    else:                           # what save_pretrained writes (per expert, as on the hub)
        model.save_pretrained(str(d))
    mtp = None
    if arch == "qwen3next":
        mtp = parity_hf.HFMtp(cfg).eval()
        parity_hf.reinit(mtp, True, cfg.num_hidden_layers, seed + 1)
        save_file({"mtp." + k: v.contiguous() for k, v in mtp.state_dict().items()}, str(d / "mtp.safetensors"))
    train_tiny.train_tokenizer([TEXT], 300, d)
    return d, model, mtp, cfg


@pytest.mark.parametrize("arch,fused", [("qwen3moe", False), ("qwen3moe", True), ("qwen3next", False),
                                        ("qwen3next", True)],
                         ids=["moe", "moe-fused", "next", "next-fused"])
def test_logits_match_transformers(tmp_path, arch, fused):
    d, model, mtp, cfg = make_checkpoint(tmp_path, arch, fused)
    out = tmp_path / "m.gguf"
    s = convert_hf.convert(d, out, "f32")
    assert s["mtp"] == (arch == "qwen3next")
    r = gguf.GGUFReader(str(out))
    kv = {f.name: f for f in r.fields.values()}
    assert kv["general.architecture"].contents() == arch
    assert kv["tokenizer.ggml.pre"].contents() == "qwen2"
    assert "<|im_start|>" in kv["tokenizer.chat_template"].contents()
    assert len(kv["tokenizer.ggml.tokens"].contents()) == cfg.vocab_size
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 290, 70)]       # > one 64-row DeltaNet chunk
    want, hidden = parity_hf.hf_prompt_logits(model, tokens)
    has_mtp = mtp is not None and strata_has_mtp()
    got, got_mtp = strata_eval(out, tokens, tmp_path, mtp=has_mtp)
    got = got.reshape(want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-4, f"max |strata - transformers| / max |logit| = {err:.2e}"
    if mtp is not None:
        pos = torch.arange(1, len(tokens))
        want_d = mtp(model, hidden[:-1], torch.tensor(tokens[1:]), pos)
        ref = Model(str(out))
        ref_d, _ = ref.mtp(ref.forward(tokens, ref.new_cache(), return_hidden=True)[1][:-1], tokens[1:],
                           ref.new_cache(), pos=np.arange(1, len(tokens)))
        assert np.abs(ref_d - want_d).max() / np.abs(want_d).max() < 2e-4
        if has_mtp:
            got_d = got_mtp.reshape(want_d.shape)
            e = np.abs(got_d - want_d).max() / np.abs(want_d).max()
            assert e < 2e-4, f"MTP draft logits: max |strata - HF| / max = {e:.2e}"


def test_fused_and_per_expert_give_the_same_file(tmp_path):
    a, *_ = make_checkpoint(tmp_path, "qwen3next", False)
    b, *_ = make_checkpoint(tmp_path, "qwen3next", True)
    convert_hf.convert(a, tmp_path / "a.gguf", "q8_0")
    convert_hf.convert(b, tmp_path / "b.gguf", "q8_0")
    ra, rb = gguf.GGUFReader(str(tmp_path / "a.gguf")), gguf.GGUFReader(str(tmp_path / "b.gguf"))
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].tensor_type == tb[n].tensor_type, n
        assert np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)), n
    # q8_0: matrices quantized, small tensors kept f32 (REFERENCE §2.2)
    assert ta["blk.0.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert ta["blk.0.ssm_a"].tensor_type == gguf.GGMLQuantizationType.F32
    assert ta["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_streams_one_tensor_at_a_time(tmp_path):
    """The converter reads shards through mmap: peak Python memory stays near one tensor, not the model."""
    import tracemalloc
    d, *_ = make_checkpoint(tmp_path, "qwen3moe", False)
    total = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    tracemalloc.start()
    convert_hf.convert(d, tmp_path / "s.gguf", "f32")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    biggest = max(np.prod(s) * 4 for s in (convert_hf.Shards(d).shape(n) for n in convert_hf.Shards(d).names()))
    assert peak < total / 2 and peak < 6 * biggest + (4 << 20), (peak, total, biggest)


def test_bad_checkpoints_fail_clearly(tmp_path):
    d, *_ = make_checkpoint(tmp_path, "qwen3moe", False)
    with pytest.raises(ValueError, match="--experts type"):
        convert_hf.convert(d, tmp_path / "x.gguf", "f32", expert_type="q7_x")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, ROOT / "tools" / "convert_hf.py", d, tmp_path / "x.gguf"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "only qwen3_moe and qwen3_next" in r.stderr


def test_train_tiny_smoke_and_perplexity_matches_strata(tmp_path):
    """train_tiny.py end to end on a CPU (tiny preset, a few steps on part of the standard library), then
    convert its checkpoint and check `strata perplexity` against the trainer's own PyTorch number."""
    import json as _j
    import sysconfig
    std = Path(sysconfig.get_paths()["stdlib"])
    srcs = [std / "json", std / "email", std / "asyncio"]
    out = tmp_path / "run"
    run(sys.executable, ROOT / "tools" / "train_tiny.py", "--preset", "smoke", "--out", out, "--steps", "3",
        "--ckpt-dtype", "float32", "--device", "cpu", "--set", "eval_headers=3", "--set", "gen_tokens=16",
        *sum((["--src", s] for s in srcs), []))
    m = _j.loads((out / "metrics.json").read_text())
    assert m["steps"] == 3 and m["val_ppl_tokens"] > 100
    b = (out / "tiny-coder.profile").read_bytes()
    assert b[:4] == b"STXP"
    ver, nl, ne = np.frombuffer(b[4:16], "<u4")
    counts = np.frombuffer(b, "<u8", offset=16).reshape(nl, ne)
    rows = counts.sum(1)
    # main layers see every token; the MTP row has no draft for each sequence's last position
    assert ver == 1 and nl == 5 and ne == 8 and (rows[:4] == rows[0]).all() and 0 < rows[4] < rows[0]
    gg = tmp_path / "t.gguf"
    convert_hf.convert(out / "hf", gg, "f32")
    r = run(BIN, "perplexity", "-m", gg, "-f", out / "val.txt", "--ctx", "512", "-t", "2")
    line = [x for x in r.stdout.splitlines() if x.startswith("perplexity:")][0]
    ppl, n = float(line.split()[1]), int(line.split()[3])
    assert n == m["val_ppl_tokens"]
    assert abs(ppl - m["val_ppl_ctx512"]) / m["val_ppl_ctx512"] < 1e-4, (ppl, m["val_ppl_ctx512"])


def test_k_quant_experts_through_strata_quantize(tmp_path):
    r = subprocess.run([BIN, "quantize", "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("this strata has no quantize command")
    # hidden 256: expert gate/up rows hold whole Q4_K super-blocks (down's rows of 32 fall back, as in C)
    d, model, _, cfg = make_checkpoint(tmp_path, "qwen3next", False, hidden_size=256)
    out = tmp_path / "k.gguf"
    s = convert_hf.convert(d, out, "q8_0", expert_type="q4_K", strata=BIN)
    assert s["experts"] == "q4_k" and s["dense"] == "q8_0"
    t = {x.name: x for x in gguf.GGUFReader(str(out)).tensors}
    assert t["blk.0.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert t["blk.4.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K    # the MTP layer
    assert t["blk.0.attn_qkv.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    tokens = [int(x) for x in np.random.default_rng(5).integers(0, 290, 40)]
    want, _ = parity_hf.hf_prompt_logits(model, tokens)
    got, _ = strata_eval(out, tokens, tmp_path)
    got = got.reshape(want.shape)
    # 4-bit experts on random weights: a few percent of the largest logit (seen: 5.5e-2), shape intact
    assert np.abs(got - want).max() / np.abs(want).max() < 0.1
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99
