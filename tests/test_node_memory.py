"""A node's memory for requests in flight stays within its caps, whatever its peers send: real
daemons on localhost with small caps, real connections, real chunks."""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import run_dlfs, trio_wait_for

from dlfs.data.service import DataService
from dlfs.data.store import ChunkStore
from dlfs.errors import NotFound, ProtocolError, Unreachable
from dlfs.format.chunk import ChunkWriter
from dlfs.meta.engine_sqlite import EmbeddedEngine
from dlfs.meta.service import MetaService
from dlfs.meta.store import MetaStore
from dlfs.metrics import NodeCollector
from dlfs.transport.base import Address
from dlfs.wire.budget import MemoryBudget
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Service, connect, serve

KEY = b"m" * 32
MiB = 1 << 20


def make_chunk(seed: int, size: int) -> tuple[bytes, bytes]:
    """A real chunk (id, bytes) of `size` incompressible bytes, in records of at most 1 MiB."""
    rng = random.Random(seed)
    w = ChunkWriter(size + (64 << 10))
    for at in range(0, size, MiB):
        w.add(rng.randbytes(min(MiB, size - at)), compress=False)
    cid, view = w.finish()
    return cid, bytes(view)


class WatchedData(DataService):
    """The data daemon, its PUTs slowed a little (so that they overlap) and gated on demand, and the
    bytes its PUT handlers hold at once measured here, apart from the budget's own count."""

    def __init__(self, root: Path, memory: MemoryBudget, pause: float = 0.0) -> None:
        super().__init__(ChunkStore(root), KEY, "t", memory=memory)
        self.pause = pause
        self.gate = trio.Event()
        self.gate.set()
        self.holding = 0
        self.most_held = 0
        self.entered = trio.Event()

    async def put_chunk(self, meta: dict[str, Any], data: bytearray) -> Any:
        self.holding += len(data)
        self.most_held = max(self.most_held, self.holding)
        self.entered.set()
        try:
            await trio.sleep(self.pause)
            await self.gate.wait()
            return await super().put_chunk(meta, data)
        finally:
            self.holding -= len(data)


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[Address]:
    async with trio.open_nursery() as n:
        bound = await n.start(serve, service, Address("127.0.0.1", 0))
        yield bound[0]
        n.cancel_scope.cancel()


@pytest.mark.timeout(20)
async def test_a_request_over_the_caps_is_refused_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    memory = MemoryBudget("node t", total=4 * MiB, per_connection=1 * MiB, wait=5)
    svc = WatchedData(tmp_path / "data", memory)
    small_id, small = make_chunk(1, 200_000)
    big_id, big = make_chunk(2, 2 * MiB)  # over the per-connection cap
    huge_id, huge = make_chunk(3, 5 * MiB)  # over the total too
    async with serving(svc) as address, connect(address, KEY, "data") as conn, \
            connect(address, KEY, "data") as other:
        for cid, data in ((big_id, big), (huge_id, huge)):
            with trio.fail_after(5), pytest.raises(ProtocolError, match="node t refuses a request of .* over its cap"):
                await conn.call(Msg.PUT_CHUNK, {"id": cid}, data)
        assert memory.refused == 2 and memory.high_water == 0  # refused bytes were read past, never held
        assert not svc.store.has(big_id) and not svc.store.has(huge_id)
        # The refused connection is in step and usable, and so is everyone else's.
        assert conn.closed is None
        assert (await conn.call(Msg.PUT_CHUNK, {"id": small_id}, small))[0] == {"stored": True}
        _, got = await other.call(Msg.READ_RANGE, {"id": small_id, "offset": 0, "length": len(small)})
        assert bytes(got) == small
        assert (await conn.call(Msg.PING))[0]["node"] == "t"
    assert memory.reserved == 0
    # The node's metrics show it.
    samples = {(s.name, s.labels.get("reason")): s.value
               for family in NodeCollector("t", [svc]).collect() for s in family.samples}
    assert samples[("dlfs_request_memory_refusals_total", "over_cap")] == 2
    assert samples[("dlfs_request_memory_refusals_total", "busy")] == 0
    assert samples[("dlfs_request_memory_bytes", None)] == 0
    assert samples[("dlfs_request_memory_limit_bytes", None)] == 4 * MiB


