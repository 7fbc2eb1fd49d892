"""dlfs.direct pin rows against a real mount: a client whose connection ends while its process and
views live keeps its row (and its views their bytes) until it is gone; a row is handed on only then;
a reply the client never received leaves no pin behind; a client can write no row but its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Node, needs_fuse

import dlfs.direct
from dlfs.direct import DirectReader

pytestmark = needs_fuse
TINY = ("--cache-size", "1M", "--readahead", "64K")  # 16 slabs of 64 KiB
SHARED = [f"a/f{i}" for i in range(8)]  # read by both clients
OWN = [f"b/f{i}" for i in range(8)]  # read by client 1 alone
CHURN = [f"c/f{i:03d}" for i in range(150)]  # 3 MB: every slab not pinned is reused


def _bytes(rel: str) -> bytes:
    return rel.encode().ljust(32, b"#") * 600  # 19 KB that name their file


@pytest.fixture(scope="module")
def mnt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    from conftest import force_unmount, running_node

    base = tmp_path_factory.mktemp("rows")
    for rel in SHARED + OWN + CHURN:
        (base / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / "src" / rel).write_bytes(_bytes(rel))
    with running_node(base / "home", base) as node:
        node.ingest(base / "src", "rows", "--chunk-size", "64K")
        mountpoint = node.mount("rows", base / "mnt", *TINY)
        try:
            yield node, mountpoint
        finally:
            force_unmount(base)


# Client 1: a process that holds views, takes commands on stdin and answers a JSON line each.
CLIENT = textwrap.dedent("""
    import json, os, socket, sys
    import dlfs.direct
    from dlfs.wire.protocol import RESPONSE, Frame, Msg, encode_frame

    mnt = sys.argv[1]
    r = dlfs.direct.connect(mnt)
    views = {}
    say = lambda **kw: print(json.dumps(kw), flush=True)
    say(row=r.row)
    for line in sys.stdin:
        cmd, *rels = line.split()
        if cmd == "read":
            views.update(zip(rels, r.read_many([os.path.join(mnt, rel) for rel in rels])))
            say(row_pins=r._shared.row_pins(r.row))
        elif cmd == "protocol-error":  # the mount ends a connection that sends it a response
            r._sock.sendall(encode_frame(Frame(RESPONSE, Msg.DIRECT_STATS, 1, 0, {})))
            say(ended=r._sock.recv(1) == b"")
        elif cmd == "unread":  # ask for records, then read no answer: the mount's send fails (EPIPE)
            ext = {p.decode(): n.ref for p, n in r.index.walk()}
            r._sock.shutdown(socket.SHUT_RD)
            r._send(Msg.DIRECT_READ, {"exts": [ext[rel] for rel in rels]})
            say(sent=True)
        elif cmd == "check":
            say(bad=[rel for rel, v in views.items() if v != (rel.encode().ljust(32, b"#") * 600)])
        elif cmd == "release":
            for v in views.values():
                v.release()
            views.clear()
            say(row_pins=r._shared.row_pins(r.row))
        elif cmd == "exit":
            os._exit(0)  # no clean-up: the mount learns of it from the process being gone
