#!/usr/bin/env python3
"""Where a reader's time goes when it is not on a CPU: a command run under `perf record -e
sched:sched_switch -a -g`, then, for its busiest processes, the time each spent off the CPU, by why it
left it (the kernel stack it was switched out from).

    echo 3 > /proc/sys/vm/drop_caches
    scripts/reader-offcpu.py -- python3 -c 'import sys; [open(p, "rb").read() for p in sys.argv[1:]]' /mnt/big/*

Run it on a dlfs mount and on local disk in the same state and compare: "waiting for a page" is the
reader waiting for data (a READ not answered yet, or the disk); "preempted" is the reader runnable
but pushed off its CPU (on a FUSE mount, typically by a serving thread woken on that CPU); "FUSE
LOOKUP" or "FUSE IOCTL" are round trips to the mount. Needs root and perf.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

SWITCH = re.compile(r"(\d+\.\d+): sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+) ==> "
                    r"next_comm=(.*?) next_pid=(\d+)")
# Frames that say nothing about why a task left its CPU.
SCHEDULING = {"__schedule", "schedule", "schedule_timeout", "io_schedule", "preempt_schedule",
              "preempt_schedule_common", "__cond_resched", "schedule_hrtimeout_range_clock",
              "preempt_schedule_irq", "raw_irqentry_exit_cond_resched", "irqentry_exit", "schedule_preempt_disabled"}
FUSE_OPS = {"fuse_lookup_name": "LOOKUP", "fuse_do_ioctl": "IOCTL", "fuse_send_open": "OPEN", "fuse_flush": "FLUSH",
            "fuse_do_getattr": "GETATTR", "fuse_readdir": "READDIR"}
SKIP_COMMS = ("perf", "swapper", "migration", "kworker", "rcu_", "ksoftirqd")


def why(state: str, frames: list[str]) -> str:
    """A switch-out's reason, in words, from its state and kernel stack."""
    if state.startswith("R"):
        top = next((f for f in frames if f not in SCHEDULING), "?")
        return f"preempted (in {top})"
    if "folio_wait_bit_common" in frames or "folio_wait_bit" in frames:
        return "waiting for a page"
    for frame, op in FUSE_OPS.items():
        if frame in frames:
            return f"FUSE {op}"
    return "<".join([f for f in frames if f not in SCHEDULING][:3]) or "?"


def off_cpu(script: str) -> dict[int, tuple[str, collections.Counter[str], collections.Counter[str]]]:
    """pid -> (comm, seconds off the CPU by reason, times by reason), from `perf script` output."""
    left: dict[int, tuple[float, str]] = {}
    out: dict[int, tuple[str, collections.Counter[str], collections.Counter[str]]] = {}
    for block in script.split("\n\n"):
        lines = block.strip().splitlines()
        m = SWITCH.search(lines[0]) if lines else None
        if not m:
            continue
        t, comm, pid, state, nxt = float(m.group(1)), m.group(2), int(m.group(3)), m.group(4), int(m.group(6))
        if pid and not comm.startswith(SKIP_COMMS):
            frames = [parts[1] for parts in (line.split() for line in lines[1:]) if len(parts) > 1]
            left[pid] = (t, why(state, frames))
            out.setdefault(pid, (comm, collections.Counter(), collections.Counter()))
        if nxt in left:
            since, reason = left.pop(nxt)
            out[nxt][1][reason] += t - since
            out[nxt][2][reason] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=2, help="processes shown, those off the CPU longest (default 2)")
    ap.add_argument("--comm", help="only processes of this name (default: the command's own, as the kernel "
                                   "names it; '' for any but the kernel's threads and perf)")
    ap.add_argument("--reasons", type=int, default=6, help="reasons shown per process (default 6)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("a command to run is needed, after --")
    perf = shutil.which("perf")
    if perf is None:
        print("reader-offcpu: perf is not installed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("reader-offcpu: recording every CPU's scheduler events needs root", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dlfs-offcpu-") as tmp:
        data = os.path.join(tmp, "sched.data")
        rc = subprocess.run([perf, "record", "-q", "-e", "sched:sched_switch", "-a", "-g", "-o", data, "--", *command],
                            stdout=sys.stdout, stderr=subprocess.DEVNULL).returncode
        if not os.path.exists(data):
            print(f"reader-offcpu: perf recorded nothing (the command exited {rc})", file=sys.stderr)
            return 2
        script = subprocess.run([perf, "script", "-i", data, "-F", "comm,pid,tid,time,event,trace,ip,sym"],
                                capture_output=True, text=True).stdout
    procs = off_cpu(script)
    comm = os.path.basename(command[0])[:15] if args.comm is None else args.comm  # (the kernel keeps 15 bytes)
    shown = sorted((p for p in procs.items() if not comm or p[1][0] == comm),
                   key=lambda p: -sum(p[1][1].values()))[: args.top]
    for pid, (comm, seconds, times) in shown:
        print(f"{comm} ({pid}): {sum(seconds.values()):.3f} s off the CPU, {sum(times.values())} times")
        for reason, s in seconds.most_common(args.reasons):
            print(f"  {s:8.3f} s {times[reason]:7d}x  {reason}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