@pytest.mark.timeout(20)
async def test_a_reply_whose_size_is_known_is_reserved_before_it_is_read(tmp_path: Path) -> None:
    memory = MemoryBudget("node t", total=4 * MiB, per_connection=1 * MiB, wait=5)
    svc = MetaService(EmbeddedEngine(MetaStore(tmp_path / "meta")), KEY, "t", ledger=None, memory=memory)  # type: ignore[arg-type]
    async with serving(svc) as address, connect(address, KEY, "meta") as conn:
        with pytest.raises(ProtocolError, match="refuses a request of 2.1 MB"):
            await conn.call(Msg.READ_INDEX, {"name": "d", "version": 1, "offset": 0, "length": 2 * MiB})
        # A piece that fits goes on to the store (which has no such dataset), its size held meanwhile.
        with pytest.raises(NotFound, match="no dataset named 'd'"):
            await conn.call(Msg.READ_INDEX, {"name": "d", "version": 1, "offset": 0, "length": MiB // 2})
        assert memory.high_water >= MiB // 2
    assert memory.refused == 1 and memory.reserved == 0


@pytest.mark.timeout(30)
async def test_many_connections_putting_and_reading_stay_within_the_total(tmp_path: Path) -> None:
    total, per_connection = 4 * MiB, 2 * MiB
    memory = MemoryBudget("node t", total=total, per_connection=per_connection, wait=20)
    svc = WatchedData(tmp_path / "data", memory, pause=0.02)
    peers, per_peer = 12, 4
    chunks = [[make_chunk(100 * p + i, 600_000 + 1000 * i) for i in range(per_peer)] for p in range(peers)]
    async with serving(svc) as address:

        async def peer(mine: list[tuple[bytes, bytes]]) -> None:
            async with connect(address, KEY, "data") as conn:
                async with trio.open_nursery() as n:  # all of one peer's PUTs in flight at once
                    for cid, data in mine:
                        n.start_soon(conn.call, Msg.PUT_CHUNK, {"id": cid}, data)
                async with trio.open_nursery() as n:
                    for cid, data in mine:
                        n.start_soon(read_back, conn, cid, data)

        async def read_back(conn: Any, cid: bytes, data: bytes) -> None:
            _, got = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": 0, "length": len(data)})
            assert bytes(got) == data

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                for mine in chunks:
                    n.start_soon(peer, mine)
    asked = sum(len(d) for mine in chunks for _, d in mine)
    assert asked > 5 * total  # the peers wanted far more at once than the node may hold
    assert svc.store.count == peers * per_peer
    assert per_connection < memory.high_water <= total, memory.high_water
    assert svc.most_held <= total, svc.most_held
    assert memory.waits > 0 and memory.busy == 0 and memory.refused == 0
    assert memory.reserved == 0


@pytest.mark.timeout(20)
async def test_a_wait_for_memory_is_bounded(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    # Time moves only when the test moves it: the wait is answered busy exactly at its bound, not before.
    memory = MemoryBudget("node t", total=2 * MiB, per_connection=2 * MiB, wait=0.3)
    svc = WatchedData(tmp_path / "data", memory)
    holder_id, holder = make_chunk(1, 1_500_000)
    late_id, late = make_chunk(2, 1 * MiB)
    async with serving(svc) as address, connect(address, KEY, "data") as a, connect(address, KEY, "data") as b:
        svc.gate = trio.Event()  # PUTs hold their bytes until it opens
        async with trio.open_nursery() as n:
            n.start_soon(a.call, Msg.PUT_CHUNK, {"id": holder_id}, holder)
            await trio_wait_for(svc.entered.is_set, 10, "the first PUT to hold its bytes")
            refused: list[BaseException] = []

            async def put_busy() -> None:
                try:
                    await b.call(Msg.PUT_CHUNK, {"id": late_id}, late, timeout=10)
                except Unreachable as exc:
                    refused.append(exc)

            n.start_soon(put_busy)
            await trio_wait_for(lambda: memory.waits == 1, 10, "the second PUT to wait for memory")
            mock_clock.jump(0.29)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert not refused and memory.busy == 0  # still waiting just short of its bound
            mock_clock.jump(0.02)
            await trio_wait_for(lambda: refused, 10, "the busy answer past the bound")
            assert re.fullmatch(r"node t is busy: no memory for a request of 1\.\d MB within 0\.3 s .*", str(refused[0]))
            assert memory.busy == 1 and memory.waits == 1 and not svc.store.has(late_id)
            # The busy answer left b's connection in step; a request that fits is served meanwhile.
            assert (await b.call(Msg.PING))[0]["node"] == "t"
            # A wait that ends in time is served: room comes while it waits.
            memory.wait = 10
            replies: list[dict[str, Any]] = []

            async def put_late() -> None:
                replies.append((await b.call(Msg.PUT_CHUNK, {"id": late_id}, late))[0])

            n.start_soon(put_late)
            await trio_wait_for(lambda: memory.waits == 2, 10, "the daemon to hold the PUT back")
            mock_clock.jump(9.9)  # most of its wait passes with no room
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert not replies and memory.busy == 1
            svc.gate.set()
        assert replies == [{"stored": True}]
        assert svc.store.has(holder_id) and svc.store.has(late_id)
        assert memory.busy == 1 and memory.waits == 2
    assert memory.reserved == 0 and memory.high_water <= 2 * MiB


def test_node_memory_option_is_checked(tmp_path: Path) -> None:
    proc = run_dlfs(tmp_path, "node", "--memory", "1M", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dlfs: error: --memory must be at least 32M"]
