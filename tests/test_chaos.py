"""The chaos suite's newer scenarios (tests/chaosfaults.py, as scripts/chaos.py runs them), small: three
real nodes on localhost with one real etcd member, a real FUSE mount and readers checking every byte
while etcd is killed, a node's disk is full, or a replica is spoiled, deleted and repaired.

tests/test_faults.py and tests/test_repair.py test the same faults with nobody reading; here the point
is the readers: not one read may fail or be wrong while the fault happens.
"""

from __future__ import annotations

import errno
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaosfaults import CHUNK_SIZE, TIGHT_NODE, Cluster, Row, run_scenario, scenarios
from chaoslab import make_files
from conftest import REPO, needs_fuse
from etcdlab import etcd_available

pytestmark = [needs_fuse, pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))]
FILES = 60
READERS = 3
HOLD = 2.0  # seconds etcd stays down at least (its ingest and gc take longer)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, bytes]]]:
    base = tmp_path_factory.mktemp("chaos")
    files = make_files(base / "src", FILES, seed=17)
    cluster = Cluster(base, None, tight_store=sum(map(len, files.values())) + (8 << 20))
    try:
        cluster.start_all()
        cluster.cli("ingest", base / "src", "--name", "chaos", "--chunk-size", CHUNK_SIZE, node="n1")
        yield cluster, files
    finally:
        cluster.close()


def run(lab: tuple[Cluster, dict[str, bytes]], name: str) -> Row:
    cluster, files = lab
    row = run_scenario(cluster, scenarios(HOLD, files)[name], files, READERS)
    assert row.log is not None
    assert not row.outcome.problems, row.outcome.problems
    assert not row.log.errors, row.log.errors[:10]
    assert not row.log.wrong, row.log.wrong[:10]
    assert row.log.reads >= 4 * FILES, row.log.reads  # two passes before the fault, two after
    return row


@pytest.mark.timeout(180)
def test_readers_go_on_while_etcd_is_killed_and_ingest_and_gc_fail_in_one_line(
        lab: tuple[Cluster, dict[str, bytes]]) -> None:
    """etcd's only member SIGKILLed: a whole pass of reads while it is down, an ingest and a gc each exit
    3 with one line naming etcd; once it is back, both work and no chunk is left behind."""
    row = run(lab, "etcd-kill")
    assert re.fullmatch(r"ingest exit 3 in [\d.]+ s, gc exit 3 in [\d.]+ s while down; ingest, gc ok after",
                        row.outcome.outcome), row.outcome
    for what, line in zip(("ingest", "gc"), row.outcome.details):
        assert re.fullmatch(rf"{what} with etcd down: dlfs: error: etcd is unavailable \(http://127\.0\.0\.1:\d+: .+\)",
                            line), line


@pytest.mark.timeout(180)
def test_readers_see_no_error_while_an_ingest_spills_past_a_full_node(lab: tuple[Cluster, dict[str, bytes]]) -> None:
    """n3's chunk store full: a replicas=2 ingest of another dataset completes on n1 and n2 (verified),
    storing nothing on n3, while readers of the first dataset see no error."""
    cluster, _ = lab
    if cluster.tight is None:
        pytest.skip(cluster.tight_why)
    row = run(lab, "disk-full")
    m = re.fullmatch(rf"ingest exit 0 in [\d.]+ s, (\d+) chunks on 2 replicas \((\d+) on {TIGHT_NODE}\)",
                     row.outcome.outcome)
    assert m and int(m[1]) > 20 and m[2] == "0", row.outcome
    assert cluster.run("datasets").stdout.count("spill") == 0  # removed again: the next scenario starts clean


@pytest.mark.timeout(180)
def test_readers_get_right_bytes_while_a_replica_is_spoiled_deleted_repaired_and_its_twin_stopped(
        lab: tuple[Cluster, dict[str, bytes]]) -> None:
    """Every chunk on n1 and n2 spoiled on n1, deleted, repaired from n2, then n2 stopped: readers of a
    mount reading n1's chunk files itself and of one reading through the data daemons get every byte
    right, and both mounts did meet the spoiled copies."""
    cluster, _ = lab
    row = run(lab, "corrupt-repair")
    m = re.fullmatch(r"mounts logged (\d+)\+(\d+) bad copies; repair copied (\d+)/(\d+), verify exit 0",
                     row.outcome.outcome)
    assert m and int(m[1]) > 0 and int(m[2]) > 0 and m[3] == m[4], row.outcome
    assert not cluster.down()


