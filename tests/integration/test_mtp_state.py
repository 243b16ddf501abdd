"""MTP drafting and session state through `strata eval`: the MTP layer's draft logits and hidden
states against the numpy reference (tests/reference/model.py), snapshot rollback (restore, then run
again) against a run without it, and determinism across thread counts and prompt chunk sizes."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import synth_gguf  # noqa: E402
from tests.reference.model import Model  # noqa: E402

BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
N_TOKENS = 70  # more than one 64-row DeltaNet chunk


def synth(tmp_path, preset, dense, experts, mtp=False):
    cfg = synth_gguf.Config(**synth_gguf.PRESETS[preset])
    cfg.dense_type, cfg.expert_type, cfg.mtp = dense, experts, mtp
    path = tmp_path / f"{preset}-{dense}-{experts}{'-mtp' if mtp else ''}.gguf"
    synth_gguf.write(cfg, path)
    return path


def tokens_for(path, seed=7, n=N_TOKENS):
    n_vocab = next(t.shape[1] for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


def run(tmp_path, model, tokens, *extra, outputs=("logits",), threads=2):
    """Runs strata eval; returns {output name: float32 array} for the --<name> files asked for."""
    files = {o: tmp_path / f"{o}.f32" for o in outputs}
    cmd = [BIN, "eval", "-m", str(model), "--tokens", ",".join(map(str, tokens)), "-t", str(threads), *extra]
    for o, f in files.items():
        cmd += [f"--{o}", str(f)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return {o: np.fromfile(f, dtype="<f4") for o, f in files.items()}


def rel(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


# ---------------------------------------------------------------------------------------------------------
# MTP against the reference

MTP_OUT = ("logits", "hidden", "mtp-logits", "mtp-hidden")


@pytest.mark.parametrize("dense,experts,tol", [("f32", "f32", 2e-4), ("q8_0", "q4_K", 2e-2)])
def test_mtp_matches_reference(tmp_path, dense, experts, tol):
    path = synth(tmp_path, "tiny-next", dense, experts, mtp=True)
    ref = Model(str(path))
    tokens = tokens_for(path)
    cache = ref.new_cache()
    logits, hidden = ref.forward(tokens, cache, return_hidden=True)
    # MTP row t: the main model's final hidden state of t and token t+1, drafting token t+2.
    mtp_logits, mtp_hidden = ref.mtp(hidden[:-1], tokens[1:], cache)
    want = {"logits": logits, "hidden": hidden, "mtp-logits": mtp_logits, "mtp-hidden": mtp_hidden}
    for batch in ("512", "1", "7"):
        got = run(tmp_path, path, tokens, "--batch", batch, outputs=MTP_OUT)
        for name, w in want.items():
            g = got[name].reshape(w.shape)
            err = np.abs(g - w).max(-1) / np.abs(w).max()  # per position
            # As in test_forward: quantized activations can flip a near-tie in a router's top-k at a
            # few positions, so 90% of positions within tol and none far off.
            assert np.quantile(err, 0.9) < tol, f"--batch {batch} {name}: 90% within {np.quantile(err, 0.9):.2e}"
            assert err.max() < (10 * tol if tol < 1e-3 else 0.3), f"--batch {batch} {name}: worst {err.max():.2e}"
        agree = (got["mtp-logits"].reshape(mtp_logits.shape).argmax(-1) == mtp_logits.argmax(-1)).mean()
        assert agree >= 0.95, f"--batch {batch}: MTP top-1 agreement {agree:.2f}"


def test_mtp_chained_drafts_match_reference(tmp_path):
    """Chained drafts: each step takes the previous step's MTP output hidden and its greedy draft
    token, one position further (vLLM's chaining)."""
    path = synth(tmp_path, "tiny-next", "f32", "f32", mtp=True)
    ref = Model(str(path))
    tokens = tokens_for(path, n=20)
    cache = ref.new_cache()
    _, hidden = ref.forward(tokens, cache, return_hidden=True)
    ml, mh = ref.mtp(hidden[:-1], tokens[1:], cache)
    chain_l, chain_h = [ml], [mh]
    for _ in range(3):
        draft = int(chain_l[-1][-1].argmax())
        l, h = ref.mtp(chain_h[-1][-1:], [draft], cache)
        chain_l.append(l)
        chain_h.append(h)
    want_l, want_h = np.concatenate(chain_l), np.concatenate(chain_h)
    got = run(tmp_path, path, tokens, "--mtp-chain", "3", outputs=("logits", "mtp-logits", "mtp-hidden"))
    assert rel(got["mtp-logits"].reshape(want_l.shape), want_l) < 2e-4
    assert rel(got["mtp-hidden"].reshape(want_h.shape), want_h) < 2e-4
    assert np.array_equal(got["mtp-logits"].reshape(want_l.shape).argmax(-1), want_l.argmax(-1))


def test_mtp_needs_an_mtp_layer(tmp_path):
    path = synth(tmp_path, "tiny-next", "f32", "f32")
    r = subprocess.run([BIN, "eval", "-m", str(path), "--tokens", "1,2,3", "--logits", str(tmp_path / "l"),
                        "--mtp-logits", str(tmp_path / "m")], capture_output=True, text=True)
    assert r.returncode == 1 and "no MTP layer" in r.stderr


# ---------------------------------------------------------------------------------------------------------
# Snapshots and rollback


@pytest.mark.parametrize("preset,mtp", [("tiny-next", True), ("tiny-moe", False)])
def test_rollback_gives_the_same_logits(tmp_path, preset, mtp):
    """Snapshot at P, run to the end, restore, run P.. again: the second run must equal a run
    without the detour. Bit for bit when the prompt chunks line up (P a multiple of --batch, or
    --batch 1); otherwise within float rounding of the different chunking."""
    path = synth(tmp_path, preset, "f32", "f32", mtp=mtp)
    tokens = tokens_for(path)
    outs = MTP_OUT if mtp else ("logits", "hidden")
    n = len(tokens)
    for batch, positions in ((16, (0, 21, 32, n - 1, n)), (512, (21, 64)), (1, (37,))):
        plain = run(tmp_path, path, tokens, "--batch", str(batch), outputs=outs)
        for p in positions:
            back = run(tmp_path, path, tokens, "--batch", str(batch), "--rollback", str(p), outputs=outs)
            aligned = batch == 1 or (p % batch == 0 and p < n)
            for name in ("logits", "hidden"):
                if aligned:
                    assert np.array_equal(back[name], plain[name]), f"--batch {batch} --rollback {p}: {name} differ"
                else:
                    assert rel(back[name], plain[name]) <= 1e-5, f"--batch {batch} --rollback {p}: {name}"
            for name in ("mtp-logits", "mtp-hidden") if mtp else ():
                assert rel(back[name], plain[name]) <= 1e-5, f"--batch {batch} --rollback {p}: {name}"


# ---------------------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("preset", ["tiny-next", "tiny-moe"])
def test_threads_and_chunks_f32(tmp_path, preset):
    path = synth(tmp_path, preset, "f32", "f32")
    tokens = tokens_for(path)
    base = run(tmp_path, path, tokens, threads=1)["logits"]
    for threads, batch in ((2, 512), (1, 1), (2, 7), (2, 64), (1, 64)):
        got = run(tmp_path, path, tokens, "--batch", str(batch), threads=threads)["logits"]
        assert rel(got, base) <= 1e-5, f"-t {threads} --batch {batch}: {rel(got, base):.2e}"


@pytest.mark.parametrize("preset", ["tiny-next", "tiny-moe"])
def test_threads_and_chunks_quantized_top1(tmp_path, preset):
    path = synth(tmp_path, preset, "q8_0", "q4_K")
    tokens = tokens_for(path)
    base = run(tmp_path, path, tokens, threads=1)["logits"].reshape(len(tokens), -1)
    for threads, batch in ((2, 512), (1, 1), (2, 7), (2, 64)):
        got = run(tmp_path, path, tokens, "--batch", str(batch), threads=threads)["logits"].reshape(len(tokens), -1)
        assert np.array_equal(got.argmax(-1), base.argmax(-1)), f"-t {threads} --batch {batch}: top-1 differs"


# ---------------------------------------------------------------------------------------------------------
# Where the MTP layer is (REFERENCE §2.4)


def test_mtp_layer_counted_in_block_count(tmp_path):
    """Newer llama.cpp counts the MTP layers in block_count: same model, same numbers."""
    path = synth(tmp_path, "tiny-next", "f32", "f32", mtp=True)
    other = tmp_path / "counted.gguf"
    other.write_bytes(path.read_bytes())
    r = GGUFReader(str(other), "r+")
    f = r.fields["qwen3next.block_count"]
    f.parts[f.data[0]][0] += 1
    r.data.flush()
    del r
    tokens = tokens_for(path, n=12)
    a = run(tmp_path, path, tokens, outputs=("logits", "mtp-logits"))
    b = run(tmp_path, other, tokens, outputs=("logits", "mtp-logits"))
    assert np.array_equal(a["logits"], b["logits"]) and np.array_equal(a["mtp-logits"], b["mtp-logits"])


def test_mtp_key_without_tensors_runs_without_mtp(tmp_path):
    """llama.cpp's qwen3next files may announce nextn_predict_layers with no nextn tensors."""
    path = synth(tmp_path, "tiny-next", "f32", "f32", mtp=True)
    data = path.read_bytes()
    name = b"blk.4.nextn.eh_proj.weight"
    assert data.count(name) == 1
    broken = tmp_path / "no-nextn.gguf"
    broken.write_bytes(data.replace(name, b"blk.4.nextn.eh_proj.weighX"))
    tokens = tokens_for(path, n=12)
    plain = run(tmp_path, path, tokens)["logits"]
    assert np.array_equal(run(tmp_path, broken, tokens)["logits"], plain)
    r = subprocess.run([BIN, "eval", "-m", str(broken), "--tokens", "1,2,3", "--logits", str(tmp_path / "l"),
                        "--mtp-logits", str(tmp_path / "m")], capture_output=True, text=True)
    assert r.returncode == 1 and "no MTP layer" in r.stderr
