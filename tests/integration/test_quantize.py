"""`strata quantize` on synthetic f32 models (tools/synth_gguf.py): which tensors get which type
(read with gguf-py and with `strata inspect --json`), metadata carried over, the bytes of the
legacy types equal gguf.quants.quantize, every quantized tensor dequantized by gguf-py (an
independent decoder) is within the type's error bound of the f32 original, `strata eval` logits
stay close to the f32 model's, fallbacks for rows that do not fit a block, and clear errors.

STRATA_BIN names the binary (default build/strata).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import gguf
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, quants

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import synth_gguf  # noqa: E402

BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))

# Relative RMSE bound of a tensor (dequantized by gguf-py) against its f32 original. Random
# synth weights are Gaussian, so the worst tensor lands near the unit test's measurement
# (test_quant_weights.c); the bounds are about 10% above the worst tensor seen.
WEIGHT_BOUND = {
    "f16": 2.3e-4, "bf16": 1.85e-3, "q8_0": 5.9e-3, "q6_K": 1.85e-2, "q5_1": 4.2e-2, "q5_0": 4.75e-2,
    "q5_K": 3.85e-2, "q4_1": 8.7e-2, "q4_0": 9.5e-2, "q4_K": 7.8e-2, "iq4_nl": 8.1e-2, "iq4_xs": 8.2e-2,
    "q3_K": 1.6e-1, "q2_K": 3e-1,
}
TYPES = list(WEIGHT_BOUND)
# Types gguf.quants quantizes: our bytes must be its bytes.
GGUF_PY_QUANTIZES = {"f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"}
# Median over positions of |logits - f32 logits| / |f32 logits| (RMS over the vocabulary).
# Measured on this model: f16 5.1e-4, bf16 3.9e-3, q8_0 0.014, q6_K 0.036, q5_K 0.071,
# q4_K 0.14, q4_0 0.18, iq4_xs 0.15, q3_K 0.28, q2_K 0.46; the tolerances are 1.5x that.
# The error grows through the layers: about 2.7x the weights' RMSE on this random 5-layer model.
LOGIT_TOL = {
    "f16": 7.5e-4, "bf16": 6e-3, "q8_0": 2.1e-2, "q6_K": 5.4e-2, "q5_K": 1.07e-1, "q4_K": 2.1e-1,
    "q4_0": 2.7e-1, "iq4_xs": 2.2e-1, "q3_K": 4.2e-1, "q2_K": 6.9e-1,
}
KEPT = ("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "ssm_a",
        "ssm_dt.bias")
FTYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_K": 10, "q3_K": 11,
         "q4_K": 14, "q5_K": 16, "q6_K": 18, "iq4_nl": 25, "iq4_xs": 30, "bf16": 32}


def run(*args, ok=True):
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A qwen3next model whose matrices all have rows of 256 (every type fits), with MTP."""
    cfg = synth_gguf.Config(**synth_gguf.PRESETS["tiny-next"])
    cfg.n_embd, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_expert, cfg.mtp = 256, 256, 256, 4, True
    cfg.ssm_d_k = cfg.ssm_d_v = 64  # ssm_out rows: ssm_n_v * ssm_d_v = 256
    path = tmp_path_factory.mktemp("quantize") / "next-f32.gguf"
    synth_gguf.write(cfg, path)
    return path


@pytest.fixture(scope="module")
def quantized(model):
    """type name -> path of `model` quantized to it (made once per module)."""
    out = {}
    for t in TYPES:
        out[t] = model.parent / f"next-{t}.gguf"
        run("quantize", model, out[t], "--type", t, "-t", "2")
    return out


def is_kept(name):
    return any(k in name for k in KEPT)


def tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


def as_f32(t):
    return np.asarray(t.data, dtype=np.float32).reshape(-1)