@pytest.mark.timeout(30)
def test_the_script_refuses_an_unknown_scenario() -> None:
    out = subprocess.run([sys.executable, "scripts/chaos.py", "--only", "kill,nosuch"], capture_output=True,
                         text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (
        "chaos.py: error: unknown scenarios: nosuch (known: sigstop, partition, kill, rolling, restart-all, "
        "etcd-kill, disk-full, corrupt-repair)"), out.stderr


@pytest.mark.timeout(120)
def test_an_ingest_returns_with_its_index_on_as_many_metadata_daemons_as_its_chunks(
        lab: tuple[Cluster, dict[str, bytes]], tmp_path: Path) -> None:
    """The node an ingest committed on frozen the moment it returns: the version's index is already on
    another node (replicas = 2), so the version still mounts; before, the other daemons copied it a moment
    later, and a mount in between found none to send it ("no metadata daemon could send the index")."""
    cluster, _ = lab
    files = make_files(tmp_path / "src", 8, seed=23)
    out = cluster.run("ingest", tmp_path / "src", "--name", "fresh", "--chunk-size", CHUNK_SIZE, node="n1")
    cluster.signal("n1", signal.SIGSTOP)
    try:
        assert out.returncode == 0 and "warning" not in out.stderr, out
        holders = [n for n, node in cluster.nodes.items() if (node.home / "meta" / "index" / "fresh" / "1.idx").exists()]
        assert "n1" in holders and len(holders) >= 2, holders
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        other = next(n for n in holders if n != "n1")
        cluster.cli("mount", "fresh", mnt, "--no-short-circuit", node=other, timeout=60)
        try:
            for rel, data in files.items():
                assert (mnt / rel).read_bytes() == data, rel
        finally:
            cluster.run("umount", mnt, node=other, timeout=60)
    finally:
        cluster.signal("n1", signal.SIGCONT)


@pytest.mark.timeout(180)
def test_an_ingest_with_a_frozen_data_node_places_its_chunks_past_it_within_one_connect_bound(
        lab: tuple[Cluster, dict[str, bytes]], tmp_path: Path) -> None:
    """n2 frozen (SIGSTOP) through an ingest on n1: its chunks go to the next nodes of their rank as for a
    down node, and the ingest ends within about one connect bound (10 s). Before, each chunk ranked on n2
    waited that bound in turn (calls queued behind one connect attempt each made their own), and the commit
    waited a call's bound for n2 to say which chunks it held: 100 chunks took over 240 s."""
    cluster, _ = lab
    files = make_files(tmp_path / "src", 40, seed=29)
    cluster.signal("n2", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = cluster.run("ingest", tmp_path / "src", "--name", "past-n2", "--chunk-size", CHUNK_SIZE, node="n1",
                          timeout=150)
        took = time.monotonic() - t0
        assert out.returncode == 0, out
        assert took < 40, took  # one connect bound and the work; it was one per chunk on n2, and the commit's wait
    finally:
        cluster.signal("n2", signal.SIGCONT)
    verify = cluster.run("verify", "past-n2", node="n1", timeout=120)
    assert verify.returncode == 0 and "every chunk has 2 good replicas" in verify.stdout, verify
    mnt = tmp_path / "mnt"
    with cluster.mounted("past-n2", mnt) as m:
        for rel, data in files.items():
            assert (m / rel).read_bytes() == data, rel


def _with_n2_frozen(cluster: Cluster, tmp_path: Path, name: str, seed: int,
                    *command: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Ingest 12 files as `name` on n1, then run `command` on n1 while n2 is frozen (SIGSTOP): its result
    and how long it took."""
    make_files(tmp_path / "src", 12, seed=seed)
    cluster.cli("ingest", tmp_path / "src", "--name", name, "--chunk-size", CHUNK_SIZE, node="n1")
    cluster.signal("n2", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = cluster.run(*command, node="n1", timeout=200)
        return out, time.monotonic() - t0
    finally:
        cluster.signal("n2", signal.SIGCONT)


@pytest.mark.timeout(240)
def test_rm_with_a_frozen_data_node_removes_and_says_what_it_left(
        lab: tuple[Cluster, dict[str, bytes]], tmp_path: Path) -> None:
    """n2 frozen: `dlfs rm` removes the version, frees what the other nodes hold and says n2's chunks wait
    (exit 0, within a PING's bound: it waited the node's whole sweep bound, 30 s, before); `dlfs gc` once n2
    is back frees the rest. Before, the sweep
    asked the nodes one after another, n2's call took the whole 60 s the CLI waits, the CLI asked the next
    daemon, and that one answered "no dataset named ..." (exit 4) for the version the first had removed."""
    from dlfs.client.cluster import SILENT_AFTER

    cluster, _ = lab
    rm, took = _with_n2_frozen(cluster, tmp_path, "doomed", 31, "rm", "doomed")
    assert rm.returncode == 0 and rm.stdout.startswith("removed doomed (version 1); freed "), rm
    assert "not all of its chunks are freed yet: data node n2 unreachable" in rm.stderr, rm
    assert took < SILENT_AFTER + 15, took  # a PING's bound: a frozen node waited the sweep's (30 s) before
    assert "doomed" not in cluster.cli("datasets", node="n1")
    gc = cluster.run("gc", node="n1", timeout=120)
    assert gc.returncode == 0, gc


@pytest.mark.timeout(180)
def test_verify_with_a_frozen_node_waits_for_it_once(lab: tuple[Cluster, dict[str, bytes]], tmp_path: Path) -> None:
    """n2 frozen: `dlfs verify` says that n2 neither checked its index files nor answered for its chunks,
    within about one PING's bound. It took 15.3 s before: the index check waited its handshake's 10 s
    bound for n2's metadata daemon, then the chunk check its PING's 5 s for n2's data daemon."""
    from dlfs.client.cluster import SILENT_AFTER

    cluster, _ = lab
    verify, took = _with_n2_frozen(cluster, tmp_path, "checked", 37, "verify", "checked")
    silent = f"no answer within {SILENT_AFTER:g} s: stopped, overloaded or cut off"
    assert f"metadata daemon n2 did not check its index files: {silent}" in verify.stdout, verify
    assert f"node n2 is unreachable ({silent})" in verify.stdout, verify
    assert verify.returncode in (0, 5), verify  # 5 where a chunk of it has a replica on n2
    assert took < SILENT_AFTER + 8, took  # both waits at once, and each a PING's bound
    again = cluster.run("verify", "checked", node="n1", timeout=120)
    assert again.returncode == 0 and "every chunk has 2 good replicas" in again.stdout, again


@pytest.mark.timeout(180)
def test_warmup_hedges_past_a_frozen_node(lab: tuple[Cluster, dict[str, bytes]], tmp_path: Path) -> None:
    """n2 frozen through a `dlfs warmup` through the daemons: its windows are raced by the next replica after
    the hedge bound, as a mount's reads are, and the warmup ends with every byte kept. Before, each window
    waited on n2 its fetch bound (30 s) or the connect bound (10 s)."""
    cluster, files = lab
    cluster.signal("n2", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = cluster.run("warmup", "chaos", "--cache-dir", tmp_path / "wc", "--no-short-circuit", node="n1",
                          timeout=150)
        took = time.monotonic() - t0
    finally:
        cluster.signal("n2", signal.SIGCONT)
    assert out.returncode == 0 and f"warmed chaos@1: {len(files)} files" in out.stdout, out
    assert took < 8, took  # a hedge's bound (1 s until it has learned) and the work; it was 10 s and more


@pytest.mark.timeout(180)
def test_reads_of_data_whose_every_replica_is_frozen_fail_at_once_after_the_retry_timeout(
        lab: tuple[Cluster, dict[str, bytes]]) -> None:
    """n2 and n3 frozen for good, a mount on n1 fetching from the daemons with --retry-timeout 2: the
    files with a replica on n1 read right, the others fail with EIO, the first after the retry timeout
    and the later ones at once (each waited the whole bound in turn, n1 answering that it has no such
    chunk while the others were silent); once the nodes run again, the same mount reads every file."""
    cluster, files = lab
    cluster.mount_args = ["--retry-timeout", "2"]
    try:
        with cluster.mounted("chaos", cluster.base / "mnt" / "outage") as mnt:
            for name in ("n2", "n3"):
                cluster.signal(name, signal.SIGSTOP)
            times: list[float] = []
            failed: list[str] = []
            try:
                for rel, data in files.items():
                    t0 = time.monotonic()
                    try:
                        assert (mnt / rel).read_bytes() == data, rel
                    except OSError as exc:
                        assert exc.errno == errno.EIO, exc
                        failed.append(rel)
                    times.append(time.monotonic() - t0)
            finally:
                for name in ("n2", "n3"):
                    cluster.signal(name, signal.SIGCONT)
            assert 0 < len(failed) < len(files)  # the chunks held by n2 and n3 only (3 nodes, 2 replicas each)
            assert sum(t > 1.0 for t in times) <= 2 and sum(times) < 4 + len(failed) * 0.2, sorted(times)[-5:]
            deadline = time.monotonic() + 30
            while failed:  # the nodes back: a probe finds them within its back-off
                assert time.monotonic() < deadline, f"{len(failed)} files still fail with n2 and n3 running"
                time.sleep(0.2)
                now = {rel: _reads_right(mnt / rel, files[rel]) for rel in failed}
                assert False not in now.values(), [rel for rel, ok in now.items() if ok is False]
                failed = [rel for rel, ok in now.items() if ok is None]
    finally:
        cluster.mount_args = []


def _reads_right(path: Path, data: bytes) -> bool | None:
    """Whether the file reads as `data` (None: EIO, which a read of a node not yet found back may get)."""
    try:
        return path.read_bytes() == data
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return None
