"""Where things are: DLFS_HOME, the cluster file, and the defaults for the embedded one-node cluster.

With no cluster file, `dlfs node` runs a one-node cluster on localhost and records the addresses it
bound in $DLFS_HOME/run/node.json; every other command on this machine finds it there. A cluster
file (TOML) names the nodes instead:

    replicas = 2                 # default: min(2, number of nodes)
    key_file = "cluster.key"     # relative to this file
    [[node]]
    name = "n1"
    address = "10.0.0.1"         # meta_port / data_port default to 7420 / 7421

and how chunks travel (`--transport` overrides it per command):

    transport = "auto"           # auto | tcp | rdma
    rdma_device = "mlx5_0"       # optional: the RDMA device (default: the first with an active port)
    rdma_port = 1                # optional: its port

and, for more than one node, the etcd cluster that keeps the control state (dlfs/control/):

    [etcd]
    endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
    prefix = "/dlfs/"            # optional: several dlfs clusters can share one etcd
    ca_file = "etcd-ca.pem"      # optional TLS (https:// endpoints), relative to this file
    cert_file = "etcd-client.pem"
    key_file = "etcd-client-key.pem"
    lease_ttl = 10               # optional: seconds a node's or mount's lease outlives its last keepalive
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from dlfs.errors import Unreachable, UsageError
from dlfs.private import private_dirs, write_private
from dlfs.procs import running
from dlfs.transport.base import Address
from dlfs.wire.auth import read_key, write_key
from dlfs.wire.messages import DATASET_NAME

META_PORT = 7420
DATA_PORT = 7421
TRANSPORTS = ("auto", "tcp", "rdma")


def home_dir(explicit: str | None = None) -> Path:
    """The state directory: --home, else $DLFS_HOME, else ~/.dlfs."""
    raw = explicit or os.environ.get("DLFS_HOME") or "~/.dlfs"
    return Path(raw).expanduser().absolute()


def check_dataset_name(name: str) -> str:
    if not re.search(DATASET_NAME, name):  # the rule every request is held to (wire/messages.py)
        raise UsageError(
            f"bad dataset name {name!r}: use letters, digits, '.', '_' and '-' (128 at most), "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class EtcdConfig:
    """Where the cluster's control state lives (the cluster file's [etcd] section)."""

    endpoints: tuple[str, ...]
    prefix: str = "/dlfs/"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    lease_ttl: int = 10


ROLES = {"both": frozenset({"meta", "data"}), "meta": frozenset({"meta"}), "data": frozenset({"data"})}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    meta: Address
    data: Address
    roles: frozenset[str] = ROLES["both"]


@dataclass
class Cluster:
    """The nodes a command talks to, and the key that lets it in."""

    nodes: list[NodeSpec]
    key: bytes
    replicas: int
    source: str  # the cluster file, or the node.json of the embedded node
    local: str | None = None  # the node on this machine, read first
    extra: dict[str, object] = field(default_factory=dict)
    transport: str = "auto"  # auto | tcp | rdma: how chunk reads travel (see dlfs/transport/verbs.py)
    rdma_device: str | None = None  # None: the first device with an active port
    rdma_port: int | None = None
    key_file: str = ""  # where the key came from (dlfs doctor checks its permissions)
    etcd: EtcdConfig | None = None  # None: the embedded catalog (one node, SQLite)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UsageError(f"no node named {name!r} in {self.source}")

    @property
    def data_nodes(self) -> list[NodeSpec]:
        return [n for n in self.nodes if "data" in n.roles]

    @property
    def meta_nodes(self) -> list[NodeSpec]:
        return [n for n in self.nodes if "meta" in n.roles]


def check_transport(value: object, where: str) -> str:
    """A transport setting, or a UsageError naming where the bad one came from."""
    if value not in TRANSPORTS:
        raise UsageError(f"{where}: transport = {value!r} (use auto, tcp or rdma)")
    return str(value)


def key_path(home: Path) -> Path:
    return home / "cluster.key"


def ensure_home_key(home: Path) -> bytes:
    """The embedded cluster's key, created (0600) on first use."""
    path = key_path(home)
    if not path.exists():
        private_dirs(home)
        try:
            return write_key(path)
        except FileExistsError:
            pass
    return read_key(path)


def runtime_file(home: Path) -> Path:
    return home / "run" / "node.json"


def ports_file(home: Path) -> Path:
    return home / "run" / "ports.json"


def write_runtime(home: Path, name: str, meta: Address, data: Address) -> None:
    """Publish where the running node listens (atomically, for the commands that read it)."""
    path = runtime_file(home)
    private_dirs(path.parent)
    for target, doc in ((ports_file(home), {"meta": meta.port, "data": data.port}),
                        (path, {"name": name, "meta": str(meta), "data": str(data), "pid": os.getpid()})):
        tmp = target.with_suffix(".tmp")
        write_private(tmp, json.dumps(doc))
        os.replace(tmp, target)


