"""What a daemon bounds about its connections (wire/limits.py, rpc.py, protocol.py): half-open
connections capped with the oldest dropped first, accept failures paused and logged once, declared
payloads never allocated before they arrive, stalled frames and idle connections closed, and the
client's pool reopening before the daemon's idle close. Real sockets on localhost, real daemons."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import DLFS, REPO, dlfs_env, stop_node, trio_wait_for, wait_for_node
from prometheus_client import generate_latest
from test_node_memory import serving
from test_services import _closed_by_peer

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster, NodeSpec, ensure_home_key, runtime_file
from dlfs.errors import AuthError, Unreachable
from dlfs.metrics import MAX_SCRAPES, NodeCollector, registry_of, serve_metrics
from dlfs.procs import raise_open_files_limit
from dlfs.transport.base import Address
from dlfs.wire import auth, limits, protocol, rpc
from dlfs.wire.protocol import HEADER, MAGIC, MAX_DATA, REQUEST, VERSION, FrameStream, Msg
from dlfs.wire.rpc import Service, connect

KEY = b"L" * 32
MiB = 1 << 20


class Plain(Service):
    """A daemon answering PING and TIME only, under the data daemon's name (what clients ask for)."""

    name = "data"




async def half_open(address: Address, source: str) -> trio.SocketStream:
    """A connection from `source` that takes the daemon's HELLO (so the daemon has admitted it) and
    says nothing."""
    stream = await trio.open_tcp_stream(address.host, address.port, local_address=source)
    hello = await FrameStream(stream, "daemon").receive()
    assert hello.msg == Msg.HELLO
    return stream


def dlfs_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dlfs") and r.levelno >= logging.INFO]


