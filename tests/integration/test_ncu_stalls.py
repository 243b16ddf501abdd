"""tools/ncu_stalls.py summarizes Nsight Compute's per-instruction source page: checked on a
made-up export whose numbers are known (CI has no GPU or ncu to write a real one)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "ncu_stalls.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
          "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def export(path, kernels):
    lines = []
    for name, rows in kernels:
        lines.append(f'"Kernel Name","{name}",')
        lines.append(",".join(f'"{h}"' for h in HEADER))
        for r in rows:
            lines.append(",".join(f'"{v}"' for v in r))
    path.write_text("\n".join(lines) + "\n")


def test_summary(tmp_path):
    f = tmp_path / "src.csv"
    # Four instructions: a load that waits on memory, a barrier, and two that take no samples.
    rows = [["0x0", "      LDG.E.128 R4, desc[UR4][R2.64]", "60", "32", "50", "0", "10", "99"],
            ["0x10", "@!P0  BAR.SYNC.DEFER_BLOCKING 0x0", "40", "32", "0", "40", "0", "0"],
            ["0x20", "      FFMA R1, R2, R3, R4", "0", "32", "0", "0", "0", "0"],
            ["0x30", "      EXIT", "0", "32", "0", "0", "0", "0"]]
    export(f, [("void k<(int)4>(p)", rows), ("void other(p)", rows[:1])])
    r = run(f, "--window", 2, "--top", 2)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "void k<(int)4>(p): 4 instructions, 100 samples" in out
    assert "long_sb 50.0%  barrier 40.0%  wait 10.0%" in out  # (the not-issued column is left out)
    # the first window holds every sample; the second (no samples) is left out
    assert "    0-1     100.0%  executed        64  long_sb 50% barrier 40% wait 10%  | LDG.E.128 BAR.SYNC" in out
    assert "    2-3" not in out
    # the instructions with the most samples, with their main reason
    assert "      0  60.0%  long_sb            LDG.E.128" in out
    assert "      1  40.0%  barrier            @!P0  BAR.SYNC" in out
    assert "void other(p): 1 instructions, 60 samples" in out


def test_bad_input(tmp_path):
    r = run(tmp_path / "missing.csv")
    assert r.returncode != 0 and "ncu_stalls:" in r.stderr
    empty = tmp_path / "e.csv"
    empty.write_text("nothing here\n")
    r = run(empty)
    assert r.returncode != 0 and "no kernel's source page" in r.stderr
    r = run(empty, "--window", 0)
    assert r.returncode != 0 and "--window" in r.stderr
