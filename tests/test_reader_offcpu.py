"""scripts/reader-offcpu.py: a reader's time off the CPU summed by why it left, from `perf script` text."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "reader-offcpu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reader_offcpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _switch(t: float, prev: str, pid: int, state: str, nxt: str, npid: int, frames: list[str]) -> str:
    head = (f"{prev:>16} {pid}/{pid} {t:.6f}: sched:sched_switch: prev_comm={prev} prev_pid={pid} prev_prio=120 "
            f"prev_state={state} ==> next_comm={nxt} next_pid={npid} next_prio=120")
    return "\n".join([head, *(f"\tffffffff8224{i:04x} {f}" for i, f in enumerate(frames))])


def test_time_off_the_cpu_is_summed_by_why_the_reader_left_it() -> None:
    mod = _load()
    page = ["__schedule", "schedule", "io_schedule", "folio_wait_bit_common", "filemap_get_pages", "filemap_read"]
    lookup = ["__schedule", "schedule", "request_wait_answer", "__fuse_simple_request", "fuse_lookup_name"]
    preempted = ["__schedule", "preempt_schedule_irq", "irqentry_exit", "filemap_read"]
    text = "\n\n".join([
        _switch(1.000, "python3", 7, "D", "dlfs-serve-0", 9, page),
        _switch(1.004, "dlfs-serve-0", 9, "S", "python3", 7, ["__schedule", "schedule"]),  # 4 ms for a page
        _switch(1.005, "python3", 7, "R", "dlfs-serve-1", 10, preempted),
        _switch(1.006, "dlfs-serve-1", 10, "S", "python3", 7, ["__schedule", "schedule"]),  # 1 ms preempted
        _switch(1.010, "python3", 7, "S", "swapper/0", 0, lookup),
        _switch(1.0102, "swapper/0", 0, "R", "python3", 7, []),  # 0.2 ms for a LOOKUP
        _switch(1.011, "python3", 7, "D", "swapper/0", 0, page),
        _switch(1.013, "swapper/0", 0, "R", "python3", 7, []),  # 2 ms for a page
    ])
    procs = mod.off_cpu(text)
    comm, seconds, times = procs[7]
    assert comm == "python3"
    assert seconds["waiting for a page"] == pytest.approx(0.006) and times["waiting for a page"] == 2
    assert seconds["preempted (in filemap_read)"] == pytest.approx(0.001)
    assert seconds["FUSE LOOKUP"] == pytest.approx(0.0002) and times["FUSE LOOKUP"] == 1
    assert 0 not in procs  # the idle task is no process of the command's
