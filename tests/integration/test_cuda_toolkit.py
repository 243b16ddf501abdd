"""cmake/cuda_toolkit.cmake: which CUDA toolkits can build Strata (12.0 and newer) and for which of
the asked architectures. Fake nvcc scripts stand in for toolkits CI does not have (11.8, 12.0,
13.0); the verdict is what `cmake -P` prints."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cmake" / "cuda_toolkit.cmake"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")


def fake_nvcc(tmp_path: Path, release: str, archs: list[int], broken: bool = False) -> Path:
    nvcc = tmp_path / f"nvcc-{release}"
    listing = "\n".join(f"compute_{a}" for a in archs)
    version = "nvcc: NVIDIA (R) Cuda compiler driver" if broken else \
        f"Cuda compilation tools, release {release}, V{release}.0"
    nvcc.write_text(f"""#!/bin/sh
case "$1" in
  --version) printf '%s\\n' "{version}" ;;
  --list-gpu-arch) printf '%s\\n' "{listing}" ;;
  *) exit 1 ;;
esac
""")
    nvcc.chmod(0o755)
    return nvcc


def verdict(nvcc: Path, archs: str) -> dict:
    out = subprocess.run(["cmake", f"-DNVCC={nvcc}", f"-DARCHS={archs}", "-P", str(SCRIPT)],
                         capture_output=True, text=True, check=True)
    lines = (out.stdout + out.stderr).splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_cuda_12_builds_what_it_knows(tmp_path):
    v = verdict(fake_nvcc(tmp_path, "12.0", [50, 75, 80, 86, 89, 90]), "75;86;89;90")
    assert v == {"ok": "TRUE", "archs": "75;86;89;90", "why": "", "notes": ""}


def test_card_newer_than_toolkit_gets_ptx(tmp_path):
    # An RTX 5080 (sm_120) with Ubuntu 24.04's CUDA 12.0: sm_120 left out, compute_90 PTX added.
    v = verdict(fake_nvcc(tmp_path, "12.0", [50, 75, 80, 86, 89, 90]), "86;120")
    assert v["ok"] == "TRUE" and v["archs"] == "86;90-virtual"
    assert "sm_120" in v["notes"] and "compute_90 PTX" in v["notes"]
    # The newest known one asked for already carries its PTX.
    v = verdict(fake_nvcc(tmp_path, "12.0", [75, 90]), "90;120")
    assert v["archs"] == "90"
    # Only newer cards: the PTX alone.
    v = verdict(fake_nvcc(tmp_path, "12.4", [75, 90]), "100;120")
    assert v["ok"] == "TRUE" and v["archs"] == "90-virtual"


def test_old_arch_left_out(tmp_path):
    v = verdict(fake_nvcc(tmp_path, "13.0", [75, 80, 86, 89, 90, 100, 120]), "70;75;90-real")
    assert v["ok"] == "TRUE" and v["archs"] == "75;90-real"
    assert "sm_70" in v["notes"] and "PTX" not in v["notes"]


def test_too_old_or_unreadable_toolkit(tmp_path):
    v = verdict(fake_nvcc(tmp_path, "11.8", [50, 75, 80, 86, 89, 90]), "75;86")
    assert v["ok"] == "FALSE" and "11.8" in v["why"] and "12.0 or newer" in v["why"]
    v = verdict(fake_nvcc(tmp_path, "12.2", [75], broken=True), "75")
    assert v["ok"] == "FALSE" and "did not say which CUDA release" in v["why"]
    v = verdict(fake_nvcc(tmp_path, "12.2", []), "75")
    assert v["ok"] == "FALSE" and "--list-gpu-arch" in v["why"]
    v = verdict(fake_nvcc(tmp_path, "12.2", [50, 52]), "75;86")
    assert v["ok"] == "FALSE" and "none of the CUDA architectures" in v["why"]
