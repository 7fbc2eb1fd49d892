"""`dlfs verify`, `dlfs repair` and the cluster view of `dlfs status`, on three real nodes on
localhost (replicas = 2) with a small dataset packed into many 64 KiB chunks.

Damage is done on disk, as a failing disk or a lost node would do it: a flipped byte in one
replica, every copy of a chunk spoiled, a node's store wiped, a node stopped.
"""

from __future__ import annotations

import filecmp
import os
import random
import re
import socket
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from conftest import (
    Node,
    mount_stats_from_now,
    needs_fuse,
    run_dlfs,
    running_cluster,
    start_node_process,
    wait_for_node,
)
from etcdlab import local_etcd

from dlfs.bench.baselines import drop_caches
from dlfs.cli import main
from dlfs.client.cluster import ClusterClient
from dlfs.config import load_cluster
from dlfs.errors import CorruptData
from dlfs.format.chunk import HEADER, RECORD, verify_chunk
from dlfs.format.chunk import HEADER as CHUNK_HEADER
from dlfs.mount.localchunks import RECHECK
from dlfs.tasks import open_nursery

UNDER_REPLICATED = re.compile(r"chunks with fewer than 2 healthy replicas: (\d+)")


def make_tree(root: Path) -> Path:
    """About 2 MB in 60 files of many sizes: some 40 chunks of 64 KiB."""
    rng = random.Random(3)
    for i in range(60):
        d = root / f"d{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.bin").write_bytes(rng.randbytes(rng.choice([100, 5_000, 30_000, 70_000])))
    (root / "big.bin").write_bytes(rng.randbytes(300_000))
    return root


def chunk_files(node: Node) -> dict[str, Path]:
    """Hex id -> chunk file in a node's store."""
    return {p.name: p for p in (node.home / "data" / "chunks").glob("*/*")}


def is_good(path: Path) -> bool:
    try:
        verify_chunk(path.read_bytes(), bytes.fromhex(path.name))
    except (CorruptData, OSError):
        return False
    return True


def flip_a_byte(path: Path) -> None:
    """Spoil one byte inside the first record's stored bytes, in place."""
    with open(path, "r+b") as f:
        head = f.read(HEADER.size + RECORD.size)
        pos = HEADER.size + RECORD.size + RECORD.unpack_from(head, HEADER.size)[2] // 2
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


def under_replicated(out: str) -> int:
    m = UNDER_REPLICATED.search(out)
    assert m, f"status has no 'chunks with fewer than 2 healthy replicas: N' line:\n{out}"
    return int(m.group(1))


@pytest.mark.timeout(10)
def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    for name, words in (("verify", ["NAME[@VERSION]", "--all", "exits 5"]), ("repair", ["copied"])):
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: dlfs {name}") and all(w in out for w in words), out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[Node], Path, set[str]]]:
    """Three nodes, replicas = 2, and dataset `data` ingested on n1: (nodes, source, chunk ids)."""
    with running_cluster(tmp_path / "c", n=3, replicas=2) as nodes:
        src = make_tree(tmp_path / "src")
        nodes[0].ingest(src, "data", "--chunk-size", "64K")
        held = [set(chunk_files(n)) for n in nodes]
        ids = set().union(*held)
        assert len(ids) > 20 and all(held), "the chunks do not spread over the three nodes"
        for cid in ids:
            assert sum(cid in h for h in held) == 2, f"chunk {cid} is not on exactly 2 nodes after ingest"
        yield nodes, src, ids