@pytest.mark.parametrize("qtype", TYPES)
def test_types_metadata_and_error(model, quantized, qtype):
    src, dst = tensors(model), tensors(quantized[qtype])
    assert list(src) == list(dst)  # same tensors, same order
    r_src, r_dst = GGUFReader(model), GGUFReader(quantized[qtype])
    # Metadata: all carried over; the file type and quantization version set.
    keys_src = [k for k in r_src.fields if not k.startswith("GGUF.") and k != "general.file_type"]
    keys_dst = [k for k in r_dst.fields if not k.startswith("GGUF.")]
    assert set(keys_src) | {"general.file_type", "general.quantization_version"} == set(keys_dst)
    for k in keys_src:
        a, b = r_src.fields[k], r_dst.fields[k]
        assert [bytes(p) for p in a.parts[-len(a.data):]] == [bytes(p) for p in b.parts[-len(b.data):]], k
    assert int(r_dst.fields["general.file_type"].parts[-1][0]) == FTYPE[qtype]

    inspect = {t["name"]: t for t in json.loads(run("inspect", "--json", quantized[qtype]).stdout)["tensors"]}
    want_type = T[qtype.upper()]
    n_quantized = 0
    for name, s in src.items():
        d = dst[name]
        assert list(d.shape) == list(s.shape), name
        if is_kept(name) or len([n for n in s.shape if n > 1]) < 2:
            assert d.tensor_type == T.F32, name
            assert inspect[name]["type"] == "f32"
            assert np.array_equal(as_f32(d), as_f32(s)), name
            continue
        n_quantized += 1
        assert d.tensor_type == want_type, name
        assert inspect[name]["type"] == qtype, name
        x = as_f32(s)
        y = quants.dequantize(np.asarray(d.data), want_type).reshape(-1)
        err = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
        assert err < WEIGHT_BOUND[qtype], f"{name}: relative RMSE {err:.3e} > {WEIGHT_BOUND[qtype]}"
        if qtype in GGUF_PY_QUANTIZES:
            ref = quants.quantize(x.reshape(s.shape[::-1]), want_type)
            assert np.array_equal(np.asarray(d.data).view(np.uint8).reshape(-1), ref.view(np.uint8).reshape(-1)), \
                f"{name}: bytes differ from gguf.quants.quantize"
    assert n_quantized >= 20


def eval_logits(model, tokens, out):
    run("eval", "-m", model, "--tokens", ",".join(map(str, tokens)), "--logits", out, "-t", "2")
    return np.fromfile(out, dtype="<f4").reshape(len(tokens), -1)


def test_logits_close_to_f32(model, quantized, tmp_path):
    tokens = np.random.default_rng(7).integers(0, 300, size=40).tolist()
    want = eval_logits(model, tokens, tmp_path / "f32.bin")
    errs = {}
    for qtype, tol in LOGIT_TOL.items():
        got = eval_logits(quantized[qtype], tokens, tmp_path / f"{qtype}.bin")
        rel = np.sqrt(((got - want) ** 2).sum(-1) / (want ** 2).sum(-1))
        errs[qtype] = float(np.median(rel))
        assert errs[qtype] < tol, f"{qtype}: median relative logit error {errs[qtype]:.3e} > {tol}"
    # More bits, less error.
    order = ["f16", "q8_0", "q6_K", "q5_K", "q4_K", "q3_K", "q2_K"]
    assert all(errs[a] < errs[b] for a, b in zip(order, order[1:])), errs


def test_experts_and_dense_override(model, tmp_path):
    out = tmp_path / "mix.gguf"
    run("quantize", model, out, "--type", "q8_0", "--experts", "q4_K")
    for name, t in tensors(out).items():
        if "_exps." in name:
            assert t.tensor_type == T.Q4_K, name
        elif not is_kept(name) and len([n for n in t.shape if n > 1]) >= 2:
            assert t.tensor_type == T.Q8_0, name
    r = GGUFReader(out)
    assert int(r.fields["general.file_type"].parts[-1][0]) == FTYPE["q4_K"]  # experts are most of it
    out2 = tmp_path / "mix2.gguf"
    run("quantize", model, out2, "--experts", "iq4_xs", "--dense", "q6_K")
    got = {n: t.tensor_type for n, t in tensors(out2).items()}
    assert got["blk.0.ffn_up_exps.weight"] == T.IQ4_XS
    assert got["token_embd.weight"] == T.Q6_K and got["output.weight"] == T.Q6_K
    assert got["blk.3.attn_q.weight"] == T.Q6_K and got["blk.0.ffn_gate_inp.weight"] == T.F32


