#!/usr/bin/env python3
"""A data daemon's READ_RANGE of one record, through its Python and through a range lane (its native
threads), the page cache dropped first: what a mount's serving threads wait for per file in scan mode.

A one-node cluster runs in this process (its daemon on loopback TCP); one chunk of --records records of
--size bytes is stored. Each pass drops the page cache (root), then reads every record once, one
request at a time, on one connection: first as a plain connection (the daemon's Python answers), then
the same connection given over with RANGE_LANE (native/rangeserve.c answers). Both are read by the
daemon's own Python client, so the client's cost is the same on both sides. Prints ms per record and
the block device's reads for each, and the ratio, for --rounds rounds.

    sudo .venv/bin/python scripts/bench_range_lane.py [--records 20] [--size 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path

import trio

from dlfs.bench.baselines import drop_caches
from dlfs.bench.bigfiles import BlockDevice, block_device
from dlfs.config import ensure_home_key
from dlfs.format.chunk import ChunkWriter
from dlfs.node import NodeOptions, run_node
from dlfs.wire.protocol import Msg
from dlfs.wire.rpc import Connection, connect


async def one_pass(conn: Connection, cid: bytes, ranges: list[tuple[int, int]],
                   dev: BlockDevice) -> tuple[float, int]:
    """ms per record and bytes read from the disk, every record read once, the page cache dropped first."""
    drop_caches()
    before = dev.read_bytes()
    t0 = time.perf_counter()
    for offset, length in ranges:
        _, data = await conn.call(Msg.READ_RANGE, {"id": cid, "offset": offset, "length": length})
        assert len(data) == length
    ms = (time.perf_counter() - t0) / len(ranges) * 1e3
    return ms, dev.read_bytes() - before


async def main(args: argparse.Namespace) -> None:
    work = Path(args.dir).absolute()
    shutil.rmtree(work, ignore_errors=True)
    home = work / "home"
    home.mkdir(parents=True)
    dev, said = block_device(work)
    if dev is None:
        sys.exit(f"bench_range_lane.py: {said}: give --dir on a disk")
    w = ChunkWriter(args.records * (args.size + 4096) + (1 << 20))
    rng = random.Random(1)
    recs = [w.add(rng.randbytes(args.size), compress=False) for _ in range(args.records)]
    cid, data = w.finish()
    ranges = [(r.offset, r.stored_len) for r in recs]
    try:
        async with trio.open_nursery() as n:
            spec = await n.start(run_node, NodeOptions(home=home))
            key = ensure_home_key(home)
            async with connect(spec.data, key, "data") as conn:
                await conn.call(Msg.PUT_CHUNK, {"id": cid}, bytes(data))
            print(f"{args.records} records of {args.size:,} bytes, one request at a time, the page cache dropped "
                  f"before each pass; disk: {said}")
            for r in range(args.rounds):
                async with connect(spec.data, key, "data") as conn:
                    py_ms, py_read = await one_pass(conn, cid, ranges, dev)
                    await conn.call(Msg.RANGE_LANE)
                    lane_ms, lane_read = await one_pass(conn, cid, ranges, dev)
                print(f"round {r}: the daemon's Python {py_ms:.3f} ms a record ({py_read / 1e6:.2f} MB from the disk), "
                      f"a range lane {lane_ms:.3f} ms ({lane_read / 1e6:.2f} MB): {lane_ms / py_ms:.2f}x the time")
            n.cancel_scope.cancel()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=20)
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=".bench-lane", help="work dir, on the disk to measure (removed after)")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_range_lane.py: must run as root (it drops the page cache)")
    trio.run(main, a)
