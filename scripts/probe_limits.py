#!/usr/bin/env python3
"""Probe a real node's connection limits as an attacker would (issue 15's targets).

Starts `dlfs node` under a temporary DLFS_HOME (with metrics), then:

1. floods its data daemon with unauthenticated connections held open (6,000 by default, from 100
   loopback addresses; the node drops the oldest over its caps, and the flood opens them again) and
   times legitimate requests meanwhile: a PING on a connection opened before, and a new connection's
   handshake and PING. Reports the slowest of each, EMFILE lines in the node's log and how many lines
   the log grew by (targets: < 1 s, no EMFILE, < 100 lines);
2. opens 8 authenticated connections that each send a frame header declaring the largest payload
   (320 MiB) and then nothing, and reports the node's resident memory (target: < 256 MiB) and when
   the node closed them (its frame stall bound).

    .venv/bin/python scripts/probe_limits.py
    .venv/bin/python scripts/probe_limits.py --connections 6000 --seconds 30 --sources 1

The probe raises its own open-files limit to the hard limit; exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import running_node  # noqa: E402

from dlfs.config import ensure_home_key, runtime_file  # noqa: E402
from dlfs.errors import DlfsError  # noqa: E402
from dlfs.transport.base import Address  # noqa: E402
from dlfs.wire.auth import client_handshake  # noqa: E402
from dlfs.wire.protocol import FRAME_STALL, HEADER, MAGIC, MAX_DATA, REQUEST, VERSION, Frame, FrameStream, Msg  # noqa: E402
from dlfs.wire.rpc import connect  # noqa: E402

MiB = 1 << 20
OPEN_BOUND = 60.0  # seconds the flood takes at most to open its connections


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class Flood:
    """`n` connections that never start the handshake, spread over loopback source addresses; each
    one the node closes is opened again after `again` seconds. Runs in a process of its own."""

    def __init__(self, address: Address, n: int, sources: int, again: float) -> None:
        self.address, self.n, self.sources, self.again = address, n, sources, again
        self.open = 0
        self.opened = 0
        self.failed = 0

    async def run(self) -> None:
        """Open them all (for at most OPEN_BOUND seconds), say so on stdout, hold them until SIGTERM,
        then print the counts."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as n:
                n.start_soon(self._open_all, n)
                async for _ in signals:
                    break
                print(json.dumps({"opened": self.opened, "open": self.open, "failed": self.failed}), flush=True)
                n.cancel_scope.cancel()

    async def _open_all(self, nursery: trio.Nursery) -> None:
        t0 = time.perf_counter()
        started = 0
        with trio.move_on_after(OPEN_BOUND):
            for i in range(self.n):
                await nursery.start(self._one, f"127.0.{2 + i % self.sources // 250}.{1 + i % self.sources % 250}")
                started += 1
        print(json.dumps({"ready": time.perf_counter() - t0, "started": started}), flush=True)

    async def _one(self, source: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                stream = await trio.open_tcp_stream(self.address.host, self.address.port, local_address=source)
            except OSError:
                self.failed += 1
            else:
                self.opened += 1
                self.open += 1
                if not started:
                    started = True
                    task_status.started()
                try:
                    while await stream.receive_some(4096):  # the HELLO, then the node's close
                        pass
                except trio.BrokenResourceError:
                    pass
                finally:
                    self.open -= 1
                    await stream.aclose()
            if not started:
                started = True
                task_status.started()
            await trio.sleep(self.again)


async def timed_new_ping(address: Address, key: bytes) -> tuple[float, float]:
    """(seconds to TCP-connect, seconds to connect, finish the handshake and get a PING answered)."""
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream(address.host, address.port)
    tcp = time.perf_counter() - t0
    fs = FrameStream(stream, str(address))
    try:
        with trio.fail_after(30):
            await client_handshake(fs, key, "data")
            await fs.send(Frame(REQUEST, Msg.PING, 1))
            if (await fs.receive()).status:
                raise DlfsError("PING refused")
    except (trio.TooSlowError, trio.EndOfChannel, trio.BrokenResourceError, OSError) as exc:
        raise DlfsError(f"new connection failed: {type(exc).__name__}") from None
    finally:
        await fs.aclose()
    return tcp, time.perf_counter() - t0


async def probe_flood(args: argparse.Namespace, pid: int, data: Address, key: bytes, log: Path, port: int) -> bool:
    """The flood comes from another process (an attacker's own CPU), the requests timed from this one."""
    lines0 = len(log.read_text(errors="replace").splitlines())
    async with connect(data, key, "data") as held:
        t0 = time.perf_counter()
        await held.call(Msg.PING)
        base = time.perf_counter() - t0
        print(f"before: PING {base * 1000:.1f} ms, node RSS {rss(pid)[0] / MiB:.0f} MiB, "
              f"{len(list(Path(f'/proc/{pid}/fd').iterdir()))} descriptors")
        flood = subprocess.Popen([sys.executable, __file__, "--flood", str(data), "--connections", str(args.connections),
                                  "--sources", str(args.sources), "--again", str(args.again)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None
            ready = json.loads(await trio.to_thread.run_sync(flood.stdout.readline))
            print(f"flood: {ready['started']} connections opened in {ready['ready']:.1f} s from {args.sources} "
                  "address(es), "
                  f"each opened again {args.again:g} s after the node drops it; held for {args.seconds:g} s")
            cpu0 = cpu_seconds(pid)
            took_held: list[float] = []
            took_new: list[float] = []
            took_tcp: list[float] = []
            failures: list[str] = []
            end = time.perf_counter() + args.seconds
            rounds = 0
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                try:
                    await held.call(Msg.PING, timeout=30)
                    took_held.append(time.perf_counter() - t0)
                    tcp, total = await timed_new_ping(data, key)
                    took_tcp.append(tcp)
                    took_new.append(total)
                except DlfsError as exc:
                    failures.append(str(exc))
                rounds += 1
                await trio.sleep(0.5)
            fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
            cpu = (cpu_seconds(pid) - cpu0) / args.seconds
        finally:
            flood.terminate()
            out, _ = flood.communicate(timeout=60)
    counts = json.loads(out.strip().splitlines()[-1])
    text = log.read_text(errors="replace").splitlines()
    grown = len(text) - lines0
    emfile = sum("Too many open files" in line or "EMFILE" in line for line in text)
    print(f"during: {rounds} rounds of requests; the flood opened {counts['opened']} connections "
          f"({counts['open']} open at its end, {counts['failed']} refused); node {fds} descriptors, "
          f"{cpu:.0%} of a CPU, "
          f"RSS {rss(pid)[0] / MiB:.0f} MiB")
    print(f"  dropped for the caps {metric(port, 'dlfs_handshake_failures_total', service='data', reason='cap'):.0f}, "
          f"handshake timeouts {metric(port, 'dlfs_handshake_failures_total', service='data', reason='timeout'):.0f}, "
          f"accept errors {metric(port, 'dlfs_accept_errors_total', service='data'):.0f}")
    worst_held, worst_new = max(took_held, default=0.0), max(took_new, default=0.0)
    ok_held, ok_new = worst_held < 1 and not failures, worst_new < 1 and not failures
    print(f"  slowest PING on a held connection   {worst_held * 1000:8.1f} ms  (target < 1000 ms) "
          f"{'ok' if ok_held else 'MISSED'}; median {statistics.median(took_held or [0]) * 1000:.1f} ms")
    print(f"  slowest new connection + PING       {worst_new * 1000:8.1f} ms  (target < 1000 ms) "
          f"{'ok' if ok_new else 'MISSED'}; median {statistics.median(took_new or [0]) * 1000:.1f} ms")
    print(f"    of which the TCP connect          {max(took_tcp, default=0) * 1000:8.1f} ms  (slowest); "
          f"median {statistics.median(took_tcp or [0]) * 1000:.1f} ms")
    print(f"  EMFILE lines in the node's log      {emfile:8d}     (target 0) {'ok' if not emfile else 'MISSED'}")
    print(f"  node log grew by                    {grown:8d} lines (target < 100) {'ok' if grown < 100 else 'MISSED'}")
    for f in failures[:5]:
        print(f"  failed: {f}")
    return ok_held and ok_new and not emfile and grown < 100


async def probe_frames(args: argparse.Namespace, pid: int, data: Address, key: bytes) -> bool:
    before, _ = rss(pid)
    async with trio.open_nursery() as n:
        conns = []
        for i in range(args.declared):
            conns.append(await n.start(_declare, data, key, i))
        await trio.sleep(2)
        now, peak = rss(pid)
        ok = now < 256 * MiB and peak < 256 * MiB
        print(f"{args.declared} authenticated connections each declaring {MAX_DATA // MiB} MiB, then silent:")
        print(f"  node RSS {before / MiB:.0f} MiB before, {now / MiB:.0f} MiB after 2 s, peak {peak / MiB:.0f} MiB "
              f"(target < 256 MiB) {'ok' if ok else 'MISSED'}")
        if args.wait_stall:
            t0 = time.perf_counter()
            with trio.move_on_after(FRAME_STALL * 3):
                for done in conns:
                    await done.wait()
            left = sum(not d.is_set() for d in conns)
            print(f"  closed by the node after {time.perf_counter() - t0 + 2:.0f} s (stall bound {FRAME_STALL:g} s, "
                  f"memory wait before it for all but the first); {left} still open")
            ok = ok and not left
        n.cancel_scope.cancel()
    return ok


async def _declare(address: Address, key: bytes, i: int,
                   task_status: trio.TaskStatus[trio.Event] = trio.TASK_STATUS_IGNORED) -> None:
    async with connect(address, key, "data") as conn:
        await conn.fs.stream.send_all(HEADER.pack(MAGIC, VERSION, REQUEST, Msg.PUT_CHUNK, 0, 1000 + i, 0, MAX_DATA))
        task_status.started(conn.done)
        await conn.done.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=6000, help="unauthenticated connections held (6000)")
    ap.add_argument("--sources", type=int, default=100, help="loopback addresses they come from (100)")
    ap.add_argument("--again", type=float, default=5.0, help="seconds before the flood reopens a dropped one (5)")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the flood is held (30)")
    ap.add_argument("--declared", type=int, default=8, help="connections declaring a 320 MiB frame (8)")
    ap.add_argument("--wait-stall", action="store_true", help="also wait for the node to close those")
    ap.add_argument("--flood", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the flood's own process
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < args.connections + 200:
        raise SystemExit(f"probe: the open files limit ({hard}) is below {args.connections + 200}; raise `ulimit -Hn`")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.flood:
        trio.run(Flood(Address.parse(args.flood), args.connections, args.sources, args.again).run)
        return 0
    with tempfile.TemporaryDirectory(prefix="dlfs-probe-") as tmp:
        port = free_port()
        home = Path(tmp) / "home"
        with running_node(home, Path(tmp), f"--metrics=127.0.0.1:{port}") as node:
            doc = json.loads(runtime_file(home).read_text())
            pid, data, key = int(doc["pid"]), Address.parse(doc["data"]), ensure_home_key(home)
            ok = trio.run(probe_flood, args, pid, data, key, node.log, port)
            if args.declared:
                ok = trio.run(probe_frames, args, pid, data, key) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
