"""scripts/cold_ab.py: two dlfs variants and local disk in alternated cold passes of the cold bench's files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_fuse, pid_alive

from dlfs.bench.baselines import DlfsNode
from dlfs.procmounts import mounts_under

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "cold_ab.py"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=REPO)


def test_a_variant_that_names_no_built_checkout_is_refused_in_one_line(tmp_path: Path) -> None:
    for spec, words in (("x", "expected NAME=CHECKOUT"), (f"x={tmp_path}", "is not a dlfs checkout"),
                        ("local=.", "the baseline's")):
        proc = _run("--dir", str(tmp_path), "--variant", spec, timeout=60)
        assert proc.returncode != 0 and words in proc.stderr, (spec, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (tmp_path / "dlfs").mkdir()
    (tmp_path / "dlfs" / "__init__.py").write_text("")
    proc = _run("--dir", str(tmp_path), "--variant", f"x={tmp_path}", timeout=60)
    assert proc.returncode != 0 and "has no built native module" in proc.stderr, proc.stderr
    assert not (tmp_path / "cold-sample").exists()  # refused before any work


def test_a_variants_dlfs_is_its_checkouts_even_run_from_this_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `python -m dlfs` puts the working directory first in sys.path: run from this repository's root (as
    # cold_ab.py's default --dir suggests), every variant ran this checkout's dlfs, whatever it named.
    other = tmp_path / "other"
    (other / "dlfs").mkdir(parents=True)
    (other / "dlfs" / "__init__.py").write_text("")
    (other / "dlfs" / "__main__.py").write_text("print(__file__)\n")
    monkeypatch.chdir(REPO)
    out = DlfsNode(tmp_path / "home").cli("--version", code=other)
    assert Path(out.strip()) == other / "dlfs" / "__main__.py", out


@needs_fuse
@pytest.mark.serial  # it drops the page cache between passes
@pytest.mark.timeout(300)
def test_two_variants_run_in_every_order_against_local_disk_and_leave_nothing_mounted(tmp_path: Path) -> None:
    proc = _run("--dir", str(tmp_path), "--files", "small", "--small", "40", "--big", "1", "--rounds", "4",
                "--variant", "a=.", "--variant", "b=.:--direct-io on")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    orders = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("round ")]
    # rotated, and reversed every other round: each system first, and after each other one
    assert orders == ["local, a, b", "b, a, local", "a, b, local", "local, b, a"], orders
    medians = out[out.index("medians over 4 rounds"):].splitlines()[2:]
    assert [line.split()[0] for line in medians] == ["local", "a", "b"], medians
    for line in medians[1:]:  # every pass read the 40 files, from the mount's Python or its threads
        mb, ratio = float(line.split()[1]), float(line.split()[2].rstrip("x"))
        assert mb > 0 and ratio > 0, line
    # each pass read the files from the disk (the page cache dropped before it): 40 files of ~110 KB
    rounds = out[:out.index("medians over")].splitlines()
    passes = [line.split() for line in rounds if line.startswith(("  a ", "  b "))]
    assert len(passes) == 8 and all(float(p[-2]) >= 1.0 for p in passes), passes
    assert all(float(p[-1]) > 0 for p in passes), passes  # each fresh mount touched cache memory
    assert not mounts_under(tmp_path / "ab-mnt")
    node = tmp_path / "ab-home" / "run" / "node.json"
    assert not node.exists() or not pid_alive(json.loads(node.read_text())["pid"])  # its node stopped
