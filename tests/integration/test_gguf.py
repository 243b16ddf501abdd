"""GGUF files written by the independent `gguf` package (gguf-py) round-trip through
`strata inspect --json` and `strata tensor`; split models load as one; corrupt files fail with
a message naming the file and the thing at fault."""
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

ROOT = Path(__file__).resolve().parents[2]
STRATA = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))


def strata(*args, check=True):
    r = subprocess.run([STRATA, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"strata {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr}")
    return r


def inspect_json(path, *extra):
    return json.loads(strata("inspect", path, "--json", *extra).stdout)


def dequant_via_strata(path, name, tmp_path, rows=None):
    out = tmp_path / f"{name}.f32"
    args = ["tensor", path, name, "--out", out]
    if rows:
        args += ["--rows", rows]
    strata(*args)
    return np.fromfile(out, dtype="<f4")


# Every scalar type, with values at the edges of their ranges.
SCALARS = [
    ("t.u8", 250, VT.UINT8), ("t.i8", -120, VT.INT8), ("t.u16", 65000, VT.UINT16),
    ("t.i16", -32000, VT.INT16), ("t.u32", 4_000_000_000, VT.UINT32), ("t.i32", -2_000_000_000, VT.INT32),
    ("t.f32", 1.25e-6, VT.FLOAT32), ("t.bool", True, VT.BOOL), ("t.str", "héllo wörld ✓", VT.STRING),
    ("t.u64", 2**63 - 5, VT.UINT64), ("t.i64", -(2**62) - 3, VT.INT64), ("t.f64", 2.718281828459045, VT.FLOAT64),
]
ARRAYS = [
    ("a.u8", [0, 7, 255], VT.UINT8), ("a.i8", [-128, 0, 127], VT.INT8), ("a.u16", [1, 65535], VT.UINT16),
    ("a.i16", [-32768, 32767], VT.INT16), ("a.u32", [0, 2**32 - 1], VT.UINT32), ("a.i32", [-(2**31), 5], VT.INT32),
    ("a.f32", [0.5, -1e30, 3.25], VT.FLOAT32), ("a.bool", [True, False, True], VT.BOOL),
    ("a.str", ["a", "", "Ġhello", "日本"], VT.STRING), ("a.u64", [1, 2**63 + 7], VT.UINT64),
    ("a.i64", [-(2**63), 2**63 - 1], VT.INT64), ("a.f64", [1e300, -0.125], VT.FLOAT64),
]


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8)