def test_deterministic_across_threads(model, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    run("quantize", model, a, "--type", "q4_K", "-t", "1")
    run("quantize", model, b, "--type", "q4_K", "-t", "3")
    assert a.read_bytes() == b.read_bytes()
    assert not list(tmp_path.glob("*.part"))  # written as OUT.part, then renamed


def test_fallback_when_rows_do_not_fit(tmp_path):
    """tiny-moe: rows of 128 (embedding) and 64 (expert down) do not fit 256-element blocks."""
    cfg = synth_gguf.Config(**synth_gguf.PRESETS["tiny-moe"])
    src = tmp_path / "moe.gguf"
    synth_gguf.write(cfg, src)
    out = tmp_path / "moe-q4k.gguf"
    r = run("quantize", src, out, "--type", "q4_K")
    got = {n: t.tensor_type for n, t in tensors(out).items()}
    assert got["blk.0.attn_q.weight"] == T.Q5_0  # q4_K -> q5_0, as llama.cpp
    assert got["blk.0.ffn_down_exps.weight"] == T.Q5_0
    assert "blk.0.attn_q.weight: rows of 128 do not fit q4_K's block of 256; using q5_0" in r.stderr
    assert r.stderr.count("blk.0.attn_q.weight: rows of") == 1
    out8 = tmp_path / "moe-q6k.gguf"
    run("quantize", src, out8, "--type", "q6_K")
    assert tensors(out8)["blk.0.attn_q.weight"].tensor_type == T.Q8_0
    # The result runs.
    eval_logits(out, [1, 2, 3], tmp_path / "l.bin")


def test_requantize_from_q8_0(model, quantized, tmp_path):
    out = tmp_path / "q8-to-q4k.gguf"
    r = run("quantize", quantized["q8_0"], out, "--type", "q4_K")
    assert "already quantized" in r.stderr
    assert tensors(out)["blk.0.ffn_up_exps.weight"].tensor_type == T.Q4_K


def test_bad_arguments(model, tmp_path):
    out = tmp_path / "x.gguf"
    r = run("quantize", model, out, "--type", "q9_K", ok=False)
    assert r.returncode == 2 and "--type: 'q9_K' is not a type strata can quantize to" in r.stderr
    assert "q4_K" in r.stderr  # the list of choices
    r = run("quantize", model, out, "--type", "iq2_xxs", ok=False)
    assert r.returncode == 2 and "'iq2_xxs' is not a type" in r.stderr
    r = run("quantize", model, out, ok=False)
    assert r.returncode == 2 and "--type is required" in r.stderr
    r = run("quantize", model, out, "--experts", "q4_K", ok=False)
    assert r.returncode == 2 and "--type is required" in r.stderr
    r = run("quantize", model, "--type", "q4_K", ok=False)
    assert r.returncode == 2 and "needs an input and an output" in r.stderr
    r = run("quantize", model, out, "--type", ok=False)
    assert r.returncode == 2 and "--type needs a value" in r.stderr
    r = run("quantize", model, out, "--type", "q4_K", "--frobnicate", ok=False)
    assert r.returncode == 2 and "unknown option '--frobnicate'" in r.stderr
    # The input as output, by the same name or another path to the same file.
    size = model.stat().st_size
    r = run("quantize", model, model, "--type", "q4_K", ok=False)
    assert r.returncode == 2 and "is the input file" in r.stderr
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    r = run("quantize", model, link, "--type", "q4_K", ok=False)
    assert r.returncode == 2 and "is the input file" in r.stderr
    assert model.stat().st_size == size
    # Unwritable output, missing input: a message naming the file, no file left behind.
    bad = tmp_path / "no-such-dir" / "x.gguf"
    r = run("quantize", model, bad, "--type", "q4_K", ok=False)
    assert r.returncode == 1 and str(bad) in r.stderr and "cannot open for writing" in r.stderr
    r = run("quantize", tmp_path / "missing.gguf", out, "--type", "q4_K", ok=False)
    assert r.returncode == 1 and "missing.gguf" in r.stderr
    assert not out.exists()
    r = run("quantize", "--help")
    assert "--experts" in r.stdout and "iq4_xs" in r.stdout


def test_split_input_becomes_one_file(tmp_path):
    """A model split in shards is read as one and written as one file, without split.* keys."""
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(tmp_path / "split.gguf"), "qwen3moe", split_max_tensors=2)
    w.add_uint32("qwen3moe.block_count", 5)
    arrays = {}
    for i in range(5):
        arrays[f"blk.{i}.attn_q.weight"] = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(f"blk.{i}.attn_q.weight", arrays[f"blk.{i}.attn_q.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(tmp_path.glob("split-*-of-00003.gguf"))
    assert len(shards) == 3
    out = tmp_path / "one.gguf"
    run("quantize", shards[1], out, "--type", "q8_0")
    r = GGUFReader(out)
    assert not [k for k in r.fields if k.startswith("split.")]
    got = {t.name: t for t in r.tensors}
    assert list(got) == list(arrays)
    for name, a in arrays.items():
        assert got[name].tensor_type == T.Q8_0
        assert np.array_equal(np.asarray(got[name].data).view(np.uint8).reshape(-1),
                              quants.quantize(a, T.Q8_0).view(np.uint8).reshape(-1)), name
    # Any shard counts as the input.
    r = run("quantize", shards[0], shards[2], "--type", "q8_0", ok=False)
    assert r.returncode == 2 and "is the input file" in r.stderr
