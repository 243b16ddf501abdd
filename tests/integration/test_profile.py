"""strata profile on the embedded tiny model: the file it writes (size, header, every main row
summing to tokens x experts-per-token, the MTP row to (tokens - 1) x that), several prompt files,
--ctx, the default output beside the model, determinism, and clear errors for bad input."""
import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
MODEL = ROOT / "models" / "tiny-coder.gguf"

TEXT_A = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
TEXT_B = "import os\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n"


def run(*args, input=None):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, input=input)


@pytest.fixture(scope="module")
def info():
    r = run("inspect", "--json", MODEL)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    hp, arch = j["hparams"], j["architecture"]
    return {"n_layer": hp[f"{arch}.block_count"], "n_expert": hp[f"{arch}.expert_count"],
            "k": hp[f"{arch}.expert_used_count"], "n_mtp": hp.get(f"{arch}.nextn_predict_layers", 0)}


def n_tokens(text):
    r = run("tokenize", "-m", MODEL, "--ids", "-", input=text.encode())
    assert r.returncode == 0, r.stderr
    return len(r.stdout.split())


def read_profile(path, info):
    b = Path(path).read_bytes()
    rows = info["n_layer"] + info["n_mtp"]
    assert len(b) == 16 + 8 * rows * info["n_expert"]
    assert b[:4] == b"STXP"
    assert struct.unpack_from("<III", b, 4) == (1, rows, info["n_expert"])
    return np.frombuffer(b, "<u8", offset=16).reshape(rows, info["n_expert"])


def check_sums(counts, info, tokens):
    """tokens: the token count of each prompt file used."""
    k, L = info["k"], info["n_layer"]
    for row in counts[:L]:
        assert int(row.sum()) == sum(tokens) * k
    if info["n_mtp"]:  # the MTP layer drafts from every position but each file's last
        assert int(counts[L].sum()) == sum(t - 1 for t in tokens) * k


def test_profile_one_file(tmp_path, info):
    text = tmp_path / "a.py"
    text.write_text(TEXT_A)
    out = tmp_path / "a.profile"
    r = run("profile", "-m", MODEL, "-f", text, "-o", out, "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    n = n_tokens(TEXT_A)
    counts = read_profile(out, info)
    check_sums(counts, info, [n])
    assert not (tmp_path / "a.profile.tmp").exists()
    stdout = r.stdout.decode()
    assert f"tokens: {n} from 1 file" in stdout
    assert f"rows: {info['n_layer'] + info['n_mtp']}" in stdout
    for share in ("10%", "25%", "50%"):
        assert share in stdout
    assert f"{n}/{n} tokens" in r.stderr.decode()
    # The same text gives the same counts with other thread and batch sizes.
    out2 = tmp_path / "b.profile"
    r = run("profile", "-m", MODEL, "-f", text, "-o", out2, "--gpu", "cpu", "-t", "1", "--batch", "7")
    assert r.returncode == 0, r.stderr
    assert out2.read_bytes() == out.read_bytes()


def test_profile_files_stdin_ctx_and_default_output(tmp_path, info):
    # The default output is the model's path with .gguf replaced: use a link to the model.
    model = tmp_path / "m.gguf"
    model.symlink_to(MODEL)
    a = tmp_path / "a.py"
    a.write_text(TEXT_A)
    r = run("profile", "-m", model, "-f", a, "-f", "-", "--gpu", "cpu", input=TEXT_B.encode())
    assert r.returncode == 0, r.stderr
    counts = read_profile(tmp_path / "m.profile", info)
    check_sums(counts, info, [n_tokens(TEXT_A), n_tokens(TEXT_B)])
    assert b"from 2 files" in r.stdout
    # --ctx cuts each file, and says so.
    r = run("profile", "-m", model, "-f", a, "--ctx", 5, "-o", tmp_path / "c.profile", "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    assert b"only the first 5 are used (--ctx)" in r.stderr
    check_sums(read_profile(tmp_path / "c.profile", info), info, [5])
    # --chat: the template's tokens join the file's.
    r = run("profile", "-m", model, "-f", a, "--chat", "-o", tmp_path / "d.profile", "--gpu", "cpu")
    assert r.returncode == 0, r.stderr
    counts = read_profile(tmp_path / "d.profile", info)
    sums = counts[:info["n_layer"]].sum(axis=1)
    assert len(set(sums.tolist())) == 1 and sums[0] % info["k"] == 0
    assert sums[0] // info["k"] > n_tokens(TEXT_A)


def test_profile_bad_input(tmp_path):
    text = tmp_path / "a.py"
    text.write_text(TEXT_A)
    out = tmp_path / "x.profile"
    # No prompt file.
    r = run("profile", "-m", MODEL, "-o", out)
    assert r.returncode == 2
    assert b"no prompt file" in r.stderr and b"-f FILE" in r.stderr
    # No model.
    r = run("profile", "-f", text, "-o", out)
    assert r.returncode == 2
    assert b"-m MODEL.gguf" in r.stderr
    # A prompt file that is not there, one that cannot be read.
    missing = tmp_path / "missing.txt"
    r = run("profile", "-m", MODEL, "-f", text, "-f", missing, "-o", out)
    assert r.returncode == 1
    assert str(missing).encode() in r.stderr and b"No such file" in r.stderr
    if os.geteuid() != 0:  # root reads files whatever their mode
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        r = run("profile", "-m", MODEL, "-f", locked, "-o", out)
        assert r.returncode == 1
        assert str(locked).encode() in r.stderr and b"Permission denied" in r.stderr
    # An output folder that does not exist, and an output that is a folder: said before the run.
    bad_out = tmp_path / "no" / "such" / "x.profile"
    r = run("profile", "-m", MODEL, "-f", text, "-o", bad_out)
    assert r.returncode == 1
    assert b"cannot write" in r.stderr and str(bad_out.parent).encode() in r.stderr
    assert b"No such file or directory" in r.stderr
    assert b"tokens" not in r.stderr  # nothing ran
    r = run("profile", "-m", MODEL, "-f", text, "-o", tmp_path)
    assert r.returncode == 1
    assert b"is a folder" in r.stderr
    # stdin twice; an unknown flag; a model that is not there.
    r = run("profile", "-m", MODEL, "-f", "-", "-f", "-")
    assert r.returncode == 2 and b"only once" in r.stderr
    r = run("profile", "-m", MODEL, "-f", text, "--bogus")
    assert r.returncode == 2 and b"unknown option '--bogus'" in r.stderr
    r = run("profile", "-m", tmp_path / "none.gguf", "-f", text, "-o", out)
    assert r.returncode == 1 and b"none.gguf" in r.stderr
    # An empty prompt file.
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run("profile", "-m", MODEL, "-f", empty, "-o", out, "--gpu", "cpu")
    assert r.returncode == 1 and b"no tokens" in r.stderr
    assert not out.exists()


def test_profile_help():
    r = run("profile", "--help")
    assert r.returncode == 0
    assert b".profile" in r.stdout and b"-f" in r.stdout
    r = run("help")
    assert b"profile" in r.stdout