def last_ports(home: Path) -> tuple[int, int]:
    """(meta, data) ports of the node's last run under `home`, or (0, 0).

    A restarted node listens where it did before, so mounts made before the restart reconnect.
    """
    try:
        doc = json.loads(ports_file(home).read_text())
        return int(doc["meta"]), int(doc["data"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0


def load_cluster(cluster_file: str | None, home: Path) -> Cluster:
    """The cluster of a command: from --cluster / $DLFS_CLUSTER, else the local embedded node."""
    cluster_file = cluster_file or os.environ.get("DLFS_CLUSTER")
    if cluster_file:
        return parse_cluster_file(Path(cluster_file))
    path = runtime_file(home)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise Unreachable(f"no dlfs node is running under {home} (start one with `dlfs node`)") from None
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot read {path}: {exc} (restart the node with `dlfs node`)") from None
    if not running(int(info.get("pid", 0))):
        raise Unreachable(f"no dlfs node is running under {home} (start one with `dlfs node`)")
    spec = NodeSpec(info["name"], Address.parse(info["meta"]), Address.parse(info["data"]))
    return Cluster([spec], ensure_home_key(home), 1, str(path), local=spec.name, key_file=str(key_path(home)))


def parse_cluster_file(path: Path) -> Cluster:
    """Read and check a cluster file; every mistake is one line naming the file."""
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"cluster file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"cluster file {path} is not valid TOML: {exc}") from None
    raw_nodes = doc.get("node")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise UsageError(f"cluster file {path} lists no [[node]] entries")
    nodes = []
    for i, n in enumerate(raw_nodes):
        if not isinstance(n, dict) or not isinstance(n.get("name"), str) or not isinstance(n.get("address"), str):
            raise UsageError(f"cluster file {path}: node {i + 1} needs a name and an address")
        host = n["address"]
        role = n.get("role", "both")
        if role not in ROLES:
            raise UsageError(f"cluster file {path}: node {n['name']} has role {role!r} (use data, meta or both)")
        nodes.append(NodeSpec(
            n["name"],
            Address(host, int(n.get("meta_port", doc.get("meta_port", META_PORT)))),
            Address(host, int(n.get("data_port", doc.get("data_port", DATA_PORT)))),
            ROLES[role],
        ))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise UsageError(f"cluster file {path}: node names are not unique")
    n_data = sum("data" in n.roles for n in nodes)
    if not n_data or not any("meta" in n.roles for n in nodes):
        raise UsageError(f"cluster file {path}: needs at least one data node and one metadata node")
    replicas = int(doc.get("replicas", min(2, n_data)))
    if not 1 <= replicas <= n_data:
        raise UsageError(f"cluster file {path}: replicas = {replicas}, but there are {n_data} data nodes")
    key_file = doc.get("key_file")
    if not isinstance(key_file, str):
        raise UsageError(f"cluster file {path} needs key_file = \"...\"")
    key_file = str((path.parent / key_file).resolve())
    key = read_key(Path(key_file))
    transport = check_transport(doc.get("transport", "auto"), f"cluster file {path}")
    device, port = doc.get("rdma_device"), doc.get("rdma_port")
    if device is not None and not isinstance(device, str):
        raise UsageError(f"cluster file {path}: rdma_device must be a device name such as \"mlx5_0\"")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 255):
        raise UsageError(f"cluster file {path}: rdma_port must be a port number from 1 to 255")
    etcd = _etcd_section(path, doc.get("etcd"))
    if etcd is None and len(nodes) > 1:
        raise UsageError(f"cluster file {path} has {len(nodes)} nodes but no [etcd] section: a cluster of more than "
                         'one node keeps its catalog in etcd (endpoints = ["http://HOST:2379", ...])')
    local = _local_node(nodes)
    return Cluster(nodes, key, replicas, str(path), local=local, extra=doc, transport=transport,
                   rdma_device=device, rdma_port=port, key_file=key_file, etcd=etcd)


def _etcd_section(path: Path, raw: object) -> EtcdConfig | None:
    if raw is None:
        return None
    where = f"cluster file {path}: [etcd]"
    if not isinstance(raw, dict):
        raise UsageError(f"{where} must be a table")
    unknown = set(raw) - {"endpoints", "prefix", "ca_file", "cert_file", "key_file", "lease_ttl"}
    if unknown:
        raise UsageError(f"{where} has unknown keys: {', '.join(sorted(unknown))}")
    endpoints = raw.get("endpoints")
    if (not isinstance(endpoints, list) or not endpoints
            or not all(isinstance(e, str) and re.fullmatch(r"https?://[^/\s]+/?", e) for e in endpoints)):
        raise UsageError(f'{where} needs endpoints = ["http://HOST:PORT", ...] (got {endpoints!r})')
    prefix = raw.get("prefix", "/dlfs/")
    if not isinstance(prefix, str) or not prefix:
        raise UsageError(f"{where}: prefix must be a non-empty string")
    files: dict[str, str | None] = {}
    for k in ("ca_file", "cert_file", "key_file"):
        v = raw.get(k)
        if v is not None and not isinstance(v, str):
            raise UsageError(f"{where}: {k} must be a path")
        files[k] = str((path.parent / v).absolute()) if v else None
    if bool(files["cert_file"]) != bool(files["key_file"]):
        raise UsageError(f"{where}: cert_file and key_file go together")
    ttl = raw.get("lease_ttl", 10)
    if not isinstance(ttl, int) or not 2 <= ttl <= 3600:
        raise UsageError(f"{where}: lease_ttl must be whole seconds from 2 to 3600")
    return EtcdConfig(tuple(e.rstrip("/") for e in endpoints), prefix if prefix.endswith("/") else prefix + "/",
                      files["ca_file"], files["cert_file"], files["key_file"], ttl)


def _local_node(nodes: list[NodeSpec]) -> str | None:
    """The node whose address is one of this machine's, if any."""
    for n in nodes:
        try:
            infos = socket.getaddrinfo(n.meta.host, None)
        except OSError:
            continue
        for info in infos:
            addr = info[4][0]
            try:
                with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                    s.bind((addr, 0))
                return n.name
            except OSError:
                continue
    return None