def random_blocks(rng, qtype, n_rows, n_cols):
    """Random bytes for a block type, with the f16 scale fields set to sane values (so neither
    implementation sees NaN/inf scales)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = n_rows * n_cols // block
    data = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    # byte offsets of the f16 scales in each block (ggml-common.h layouts)
    fields = {QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208], QT.Q2_K: [80, 82], QT.Q3_K: [108],
              QT.IQ4_NL: [0], QT.IQ4_XS: [0], QT.IQ2_XXS: [0], QT.IQ3_XXS: [0], QT.IQ2_S: [0]}[qtype]
    for off in fields:
        data[:, off:off + 2] = f16_bytes(rng.uniform(0.01, 0.1, size=nb)).reshape(nb, 2)
    return data.reshape(n_rows, n_cols // block * size)


def write_model(path, rng):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 2)
    w.add_uint32("qwen3moe.embedding_length", 64)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array("qwen3moe.attention.head_count_kv", [2, 4])
    for key, val, vt in SCALARS:
        w.add_key_value(key, val, vt)
    for key, val, vt in ARRAYS:
        w.add_key_value(key, val, VT.ARRAY, sub_type=vt)
    w.add_array("a.nested", [[1, 2, 3], [4], [5, 6]])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.merges", ["t o", "to k"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 11)
    w.add_uint32("tokenizer.ggml.eos_token_id", 12)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")

    tensors = {}  # name -> (numpy reference as float32, ggml shape ne, type name)
    f32 = rng.standard_normal((3, 5, 64)).astype(np.float32)
    w.add_tensor("t.f32", f32)
    tensors["t.f32"] = (f32.reshape(-1), [64, 5, 3], "f32")
    f16 = rng.standard_normal((4, 32)).astype(np.float16)
    w.add_tensor("t.f16", f16)
    tensors["t.f16"] = (f16.astype(np.float32).reshape(-1), [32, 4], "f16")
    for qt in (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        src = rng.standard_normal((6, 64)).astype(np.float32)
        q = gguf.quants.quantize(src, qt)
        name = f"t.{qt.name.lower()}"
        w.add_tensor(name, q, raw_dtype=qt)
        tensors[name] = (gguf.quants.dequantize(q, qt).astype(np.float32).reshape(-1), [64, 6], qt.name.lower())
    for qt in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ3_XXS):
        q = random_blocks(rng, qt, 3, 512)
        name = f"t.{qt.name.lower()}"
        w.add_tensor(name, q, raw_dtype=qt)
        tensors[name] = (gguf.quants.dequantize(q, qt).astype(np.float32).reshape(-1), [512, 3], qt.name)
    for dt, tn in ((np.int8, "i8"), (np.int16, "i16"), (np.int32, "i32"), (np.float64, "f64")):
        a = (rng.standard_normal((2, 8)) * 100).astype(dt)
        w.add_tensor(f"t.{tn}", a)
        tensors[f"t.{tn}"] = (a.astype(np.float32).reshape(-1), [8, 2], tn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    tensors = write_model(path, np.random.default_rng(1234))
    return path, tensors


def test_inspect_metadata_round_trip(model):
    path, _ = model
    j = inspect_json(path)
    assert j["version"] == 3 and j["shards"] == 1 and j["architecture"] == "qwen3moe"
    assert j["file_bytes"] == path.stat().st_size
    meta = j["metadata"]
    for key, val, vt in SCALARS:
        m = meta[key]
        assert m["type"] == {VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
                             VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool", VT.STRING: "string",
                             VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT64: "f64"}[vt], key
        if vt == VT.FLOAT32:
            assert np.float32(m["value"]) == np.float32(val)
        else:
            assert m["value"] == val, key
    for key, val, vt in ARRAYS:
        m = meta[key]
        assert m["type"] == "array" and m["count"] == len(val), key
        got = m["value"]
        if vt == VT.UINT64:  # JSON integers stop at 2^63: larger ones come as strings
            got = [int(x) for x in got]
        if vt == VT.FLOAT32:
            assert np.array_equal(np.float32(got), np.float32(val)), key
        else:
            assert got == val, key
    assert meta["a.nested"]["elem_type"] == "array"
    assert meta["a.nested"]["value"] == [[1, 2, 3], [4], [5, 6]]
    # hyper-parameters: every qwen3moe.* key
    hp = j["hparams"]
    assert set(hp) == {"qwen3moe.block_count", "qwen3moe.embedding_length",
                       "qwen3moe.attention.layer_norm_rms_epsilon", "qwen3moe.attention.head_count_kv"}
    assert hp["qwen3moe.block_count"] == 2 and hp["qwen3moe.attention.head_count_kv"] == [2, 4]
    tok = j["tokenizer"]
    assert tok == {"model": "gpt2", "pre": "qwen2", "vocab_size": 300, "merges": 2, "bos_token_id": 11,
                   "eos_token_id": 12, "has_chat_template": True}
    # long arrays are summarised unless --full
    assert "value" not in meta["tokenizer.ggml.tokens"] and meta["tokenizer.ggml.tokens"]["count"] == 300
    full = inspect_json(path, "--full")
    assert full["metadata"]["tokenizer.ggml.tokens"]["value"] == [f"tok{i}" for i in range(300)]


def test_inspect_tensor_table(model):
    path, tensors = model
    j = inspect_json(path)
    reader = gguf.GGUFReader(str(path))
    by_name = {t["name"]: t for t in j["tensors"]}
    assert j["tensor_count"] == len(tensors) == len(reader.tensors)
    for rt in reader.tensors:
        t = by_name[rt.name]
        assert t["shape"] == [int(x) for x in rt.shape], rt.name
        assert t["type"].lower() == rt.tensor_type.name.lower(), rt.name
        assert t["bytes"] == int(rt.n_bytes), rt.name
        assert t["offset"] == int(rt.data_offset), rt.name
    totals = j["type_totals"]
    assert sum(v["count"] for v in totals.values()) == len(tensors)
    assert sum(v["bytes"] for v in totals.values()) == j["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    text = strata("inspect", path).stdout
    for needle in ("architecture:  qwen3moe", "qwen3moe.block_count", "t.q4_k", "totals per type", "q6_K"):
        assert needle in text
    assert re.search(r"layer_norm_rms_epsilon +f32 +1e-06\n", text)  # shortest exact decimal


@pytest.mark.parametrize("name", ["t.f32", "t.f16", "t.bf16", "t.q8_0", "t.q4_0", "t.q4_1", "t.q5_0", "t.q5_1",
                                  "t.q2_k", "t.q3_k", "t.q4_k", "t.q5_k", "t.q6_k", "t.iq4_nl", "t.iq4_xs",
                                  "t.iq2_xxs", "t.iq3_xxs", "t.i8", "t.i16", "t.i32", "t.f64"])
def test_tensor_values(model, tmp_path, name):
    path, tensors = model
    ref, ne, _ = tensors[name]
    got = dequant_via_strata(path, name, tmp_path)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))


def test_tensor_rows(model, tmp_path):
    path, tensors = model
    ref, ne, _ = tensors["t.f32"]  # ne = {64, 5, 3}: 15 rows of 64
    got = dequant_via_strata(path, "t.f32", tmp_path, rows="4:11")
    np.testing.assert_array_equal(got, ref[4 * 64:11 * 64])
    got = dequant_via_strata(path, "t.q4_k", tmp_path, rows="1:")
    np.testing.assert_allclose(got, tensors["t.q4_k"][0][512:], rtol=1e-6, atol=1e-6)
    got = dequant_via_strata(path, "t.q8_0", tmp_path, rows=":2")
    np.testing.assert_allclose(got, tensors["t.q8_0"][0][:128], rtol=1e-6, atol=1e-7)


def test_tensor_errors(model, tmp_path):
    path, _ = model
    r = strata("tensor", path, "t.q4k", "--out", tmp_path / "x", check=False)
    assert r.returncode == 1 and "tensor 't.q4k' not found" in r.stderr and "t.q4_k" in r.stderr
    for rows in ("3:3", "0:16", "-1:2", "15:"):
        r = strata("tensor", path, "t.f32", "--rows", rows, "--out", tmp_path / "x", check=False)
        assert r.returncode != 0 and "the tensor has 15 rows" in r.stderr, rows
    r = strata("tensor", path, "t.f32", "--rows", "a:b", "--out", tmp_path / "x", check=False)
    assert r.returncode == 2 and "not an integer" in r.stderr
    r = strata("tensor", path, "t.f32", "--out", "/nonexistent-dir/x.f32", check=False)
    assert r.returncode == 1 and "cannot open '/nonexistent-dir/x.f32' for writing" in r.stderr
    r = strata("tensor", path, "t.f32", check=False)
    assert r.returncode == 2 and "--out" in r.stderr
    assert strata("tensor", "--help").stdout.startswith("usage: strata tensor")
    assert strata("inspect", "--help").stdout.startswith("usage: strata inspect")


def test_split_model(tmp_path):
    rng = np.random.default_rng(7)
    base = tmp_path / "split.gguf"
    w = gguf.GGUFWriter(str(base), "qwen3moe", split_max_tensors=2)
    w.add_uint32("qwen3moe.block_count", 5)
    arrays = {}
    for i in range(5):
        a = rng.standard_normal((2, 32)).astype(np.float32)
        arrays[f"blk.{i}.w"] = a
        w.add_tensor(f"blk.{i}.w", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(tmp_path.glob("split-*-of-00003.gguf"))
    assert [p.name for p in shards] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for shard in shards:  # any shard's name opens the whole model
        j = inspect_json(shard)
        assert j["shards"] == 3 and j["tensor_count"] == 5
        assert j["file_bytes"] == sum(p.stat().st_size for p in shards)
        assert j["hparams"]["qwen3moe.block_count"] == 5
        assert sorted(t["shard"] for t in j["tensors"]) == [0, 0, 1, 1, 2]
    for name, a in arrays.items():
        np.testing.assert_array_equal(dequant_via_strata(shards[1], name, tmp_path), a.reshape(-1))
    shards[1].unlink()
    r = strata("inspect", shards[0], check=False)
    assert r.returncode == 1 and "shard 2 of 3 is missing" in r.stderr and "split-00002-of-00003.gguf" in r.stderr


def small_file(path):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_k.weight", np.zeros((2, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return bytearray(path.read_bytes())


def info_at(data, name):
    """Byte offset of a tensor's info (its name's length field) and of the field after the name."""
    i = data.find(name.encode())
    return i - 8, i + len(name)


def expect_fail(tmp_path, data, *parts):
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    for cmd in (["inspect", p], ["tensor", p, "blk.0.attn_q.weight", "--out", tmp_path / "o.f32"]):
        r = strata(*cmd, check=False)
        assert r.returncode == 1, r.stderr
        assert "AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr
        for part in parts:
            assert part in r.stderr, f"{part!r} not in {r.stderr!r}"


def test_corrupt_files(tmp_path):
    good = small_file(tmp_path / "good.gguf")
    strata("inspect", tmp_path / "good.gguf")
    q_info, q_after = info_at(good, "blk.0.attn_q.weight")
    k_info, k_after = info_at(good, "blk.0.attn_k.weight")

    d = bytearray(good); d[0:4] = b"GGML"
    expect_fail(tmp_path, d, "bad.gguf: not a GGUF file", "magic at byte 0")
    d = bytearray(good); d[4] = 9
    expect_fail(tmp_path, d, "GGUF version 9 at byte 4 is not supported")
    d = bytearray(good); d[q_after:q_after + 4] = (5).to_bytes(4, "little")
    expect_fail(tmp_path, d, f"tensor 'blk.0.attn_q.weight' (info at byte {q_info}): n_dims 5 at byte {q_after}")
    d = bytearray(good); d[k_after + 4 + 16:k_after + 4 + 20] = (99).to_bytes(4, "little")
    expect_fail(tmp_path, d, f"tensor 'blk.0.attn_k.weight' (info at byte {k_info}): type 99", "not a known tensor type")
    d = bytearray(good); d[k_after + 4 + 20:k_after + 4 + 28] = (32).to_bytes(8, "little")
    expect_fail(tmp_path, d, "tensor 'blk.0.attn_k.weight'", "overlaps tensor 'blk.0.attn_q.weight'")
    d = bytearray(good); d[k_after + 4 + 20:k_after + 4 + 28] = (8).to_bytes(8, "little")
    expect_fail(tmp_path, d, "tensor 'blk.0.attn_k.weight'", "is not a multiple of the alignment 32")
    d = good[:-40]
    expect_fail(tmp_path, d, f"tensor 'blk.0.attn_k.weight' (info at byte {k_info}): data [",
                f"runs past the end of the file (size {len(d)})")
    d = bytearray(good); d[k_info + 8:k_after] = b"blk.0.attn_q.weight"
    expect_fail(tmp_path, d, "tensor 'blk.0.attn_q.weight'", "duplicate tensor name")
    d = bytearray(good); d[16:24] = (2**62).to_bytes(8, "little")
    expect_fail(tmp_path, d, "kv_count 4611686018427387904 at byte 16 cannot fit")
    expect_fail(tmp_path, good[:30], "bad.gguf")