@pytest.mark.timeout(60)
def test_verify_finds_a_corrupt_replica_and_repair_heals_it(cluster: tuple[list[Node], Path, set[str]]) -> None:
    nodes, _, ids = cluster
    n1, n2, n3 = nodes
    ok = n1.run("verify", "data")
    assert f"verified {len(ids)} chunks" in ok.stdout and "every chunk has 2 good replicas" in ok.stdout, ok.stdout

    cid = sorted(chunk_files(n2))[0]
    flip_a_byte(chunk_files(n2)[cid])
    bad = n1.run("verify", "data", check=False)
    assert bad.returncode == 5, bad
    assert f"bad replica of chunk {cid} on n2: record 0: checksum mismatch\n" in bad.stdout, bad.stdout
    assert f"chunk {cid} has only 1 of 2 replicas" in bad.stdout, bad.stdout
    assert bad.stderr.strip().splitlines() == [
        "dlfs: error: 1 chunk lacks 2 good replicas; `dlfs repair` restores them"], bad.stderr
    assert n1.run("verify", "--all", check=False).returncode == 5

    fixed = n1.run("repair")
    assert f"removed bad replica of chunk {cid} on n2" in fixed.stdout, fixed.stdout
    assert re.search(rf"^copied chunk {cid} from n[13] to n2$", fixed.stdout, re.M), fixed.stdout
    assert fixed.stdout.count("copied chunk") == 1, fixed.stdout
    assert is_good(chunk_files(n2)[cid])  # back on its placed node
    assert n1.run("verify", "data").returncode == 0

    # Every copy of a chunk spoiled: nothing to heal it from. Repair says so, exits 5 and keeps
    # the bad copies (their other records still serve reads).
    lost = sorted(set(chunk_files(n1)) & set(chunk_files(n3)))[0]
    for n in (n1, n3):
        flip_a_byte(chunk_files(n)[lost])
    # verify does not send the user to `dlfs repair` for it: repair cannot restore it.
    gone = n1.run("verify", "data", check=False)
    assert gone.returncode == 5, gone
    assert gone.stderr.strip().splitlines() == [
        "dlfs: error: 1 chunk has no good copy on any reachable node, which repair cannot restore: ingest again "
        "(data@1)"], gone.stderr
    proc = n1.run("repair", check=False)
    assert proc.returncode == 5, proc
    assert re.search(rf"^cannot heal chunk {lost} \(in data@1\): no good copy on any reachable node", proc.stdout,
                     re.M), proc.stdout
    assert proc.stderr.strip().splitlines() == [f"dlfs: error: could not heal 1 chunk: {lost}"], proc.stderr
    assert lost in chunk_files(n1) and lost in chunk_files(n3)
    assert "chunk" not in n1.run("verify", "nosuch", check=False).stdout
    assert n1.run("verify", "nosuch", check=False).returncode == 4
    assert n1.run("verify", check=False).returncode == 2


@pytest.mark.timeout(60)
def test_a_wiped_store_is_refilled(cluster: tuple[list[Node], Path, set[str]]) -> None:
    nodes, _, ids = cluster
    n1, n2, _ = nodes
    wiped = set(chunk_files(n2))
    for path in chunk_files(n2).values():
        path.unlink()
    status = n1.run("status")  # every node is up: exit 0, whatever the chunks
    assert under_replicated(status.stdout) == len(wiped), status.stdout
    assert "data@1: 61 files" in status.stdout, status.stdout
    assert re.search(r"^node n2: up  roles data\+meta  meta 127\.0\.0\.1:\d+  data 127\.0\.0\.1:\d+$",
                     status.stdout, re.M), status.stdout

    fixed = n1.run("repair")
    copied = re.findall(r"^copied chunk ([0-9a-f]{32}) from n[13] to (n\d)$", fixed.stdout, re.M)
    assert sorted(copied) == sorted((cid, "n2") for cid in wiped), fixed.stdout
    assert set(chunk_files(n2)) == wiped and all(map(is_good, chunk_files(n2).values()))
    assert under_replicated(n1.run("status").stdout) == 0
    assert n1.run("verify", "data@1").returncode == 0


@needs_fuse
@pytest.mark.timeout(60)
def test_a_stopped_node_is_reported_and_repair_restores_replicas(cluster: tuple[list[Node], Path, set[str]],
                                                                   tmp_path: Path) -> None:
    nodes, src, ids = cluster
    n1, n2, n3 = nodes
    on_n3 = set(chunk_files(n3))
    n3.stop()
    status = n1.run("status", check=False)
    assert status.returncode == 3, status
    assert re.search(r"^node n3: DOWN \(.+\)  roles data\+meta$", status.stdout, re.M), status.stdout
    assert under_replicated(status.stdout) == len(on_n3), status.stdout

    fixed = n1.run("repair")
    assert "node n3 is unreachable" in fixed.stdout
    copied = re.findall(r"^copied chunk ([0-9a-f]{32}) from (n\d) to (n\d)$", fixed.stdout, re.M)
    assert {c for c, _, _ in copied} == on_n3, fixed.stdout
    assert all({frm, to} == {"n1", "n2"} for _, frm, to in copied), fixed.stdout
    for n in (n1, n2):
        files = chunk_files(n)
        assert set(files) == ids and all(map(is_good, files.values())), f"{n.name} lacks a good copy"
    status = n1.run("status", check=False)
    assert status.returncode == 3 and under_replicated(status.stdout) == 0, status.stdout
    ok = n1.run("verify", "data")  # n3 is down, but every chunk has its 2 good copies
    assert "every chunk has 2 good replicas (nodes n3 unreachable)" in ok.stdout, ok.stdout

    mnt = n1.mount("data", tmp_path / "mnt")
    for dirpath, _, names in os.walk(src):
        for name in names:
            path = Path(dirpath, name)
            assert filecmp.cmp(path, mnt / path.relative_to(src), shallow=False), path
    n1.umount(mnt)


