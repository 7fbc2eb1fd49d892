"""Faults a chaos run found on a real cluster (issue 25), each on real nodes on localhost with a real
etcd: a gc on one node right after a commit on another, a data node whose disk is full during an
ingest, and what the logs say about both.

The full disk is real: a small tmpfs mounted (by the test, as root) over one node's chunk store.
`DLFS_SLOW_TESTS=1` also runs the long version of the gc race (50 rounds).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from conftest import DLFS, REPO, dlfs_env, needs_fuse, run_dlfs, running_cluster
from etcdlab import etcd_available, free_ports
from netlab import NetLab, netns_available
from test_ingest_cleanup import free_bytes, tmpfs

from dlfs.client.cluster import ClusterClient, rank
from dlfs.config import load_cluster
from dlfs.data.service import FULL_LOG_EVERY
from dlfs.errors import DlfsError
from dlfs.mount.records import mount_log
from dlfs.tasks import open_nursery
from dlfs.wire.protocol import Msg

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))
CHUNK = 64 << 10


def make_tree(root: Path, files: int, size: int, seed: int) -> Path:
    """`files` files of about `size` random bytes each (random: every chunk differs)."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(files):
        (root / f"f{i:03d}.bin").write_bytes(rng.randbytes(size + rng.randrange(size // 4 + 1)))
    return root


def chunk_ids(home: Path) -> set[str]:
    root = home / "data" / "chunks"
    return {p.name for d in root.iterdir() if d.is_dir() for p in d.iterdir() if len(p.name) == 32} \
        if root.is_dir() else set()


# --- gc right after a commit elsewhere ---------------------------------------------------------------
async def gc_races_commits(tmp_path: Path, rounds: int) -> None:
    """Each round: an ingest on n1, then, about when n3's follower fetches the new version's index,
    garbage collections on n3 for 300 ms. Every collection succeeds."""
    with running_cluster(tmp_path / "c", n=3, replicas=2) as nodes:
        n1 = nodes[0]
        assert n1.cluster is not None
        cluster = load_cluster(str(n1.cluster), n1.home)
        failures: list[str] = []
        collections = 0
        rng = random.Random(5)
        async with open_nursery() as nursery:
            client = ClusterClient(cluster, nursery)
            n3 = cluster.node("n3")
            for i in range(rounds):
                src = make_tree(tmp_path / f"src{i}", 3, 20_000, seed=i)
                argv = [*DLFS, "--cluster", str(n1.cluster), "ingest", str(src), "--name", f"race{i}"]
                done = await trio.run_process(argv, env=dlfs_env(n1.home), cwd=REPO, capture_stdout=True,
                                              capture_stderr=True, check=False)
                assert done.returncode == 0, done.stderr.decode()
                # The follower on n3 fetches the new index some 0.2 s after the commit (a burst of changes
                # is one reconcile): collections from then on meet its fetch half done.
                await trio.sleep(rng.uniform(0.1, 0.4))
                end = trio.current_time() + 0.3
                while trio.current_time() < end:
                    try:
                        await client.call(n3, "meta", Msg.COLLECT)
                    except DlfsError as exc:
                        failures.append(f"round {i}: {type(exc).__name__}: {exc}")
                    collections += 1
                meta, _ = await client.call(n3, "meta", Msg.GET_DATASET, {"name": f"race{i}"})
                assert meta["version"] == 1, meta
            nursery.cancel_scope.cancel()
        print(f"{rounds} rounds, {collections} collections on n3 right after a commit on n1: {len(failures)} failed")
        assert not failures, "\n".join(failures)
        # Nothing a live version needs was freed by them: every chunk still has its 2 replicas.
        out = n1.run("verify", "--all")
        assert "every chunk has 2 good replicas" in out.stdout, out.stdout


@pytest.mark.timeout(240)
async def test_gc_on_another_node_right_after_a_commit(tmp_path: Path) -> None:
    await gc_races_commits(tmp_path, 10)


@pytest.mark.skipif(not os.environ.get("DLFS_SLOW_TESTS"), reason="long (50 rounds): set DLFS_SLOW_TESTS=1")
@pytest.mark.timeout(900)
async def test_gc_on_another_node_right_after_a_commit_50_times(tmp_path: Path) -> None:
    await gc_races_commits(tmp_path, 50)


# --- a data node whose disk is full --------------------------------------------------------------------
def store_on(home: Path, fs: Path) -> None:
    """Make `home`'s chunk store live on `fs` (a link: a cluster's teardown unmounts what is under its homes)."""
    home.mkdir(parents=True, mode=0o700)
    (home / "data").symlink_to(fs)


def fill(path: Path, leave: int) -> None:
    """Take the room of `path`'s file system until `leave` bytes are free."""
    with open(path / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, free_bytes(path) - leave))


FULL_LINE = re.compile(r"node n(\d): chunk store at (\S+) is full \((.+?) free of (.+?)\): (\d+) chunks? refused")
GIVEN_UP = re.compile(r"ingest session \S+ given up: (\d+) of its (\d+) chunks freed")


@needs_fuse
@pytest.mark.timeout(240)
def test_ingest_places_chunks_past_a_full_data_node(tmp_path: Path) -> None:
    base = tmp_path / "c"
    with tmpfs(tmp_path / "fs2", "256k") as fs2, tmpfs(tmp_path / "fs3", "16m") as fs3:
        store_on(base / "h2", fs2)
        store_on(base / "h3", fs3)
        with running_cluster(base, n=3, replicas=2) as nodes:
            n1, n2, n3 = nodes
            assert n1.cluster is not None
            cluster = load_cluster(str(n1.cluster), n1.home)
            src = make_tree(tmp_path / "a", 40, 100_000, seed=1)  # some 70 chunks of 64 KiB
            t0 = time.monotonic()
            out = n1.ingest(src, "a", "--chunk-size", "64K")
            assert out.stderr.count("data node n2 is full") >= 1, out.stderr

            held = {n.name: chunk_ids(n.home) for n in nodes}
            ids = set().union(*held.values())
            assert len(ids) > 50
            for cid in ids:
                assert sum(cid in h for h in held.values()) == 2, f"chunk {cid} is not on exactly 2 nodes"
            placed = {cid: [s.name for s in rank(bytes.fromhex(cid), cluster.data_nodes)[:2]] for cid in ids}
            past = [cid for cid in ids if not all(cid in held[name] for name in placed[cid])]
            assert len(past) > 10, "too few chunks went past the full node to test what readers do"
            assert all("n2" in placed[cid] and cid not in held["n2"] for cid in past)

            # The full node said so, in one line (not one per refused chunk).
            lines = FULL_LINE.findall(n2.node_log())
            assert lines and lines[0][0] == "2" and lines[0][1] == str(base / "h2" / "data"), n2.node_log()
            assert len(lines) <= 1 + (time.monotonic() - t0) // FULL_LOG_EVERY, lines

            assert "every chunk has 2 good replicas" in n1.run("verify", "a").stdout

            # n3 fills up too: the next ingest stores chunks on n1 and n3 until n3 is full, then stops
            # with exit 7 and frees what it stored; the line says how many chunks (not replicas) went.
            fill(fs3, 1 << 20)
            before = {n.name: chunk_ids(n.home) for n in nodes}
            b = make_tree(tmp_path / "b", 40, 100_000, seed=2)
            failed = n1.run("ingest", b, "--name", "b", "--chunk-size", "64K", check=False)
            assert failed.returncode == 7, failed
            error = failed.stderr.strip().splitlines()[-1]
            full_at = r"(n2|n3): data daemon disk is full at \S+"
            found = re.fullmatch(rf"dlfs: error: chunk [0-9a-f]{{32}}: stored on 1 of 2 nodes \({full_at}; {full_at}\)", error)
            assert found and {found[1], found[2]} == {"n2", "n3"}, failed.stderr
            assert {n.name: chunk_ids(n.home) for n in nodes} == before, "the failed ingest left chunks behind"
            given_up = GIVEN_UP.findall(n1.node_log())
            assert len(given_up) == 1, n1.node_log()
            freed, pinned = map(int, given_up[0])
            assert 0 < freed <= pinned, given_up

            # Readers find chunks past their placed nodes. The mount reads as a machine whose own node
            # is the full n2 (a cluster file naming n2 first), with n1 stopped: a chunk placed on n2
            # and n1 is then read from the one place it went to instead, n3.
            only_n3 = [cid for cid in past if "n1" in placed[cid] and cid in held["n3"]]
            assert only_n3, "no chunk of n2 and n1 went to n3"
            nodes_part, etcd_part = n1.cluster.read_text().split("[etcd]")
            top, *blocks = nodes_part.split("[[node]]")
            blocks.sort(key=lambda b: 'name = "n2"' not in b)
            reader = base / "reader.toml"  # the same cluster, n2 first: the mount's own node is then n2
            reader.write_text(top + "".join("[[node]]" + b for b in blocks) + "[etcd]" + etcd_part)
            assert load_cluster(str(reader), n3.home).local == "n2"
            n1.stop()
            mnt = tmp_path / "mnt"
            mnt.mkdir()
            run_dlfs(n3.home, "--cluster", reader, "mount", "a", mnt)
            try:
                for f in sorted(src.iterdir()):
                    assert (mnt / f.name).read_bytes() == f.read_bytes(), f.name
            finally:
                run_dlfs(n3.home, "--cluster", reader, "umount", mnt)

            # Neither the nodes nor the mount log a line per etcd request (a lease keepalive every 1.3 s).
            logs = [n.node_log() for n in nodes] + [mount_log(n3.home, "a", mnt).read_text()]
            assert all("httpx" not in text and "HTTP Request" not in text for text in logs)
            print(f"{len(ids)} chunks, {len(past)} past the full n2 ({len(only_n3)} read from n3 alone); its "
                  f"log: {lines}; the failed ingest: {freed} of {pinned} chunks freed; stderr: {error}")


# --- etcd out of reach ---------------------------------------------------------------------------------
REACH_ETCD = """
import sys, trio
from dlfs.config import EtcdConfig
from dlfs.control.plane import ControlPlane
from dlfs.errors import DlfsError
try:
    trio.run(ControlPlane(EtcdConfig(tuple(sys.argv[1:]))).versions)
except DlfsError as exc:
    print(exc)
"""


@pytest.mark.skipif(netns_available() is not None, reason=str(netns_available()))
@pytest.mark.timeout(60)
def test_etcd_out_of_reach_is_one_line_saying_why(tmp_path: Path) -> None:
    """From a host whose network has no route to etcd, the line names etcd, each endpoint and the real
    cause (not "connection refused", which says that nothing listens there)."""
    with NetLab(["h1"]) as lab:
        host = lab.hosts["h1"]
        nowhere = ["http://10.252.0.1:2379", "http://10.252.0.2:2379"]  # outside the lab's one subnet
        refused = f"http://{host.address}:{free_ports(1)[0]}"  # its own address, where nothing listens
        out = subprocess.run(host.cmd(sys.executable, "-c", REACH_ETCD, *nowhere, refused), env=dlfs_env(tmp_path),
                             capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.stdout.strip() == (f"etcd is unavailable ({nowhere[0]}: network is unreachable; {nowhere[1]}: "
                                  f"network is unreachable; {refused}: connection refused)"), out
