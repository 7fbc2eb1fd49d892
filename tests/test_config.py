"""The cluster file refuses every mistake in one line (exit 2), good files parse as before, and the
--json outputs of `dlfs datasets` and `dlfs stats` are what the README documents."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import DLFS, REPO, Node, dlfs_env, needs_fuse, run_dlfs

from dlfs.config import ROLES, EtcdConfig, parse_cluster_file
from dlfs.errors import UsageError
from dlfs.wire.auth import write_key

NODE = '[[node]]\nname = "n1"\naddress = "127.0.0.1"\n'
TWO = NODE + '[[node]]\nname = "n2"\naddress = "127.0.0.2"\n'
ETCD = '[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n'


@pytest.fixture
def write(tmp_path: Path):  # type: ignore[no-untyped-def]
    """write(text) -> the path of a cluster file holding `text`, beside a good key `k`."""
    write_key(tmp_path / "k")

    def make(text: str, name: str = "c.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return make


def refusal(path: Path) -> str:
    with pytest.raises(UsageError) as err:
        parse_cluster_file(path)
    assert err.value.exit_code == 2
    return str(err.value).removeprefix(f"cluster file {path}")


# Each kind of mistake and its exact line (after "cluster file PATH").
MISTAKES = [
    # unknown keys, with the key meant
    ('key_file = "k"\n' + NODE + "metaport = 7500\n",
     ": unknown key 'metaport' in node[1] (did you mean 'meta_port'?)"),
    ('key_file = "k"\nreplicaz = 3\n' + NODE, ": unknown key 'replicaz' (did you mean 'replicas'?)"),
    ('key_file = "k"\n' + NODE + ETCD + "leasettl = 5\n",
     ": unknown key 'leasettl' in [etcd] (did you mean 'lease_ttl'?)"),
    ('key_file = "k"\n' + NODE + ETCD + "meta_port = 7500\n",
     ": unknown key 'meta_port' in [etcd] (it goes at the top of the file, before the first table)"),
    ('key_file = "k"\n' + NODE + ETCD + "[etcd.tls]\nca = 1\n",
     ": unknown key 'tls' in [etcd] (allowed: endpoints, prefix, ca_file, cert_file, key_file, lease_ttl)"),
    ('key_file = "k"\nfoo = 1\n' + NODE,
     ": unknown key 'foo' (allowed: node, key_file, replicas, meta_port, data_port, transport, rdma_device, "
     "rdma_port, etcd)"),
    ('key_file = "k"\n[[nodes]]\nname = "n1"\n', ": unknown key 'nodes' (did you mean 'node'?)"),
    # a key in the wrong table: TOML puts a top-level key written after [[node]] into that node
    ('key_file = "k"\n' + NODE + "replicas = 1\n",
     ": unknown key 'replicas' in node[1] (it goes at the top of the file, before the first table)"),
    ('key_file = "k"\nrole = "data"\n' + NODE, ": unknown key 'role' (it goes in each [[node]] table)"),
    # wrong types
    ('key_file = "k"\n' + NODE + 'meta_port = "abc"\n',
     ": node[1].meta_port = 'abc' (use a port number from 1 to 65535)"),
    ('key_file = "k"\nreplicas = "two"\n' + NODE,
     ": replicas = 'two' (use a whole number from 1 to the number of data nodes)"),
    ('key_file = "k"\n' + NODE + "data_port = true\n", ": node[1].data_port = true (use a port number from 1 to 65535)"),
    ('key_file = "k"\n' + NODE + "data_port = 7421.0\n",
     ": node[1].data_port = 7421.0 (use a port number from 1 to 65535)"),
    ("key_file = 3\n" + NODE,
     ": key_file = 3 (use the cluster key's path, relative to this file; `dlfs keygen FILE` makes one)"),
    ('key_file = "k"\n[node]\nname = "n1"\n', ": node is a table (use [[node]] tables, one per node)"),
    ('key_file = "k"\netcd = "http://e:2379"\n' + NODE, ": etcd = 'http://e:2379' (use an [etcd] table)"),
    ('key_file = "k"\n' + NODE + '[etcd]\nendpoints = "http://e:2379"\n',
     ": etcd.endpoints = 'http://e:2379' (use [\"http://HOST:PORT\", ...], https:// for TLS)"),
    # out of range
    ('key_file = "k"\n' + TWO + "meta_port = 99999\n" + ETCD,
     ": node[2].meta_port = 99999 (use a port number from 1 to 65535)"),
    ('key_file = "k"\nmeta_port = 0\n' + NODE, ": meta_port = 0 (use a port number from 1 to 65535)"),
    ('key_file = "k"\nreplicas = 0\n' + NODE,
     ": replicas = 0 (use a whole number from 1 to the number of data nodes)"),
    ('key_file = "k"\nreplicas = 3\n' + TWO + ETCD,
     ": replicas = 3 (use a whole number from 1 to 2, the number of data nodes)"),
    ('key_file = "k"\n' + NODE + ETCD + "lease_ttl = 0\n", ": etcd.lease_ttl = 0 (use whole seconds from 2 to 3600)"),
    ('key_file = "k"\ntransport = "ib"\n' + NODE, ": transport = 'ib' (use auto, tcp or rdma)"),
    ('key_file = "k"\nrdma_port = 256\n' + NODE, ": rdma_port = 256 (use a port number from 1 to 255)"),
    ('key_file = "k"\n' + NODE + 'role = "storage"\n', ": node[1].role = 'storage' (use data, meta or both)"),
    ('key_file = "k"\n' + NODE + '[etcd]\nendpoints = ["10.0.0.1:2379"]\n',
     ": etcd.endpoints[1] = '10.0.0.1:2379' (use [\"http://HOST:PORT\", ...], https:// for TLS)"),
    ('key_file = "k"\n' + NODE + '[etcd]\nendpoints = ["http://e:2379"]\nprefix = ""\n',
     ": etcd.prefix = '' (use a non-empty key prefix such as \"/dlfs/\")"),
    ('key_file = "k"\n[[node]]\nname = "gpu 1"\naddress = "10.0.0.1"\n',
     ": node[1].name = 'gpu 1' (use a name of letters, digits, '.', '_' and '-')"),
    ('key_file = "k"\n[[node]]\nname = "n1"\naddress = "10.0.0.1:7420"\n',
     ": node[1].address = '10.0.0.1:7420' (use a host name or IP address without a port; ports go in meta_port "
     "and data_port)"),
    # missing
    (NODE, " needs key_file (the cluster key's path, relative to this file; `dlfs keygen FILE` makes one)"),
    ('key_file = "k"\n', " lists no [[node]] entries"),
    ('key_file = "k"\nnode = []\n', " lists no [[node]] entries"),
    ('key_file = "k"\n[[node]]\naddress = "10.0.0.1"\n',
     ": node[1] needs name (a name of letters, digits, '.', '_' and '-')"),
    ('key_file = "k"\n' + NODE + "[etcd]\n", ': [etcd] needs endpoints (["http://HOST:PORT", ...], https:// for TLS)'),
    # between entries
    ('key_file = "k"\n' + NODE + NODE.replace("127.0.0.1", "127.0.0.2") + ETCD,
     ": node[2].name = 'n1' is node[1]'s name too (use a name no other node has)"),
    ('key_file = "k"\n' + NODE + '[[node]]\nname = "n2"\naddress = "127.0.0.1"\n' + ETCD,
     ": node[2].meta_port = 7420 (the top-level meta_port) clashes with node[1].meta_port: both listen on "
     "127.0.0.1 port 7420 (use a port no other daemon at that address has)"),
    ('key_file = "k"\n' + NODE + "meta_port = 7500\ndata_port = 7500\n",
     ": node[1].data_port = 7500 clashes with node[1].meta_port: both listen on 127.0.0.1 port 7500 "
     "(use a port no other daemon at that address has)"),
    ('key_file = "k"\n' + NODE + 'role = "data"\n',
     ": needs at least one data node and one metadata node (role = data, meta or both)"),
    ('key_file = "k"\n' + TWO, ' has 2 nodes but no [etcd] section: a cluster of more than one node keeps its '
     'catalog in etcd (endpoints = ["http://HOST:2379", ...])'),
    ('key_file = "k"\n' + NODE + ETCD + 'cert_file = "c.pem"\n',
     ": [etcd]: cert_file and key_file go together (TLS client certificate and its key)"),
    # not TOML
    ('key_file = "k"\nmeta_port = 1 2\n',
     " is not valid TOML: Expected newline or end of document after a statement (at line 2, column 15)"),
]


@pytest.mark.parametrize(("text", "line"), MISTAKES, ids=[f"{i}" for i in range(len(MISTAKES))])
def test_every_mistake_is_one_line_naming_the_key(write, text: str, line: str) -> None:  # type: ignore[no-untyped-def]
    assert refusal(write(text)) == line


def test_what_no_toml_reader_gets_that_far(tmp_path: Path) -> None:
    assert refusal(tmp_path / "absent.toml") == " does not exist"
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(UsageError, match=r"^cannot read cluster file .*d\.toml: Is a directory$"):
        parse_cluster_file(tmp_path / "d.toml")
    (tmp_path / "bin.toml").write_bytes(b"key_file = \"\xff\"\n")
    assert refusal(tmp_path / "bin.toml") == " is not UTF-8 text"


def test_a_same_port_is_fine_where_only_one_daemon_listens(write) -> None:  # type: ignore[no-untyped-def]
    """A meta-only and a data-only node at one address may share a port number; ports on other
    addresses never clash."""
    text = ('key_file = "k"\nreplicas = 1\n[[node]]\nname = "m"\naddress = "127.0.0.1"\nrole = "meta"\n'
            'meta_port = 7600\ndata_port = 7600\n[[node]]\nname = "d"\naddress = "127.0.0.1"\nrole = "data"\n'
            'meta_port = 7601\ndata_port = 7601\n[[node]]\nname = "x"\naddress = "127.0.0.2"\n'
            'meta_port = 7600\ndata_port = 7601\n' + ETCD)
    cluster = parse_cluster_file(write(text))
    assert [(n.name, n.meta.port, n.data.port, n.roles) for n in cluster.nodes] == [
        ("m", 7600, 7600, ROLES["meta"]), ("d", 7601, 7601, ROLES["data"]), ("x", 7600, 7601, ROLES["both"])]


# --- good files parse as they did -------------------------------------------------------------------
def test_defaults_and_paths_as_before(write, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "sub").mkdir()
    write_key(tmp_path / "sub" / "key")
    path = write('key_file = "sub/key"\n' + NODE)
    c = parse_cluster_file(path)
    assert [(n.name, str(n.meta), str(n.data), n.roles) for n in c.nodes] == [
        ("n1", "127.0.0.1:7420", "127.0.0.1:7421", ROLES["both"])]
    assert (c.replicas, c.transport, c.rdma_device, c.rdma_port, c.etcd) == (1, "auto", None, None, None)
    assert c.key_file == str(tmp_path / "sub" / "key") and c.key == bytes.fromhex((tmp_path / "sub" / "key").read_text())
    assert c.source == str(path) and c.local == "n1"  # 127.0.0.1 is this machine's
    assert c.extra["node"] == [{"name": "n1", "address": "127.0.0.1"}]  # the raw document, as before

    text = ('key_file = "k"\nmeta_port = 7500\ndata_port = 7501\ntransport = "tcp"\n' + TWO +
            'meta_port = 7600\nrole = "data"\n[[node]]\nname = "n3"\naddress = "fd00::3"\nrole = "meta"\n'
            '[etcd]\nendpoints = ["https://e1:2379/", "https://e2:2379"]\nprefix = "/mine"\nca_file = "ca.pem"\n'
            'cert_file = "c.pem"\nkey_file = "/abs/k.pem"\nlease_ttl = 30\n')
    c = parse_cluster_file(write(text))
    assert [(n.name, str(n.meta), str(n.data), n.roles) for n in c.nodes] == [
        ("n1", "127.0.0.1:7500", "127.0.0.1:7501", ROLES["both"]),
        ("n2", "127.0.0.2:7600", "127.0.0.2:7501", ROLES["data"]),
        ("n3", "[fd00::3]:7500", "[fd00::3]:7501", ROLES["meta"])]
    assert c.replicas == 2 and c.transport == "tcp"  # min(2, data nodes)
    assert c.etcd == EtcdConfig(("https://e1:2379", "https://e2:2379"), "/mine/", str(tmp_path / "ca.pem"),
                                str(tmp_path / "c.pem"), "/abs/k.pem", 30)


def test_the_shipped_examples_parse(tmp_path: Path) -> None:
    """The README's cluster file and the Kubernetes ConfigMap's, with the values they show."""
    write_key(tmp_path / "cluster.key")
    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", readme, re.S) if "[[node]]" in b][:1]
    (tmp_path / "readme.toml").write_text(block)
    c = parse_cluster_file(tmp_path / "readme.toml")
    assert [(n.name, str(n.meta), str(n.data), n.roles) for n in c.nodes] == [
        ("n1", "10.0.0.1:7420", "10.0.0.1:7421", ROLES["both"]), ("n2", "10.0.0.2:7420", "10.0.0.2:7421", ROLES["data"])]
    assert c.replicas == 2 and c.etcd is not None and c.etcd.lease_ttl == 10 and c.etcd.prefix == "/dlfs/"

    docs = [d for d in yaml.safe_load_all((REPO / "deploy/kubernetes/configmap.yaml").read_text()) if d]
    (cm,) = [d for d in docs if d.get("kind") == "ConfigMap" and "cluster.toml" in d.get("data", {})]
    (tmp_path / "k8s.toml").write_text(cm["data"]["cluster.toml"])
    c = parse_cluster_file(tmp_path / "k8s.toml")
    assert [(n.name, str(n.meta)) for n in c.nodes] == [
        ("worker-1", "10.0.0.11:7420"), ("worker-2", "10.0.0.12:7420"), ("worker-3", "10.0.0.13:7420")]
    assert c.replicas == 2 and c.etcd is not None and len(c.etcd.endpoints) == 3


# --- through the real CLI ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_the_cli_says_it_in_one_line_and_exits_2(write, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write('key_file = "k"\n' + NODE + "metaport = 7500\n")
    line = f"cluster file {path}: unknown key 'metaport' in node[1] (did you mean 'meta_port'?)"
    for args in (["datasets"], ["node"], ["status", "--json"], ["ingest", tmp_path, "--name", "x"]):
        proc = run_dlfs(tmp_path / "home", "--cluster", path, *args, check=False)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"dlfs: error: {line}\n", ""), args
    # $DLFS_CLUSTER is read the same way
    env = {**dlfs_env(tmp_path / "home"), "DLFS_CLUSTER": str(write('key_file = "k"\n' + NODE + 'meta_port = "abc"\n',
                                                                      "e.toml"))}
    proc = subprocess.run([*DLFS, "datasets"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (
        2, f"dlfs: error: cluster file {tmp_path / 'e.toml'}: node[1].meta_port = 'abc' "
           "(use a port number from 1 to 65535)\n")

    # doctor shows the same line as its failed row, and goes on with the checks that need no cluster
    proc = run_dlfs(tmp_path / "home", "doctor", "--json", "--cluster", path, check=False)
    assert proc.returncode == 1
    rows = {r["check"]: r for r in json.loads(proc.stdout)["checks"]}
    assert rows["cluster file"]["status"] == "FAIL" and rows["cluster file"]["detail"] == line
    assert "/dev/fuse" in rows


# --- --json ------------------------------------------------------------------------------------------
def _unix(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp()


@needs_fuse
@pytest.mark.timeout(180)
def test_datasets_and_stats_as_json(node: Node, tmp_path: Path) -> None:
    assert json.loads(node.run("datasets", "--json").stdout) == {"datasets": []}
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"f{i:02}").write_bytes(os.urandom(10_000 + i))
    node.ingest(src, "pics")
    node.ingest(src, "pics", "--force")
    out = json.loads(node.run("datasets", "--json").stdout)
    assert list(out) == ["datasets"]
    rows = out["datasets"]
    assert [(r["name"], r["version"]) for r in rows] == [("pics", 1), ("pics", 2)]
    total = sum(10_000 + i for i in range(30))
    for r in rows:
        assert list(r) == ["name", "version", "files", "bytes", "chunks", "chunk_size", "index_bytes", "created",
                           "created_unix"]
        assert r["files"] == 30 and r["bytes"] == total and r["chunks"] >= 1 and r["chunk_size"] == 8 << 20
        assert isinstance(r["index_bytes"], int) and r["index_bytes"] > 0
        assert isinstance(r["created_unix"], float) and abs(_unix(r["created"]) - r["created_unix"]) < 1
    # the table says the same
    table = node.run("datasets").stdout.splitlines()
    assert [line.split()[:3] for line in table[1:]] == [["pics", "1", "30"], ["pics", "2", "30"]]

    mnt = node.mount("pics", tmp_path / "mnt")
    for i in range(10):
        assert (mnt / f"f{i:02}").read_bytes() == (src / f"f{i:02}").read_bytes()
    proc = node.run("stats", mnt, "--json")
    assert proc.stdout.count("\n") == 1
    view = json.loads(proc.stdout)
    assert list(view) == ["dataset", "mountpoint", "pid", "started", "started_unix", "time", "time_unix",
                          "uptime_seconds", "metrics", "interval", "total", "engine", "direct", "failing_nodes",
                          "nodes", "thread_connections", "disk_cache"]
    assert view["disk_cache"] is None  # no --cache-dir (test_diskcache.py has one)
    assert view["dataset"] == "pics@2" and view["mountpoint"] == str(mnt) and view["metrics"] is None
    assert abs(_unix(view["time"]) - view["time_unix"]) < 1 and abs(_unix(view["started"]) - view["started_unix"]) < 1
    assert view["uptime_seconds"] == pytest.approx(view["time_unix"] - view["started_unix"], abs=0.01)
    t = view["total"]
    assert t["reads"] >= 10 and t["read_bytes"] == sum(10_000 + i for i in range(10))
    assert t["cache_hits"] + t["cache_misses"] >= 10 and t["cache_misses"] >= 1
    assert t["cache_hit_rate"] == pytest.approx(t["cache_hits"] / (t["cache_hits"] + t["cache_misses"]))
    assert t["fetched_bytes"] > 0 and t["fetches"] >= 1 and t["read_errors"] == 0 and t["failovers"] == 0
    assert t["in_place_bytes"] == t["fetched_bytes"], t  # one node: every chunk is this machine's, read in place
    assert t["cache_capacity"] > 0 and isinstance(t["cache_bytes"], int)
    i = view["interval"]  # the reads may fall in it (the sample before the command may predate them)
    assert i["seconds"] > 0 and 0 <= round(i["reads_per_second"] * i["seconds"]) <= t["reads"]
    assert i["cache_hits"] + i["cache_misses"] <= t["cache_hits"] + t["cache_misses"]
    assert [(n["node"], n["bytes"], n["share"]) for n in view["nodes"]] == [("local", t["fetched_bytes"], 1.0)]
    assert view["failing_nodes"] == []
    assert view["thread_connections"] == {}  # nothing fetched by the threads: every record is read in place
    if view["engine"] is not None:
        assert set(view["engine"]) == {"requests", "answered", "forwarded", "threads", "io_uring", "direct_io_min",
                                       "chunk_file_reads", "started_at_lookup", "scan", "scan_kept", "remote_reads",
                                       "remote_failures", "disk_cache_reads", "miss_readers"}
        assert view["engine"]["remote_reads"] == view["engine"]["remote_failures"] == view["engine"]["disk_cache_reads"] == 0
        assert view["engine"]["direct_io_min"] == 0  # small files, far less than memory: --direct-io auto is off
        # Ten files in a default cache: read-ahead has room, nothing is read whole from chunk files.
        assert view["engine"]["scan"] is False and view["engine"]["chunk_file_reads"] == 0
        assert view["engine"]["scan_kept"] is False
        assert view["engine"]["miss_readers"] == 1  # this test reads: its first READ went to Python
        assert view["engine"]["threads"] >= 1

    # --watch --json: JSON Lines, one object a view, each with its own interval
    proc = node.run("stats", mnt, "--json", "--watch", "--count", "2", "--interval", "0.5")
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and proc.stdout.endswith("\n")
    first, second = map(json.loads, lines)
    assert list(first) == list(view) and second["time_unix"] > first["time_unix"] > view["time_unix"]
    for v in (first, second):  # nothing read since the view above was taken
        assert v["total"]["reads"] == t["reads"] and v["interval"]["reads_per_second"] == 0
        assert v["interval"]["cache_hit_rate"] is None and v["interval"]["read_latency_mean_seconds"] is None
        assert v["interval"]["seconds"] > 0

    # errors: one line on stderr, nothing on stdout, the exit code of the error
    node.umount(mnt)
    gone = node.run("stats", mnt, "--json", check=False)
    assert (gone.returncode, gone.stdout) == (4, "") and gone.stderr.count("\n") == 1
    assert gone.stderr.startswith(f"dlfs: error: no dlfs mount at {mnt}")


@pytest.mark.timeout(60)
def test_datasets_json_without_a_node_is_an_error_line(tmp_path: Path) -> None:
    proc = run_dlfs(tmp_path / "home", "datasets", "--json", check=False)
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr == f"dlfs: error: no dlfs node is running under {tmp_path / 'home'} (start one with `dlfs node`)\n"