@pytest.mark.timeout(30)
async def test_half_open_caps_drop_the_oldest_and_a_client_still_gets_in(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(limits, "MAX_HALF_OPEN", 8)
    monkeypatch.setattr(limits, "MAX_HALF_OPEN_PER_PEER", 4)
    caplog.set_level(logging.INFO, logger="dlfs")
    svc = Plain(KEY, "n")
    assert (svc.half_open.total, svc.half_open.per_peer) == (8, 4)
    async with serving(svc) as address:
        a = [await half_open(address, "127.0.0.2") for _ in range(4)]
        b = [await half_open(address, "127.0.0.3") for _ in range(4)]
        assert len(svc.half_open) == 8 and svc.conns.handshake_failures["cap"] == 0
        # A fifth from one address: that address's oldest goes.
        b.append(await half_open(address, "127.0.0.3"))
        assert await _closed_by_peer(b[0], 5)
        # A new address past the total: the oldest of all goes.
        c = await half_open(address, "127.0.0.4")
        assert await _closed_by_peer(a[0], 5)
        assert svc.conns.handshake_failures["cap"] == 2
        for stream in (*a[1:], *b[1:], c):
            assert not await _closed_by_peer(stream, 0.05), "a newer half-open connection was dropped"

        # A flood from many addresses, held open: the daemon keeps 8 and a real client gets in.
        flood = []
        for i in range(300):
            flood.append(await trio.open_tcp_stream(address.host, address.port, local_address=f"127.0.1.{i % 50 + 1}"))
        await trio_wait_for(lambda: svc.conns.handshake_failures["cap"] == 2 + 300, 10,
                            "the daemon to drop a connection for each of the flood's")
        with trio.fail_after(10):
            async with connect(address, KEY, "data") as conn:
                assert (await conn.call(Msg.PING))[0]["node"] == "n"
        assert len(svc.half_open) <= 8 and svc.conns.accept_errors == 0
        for stream in (*a, *b, c, *flood):
            await stream.aclose()
    lines = dlfs_lines(caplog)
    assert len(lines) <= 3, lines  # 310 connections dropped or closed: counted, not logged one by one
    assert not any("Too many open files" in line for line in lines)


@pytest.mark.timeout(30)
async def test_failed_handshakes_are_counted_and_logged_once_per_interval(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.3)
    caplog.set_level(logging.INFO, logger="dlfs")
    svc = Plain(KEY, "n")
    async with serving(svc) as address:
        for _ in range(5):
            with pytest.raises(AuthError, match="wrong cluster key"):
                async with connect(address, b"W" * 32, "data"):
                    pass
        silent = [await half_open(address, "127.0.0.1") for _ in range(3)]
        for stream in silent:
            assert await _closed_by_peer(stream, 5)
            await stream.aclose()
    assert svc.conns.handshake_failures["wrong_key"] == 5
    assert svc.conns.handshake_failures["timeout"] == 3
    scraped = generate_latest(registry_of(NodeCollector("n1", [svc]))).decode()
    assert 'dlfs_handshake_failures_total{node="n1",reason="wrong_key",service="data"} 5.0' in scraped
    assert 'dlfs_handshake_failures_total{node="n1",reason="timeout",service="data"} 3.0' in scraped
    assert 'dlfs_connections{node="n1",service="data",state="half_open"} 0.0' in scraped
    lines = dlfs_lines(caplog)
    assert sum("wrong cluster key" in line for line in lines) == 1, lines
    timeouts = [line for line in lines if "handshake not finished within 0.3 s" in line]
    assert len(timeouts) == 1, lines


@pytest.mark.timeout(60)
async def test_out_of_descriptors_the_daemon_pauses_logs_once_and_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `dlfs node` with 64 descriptors, sent more authenticated connections than it can take."""
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 2.0)  # the client's wait for a connection not accepted
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "node.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen(["prlimit", "--nofile=64:64", *DLFS, "node"], env=dlfs_env(home), stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for_node(home, proc, log)
        data = Address.parse(json.loads(runtime_file(home).read_text())["data"])
        key = ensure_home_key(home)
        held = 0

        async def hold(task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                async with connect(data, key, "data", timeout=2):
                    task_status.started(True)
                    await trio.sleep_forever()
            except Unreachable:
                task_status.started(False)

        async with trio.open_nursery() as n:
            # One at a time (all at once, the half-open cap would drop most), until one is not taken.
            while held < 70 and await n.start(hold):
                held += 1
            assert held < 70, "the node took 70 connections with 64 descriptors"
            # Until the accept loop has failed and said so; it keeps failing meanwhile.
            await trio_wait_for(lambda: "cannot accept connections: Too many open files" in log.read_text(), 20,
                                "the node to log that it cannot accept connections")
            n.cancel_scope.cancel()
        with trio.fail_after(10):
            while True:  # descriptors free again: the node takes connections at once
                try:
                    async with connect(data, key, "data", timeout=2) as conn:
                        assert (await conn.call(Msg.PING))[0]["node"] == "local"
                    break
                except Unreachable:
                    await trio.sleep(0.2)
    finally:
        rc = stop_node(proc)
    text = log.read_text(errors="replace")
    assert rc == 0, text
    assert "up to 64 open files" in text
    failing = [line for line in text.splitlines() if "cannot accept connections: Too many open files" in line]
    assert 1 <= len(failing) <= 2, text  # one line per LOG_INTERVAL, however often accept failed
    assert "Traceback" not in text and len(text.splitlines()) < 30, text


@pytest.mark.timeout(30)
async def test_a_declared_payload_is_not_allocated_and_a_stalled_frame_ends_its_connection(
        mock_clock: trio.testing.MockClock) -> None:
    # Time moves only when the test moves it: the stalled frame ends its connection at FRAME_STALL, not before.
    svc = Plain(KEY, "n")
    async with serving(svc) as address, connect(address, KEY, "data") as conn:
        tracemalloc.start()
        try:
            # A request declaring the largest payload there is, 64 KiB of it, then silence.
            await conn.fs.stream.send_all(HEADER.pack(MAGIC, VERSION, REQUEST, Msg.PUT_CHUNK, 0, 7, 0, MAX_DATA)
                                          + bytes(64 << 10))
            await trio.testing.wait_all_tasks_blocked(0.05)  # the daemon took what came and waits for more
            mock_clock.jump(protocol.FRAME_STALL - 0.01)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert not conn.done.is_set() and svc.conns.closed["stall"] == 0
            mock_clock.jump(0.02)
            await trio_wait_for(conn.done.is_set, 15, "the daemon to close the stalled connection")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * MiB, f"{peak} bytes allocated for a frame with 64 KiB of its 320 MiB received"
    assert svc.conns.closed["stall"] == 1
    assert svc.memory.reserved == 0  # its reservation went with it


@pytest.mark.timeout(30)
async def test_a_frame_arriving_in_pieces_lands_whole_in_a_buffer_that_grows_with_it() -> None:
    a, b = trio.socket.socketpair()
    sender, receiver = trio.SocketStream(a), FrameStream(trio.SocketStream(b), "sender")
    receiver.authenticated()
    payload = os.urandom(5 * MiB + 3)
    wire = HEADER.pack(MAGIC, VERSION, REQUEST, Msg.PUT_CHUNK, 0, 9, 0, len(payload)) + payload

    async def send() -> None:
        for at in range(0, len(wire), 700_001):
            await sender.send_all(wire[at : at + 700_001])
            await trio.testing.wait_all_tasks_blocked()  # the receiver took this piece and waits for the next

    async with trio.open_nursery() as n:
        n.start_soon(send)
        f = await receiver.receive()
    assert f.req_id == 9 and f.data == payload


@pytest.mark.timeout(30)
async def test_idle_connections_are_closed_and_the_pool_reopens_before(mock_clock: trio.testing.MockClock) -> None:
    # Time moves only when the test moves it: an idle connection is closed at IDLE_TIMEOUT, not before.
    svc = Plain(KEY, "n")
    async with serving(svc) as address:
        async with connect(address, KEY, "data") as conn:
            await conn.call(Msg.PING)
            await trio.testing.wait_all_tasks_blocked(0.05)
            mock_clock.jump(rpc.IDLE_TIMEOUT - 0.01)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert not conn.done.is_set() and svc.conns.closed["idle"] == 0
            mock_clock.jump(0.02)
            await trio_wait_for(conn.done.is_set, 10, "the daemon to close the idle connection")
        assert svc.conns.closed["idle"] == 1

        async with trio.open_nursery() as n:
            client = ClusterClient(Cluster([NodeSpec("n", address, address)], KEY, 1, "test", local="n"), n)
            spec = client.cluster.node("n")
            await client.call(spec, "data", Msg.PING)
            first = await client.connection(spec, "data")
            mock_clock.jump(0.6 * rpc.IDLE_TIMEOUT)  # over half the timeout: the client reopens rather than race the daemon
            await client.call(spec, "data", Msg.PING)
            second = await client.connection(spec, "data")
            assert second is not first and first.closed is not None
            mock_clock.jump(1.5 * rpc.IDLE_TIMEOUT)  # past the timeout: the daemon closes it; the call still succeeds
            await trio_wait_for(lambda: second.closed is not None, 10, "the daemon to close the pool's idle connection")
            assert svc.conns.closed["idle"] == 2
            assert (await client.call(spec, "data", Msg.TIME))[0]["node"] == "n"
            assert not client.health
            n.cancel_scope.cancel()


@pytest.mark.timeout(30)
async def test_a_flood_on_the_metrics_port_is_capped_and_a_scrape_still_answers() -> None:
    svc = Plain(KEY, "n")
    async with trio.open_nursery() as n:
        bound = await n.start(serve_metrics, Address("127.0.0.1", 0), registry_of(NodeCollector("n1", [svc])))
        flood = [await trio.open_tcp_stream(bound.host, bound.port, local_address=f"127.0.2.{i % 20 + 1}")
                 for i in range(3 * MAX_SCRAPES)]
        closed = []

        async def watch(stream: trio.SocketStream) -> None:
            closed.append(await _closed_by_peer(stream, 2))

        async with trio.open_nursery() as watching:  # the oldest are closed for the newer ones
            for stream in flood:
                watching.start_soon(watch, stream)
        assert sum(closed) == 2 * MAX_SCRAPES
        stream = await trio.open_tcp_stream(bound.host, bound.port)
        await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b""
        with trio.fail_after(10):
            while more := await stream.receive_some(65536):
                answer += more
        assert answer.startswith(b"HTTP/1.1 200 OK") and b"dlfs_connections" in answer
        for s in (*flood, stream):
            await s.aclose()
        n.cancel_scope.cancel()


def test_the_node_raises_its_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
