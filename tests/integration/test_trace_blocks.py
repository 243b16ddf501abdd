"""tools/trace_blocks.py summarizes STRATA_CUDA_TRACE_BLOCKS's CSV: checked on a made-up replay
whose numbers are known (CI has no GPU to write a real one)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "trace_blocks.py"


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def test_summary(tmp_path):
    f = tmp_path / "b.csv"
    lines = ["launch,label,block_x,block_y,block_z,sm,release_us,end_us"]
    # Two launches of one op, four blocks each; block 3 shares SM 0 with block 0 and ends last.
    for launch in (0, 5):
        for b, (sm, end) in enumerate([(0, 4.0), (1, 5.0), (2, 6.0), (0, 9.0)]):
            lines.append(f'{launch},"moe q4_K n=1 #1",{b},0,0,{sm},0.{b},{end}')
    lines.append('1,"attention n=1 #1",0,0,0,3,0.0,2.0')
    f.write_text("\n".join(lines) + "\n")
    r = run(f, "--late", 1)
    assert r.returncode == 0, r.stderr
    rows = [l for l in r.stdout.splitlines() if l.startswith("moe")]
    assert len(rows) == 1
    cols = rows[0][58:].split()
    # launches, blocks, release median / max, end median / max, last block's SM load vs mean
    assert cols[:7] == ["2", "4", "0.15", "0.30", "5.50", "9.00", "2.00"]
    assert cols[8] == "1.50"
    assert "block (3,0,0) on SM 0: released 0.30, ended 9.00" in r.stdout
    # moe's slowest launch ends later than attention's: listed first
    assert r.stdout.index("moe q4_K") < r.stdout.index("attention")
    only = run(f, "--op", "attention")
    assert "attention" in only.stdout and "moe" not in only.stdout


def test_bad_file(tmp_path):
    r = run(tmp_path / "missing.csv")
    assert r.returncode != 0 and "trace_blocks" in r.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("not,a,trace\n1,2,3\n")
    r = run(bad)
    assert r.returncode != 0 and "trace_blocks" in r.stderr
