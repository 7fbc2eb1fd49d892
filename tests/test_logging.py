"""Logging: every command takes --log-level and --log-file; one line per event, naming its node or dataset."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import Node, needs_fuse, run_dlfs

from dlfs.cli import build_parser
from dlfs.logs import FORMAT, REPEAT_BURST, OneLineFormatter, RepeatLimit, set_context

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


def test_lines_of_one_kind_are_bounded_and_counted() -> None:
    """Past REPEAT_BURST lines of one kind in a period the rest are counted, then said in one line with
    the last of them; other kinds, and debug lines, are not held back."""
    limit = RepeatLimit(burst=3, period=0.2)
    out: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            out.append(record.getMessage())

    log = logging.getLogger("dlfs.test.repeat")
    keep = Keep()
    keep.addFilter(limit)
    log.addHandler(keep)
    log.propagate, log.level = False, logging.DEBUG
    try:
        for i in range(10):
            log.error("read of inode %d failed", i)
            log.debug("fetched %d", i)
        log.warning("another kind")
        assert [m for m in out if m.startswith("read")] == [
            "read of inode 0 failed", "read of inode 1 failed",
            "read of inode 2 failed (line 3 like it in 0.2 s: the rest are counted, not written)"]
        assert sum(m.startswith("fetched") for m in out) == 10 and "another kind" in out
        time.sleep(0.25)
        log.error("read of inode %d failed", 10)  # a new period: said first, then written
        assert out[-2].startswith("7 more lines like this were not written in the 0 s after ")
        assert out[-2].endswith("; the last: read of inode 9 failed") and out[-1] == "read of inode 10 failed"
        for i in range(5):
            log.error("read of inode %d failed", 11 + i)
        limit.flush()  # at exit: what is held back so far
        assert out[-1].startswith("3 more lines like this") and out[-1].endswith("read of inode 15 failed")
    finally:
        log.removeHandler(keep)
        log.propagate = True


@needs_fuse
@pytest.mark.timeout(120)
def test_a_mount_whose_reads_fail_through_an_outage_logs_a_bounded_amount(tmp_path: Path) -> None:
    """Every read failing (the node stopped, a reader skipping what fails) wrote two lines a read to the
    mount's log, 2.3 MB in 10 s: enough to fill a disk in a long outage."""
    from conftest import running_node

    src = tmp_path / "src"
    src.mkdir()
    for i in range(300):
        (src / f"f{i:03d}").write_bytes(os.urandom(20_000))
    with running_node(tmp_path / "home", tmp_path) as node:
        node.ingest(src, "out")
        log_file = tmp_path / "mount.log"
        mnt = node.mount("out", tmp_path / "mnt", "--no-short-circuit", "--cache-size", "16M", "--retry-timeout", "1",
                         "--log-file", str(log_file))
        os.kill(node.proc.pid, signal.SIGSTOP)
        failed = 0
        try:
            for name in sorted(os.listdir(mnt)) * 2:
                try:
                    (mnt / name).read_bytes()
                except OSError:
                    failed += 1
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        node.umount(mnt)
    assert failed >= 500
    lines = log_file.read_text().splitlines()
    failures = [line for line in lines if "read of inode" in line]
    assert REPEAT_BURST <= len(failures) <= REPEAT_BURST + 1, len(failures)
    said = [line for line in lines if "more lines like this were not written" in line]
    assert len(said) == 1 and "; the last: read of inode" in said[0], said
    assert int(said[0].split("]: ")[1].split()[0]) + REPEAT_BURST >= failed
