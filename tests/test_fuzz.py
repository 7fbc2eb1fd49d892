"""Fuzzed frames against a real node's daemons and a real mount's control socket (tests/fuzzlab.py):
afterwards the processes live, serve the dataset ingested before byte for byte, no exchange hung, and
no log holds a traceback. A short round (about 2,000 frames); scripts/fuzz.py runs a long one.

The seed is random unless DLFS_FUZZ_SEED is set, and every failure names it:
    DLFS_FUZZ_SEED=<seed> .venv/bin/python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from conftest import Node, mount_pids, needs_fuse, pid_alive, running_node
from fuzzlab import (
    CHECK_NAME,
    INGEST_ARGS,
    Pools,
    Tally,
    Target,
    daemon_targets,
    fuzz_round,
    log_marks,
    log_problems,
    make_source,
    problems_after,
)

from dlfs.direct import CONTROL_XATTR
from dlfs.wire.protocol import Msg

SEED = int(os.environ.get("DLFS_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
DAEMON_FRAMES = 700  # each of meta and data
CONTROL_FRAMES = 600


@dataclass
class Lab:
    node: Node
    base: Path
    files: dict[str, bytes]
    meta: Target
    data: Target
    pools: Pools


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A node with the check dataset ingested; the fuzzer's pools filled from its index."""
    base = tmp_path_factory.mktemp("fuzz")
    files = make_source(base / "src", SEED)
    with running_node(base / "home", base) as node:
        node.ingest(base / "src", CHECK_NAME, *INGEST_ARGS)
        meta, data, pools = daemon_targets(node.home, base / "index")
        yield Lab(node, base, files, meta, data, pools)


def logs(lab: Lab) -> dict[Path, int]:
    return log_marks([lab.node.log, lab.node.mount_log(CHECK_NAME)])


def after_fuzzing(lab: Lab, marks: dict[Path, int], tally: Tally, mnt: Path | None = None) -> None:
    pids = {"node": lab.node.proc.pid}
    if mnt is not None:
        pids |= {f"mount #{i}": p for i, p in enumerate(mount_pids(lab.node.home), 1)}
    problems = problems_after(tally, pids, pid_alive, marks, lab.meta, lab.data, lab.files, mnt)
    report = "\n".join([*problems[:30], *tally.lines()])
    assert not problems, f"fuzz seed {SEED} (replay: DLFS_FUZZ_SEED={SEED}):\n{report}"


@pytest.mark.timeout(90)
def test_fuzzed_frames_leave_both_daemons_serving_right_bytes(lab: Lab) -> None:
    marks = logs(lab)
    tally = fuzz_round([lab.meta, lab.data], {"meta": DAEMON_FRAMES, "data": DAEMON_FRAMES}, SEED, lab.pools)
    after_fuzzing(lab, marks, tally)
    # The round reached both sides of the door: daemons answered requests and closed connections.
    for t in ("meta", "data"):
        assert tally.frames[t] >= DAEMON_FRAMES and tally.closed[t] and tally.kept[t], tally.lines()


@needs_fuse
@pytest.mark.timeout(90)
def test_fuzzed_control_socket_leaves_the_mount_serving_right_bytes(lab: Lab) -> None:
    mnt = lab.node.mount(CHECK_NAME, lab.base / "mnt")
    try:
        marks = logs(lab)
        control = Target("control", os.fsdecode(os.getxattr(mnt, CONTROL_XATTR)))
        tally = fuzz_round([control], {"control": CONTROL_FRAMES}, SEED, lab.pools)
        after_fuzzing(lab, marks, tally, mnt)
        assert tally.frames["control"] >= CONTROL_FRAMES, tally.lines()
        # Attached (descriptors came), answered, and closed on garbage.
        assert tally.fds and tally.kept["control"] and tally.closed["control"], tally.lines()
    finally:
        lab.node.umount(mnt)


@pytest.mark.timeout(30)
def test_read_index_past_the_end_is_an_empty_piece(lab: Lab) -> None:
    """Found by fuzzing: these once got an internal error (EINVAL from seek) and a traceback."""
    marks = logs(lab)

    async def replay() -> None:
        wire = await lab.meta.connect()
        try:
            # READ_INDEX past the end, and past what lseek accepts (EINVAL): an empty piece.
            for offset in (1 << 40, 2**63 - 1):
                ask = {"name": CHECK_NAME, "version": 1, "offset": offset, "length": 10}
                assert (await wire.answer(Msg.READ_INDEX, ask)).data == b""
        finally:
            wire.close()

    trio.run(replay)
    assert not log_problems(marks)
