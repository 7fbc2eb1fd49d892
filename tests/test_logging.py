"""Logging: every command takes --log-level and --log-file; one line per event, naming its node or dataset."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import Node, needs_fuse, run_dlfs

from dlfs.cli import build_parser
from dlfs.logs import FORMAT, OneLineFormatter, set_context

LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+( \[[^]]+\])?: ")


def test_every_command_takes_log_options() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert commands
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings}
        assert {"--log-level", "--log-file"} <= options, name


def test_one_line_per_event_with_context() -> None:
    formatter = OneLineFormatter(FORMAT)
    try:
        raise ValueError("first\nsecond")
    except ValueError:
        record = logging.LogRecord("dlfs.x", logging.ERROR, __file__, 1, "read of %s failed", ("f",),
                                   exc_info=sys.exc_info())
    set_context("dataset=imagenet@2")
    try:
        line = formatter.format(record)
    finally:
        set_context("")
    assert "\n" not in line
    assert LINE.match(line) and " [dataset=imagenet@2]: read of f failed | Traceback" in line
    assert "ValueError: first | second" in line


def test_bad_log_file_is_one_line(tmp_path: Path) -> None:
    proc = run_dlfs(tmp_path, "--log-file", tmp_path / "no" / "such.log", "datasets", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"dlfs: error: cannot write the log file {tmp_path}/no/such.log: No such file or directory"


@needs_fuse
@pytest.mark.timeout(90)
def test_node_and_mount_logs_name_their_node_and_dataset(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(30_000))
    node.ingest(src, "logged")
    log_file = tmp_path / "mount.log"
    mnt = node.mount("logged", tmp_path / "mnt", "--log-level", "debug", "--log-file", str(log_file))
    assert (mnt / "a").read_bytes() == (src / "a").read_bytes()
    node.umount(mnt)
    mount_lines = log_file.read_text().splitlines()
    assert any("mounted logged@1 at" in line for line in mount_lines)
    assert any(" DEBUG " in line for line in mount_lines)  # --log-level reached the mount process
    node_lines = node.node_log().splitlines()
    assert any("committed dataset logged version 1" in line for line in node_lines)
    for line in node_lines:
        assert LINE.match(line) and " [node=local]: " in line, line
    for line in mount_lines:
        assert LINE.match(line), line
    assert all(" [dataset=logged@1]: " in line for line in mount_lines if "mounted" in line or "unmount" in line)
