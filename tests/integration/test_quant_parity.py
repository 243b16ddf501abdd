"""Dequantization parity: for every type Strata computes, random blocks written into a GGUF file
and read back through `strata tensor FILE NAME --out OUT.f32` must equal gguf.quants.dequantize
bit for bit. No tolerance is needed: Strata's dequantizers do the same float32 operations in the
same order as gguf-py's NumPy code (scale products first, e.g. (d*sc)*q - dmin*m).

STRATA_BIN names the binary (default build/strata).
"""
import os
import pathlib
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter, GGML_QUANT_SIZES, quants

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))

# Byte offsets of the fp16 scale fields inside one block: they get sane finite values, the rest
# of each block is random bytes. IQ1_M keeps its fp16 scale in the top nibbles of 4 words.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.IQ4_NL: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
    T.IQ4_XS: [0], T.IQ1_M: [],
}
PLAIN = [T.F32, T.F16, T.BF16]
TYPES = PLAIN + list(F16_FIELDS)
ROWS = 3


def random_scales(rng, n):
    """fp16 scales over a wide range (1e-7..10, both signs; some are fp16 subnormals)."""
    mag = 10.0 ** rng.uniform(-7, 1, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def random_tensor(qtype, rng):
    """(ROWS, row bytes) uint8 for quant types, or a float array for the plain types."""
    if qtype == T.F32:
        return rng.standard_normal((ROWS, 37)).astype(np.float32)
    if qtype == T.F16:
        return rng.standard_normal((ROWS, 37)).astype(np.float16)
    if qtype == T.BF16:
        bits = (rng.standard_normal((ROWS, 37)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks_per_row = 3 if block == 256 else 5  # odd counts
    nb = ROWS * blocks_per_row
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = random_scales(rng, nb).view(np.uint8).reshape(nb, 2)
    if qtype == T.IQ1_M:
        d = random_scales(rng, nb).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(ROWS, blocks_per_row * size)


def expected(qtype, data):
    if qtype == T.BF16:
        return quants.dequantize(data, qtype)
    if qtype in PLAIN:
        return data.astype(np.float32)
    return quants.dequantize(data, qtype)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """One GGUF holding a tensor per type; returns (path, {type: data})."""
    rng = np.random.default_rng(20261129)
    path = tmp_path_factory.mktemp("quant") / "quant_parity.gguf"
    writer = GGUFWriter(str(path), "quant-parity")
    tensors = {}
    for qtype in TYPES:
        data = random_tensor(qtype, rng)
        tensors[qtype] = data
        raw_dtype = None if qtype in (T.F32, T.F16) else qtype
        writer.add_tensor(f"t.{qtype.name.lower()}", data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tensors


@pytest.fixture(scope="module")
def strata():
    if not pathlib.Path(BIN).is_file():
        pytest.fail(f"strata binary not found at {BIN} (set STRATA_BIN or build it)")
    probe = subprocess.run([BIN, "tensor", "--help"], capture_output=True, text=True)
    if probe.returncode == 2 and "unknown command" in probe.stderr:
        pytest.skip(f"{BIN} has no `tensor` command yet")
    return BIN


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_matches_gguf_py(model, strata, qtype, tmp_path):
    path, tensors = model
    out = tmp_path / "out.f32"
    name = f"t.{qtype.name.lower()}"
    run = subprocess.run([strata, "tensor", str(path), name, "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, f"strata tensor {name} failed: {run.stderr}"
    want = expected(qtype, tensors[qtype]).reshape(-1).astype(np.float32)
    got = np.fromfile(out, dtype="<f4")
    assert got.size == want.size, f"{name}: {got.size} floats written, {want.size} expected"
    diff = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
    assert diff.size == 0, (f"{name}: {diff.size} of {want.size} values differ, first at {diff[0]}: "
                            f"strata {got[diff[0]]!r}, gguf-py {want[diff[0]]!r}")
