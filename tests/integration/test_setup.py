"""./setup.sh's flags, GPU list and config, in seconds: a copy of the script in a temporary
directory with STRATA_SETUP_SKIP_BUILD=1 (no packages, .venv or build), a stand-in nvidia-smi on
PATH and, where a test needs one, a stand-in build/strata. No server is started."""
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RTX_5080 = "0, NVIDIA GeForce RTX 5080, 16303, 12.0"
GTX_1080TI = "1, NVIDIA GeForce GTX 1080 Ti, 11264, 6.1"
RTX_3090 = "2, NVIDIA GeForce RTX 3090, 24576, 8.6"


def script(path, text):
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def repo(tmp_path):
    """A directory laid out like the repository, as far as setup.sh looks."""
    shutil.copy(ROOT / "setup.sh", tmp_path / "setup.sh")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-coder.gguf").symlink_to(ROOT / "models" / "tiny-coder.gguf")
    (tmp_path / "fakebin").mkdir()
    gpus(tmp_path, [])
    return tmp_path


def gpus(repo, lines):
    script(repo / "fakebin" / "nvidia-smi", "".join(f"echo '{line}'\n" for line in lines))


def setup(repo, *args, stdin=subprocess.DEVNULL):
    env = dict(os.environ, STRATA_SETUP_SKIP_BUILD="1", PATH=f"{repo / 'fakebin'}:{os.environ['PATH']}")
    return subprocess.run(["./setup.sh", *args], cwd=repo, env=env, stdin=stdin, capture_output=True, text=True,
                          timeout=60)


def config(repo, name="tiny-coder"):
    return json.loads((repo / f"strata-{name}.json").read_text())


