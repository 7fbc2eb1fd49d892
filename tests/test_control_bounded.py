"""Bounded control state against a real etcd: dlfs compacts etcd's history itself, an ingest writes
one pin key per session (not one per chunk), a NOSPACE alarm is one line saying what to run, and an
ingest that fails while etcd is down has its chunks freed by its node once etcd is back."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from conftest import Node, run_dlfs, start_node_process, wait_for_node
from etcdlab import EtcdCluster, Member, etcd_available, free_ports, local_etcd
from test_ingest import chunk_files, make_files

import dlfs.ingest.run
from dlfs.config import EtcdConfig, parse_cluster_file
from dlfs.control.etcd import EtcdFull
from dlfs.control.plane import COMPACT_MARGIN, ControlPlane
from dlfs.doctor import FAIL
from dlfs.doctor import _etcd_space as etcd_space
from dlfs.errors import ControlUnavailable, SourceError

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))


@contextmanager
def cluster_of_two(base: Path) -> Iterator[tuple[list[Node], EtcdCluster]]:
    """Two nodes on localhost with one etcd member the test may stop and start."""
    base.mkdir(parents=True, exist_ok=True)
    run_dlfs(base, "keygen", base / "cluster.key")
    ports = free_ports(4)
    lines = ["replicas = 2", 'key_file = "cluster.key"']
    for i in range(2):
        lines += ["[[node]]", f'name = "n{i + 1}"', 'address = "127.0.0.1"',
                  f"meta_port = {ports[2 * i]}", f"data_port = {ports[2 * i + 1]}"]
    etcd = local_etcd(base)
    cluster = base / "cluster.toml"
    cluster.write_text("\n".join(lines) + "\n" + etcd.toml())
    nodes: list[Node] = []
    try:
        for i in range(2):
            proc, log = start_node_process(base / f"h{i + 1}", "--cluster", str(cluster), "--name", f"n{i + 1}")
            nodes.append(Node(base / f"h{i + 1}", proc, log, cluster=cluster, name=f"n{i + 1}"))
        for node in nodes:
            wait_for_node(node.home, node.proc, node.log, cluster)
        yield nodes, etcd
    finally:
        for node in nodes:
            node.stop()
        etcd.stop()


def wait_until(what: str, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


def revision_readable(endpoint: str, revision: int) -> bool:
    r = httpx.post(f"{endpoint}/v3/kv/range", json={"key": "eA==", "revision": str(revision)}, timeout=5)
    return "compacted" not in r.text


@pytest.mark.timeout(120)
def test_ingest_rm_gc_cycles_compact_history_and_pin_one_key_per_session(tmp_path: Path) -> None:
    make_files(tmp_path / "src", 40, 30_000, seed=31)  # 40 files in 64 KiB chunks: ~20 chunks
    with cluster_of_two(tmp_path / "c") as (nodes, etcd):
        cluster = parse_cluster_file(tmp_path / "c" / "cluster.toml")
        control = ControlPlane(EtcdConfig(tuple(etcd.endpoints)))
        writes: list[str] = []

        async def cycles(n: int) -> tuple[int, int]:
            async with trio.open_nursery() as watch:  # every key an ingest writes, as etcd reports it
                async def record() -> None:
                    async for _ in control.etcd.watch("/dlfs/pins/", first):
                        writes.append("pin")

                _, first = await control.etcd.range("x")
                watch.start_soon(record)
                for _ in range(n):
                    report = await dlfs.ingest.run.ingest(cluster, str(tmp_path / "src"), "churn", 64 << 10)
                    assert report.chunks_sent > 10
                    nodes[0].run("rm", "churn")
                    nodes[1].run("gc")
                watch.cancel_scope.cancel()
            _, now = await control.etcd.range("x")
            return first, now

        async def history(n: int) -> None:  # more revisions than the margin, so that there is something to compact
            for i in range(n):
                await control.etcd.put("/scratch", str(i))

        trio.run(history, COMPACT_MARGIN + 100)
        first, now = trio.run(cycles, 3)
        # No pin key per chunk: no collection ran during the ingests, so none at all.
        assert writes == []
        # History older than the margin is gone (compacted by the collections), newer is kept.
        assert not revision_readable(etcd.endpoints[0], 2)
        assert revision_readable(etcd.endpoints[0], now - 10)
        assert [chunk_files(n.home) for n in nodes] == [[], []]
        trio.run(control.aclose)


@pytest.mark.timeout(60)
async def test_compaction_keeps_a_margin_and_watchers_resume(tmp_path: Path) -> None:
    etcd = local_etcd(tmp_path)
    try:
        control = ControlPlane(EtcdConfig(tuple(etcd.endpoints), prefix="/t/"))
        for i in range(30):
            await control.etcd.put(f"/t/k{i}", str(i))
        _, now = await control.etcd.range("/t/k0")
        assert await control.compact(margin=10) == now - 10
        assert await control.compact(margin=10) == 0  # nothing more to do
        assert not revision_readable(etcd.endpoints[0], now - 11)
        assert revision_readable(etcd.endpoints[0], now - 10)
        # A watch from a compacted revision ends at once: its owner re-reads (dlfs/meta/follow.py).
        with trio.fail_after(10):
            assert [r async for r in control.etcd.watch("/t/", 2)] == []
        await control.aclose()
    finally:
        etcd.stop()


@pytest.mark.timeout(60)
async def test_a_full_etcd_is_one_line_saying_what_to_run(tmp_path: Path) -> None:
    client, peer = free_ports(2)
    member = Member("e1", "127.0.0.1", client, peer, tmp_path / "etcd-e1")
    etcd = EtcdCluster([member])
    member.data.mkdir(parents=True, mode=0o700)
    argv = ["etcd", "--name", "e1", "--data-dir", str(member.data / "etcd"), "--listen-client-urls",
            member.client_url, "--advertise-client-urls", member.client_url, "--listen-peer-urls",
            member.peer_url, "--initial-advertise-peer-urls", member.peer_url, "--initial-cluster",
            etcd.initial, "--quota-backend-bytes", str(1 << 20)]  # a 1 MiB quota, to fill in a moment
    with open(member.data / "etcd.log", "ab") as log:
        member.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        etcd.wait_healthy()
        control = ControlPlane(EtcdConfig(tuple(etcd.endpoints), prefix="/t/"))
        with pytest.raises(EtcdFull) as caught:
            for i in range(200):
                await control.etcd.put(f"/t/big{i}", os.urandom(20_000))
        line = str(caught.value)
        assert "\n" not in line and "NOSPACE" in line
        assert "compact" in line and "defrag" in line and "alarm disarm" in line
        assert caught.value.exit_code == 7 and caught.value.errno == errno.ENOSPC
        # `dlfs doctor` says so too, with the same commands.
        st = await control.etcd.status(etcd.endpoints[0])
        row = await etcd_space(control, etcd.endpoints[0], st)
        assert row.status == FAIL and "alarm NOSPACE raised" in row.detail and "of a 1.0 MB quota" in row.detail
        assert "alarm disarm" in row.fix
        await control.aclose()
    finally:
        etcd.stop()


@pytest.mark.timeout(120)
def test_an_ingest_failing_while_etcd_is_down_is_finished_by_its_node(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    make_files(tmp_path / "src", 12, 30_000, seed=32)
    victim = os.fsencode(tmp_path / "src" / "d2" / "f011.bin")  # the last file: chunks are stored before it
    real_open = os.open
    with cluster_of_two(tmp_path / "c") as (nodes, etcd):
        cluster = parse_cluster_file(tmp_path / "c" / "cluster.toml")

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if os.fsencode(path) == victim:  # (the packer's thread: the uploads go on meanwhile)
                wait_until("chunks stored", lambda: sum(len(chunk_files(n.home)) for n in nodes) > 0, 30)
                etcd.members[0].stop()  # etcd dies, then the source fails: the abort meets etcd down
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_)
        with pytest.raises((SourceError, ControlUnavailable)):  # whichever the ingest meets first
            trio.run(dlfs.ingest.run.ingest, cluster, str(tmp_path / "src"), "broken", 64 << 10)
        monkeypatch.undo()
        assert sum(len(chunk_files(n.home)) for n in nodes) > 0  # not freed yet: etcd is down
        etcd.members[0].start(etcd.initial)
        etcd.wait_healthy()
        # No `dlfs gc`: the node that took the abort finishes it once etcd answers.
        wait_until("the aborted ingest's chunks are freed", lambda: [chunk_files(n.home) for n in nodes] == [[], []],
                   60)
        # Logged once the abort's collection has returned, a moment after the data nodes deleted the chunks.
        wait_until("the abort's log line", lambda: "its abort is finished" in nodes[0].log.read_text()
                   + nodes[1].log.read_text(), 10)


@pytest.mark.timeout(60)
async def test_a_gc_lock_left_by_a_lost_answer_is_released_by_its_own_node(tmp_path: Path) -> None:
    """A take of the gc lock that etcd committed but whose answer was lost (an outage mid-request) left
    the lock naming the node, bound to the node's lease, which the node renews: every ingest's pins
    waited behind a collection that did not run. The node now releases a lock that names it while no
    collection of its own holds it; another node's lock, or its own during a collection, stays."""
    import json

    from dlfs.control.pins import PinPublisher
    from dlfs.errors import Conflict

    etcd = local_etcd(tmp_path)
    try:
        control = ControlPlane(EtcdConfig(tuple(etcd.endpoints), prefix="/t/"))
        lease = await control.etcd.grant(60)
        await control.open_ingest("s1", "ds", "n1", lease)

        async def lost_take(node: str) -> None:  # what a committed take whose answer never came leaves
            await control.etcd.put(control.gc_key, json.dumps({"node": node, "since": time.time()}), lease)

        await lost_take("n2")
        assert not await control.clear_to_pin("s1")
        assert not await control.release_stale_gc_lock("n1")  # another node's: its own to release
        with pytest.raises(Conflict, match="already running on n2"):
            async with control.gc_lock("n1", lease):
                pass
        assert await control.etcd.get(control.gc_key) is not None and not control.collecting
        await control.etcd.delete(control.gc_key)

        await lost_take("n1")
        assert not await control.clear_to_pin("s1")
        assert await control.release_stale_gc_lock("n1")
        assert await control.etcd.get(control.gc_key) is None and await control.clear_to_pin("s1")

        publisher = PinPublisher(control, "n1", lambda: {"s1": set()})  # the daemon's, for its session
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            # It releases such a lock by itself, within a watch round.
            await lost_take("n1")
            with trio.fail_after(10):
                while not await control.clear_to_pin("s1"):
                    await trio.sleep(0.05)
            # During a collection of its own the node's lock is not stale (the publisher leaves it, and
            # publishes the session's pins for it); a stale one is taken over by the next collection.
            await lost_take("n1")
            with trio.fail_after(20):
                async with control.gc_lock("n1", lease):
                    assert control.collecting and not await control.release_stale_gc_lock("n1")
                    await trio.sleep(0.5)  # the publisher sees the lock meanwhile, and leaves it
                    kv = await control.etcd.get(control.gc_key)
                    assert kv is not None and json.loads(kv.value)["node"] == "n1"
                    assert not await control.clear_to_pin("s1")
            assert not control.collecting and await control.clear_to_pin("s1")
            nursery.cancel_scope.cancel()
        await control.aclose()
    finally:
        etcd.stop()
