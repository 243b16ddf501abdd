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


def kernels(text: str, qualifier: str = "__global__"):
    """(name, body) of each __global__ function (or other qualifier's)."""
    for m in re.finditer(qualifier + r"[^;{]*?\b(\w+)\s*\(", text):
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
        text = without_comments(path.read_text())
        # Kernels that share a body (a __device__ function named ..._body, as moe2_kernel and
        # moe2_down4_kernel do for their different bounds) wait in it.
        bodies = {name: body for name, body in kernels(text, "__device__") if name.endswith("_body")}
        for name, body in kernels(text):
            seen += 1
            called = [b for n, b in bodies.items() if re.search(r"\b" + n + r"\s*<", body) or n + "(" in body]
            assert "st_pdl_begin()" in body or any("st_pdl_begin()" in b for b in called), \
                f"{path.name}: kernel {name} never calls st_pdl_begin()"
    assert seen >= 40  # the files hold ~50 kernels: the parser found them