@contextmanager
def cluster_with_roles(base: Path, roles: list[str], replicas: int) -> Iterator[list[Node]]:
    """Like conftest.running_cluster, with a role per node (n1, n2, ...)."""
    base.mkdir(parents=True)
    run_dlfs(base, "keygen", base / "cluster.key")
    socks = [socket.socket() for _ in roles]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    lines = [f"replicas = {replicas}", 'key_file = "cluster.key"']
    for i, (role, port) in enumerate(zip(roles, ports)):
        # One port per node: a node of one role listens on that one only.
        lines += ["[[node]]", f'name = "n{i + 1}"', 'address = "127.0.0.1"', f'role = "{role}"',
                  f"meta_port = {port}", f"data_port = {port}"] if role != "both" else \
                 ["[[node]]", f'name = "n{i + 1}"', 'address = "127.0.0.1"', f"meta_port = {port}",
                  f"data_port = {_spare_port()}"]
    etcd = local_etcd(base)
    cluster = base / "cluster.toml"
    cluster.write_text("\n".join(lines) + "\n" + etcd.toml())
    nodes: list[Node] = []
    try:
        for i in range(len(roles)):
            proc, log = start_node_process(base / f"h{i + 1}", "--cluster", str(cluster), "--name", f"n{i + 1}")
            nodes.append(Node(base / f"h{i + 1}", proc, log, cluster=cluster, name=f"n{i + 1}"))
        for node in nodes:
            wait_for_node(node.home, node.proc, node.log, cluster)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
        etcd.stop()


def _spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(60)
def test_status_and_repair_with_node_roles(tmp_path: Path) -> None:
    """n1 runs both daemons, n2 only a metadata daemon, n3 only a data daemon."""
    with cluster_with_roles(tmp_path / "c", ["both", "meta", "data"], replicas=2) as (n1, n2, n3):
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.bin").write_bytes(random.Random(5).randbytes(200_000))
        n1.ingest(src, "small", "--chunk-size", "64K")
        ids = set(chunk_files(n1))
        assert ids and set(chunk_files(n3)) == ids and not chunk_files(n2)

        out = n1.run("status").stdout
        lines = out.splitlines()
        n2_at = lines.index(next(line for line in lines if line.startswith("node n2: ")))
        assert re.fullmatch(r"node n2: up  roles meta  meta 127\.0\.0\.1:\d+", lines[n2_at]), out
        assert lines[n2_at + 1].startswith("  datasets ") and lines[n2_at + 2].startswith("node n3: "), out
        assert re.fullmatch(r"node n3: up  roles data  data 127\.0\.0\.1:\d+", lines[n2_at + 2]), out
        assert lines[n2_at + 3].startswith("  chunks ") and lines[n2_at + 4] == "datasets: 1 (1 version)", out
        assert under_replicated(out) == 0
        assert n1.run("verify", "small").returncode == 0

        n3.stop()  # one data node left: nowhere to put a second copy
        status = n1.run("status", check=False)
        assert status.returncode == 3 and under_replicated(status.stdout) == len(ids), status.stdout
        proc = n1.run("repair", check=False)
        assert proc.returncode == 5, proc
        assert proc.stdout.count("only 1 of 2 good copies (not enough reachable data nodes)") == len(ids), proc.stdout
        assert "copied chunk" not in proc.stdout


def served(node: Node, of: Node, cid: str) -> bytes:
    """What `of`'s data daemon sends of chunk `cid` (all of it), asked by `node`'s client."""
    size = chunk_files(of)[cid].stat().st_size if cid in chunk_files(of) else CHUNK_HEADER.size

    async def ask() -> bytes:
        async with open_nursery() as nursery:
            client = ClusterClient(load_cluster(str(node.cluster), node.home), nursery)
            data = await client.read_from(client.cluster.node(of.name), bytes.fromhex(cid), 0, size, timeout=10)
            nursery.cancel_scope.cancel()
        return bytes(data)

    return trio.run(ask)


