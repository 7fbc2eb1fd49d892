"""etcd under ingest/rm/gc churn: how its database grows with dlfs compacting its history.

Starts a local etcd member and a cluster of two dlfs nodes (the tests' helpers), then runs CYCLES
cycles of: ingest a small tree as a new version, `rm` it, `gc`. Every --every cycles it prints etcd's
revision, its database size and the part in use (maintenance/status), the live data (every key and
value now held: the versions' tombstones grow by one per cycle), and checks the target:
db <= 4 x live + 10 MB, no alarm. Needs etcd on PATH (make install).

    .venv/bin/python scripts/etcd_churn.py --cycles 1000 --every 100
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import running_cluster  # noqa: E402
from test_ingest import make_files  # noqa: E402

import dlfs.ingest.run  # noqa: E402
from dlfs.client.cluster import ClusterClient  # noqa: E402
from dlfs.config import Cluster, parse_cluster_file  # noqa: E402
from dlfs.tasks import open_nursery  # noqa: E402
from dlfs.wire.protocol import Msg  # noqa: E402

MB = 1 << 20


def etcd_state(endpoint: str) -> dict[str, int]:
    status = httpx.post(f"{endpoint}/v3/maintenance/status", json={}, timeout=10).json()
    alarms = httpx.post(f"{endpoint}/v3/maintenance/alarm", json={"action": "GET"}, timeout=10).json()
    kvs = httpx.post(f"{endpoint}/v3/kv/range", json={"key": "AA==", "range_end": "AA=="}, timeout=10).json()
    live = sum(len(kv["key"]) * 3 // 4 + len(kv.get("value", "")) * 3 // 4 for kv in kvs.get("kvs", []))
    return {"revision": int(status["header"]["revision"]), "db": int(status["dbSize"]),
            "in_use": int(status.get("dbSizeInUse", 0)), "live": live, "keys": int(kvs.get("count", 0)),
            "alarms": len(alarms.get("alarms") or [])}


async def cycle(cluster: Cluster, src: Path, name: str) -> None:
    await dlfs.ingest.run.ingest(cluster, str(src), name, 64 << 10)
    async with open_nursery() as nursery:
        client = ClusterClient(cluster, nursery)
        await client.call_meta(Msg.REMOVE, {"name": name, "version": None})
        await client.call_meta(Msg.COLLECT)
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100, help="print a row every N cycles")
    ap.add_argument("--files", type=int, default=40, help="files per ingest (30 kB each, 64 KiB chunks)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlfs-churn-") as tmp:
        base = Path(tmp)
        make_files(base / "src", args.files, 30_000, seed=1)
        with running_cluster(base / "c", n=2, replicas=2):
            cluster = parse_cluster_file(base / "c" / "cluster.toml")
            assert cluster.etcd is not None
            endpoint = cluster.etcd.endpoints[0]
            first = etcd_state(endpoint)
            print(f"{'cycle':>6} {'revision':>9} {'db MB':>7} {'in use MB':>9} {'live kB':>8} {'keys':>5} "
                  f"{'alarms':>6} {'s/cycle':>7}  target db <= 4 x live + 10 MB")
            t0, worst = time.monotonic(), 0.0
            for i in range(1, args.cycles + 1):
                trio.run(cycle, cluster, base / "src", "churn")
                if i % args.every == 0 or i == args.cycles:
                    st = etcd_state(endpoint)
                    bound = 4 * st["live"] + 10 * MB
                    worst = max(worst, st["db"] / bound)
                    ok = st["db"] <= bound and not st["alarms"]
                    print(f"{i:>6} {st['revision']:>9} {st['db'] / MB:>7.2f} {st['in_use'] / MB:>9.2f} "
                          f"{st['live'] / 1000:>8.1f} {st['keys']:>5} {st['alarms']:>6} "
                          f"{(time.monotonic() - t0) / i:>7.2f}  {'ok' if ok else 'MISSED'}", flush=True)
            last = etcd_state(endpoint)
            per = (last["db"] - first["db"]) / args.cycles
            print(f"db grew {(last['db'] - first['db']) / MB:.2f} MB over {args.cycles} cycles "
                  f"({per / 1000:.2f} kB/cycle, {last['revision'] - first['revision']} revisions); "
                  f"worst db / bound {worst:.2f}")
            return 0 if worst <= 1 and not last["alarms"] else 1


if __name__ == "__main__":
    sys.exit(main())