""")


class Client:
    def __init__(self, node: Node, mountpoint: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(mountpoint)], env=node.env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.row = self._answer()["row"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"client 1 exited with {self.proc.wait(timeout=10)}"
        return json.loads(line)

    def __call__(self, *words: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def _until(reader: DirectReader, holds: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
    """The mount's statistics once `holds` is true of them (bounded)."""
    deadline = time.monotonic() + timeout
    while not holds(stats := reader.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def _churn(reader: DirectReader, mountpoint: Path) -> None:
    """Read every churn file, a batch at a time, letting each go: every slab nobody pins is reused."""
    for i in range(0, len(CHURN), 25):
        views = reader.read_many([mountpoint / rel for rel in CHURN[i : i + 25]])
        assert [bytes(v) for v in views] == [_bytes(rel) for rel in CHURN[i : i + 25]]
        for v in views:
            v.release()


def _read(reader: DirectReader, mountpoint: Path, rels: list[str]) -> list[memoryview]:
    views = reader.read_many([mountpoint / rel for rel in rels])
    assert [bytes(v) for v in views] == [_bytes(rel) for rel in rels]
    return views


def test_a_row_is_not_handed_on_while_its_process_lives(mnt: tuple[Node, Path]) -> None:
    """Client 1 holds views; the mount ends its connection (a protocol error); client 2 attaches and
    pins the same slabs. Client 1's views keep their bytes through churn, its releases take nothing of
    client 2's, no count wraps; its row goes back to the pool once its process exits."""
    node, mountpoint = mnt
    with dlfs.direct.connect(mountpoint) as watcher:
        assert isinstance(watcher, DirectReader)
        before = watcher.stats()
        one = Client(node, mountpoint)
        try:
            assert one("read", *SHARED, *OWN)["row_pins"] > 0
            assert one("protocol-error") == {"ended": True}  # the mount is done with the connection

            with dlfs.direct.connect(mountpoint) as two:
                assert isinstance(two, DirectReader)
                mine = _read(two, mountpoint, SHARED)  # warm: pinned where client 1 pinned them
                pins = two._shared.row_pins(two.row)
                assert pins > 0
                _churn(watcher, mountpoint)
                assert one("check") == {"bad": []}  # its slabs stayed pinned though its connection ended

                assert one("release") == {"row_pins": 0}  # in its own row, and none below zero
                assert two._shared.row_pins(two.row) == pins
                _churn(watcher, mountpoint)
                assert [bytes(v) for v in mine] == [_bytes(rel) for rel in SHARED]
                del mine
                assert two.row != one.row
                held = watcher.stats()
                assert held["direct_rows_held"] == 1 and held["direct_clients"] == before["direct_clients"] + 2
                assert held["direct_refused_releases"] == before["direct_refused_releases"]

                one.exit()
                after = _until(watcher, lambda s: s["direct_rows_held"] == 0)
                assert after["direct_rows_held"] == 0
                assert after["direct_clients"] == before["direct_clients"] + 1  # client 2
                with dlfs.direct.connect(mountpoint) as three:
                    assert isinstance(three, DirectReader) and three.row == one.row  # back in the pool
        finally:
            one.kill()


def test_a_reply_never_received_leaves_no_pin(mnt: tuple[Node, Path]) -> None:
    """Client 1 asks for records pinned in the cache and reads no answer (the mount's send fails): the
    mount lets go of the pins it took for that answer, and keeps only the ones client 1's views hold."""
    node, mountpoint = mnt
    with dlfs.direct.connect(mountpoint) as watcher:
        assert isinstance(watcher, DirectReader)
        _read(watcher, mountpoint, SHARED + OWN)  # cached, and let go
        before = watcher.stats()
        one = Client(node, mountpoint)
        try:
            views_pins = one("read", *SHARED)["row_pins"]
            assert views_pins > 0
            assert one("unread", *OWN) == {"sent": True}
            _until(watcher, lambda s: s.get("direct_rows_held") == 1)
            assert watcher._shared.row_pins(one.row) == views_pins
            assert one("release") == {"row_pins": 0}
            one.exit()
            after = _until(watcher, lambda s: s.get("direct_rows_held") == 0)
            assert after["direct_reclaimed_pins"] == before["direct_reclaimed_pins"]
        finally:
            one.kill()


# A client that writes outside its own row of the control region: the write must fault.
WRITER = textwrap.dedent("""
    import ctypes, struct, sys
    import dlfs.direct
    r = dlfs.direct.connect(sys.argv[1])
    maps = [line.split() for line in open("/proc/self/maps") if "dlfs-cache-control" in line]
    spans = [(int(m[0].split("-")[0], 16), int(m[0].split("-")[1], 16), m[1], int(m[2], 16)) for m in maps]
    base = next(lo for lo, _, _, off in spans if off == 0)
    n_rows, rows, stride = (struct.unpack_from("<8sII10Q", ctypes.string_at(base, 128))[i] for i in (2, 10, 11))
    writable = [(lo - base, hi - lo) for lo, hi, perms, _ in spans if "w" in perms]
    assert writable == [(rows + r.row * stride, stride)], (writable, r.row)
    own = base + rows + r.row * stride + stride - 1  # the last byte of its own span: padding
    ctypes.memset(own, 0, 1)
    print("own row written", flush=True)
    other = (r.row + 1) % n_rows
    ctypes.memset(base + rows + other * stride + stride - 1, 0, 1)
    print("another row written", flush=True)
""")


def test_a_client_can_write_no_row_but_its_own(mnt: tuple[Node, Path]) -> None:
    node, mountpoint = mnt
    proc = subprocess.run([sys.executable, "-c", WRITER, str(mountpoint)], env=node.env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.splitlines() == ["own row written"], proc.stderr
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS), proc.returncode
