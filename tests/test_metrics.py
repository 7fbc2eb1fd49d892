"""Prometheus metrics, scraped over HTTP from real nodes and a real mount after real reads."""

from __future__ import annotations

import random
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import _free_ports, needs_fuse, run_dlfs, running_cluster, running_node
from prometheus_client.parser import text_string_to_metric_families

from dlfs.counters import LATENCY_BOUNDS, LatencyHistogram
from dlfs.errors import UsageError
from dlfs.metrics import parse_metrics_address

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not among {sorted({n for n, _ in samples})}"
    return samples[key]


def test_latency_histogram_buckets() -> None:
    h = LatencyHistogram()
    for seconds in (0.00001, LATENCY_BOUNDS[0], 0.003, 0.003, 99.0):
        h.observe(seconds)
    cumulative = dict(h.cumulative())
    assert cumulative[repr(LATENCY_BOUNDS[0])] == 2  # a value equal to a bound is inside it
    assert cumulative["0.0025"] == 2 and cumulative["0.005"] == 4
    assert cumulative["10.0"] == 4 and cumulative["+Inf"] == 5 == h.count
    assert h.sum == pytest.approx(99.00601)


def test_metrics_address() -> None:
    assert parse_metrics_address("127.0.0.1:9420").port == 9420
    assert parse_metrics_address(":9420").host == ""
    assert parse_metrics_address("[::1]:9420").host == "::1"
    for bad in ("9420", "host:", "host:99999", "host:port"):
        with pytest.raises(UsageError, match="bad --metrics address"):
            parse_metrics_address(bad)


def test_bad_metrics_address_is_one_line(tmp_path: Path) -> None:
    proc = run_dlfs(tmp_path / "home", "node", "--metrics", "nowhere", check=False, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("dlfs: error: bad --metrics address 'nowhere': use HOST:PORT "
                                   "(e.g. 127.0.0.1:9420) or :PORT")


def _corrupt(path: Path, offset: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))


@needs_fuse
@pytest.mark.timeout(120)
def test_node_and_mount_metrics_after_reads(tmp_path: Path) -> None:
    n_files, size = 8, 40_000
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(7)
    for i in range(n_files):
        (src / f"f{i}").write_bytes(rng.randbytes(size))
    p1, p2, pm = _free_ports(3)
    extra = [["--metrics", f"127.0.0.1:{p}", "--replica-check", "0"] for p in (p1, p2)]
    with running_cluster(tmp_path / "cluster", 2, extra_args=extra) as (n1, n2):
        # 64K chunks of 40 kB files: one file per chunk, so every count below is exact.
        n1.ingest(src, "twice", "--chunk-size", "64K")
        chunks = sorted(p for p in (n1.home / "data/chunks").rglob("*") if p.is_file())
        assert len(chunks) == n_files
        before1, before2 = scrape(p1), scrape(p2)
        assert value(before1, "dlfs_chunks_stored", node="n1") == n_files
        assert value(before1, "dlfs_requests_total", node="n1", service="meta", msg="COMMIT") == 1
        # Both daemons run on this machine: every chunk went in as a staged file, none through a socket.
        for got, name in ((before1, "n1"), (before2, "n2")):
            assert value(got, "dlfs_requests_total", node=name, service="data", msg="PUT_STAGED") == n_files
            assert ("dlfs_requests_total", frozenset({"node": name, "service": "data", "msg": "PUT_CHUNK"}.items())) \
                not in got
        assert value(before1, "dlfs_chunks_under_replicated", node="n1") == 0
        # Native range lanes are served (none open: no mount reads in scan mode yet).
        assert value(before1, "dlfs_range_lanes", node="n1") == 0
        assert value(before1, "dlfs_range_lane_reads_total", node="n1") == 0
        assert value(before1, "dlfs_chunks_live", node="n1") == n_files

        # n1's copy is read first (the local node) and every one of them is damaged: each read
        # fails its checksum there and fails over to n2.
        for path in chunks:
            _corrupt(path)
        mnt = n1.mount("twice", tmp_path / "mnt", "--metrics", f"127.0.0.1:{pm}")
        try:
            for p in sorted(src.iterdir()):
                assert (mnt / p.name).read_bytes() == p.read_bytes()
            m = scrape(pm)
        finally:
            n1.umount(mnt)
        ds = "twice@1"
        after1, after2 = scrape(p1), scrape(p2)

        def served(after: Samples, before: Samples, name: str, node: str) -> float:
            labels = {"node": node, "service": "data", "msg": "READ_RANGE"}
            return value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0.0)

        reads = value(m, "dlfs_mount_reads_total", dataset=ds)
        assert reads >= n_files
        assert value(m, "dlfs_mount_read_bytes_total", dataset=ds) == n_files * size
        assert value(m, "dlfs_mount_read_errors_total", dataset=ds) == 0
        assert value(m, "dlfs_mount_read_duration_seconds_count", dataset=ds) == reads
        assert value(m, "dlfs_mount_read_duration_seconds_bucket", dataset=ds, le="+Inf") == reads
        assert value(m, "dlfs_cache_misses_total", dataset=ds) == n_files
        assert value(m, "dlfs_cache_hits_total", dataset=ds) + n_files == reads
        assert value(m, "dlfs_cache_evictions_total", dataset=ds) == 0
        assert value(m, "dlfs_checksum_failures_total", dataset=ds) == n_files
        assert value(m, "dlfs_failovers_total", dataset=ds) == n_files
        assert value(m, "dlfs_fetch_duration_seconds_count", dataset=ds) == 2 * n_files
        # Each record was read in place from n1's chunk file first (and failed its check there).
        assert value(m, "dlfs_in_place_bytes_total", dataset=ds) == n_files * size
        for node, before, after in (("n1", before1, after1), ("n2", before2, after2)):
            # What the mount says it fetched from each node is what that node says it sent.
            assert value(m, "dlfs_fetches_total", dataset=ds, node=node) == n_files
            assert served(after, before, "dlfs_requests_total", node) == n_files
            fetched = value(m, "dlfs_fetched_bytes_total", dataset=ds, node=node)
            assert fetched == served(after, before, "dlfs_sent_bytes_total", node) == n_files * size
            assert served(after, before, "dlfs_request_duration_seconds_count", node) == n_files
        assert value(m, "process_resident_memory_bytes") > 0

        # The data daemon counts the damage when verify reads it; the replica count sees a node go.
        assert n1.run("verify", "twice", check=False).returncode == 5
        assert value(scrape(p1), "dlfs_checksum_failures_total", node="n1") == n_files
        assert value(scrape(p2), "dlfs_checksum_failures_total", node="n2") == 0
        n2.stop()
        down = scrape(p1)
        assert value(down, "dlfs_chunks_under_replicated", node="n1") == n_files
        assert value(down, "dlfs_replicas_missing", node="n1") == n_files
        assert value(down, "dlfs_data_nodes_unreachable", node="n1") == 1
        n2.start()
    # Gone with the node: nothing listens on the port any more.
    with pytest.raises(urllib.error.URLError):
        scrape(p1)


@pytest.mark.timeout(60)
def test_metrics_http_answers(tmp_path: Path) -> None:
    (port,) = _free_ports(1)
    home = tmp_path / "home"
    with running_node(home, tmp_path, "--metrics", f"127.0.0.1:{port}") as node:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=10)
        assert info.value.code == 404
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="POST", data=b"x")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 405
        # A scraper that connects and says nothing holds only its own connection.
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            assert value(scrape(port), "dlfs_chunks_stored", node="local") == 0
        assert f"metrics on http://127.0.0.1:{port}/metrics" in node.node_log()
