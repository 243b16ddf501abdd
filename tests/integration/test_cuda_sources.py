"""The CUDA sources keep the launch rule that programmatic dependent launch relies on (see
st_pdl_begin in src/backend/cuda/cuda_common.cuh): every kernel is launched through st_launch,
and every kernel calls st_pdl_begin() before it reads what an earlier kernel wrote. A kernel that
forgot it would race with the kernel before it, on Hopper cards only: CI has no GPU, so the
rule is checked here on the text."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA = sorted((ROOT / "src" / "backend" / "cuda").glob("*.cu")) + sorted(
    (ROOT / "src" / "backend" / "cuda").glob("*.cuh"))


def without_comments(text: str) -> str:
    """The text without comments and __launch_bounds__(...) (so a kernel's name is the first
    name followed by a parenthesis after __global__)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"__launch_bounds__\s*\([^()]*(\([^()]*\)[^()]*)*\)", "", text)


def kernels(text: str):
    """(name, body) of each __global__ function."""
    for m in re.finditer(r"__global__[^;{]*?\b(\w+)\s*\(", text):
        i = text.index("(", m.end() - 1)
        depth = 0
        for j in range(i, len(text)):  # the parameter list
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
        k = j + 1
        while text[k].isspace():
            k += 1
        if text[k] != "{":  # a declaration
            continue
        depth = 0
        for e in range(k, len(text)):
            depth += {"{": 1, "}": -1}.get(text[e], 0)
            if depth == 0:
                break
        yield m.group(1), text[k:e + 1]


def test_sources_found():
    assert any(p.name == "cuda_common.cuh" for p in CUDA)
    assert len([p for p in CUDA if p.suffix == ".cu"]) >= 5


def test_no_triple_chevron_launches():
    for path in CUDA:
        text = without_comments(path.read_text())
        assert "<<<" not in text, f"{path.name}: launch kernels with st_launch, not <<<...>>>"


def test_every_kernel_waits_for_the_one_before():
    seen = 0
    for path in CUDA:
        for name, body in kernels(without_comments(path.read_text())):
            seen += 1
            assert "st_pdl_begin()" in body, f"{path.name}: kernel {name} never calls st_pdl_begin()"
    assert seen >= 40  # the files hold ~50 kernels: the parser found them