def test_help():
    r = subprocess.run([ROOT / "setup.sh", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: ./setup.sh")
    for flag in ("--yes", "--no-start", "--model FILE", "--gpu", "--port", "--quiet"):
        assert flag in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--model"], "--model needs a value"),
    (["--model", "--yes"], "--model needs a value"),
    (["--model", "no/such.gguf"], "--model: no such file 'no/such.gguf'"),
    (["--model", "setup.sh"], "--model: 'setup.sh' is not a .gguf file"),
    (["--gpu", "first"], "--gpu: 'first' is not a GPU index, cpu or auto"),
    (["--gpu="], "--gpu needs a value"),
    (["--port", "0"], "--port: 0 is not in 1..65535"),
    (["--port", "65536"], "--port: 65536 is not in 1..65535"),
    (["--port", "80a"], "--port: '80a' is not a number"),
    (["--quiet", "--port", "9000"], "--quiet only sets up and builds"),
])
def test_bad_flags_are_named(repo, args, message):
    r = setup(repo, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("setup.sh: ") and message in r.stderr, r.stderr
    assert not list(repo.glob("strata-*.json"))


def test_gpu_list_and_config(repo):
    gpus(repo, [RTX_5080, GTX_1080TI, RTX_3090])
    r = setup(repo, "--yes", "--no-start")
    assert r.returncode == 0, r.stderr
    assert "setup: CUDA architectures: 86;120\n" in r.stdout
    assert ("Your NVIDIA GPUs:\n"
            "GPU 0: NVIDIA GeForce RTX 5080, 16 GB VRAM - can be used\n"
            "GPU 1: NVIDIA GeForce GTX 1080 Ti, 11 GB VRAM - not supported - older than the RTX 20 series "
            "(compute capability 6.1; Strata needs 7.5 or newer)\n"
            "GPU 2: NVIDIA GeForce RTX 3090, 24 GB VRAM - can be used\n") in r.stdout
    assert config(repo) == {"model": str(repo / "models" / "tiny-coder.gguf"), "gpu": "auto",
                            "host": "127.0.0.1", "port": 8080, "parallel": 1, "ctx": 0, "args": []}
    assert "every usable GPU: 0 2" in r.stdout
    assert "start the server with: build/strata serve --config strata-tiny-coder.json" in r.stdout
    # A GPU too old to use is refused by name.
    r = setup(repo, "--no-start", "--gpu", "1")
    assert r.returncode == 2 and "--gpu 1: not a usable GPU here (usable: 0 2)" in r.stderr


def test_one_gpu_is_chosen_without_asking(repo):
    gpus(repo, [GTX_1080TI, RTX_3090])
    r = setup(repo, "--no-start")   # stdin is not a terminal: no question
    assert r.returncode == 0, r.stderr
    assert config(repo)["gpu"] == 2
    assert "Strata will use GPU 2" in r.stdout


def test_without_a_usable_gpu_it_says_cpu(repo):
    r = setup(repo, "--yes", "--no-start")
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA GPU found" in r.stdout and "it will run on the CPU" in r.stdout
    assert config(repo)["gpu"] == "cpu"
    gpus(repo, [GTX_1080TI])
    (repo / "strata-tiny-coder.json").unlink()
    r = setup(repo, "--yes", "--no-start")
    assert "not supported - older than the RTX 20 series" in r.stdout
    assert "no NVIDIA GPU that Strata can use: it will run on the CPU" in r.stdout
    assert config(repo)["gpu"] == "cpu"
    assert "CUDA architectures" not in r.stdout


def test_a_build_without_cuda_says_why(repo):
    # The configure step found a toolkit too old for the kernels (cmake/cuda_toolkit.cmake) and
    # built the CPU backend only: setup names the reason, and the usable card is not chosen.
    (repo / "build").mkdir()
    (repo / "build" / "CMakeCache.txt").write_text(
        "STRATA_NO_CUDA_WHY:INTERNAL=the CUDA toolkit at /usr/bin/nvcc is 11.8; Strata's kernels need 12.0 or newer\n")
    gpus(repo, [RTX_3090])
    r = setup(repo, "--yes", "--no-start")
    assert r.returncode == 0, r.stderr
    assert ("this build has no CUDA backend (the CUDA toolkit at /usr/bin/nvcc is 11.8; Strata's kernels need 12.0 "
            "or newer): Strata will run on the CPU") in r.stdout, r.stdout
    assert config(repo)["gpu"] == "cpu"


def test_kept_config_is_used_and_flags_update_it(repo):
    gpus(repo, [RTX_3090])
    assert setup(repo, "--yes", "--no-start").returncode == 0
    cfg = config(repo)
    cfg["parallel"] = 2   # an edit by hand
    (repo / "strata-tiny-coder.json").write_text(json.dumps(cfg))
    r = setup(repo, "--no-start")
    assert r.returncode == 0 and "using the kept config strata-tiny-coder.json" in r.stdout
    assert config(repo) == cfg
    r = setup(repo, "--no-start", "--port", "9000", "--gpu", "cpu")
    assert r.returncode == 0 and "wrote strata-tiny-coder.json" in r.stdout
    assert config(repo) == dict(cfg, port=9000, gpu="cpu")


def test_model_flag_names_the_config(repo, tmp_path_factory):
    other = tmp_path_factory.mktemp("models") / "Qwen3 Coder-Q4_K_M-00001-of-00002.gguf"
    other.write_bytes(b"GGUF")
    r = setup(repo, "--yes", "--no-start", "--model", str(other))
    assert r.returncode == 0, r.stderr
    assert config(repo, "Qwen3-Coder-Q4_K_M")["model"] == str(other)
    # Without --model, the newest kept config is the one used.
    r = setup(repo, "--no-start")
    assert "using the kept config strata-Qwen3-Coder-Q4_K_M.json" in r.stdout


def test_quiet_only_sets_up(repo):
    gpus(repo, [RTX_3090])
    r = setup(repo, "--quiet")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    assert not list(repo.glob("strata-*.json"))


def test_starts_the_server_with_the_config(repo):
    # A stand-in build/strata: `devices --brief` lists two GPUs, `serve` prints what it was given.
    (repo / "build").mkdir()
    script(repo / "build" / "strata", """
case "$1 $2" in
  "devices --brief") echo "GPU 0: NVIDIA H200, 150 GB VRAM - can be used"; echo "GPU 1: Tesla P40, 24 GB VRAM - not supported - too old" ;;
  "serve --help") echo usage ;;
  "serve --config") echo "SERVE $*" ;;
  *) exit 2 ;;
esac
""")
    gpus(repo, ["0, NVIDIA H200, 143771, 9.0", "1, Tesla P40, 24576, 6.1"])
    r = setup(repo, "--yes")
    assert r.returncode == 0, r.stderr
    assert "Your NVIDIA GPUs:\nGPU 0: NVIDIA H200, 150 GB VRAM - can be used\nGPU 1: Tesla P40" in r.stdout
    assert config(repo)["gpu"] == 0
    assert "chat in your browser at http://127.0.0.1:8080/" in r.stdout
    assert r.stdout.rstrip().endswith("SERVE serve --config strata-tiny-coder.json")
    # The second run starts at once with the kept config.
    r = setup(repo)
    assert "using the kept config" in r.stdout and r.stdout.rstrip().endswith("SERVE serve --config strata-tiny-coder.json")


def test_without_a_server_build_it_says_so(repo):
    r = setup(repo, "--yes")
    assert r.returncode == 1
    assert "has no server yet" in r.stdout and config(repo)["gpu"] == "cpu"