@pytest.mark.drops_caches
@needs_fuse
@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_repaired_replica_is_read_from_its_new_file(cluster: tuple[list[Node], Path, set[str]], tmp_path: Path,
                                                      engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk file spoiled and deleted by hand, then repaired: neither its data daemon nor a mount on its
    machine (its native engine's reads of chunk files, or Python's) reads the old inode through a
    descriptor kept from before (issue 25's first fault)."""
    if engine == "python":
        monkeypatch.setenv("DLFS_NO_NATIVE", "1")
    nodes, src, _ = cluster
    n1, n2, _ = nodes
    both = sorted(set(chunk_files(n1)) & set(chunk_files(n2)))
    assert both
    mnt = n1.mount("data", tmp_path / "mnt")
    try:
        # Both keep descriptors: the daemon of the chunks it served, the mount of the files it read.
        for cid in both:
            assert served(n1, n1, cid) == chunk_files(n1)[cid].read_bytes()
        for path in src.rglob("*.bin"):
            assert (mnt / path.relative_to(src)).read_bytes() == path.read_bytes()
        for cid in both:
            flip_a_byte(chunk_files(n1)[cid])
            chunk_files(n1)[cid].unlink()
        fixed = n1.run("repair")
        assert sorted(re.findall(r"^copied chunk ([0-9a-f]{32}) from n2 to n1$", fixed.stdout, re.M)) == both, \
            fixed.stdout
        assert n1.run("verify", "data").returncode == 0
        n2.stop()  # n1's copies are the only ones of these chunks now
        for cid in both:
            assert served(n1, n1, cid) == chunk_files(n1)[cid].read_bytes(), cid
        drop_caches()  # the mount's pages too: read again, from its chunk files
        time.sleep(RECHECK)  # how long a mount may trust what it found of a chunk file
        for path in src.rglob("*.bin"):
            assert (mnt / path.relative_to(src)).read_bytes() == path.read_bytes(), path
        counted = mount_stats_from_now(n1.home, mnt)  # counters written after the reads
        failed = {k: v for k, v in counted["engine"].items() if k.endswith("_failures") and v}
        assert not failed, failed
        # Not even a fallback to the daemon: the mount's own reads of the chunk files found the new ones.
        log = n1.mount_log("data").read_text()
        assert "reading it from the replicas" not in log and "mismatch" not in log, log
    finally:
        n1.umount(mnt)


@pytest.mark.drops_caches
@pytest.mark.timeout(30)
def test_a_mount_reads_the_chunk_file_its_path_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalChunks keeps descriptors, and trusts them (or that a chunk is absent) for RECHECK seconds at
    most: then a file replaced (repair), deleted or arrived is seen; a file whose bytes failed their
    check is passed over until it is replaced."""
    import dlfs.mount.localchunks as local

    now = [0.0]  # LocalChunks's clock, moved by the test: RECHECK passes exactly when the test says so
    monkeypatch.setattr(local, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def recheck_passes() -> None:
        now[0] += local.RECHECK

    cid = bytes.fromhex("ab" + "00" * 15)
    path = tmp_path / "chunks" / "ab" / cid.hex()
    path.parent.mkdir(parents=True)
    chunks = local.LocalChunks(tmp_path / "chunks", "n1")

    async def read() -> bytes | None:
        got = await chunks.read_ranges(cid, [(0, 8192)], memoryview(bytearray(1 << 16)))
        return None if got is None else bytes(got[0][:4])

    async def main() -> None:
        assert await read() is None  # not here (yet)
        path.write_bytes(b"A" * 65536)
        assert await read() is None  # absent, as of less than RECHECK ago
        recheck_passes()
        assert await read() == b"AAAA"  # arrived
        with open(path, "r+b") as f:
            f.write(b"ZZZZ")  # spoiled in place ...
        path.unlink()
        path.write_bytes(b"B" * 65536)  # ... deleted, and replaced by repair
        drop_caches()
        assert await read() == b"ZZZZ"  # within RECHECK the kept descriptor is trusted
        recheck_passes()
        assert await read() == b"BBBB"
        chunks.failed(cid)  # its bytes failed their check: not read again while it is this file
        recheck_passes()
        assert await read() is None
        path.unlink()
        path.write_bytes(b"C" * 65536)
        recheck_passes()
        assert await read() == b"CCCC"  # a new file: read again
        path.unlink()
        recheck_passes()
        assert await read() is None  # deleted by hand: the replicas', not the old inode's

    try:
        trio.run(main)
    finally:
        chunks.close()
