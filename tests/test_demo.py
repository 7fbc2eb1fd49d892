"""`make demo` (scripts/demo.py), small: the main job end to end, and its comparisons state for state."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_fuse


@needs_fuse
@pytest.mark.timeout(240)
def test_the_demo_runs_and_compares_cold_with_cold(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLFS_")}
    proc = subprocess.run([sys.executable, "scripts/demo.py", "--files", "300", "--dir", str(tmp_path / "demo")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "all 300 files matched the source byte for byte" in out, out
    rows = {m[1].strip(): m[0] for m in re.finditer(r"^(\S.{13})\s+300 files.*$", out, re.M)}
    if os.geteuid() == 0:  # the page cache can be dropped: the first reads are set beside the source's, cold
        assert list(rows) == ["source, cold", "dlfs 1st read", "direct 1st", "source, warm", "dlfs 2nd read",
                              "direct 2nd"], out
        assert "dlfs 1st read: the page cache dropped" in out and ": against the source, cold" in out
        compared = ["dlfs 1st read", "direct 1st", "dlfs 2nd read", "direct 2nd"]
    else:  # no cold source read to set them beside: no ratio (it was the warm source's, 0.07x)
        assert "source, cold" not in rows and not rows["dlfs 1st read"].endswith("x source"), out
        compared = ["dlfs 2nd read", "direct 2nd"]
    assert all(rows[name].endswith("x source") for name in compared), out
    assert str(tmp_path) not in Path("/proc/self/mounts").read_text()  # unmounted
