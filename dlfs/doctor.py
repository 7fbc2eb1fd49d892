"""`dlfs doctor`: checks this node and its cluster, and says how to fix whatever fails.

Each check gives one row: pass, warn, FAIL or info, what it found, and for anything short of pass,
the fix. Checks cost little (no test mount): FUSE (device, fusermount3, kernel), memlock, RDMA
(pyverbs, devices, ports, the transport a mount would use and why), the cluster file and its key,
every daemon of the cluster (reachable, authenticated, clock skew), the state directory, and the
disk caches (--cache-dir) of this machine's mounts or the one named.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import platform
import shutil
import sqlite3
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from dlfs.cgroup import MemoryLimit, memory_limit
from dlfs.config import Cluster, NodeSpec, load_cluster, parse_cluster_file
from dlfs.errors import AuthError, DlfsError, KeyExposed, NoNode, ProtocolError, TransportUnavailable, Unreachable
from dlfs.units import counted, human_bytes, human_mib
from dlfs.wire.auth import key_exposure

PASS, WARN, FAIL, INFO = "pass", "warn", "FAIL", "info"
NODE_TIMEOUT = 3.0  # per daemon: connect, handshake and one request
SKEW_WARN, SKEW_FAIL = 0.5, 5.0  # seconds
FREE_FAIL = 1 << 30
MIN_USEFUL_MEMORY = 512 << 20  # a node, a mount (64 MiB cache and its overhead) and two readers
MIN_DISK_CACHE = 1 << 30  # a disk cache that can hold less keeps too little of a dataset to matter


@dataclass
class Check:
    check: str
    status: str
    detail: str
    fix: str = ""


# --- FUSE --------------------------------------------------------------------------------------
def check_fuse_device() -> Check:
    path = "/dev/fuse"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Check("/dev/fuse", FAIL, "missing",
                     "load the fuse module (modprobe fuse); in a container, pass --device /dev/fuse")
    if not stat.S_ISCHR(st.st_mode):
        return Check("/dev/fuse", FAIL, "not a character device", "recreate it: mknod /dev/fuse c 10 229")
    if not os.access(path, os.R_OK | os.W_OK):
        return Check("/dev/fuse", FAIL, f"not readable and writable by uid {os.geteuid()}",
                     "chmod 666 /dev/fuse, or run dlfs mount as root")
    return Check("/dev/fuse", PASS, f"character device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, read-write")


def check_fusermount() -> Check:
    path = shutil.which("fusermount3")
    if path is None:
        return Check("fusermount3", FAIL, "not on PATH", "apt-get install fuse3 (or `make install`)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5, check=False)
        version = (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else "?"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("fusermount3", FAIL, f"{path} does not run ({exc})", "reinstall fuse3")
    setuid = bool(os.stat(path).st_mode & stat.S_ISUID)
    if os.geteuid() != 0 and not setuid:
        return Check("fusermount3", FAIL, f"{path} ({version}) is not setuid root: unprivileged users cannot unmount",
                     f"chmod u+s {path}")
    return Check("fusermount3", PASS, f"{path} ({version})")


def _kernel_config() -> dict[str, str]:
    """The kernel's CONFIG_* options, from /proc/config.gz or /boot/config-<release>, if readable."""
    text = ""
    try:
        text = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode(errors="replace")
    except OSError:
        try:
            text = Path(f"/boot/config-{platform.release()}").read_text(errors="replace")
        except OSError:
            return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("CONFIG_FUSE") or line.startswith("CONFIG_INFINIBAND="):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def check_kernel_fuse() -> Check:
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    parts = [f"kernel {platform.release()}"]
    config = _kernel_config()
    if config:
        wanted = [("CONFIG_FUSE_PASSTHROUGH", "passthrough"), ("CONFIG_FUSE_IO_URING", "io_uring")]
        parts.append(", ".join(f"{label} {'yes' if config.get(key) == 'y' else 'no'}" for key, label in wanted))
    params = Path("/sys/module/fuse/parameters")
    for name in ("enable_uring", "max_user_bgreq"):
        try:
            parts.append(f"{name}={(params / name).read_text().strip()}")
        except OSError:
            continue
    parts.append("fusectl " + ("mounted" if Path("/sys/fs/fuse/connections").is_dir() else "not mounted"))
    if "\tfuse\n" not in filesystems and not filesystems.rstrip().endswith("\tfuse"):
        return Check("kernel FUSE", FAIL, "; ".join(parts) + "; no fuse in /proc/filesystems",
                     "load the fuse module (modprobe fuse) or use a kernel with CONFIG_FUSE_FS")
    return Check("kernel FUSE", PASS, "; ".join(parts))


def check_native() -> Check:
    if importlib.util.find_spec("dlfs._native") is None:
        return Check("dlfs C helper", FAIL, "dlfs._native is not built: a mount cannot start (its answers "
                     "to the kernel are defined in C)", "make install (builds it with the package)")
    return Check("dlfs C helper", PASS, "dlfs._native is built")


def check_engine(param: Path = Path("/sys/module/fuse/parameters/enable_uring")) -> Check:
    """How a mount will be served: native threads on /dev/fuse, and FUSE over io_uring where it is on."""
    from dlfs.native import engine_threads

    threads = f"{engine_threads()} native threads per mount (--threads)"
    try:
        enabled = param.read_text().strip() in ("Y", "1")
    except OSError:
        return Check("serving engine", PASS, f"{threads}; FUSE over io_uring: not in this kernel (Linux 6.14+)")
    if enabled:
        return Check("serving engine", PASS, f"{threads}; FUSE over io_uring on: one queue per CPU")
    return Check("serving engine", WARN, f"{threads}; FUSE over io_uring is built in but off (a request then "
                 "often wakes a thread on another CPU)",
                 f"echo Y > {param} (root; `options fuse enable_uring=1` in /etc/modprobe.d keeps it), or "
                 "dlfs mount --io-uring on")


SHMEM_HUGE = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def _chosen(knob: Path) -> str | None:
    """The bracketed word of a kernel setting such as "always [madvise] never"; None without one."""
    try:
        return knob.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def check_cache_pages(shmem: Path = SHMEM_HUGE, private_tmpfs: bool = True, limited: bool | None = None) -> Check:
    """Whether a mount's cache can be on 2 MiB pages (dlfs/mount/slabs.py): then a window read from a
    local disk is one request of a few segments, not four of 254 pages (`private_tmpfs`: try that way;
    `limited`: whether memory is limited here, where the cache stays on 4 KiB pages)."""
    from dlfs.native import native

    if native is None:
        return Check("cache pages", INFO, "unknown without the C helper")
    if memory_limit().limited if limited is None else limited:
        return Check("cache pages", INFO, "4 KiB pages: memory is limited here, and a slab given back under "
                     "pressure must free all it held (slabs share 2 MiB pages)")
    why = "no private tmpfs (try skipped)"
    if private_tmpfs:
        try:
            os.close(native.huge_arena(tempfile.gettempdir(), 2 << 20))
            return Check("cache pages", PASS, "2 MiB pages (a private tmpfs with huge=always)")
        except OSError as exc:
            why = str(exc).removeprefix("no huge-page cache arena: ")
    policy = _chosen(shmem) or ""
    if policy in ("always", "within_size", "advise", "force"):
        return Check("cache pages", PASS, f"2 MiB pages (a memfd: {shmem} says {policy})")
    return Check("cache pages", WARN, f"4 KiB pages ({why}; shared memory huge pages: "
                 f"{policy or 'not in this kernel'}): windows read from "
                 "a local disk go in requests of at most 254 pages (half the speed on a virtio disk)",
                 f"mount as root, or `echo advise > {shmem}` (root)")


ANON_HUGE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def check_read_buffers(anon: Path = ANON_HUGE) -> Check:
    """Whether the serving threads' buffers for reads from the disk (native/hugebuf.h) can be on 2 MiB
    pages: transparent huge pages for memory that asks (madvise) or all (always)."""
    policy = _chosen(anon)
    if policy is None:
        return Check("read buffers", INFO, "4 KiB pages: this kernel has no transparent huge pages")
    if policy in ("always", "madvise"):
        return Check("read buffers", PASS, f"2 MiB pages for small files' reads from the disk ({anon} says {policy})")
    return Check("read buffers", WARN, f"4 KiB pages ({anon} says {policy}): each small file's read from the disk "
                 "is a request of a segment per page, 20-55 us slower here than into one huge page",
                 f"`echo madvise > {anon}` (root)")


def check_memory(limit: MemoryLimit | None = None) -> Check:
    """The memory a mount may use here, and the cache `--cache-size auto` gets from it."""
    from dlfs.mount.cache import auto_cache_size

    limit = limit or memory_limit()
    cache = auto_cache_size(limit)
    text = f"{limit.describe()}; a mount's cache gets {human_bytes(cache)} by default (a quarter)"
    if limit.limited and limit.effective < MIN_USEFUL_MEMORY:
        return Check("memory", WARN, text, f"give the job at least {human_bytes(MIN_USEFUL_MEMORY)} "
                     "(node, mount and readers share its limit)")
    return Check("memory", PASS, text)


# --- RDMA --------------------------------------------------------------------------------------
def check_rdma(setting: str, cluster: Cluster | None) -> list[Check]:
    from dlfs.client.transport import QUEUE_HEADROOM, arena_for_cache
    from dlfs.mount.cache import auto_cache_size
    from dlfs.transport.verbs import MEMLOCK_FIX, choose_transport, memlock, probe

    device = cluster.rdma_device if cluster else None
    port = cluster.rdma_port if cluster else None
    report = probe(device)
    limits = memlock(raise_soft=True)
    rows = []
    if report.pyverbs_error:
        rows.append(Check("pyverbs", FAIL, f"does not import: {report.pyverbs_error}",
                          "make install (installs python3-pyverbs; the venv must see system site-packages)"))
    else:
        rows.append(Check("pyverbs", PASS, f"imports from {report.pyverbs_path}"))
    if report.ports:
        text = "; ".join(f"{p.label()}: {p.state}, {p.link_layer}" + (f", lid {p.lid}" if p.lid else "")
                         for p in report.ports)
        active = report.active_ports()
        status = PASS if active else (FAIL if setting == "rdma" else WARN)
        fix = "" if active else "check the cable and the subnet manager (ibstat, rdma link show)"
        rows.append(Check("RDMA devices", status, text, fix))
    else:
        why = report.error or "none"
        status = FAIL if setting == "rdma" else INFO
        fix = "load the RDMA driver, or set transport = \"tcp\"" if setting == "rdma" else ""
        rows.append(Check("RDMA devices", status, why if report.devices or report.error else "none", fix))
    need = arena_for_cache(auto_cache_size()) + QUEUE_HEADROOM  # what a mount registers by default
    rdma_possible = bool(report.active_ports()) and not report.pyverbs_error
    if limits.allows(need):
        rows.append(Check("memlock", PASS, f"{limits.describe()}: enough to register a mount's {human_bytes(need)}"))
    elif rdma_possible or setting == "rdma":
        rows.append(Check("memlock", FAIL if setting == "rdma" else WARN,
                          f"{limits.describe()}: below the {human_bytes(need)} a mount with the default cache "
                          f"registers for RDMA", MEMLOCK_FIX))
    else:
        rows.append(Check("memlock", INFO, f"{limits.describe()} (only RDMA registration needs more)"))
    try:
        choice = choose_transport(setting, need, "a mount with the default cache", device, port, report, limits)
        rows.append(Check("transport", PASS, f"{choice.name.upper()}: {choice.reason}"))
    except TransportUnavailable as exc:
        rows.append(Check("transport", FAIL, str(exc), 'fix the cause above, or set transport = "auto" or "tcp"'))
    return rows


# --- the cluster -------------------------------------------------------------------------------
def check_key(path: str) -> Check:
    try:
        st = os.stat(path)
    except OSError as exc:
        return Check("cluster key", FAIL, f"{path}: {exc.strerror}", "make one with `dlfs keygen FILE`")
    mode = stat.S_IMODE(st.st_mode)
    who = key_exposure(mode)  # the rule the node and every command refuse a key by
    if who:
        return Check("cluster key", FAIL, f"{path} has mode {mode:04o}: {who} can read or change it",
                     f"chmod 600 {path}")
    if st.st_uid != os.geteuid():
        return Check("cluster key", WARN, f"{path} (mode {mode:04o}) belongs to uid {st.st_uid}, not {os.geteuid()}",
                     f"chown {os.geteuid()} {path}")
    return Check("cluster key", PASS, f"{path}, mode {mode:04o}")


def load_for_doctor(cluster_file: str | None, home: Path) -> tuple[Cluster | None, list[Check]]:
    """The cluster to check, and the rows about its file and key."""
    cluster_file = cluster_file or os.environ.get("DLFS_CLUSTER")
    rows = []
    try:
        if cluster_file:
            cluster = parse_cluster_file(Path(cluster_file))
            rows.append(Check("cluster file", PASS, f"{cluster_file}: {counted(len(cluster.nodes), 'node')}, "
                                                    f"{counted(cluster.replicas, 'replica')}, transport {cluster.transport}"))
        else:
            cluster = load_cluster(None, home)
            rows.append(Check("cluster file", INFO, f"none: the local node under {home}"))
    except NoNode as exc:
        rows.append(Check("cluster file", FAIL, f"none, and {exc.problem}", f"{exc.fix}, or pass --cluster FILE"))
        key = home / "cluster.key"
        if key.exists():
            rows.append(check_key(str(key)))
        return None, rows
    except KeyExposed as exc:
        rows.append(Check("cluster file", INFO, f"{cluster_file or f'none: the local node under {home}'}; "
                                                "its key is refused (below)"))
        rows.append(check_key(exc.path))
        return None, rows
    except DlfsError as exc:
        rows.append(Check("cluster file", FAIL, str(exc), "fix the file or its key (see README: Run a cluster)"))
        return None, rows
    rows.append(check_key(cluster.key_file))
    return cluster, rows


async def _check_daemon(cluster: Cluster, spec: NodeSpec, service: str) -> list[Check]:
    from dlfs.wire.protocol import Msg
    from dlfs.wire.rpc import connect

    address = spec.meta if service == "meta" else spec.data
    label = f"{spec.name} {service}"
    t0 = time.monotonic()
    try:
        with trio.fail_after(NODE_TIMEOUT):
            async with connect(address, cluster.key, service, NODE_TIMEOUT) as conn:
                handshake = time.monotonic() - t0
                sent = time.time()
                meta, _ = await conn.call(Msg.TIME, timeout=NODE_TIMEOUT)
                back = time.time()
    except AuthError as exc:
        return [Check(f"{label} daemon", FAIL, f"{address}: {exc}",
                      "use the same key file on every node (copy it; `dlfs keygen` makes one once)")]
    except ProtocolError as exc:
        return [Check(f"{label} daemon", FAIL, f"{address}: {exc}", f"is a dlfs {service} daemon listening there?")]
    except (Unreachable, trio.TooSlowError) as exc:
        why = str(exc) if isinstance(exc, Unreachable) else f"no answer within {NODE_TIMEOUT:g} s"
        return [Check(f"{label} daemon", FAIL, why,
                      f"start `dlfs node` on {spec.name}, or open TCP port {address.port} to it")]
    except DlfsError as exc:
        return [Check(f"{label} daemon", FAIL, f"{address}: {exc}", f"see the log of dlfs node on {spec.name}")]
    rows = [Check(f"{label} daemon", PASS, f"{address}: authenticated in {handshake * 1000:.1f} ms")]
    remote = meta.get("time")
    if isinstance(remote, (int, float)):
        skew = round(float(remote) - (sent + back) / 2, 3) + 0.0  # + 0.0: no "-0.000"
        text = f"{skew:+.3f} s (±{(back - sent) / 2:.3f} s) against {spec.name}"
        fix = "keep clocks in sync: timedatectl set-ntp true (chrony or systemd-timesyncd)"
        # Judged by the least skew the round trip allows: a slow answer alone is not a bad clock.
        least = max(abs(skew) - (back - sent) / 2, 0.0)
        status = PASS if least <= SKEW_WARN else WARN if least <= SKEW_FAIL else FAIL
        rows.append(Check(f"{label} clock", status, text, "" if status == PASS else fix))
    return rows


async def check_nodes(cluster: Cluster) -> list[Check]:
    """Every daemon of the cluster at once, each bounded by NODE_TIMEOUT."""
    results: dict[tuple[int, str], list[Check]] = {}

    async def one(i: int, spec: NodeSpec, service: str) -> None:
        results[i, service] = await _check_daemon(cluster, spec, service)

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(cluster.nodes):
            for service in sorted(spec.roles, reverse=True):  # meta, then data
                nursery.start_soon(one, i, spec, service)
    return [row for key in sorted(results, key=lambda k: (k[0], k[1] != "meta")) for row in results[key]]


async def check_etcd(cluster: Cluster) -> list[Check]:
    """Each etcd endpoint: it answers, is in a cluster with a leader, and the TLS files load; then
    the nodes holding live leases in it."""
    from dlfs.control.plane import ControlPlane

    if cluster.etcd is None:
        return [Check("etcd", INFO, "none: a one-node cluster keeps its catalog in SQLite under its state directory")]
    try:
        control = ControlPlane(cluster.etcd)
    except (OSError, ValueError) as exc:  # TLS files that do not load
        return [Check("etcd", FAIL, f"TLS files of [etcd] do not load: {exc}", "fix ca_file / cert_file / key_file")]
    rows: list[Check] = []
    try:
        for endpoint in cluster.etcd.endpoints:
            try:
                st = await control.etcd.status(endpoint)
            except Exception as exc:  # httpx's errors, DlfsError, a reply that does not parse: all one FAIL row
                why = _etcd_why(exc)
                rows.append(Check(f"etcd {endpoint}", FAIL, why,
                                  "start etcd there (systemctl start etcd), or fix [etcd] endpoints in the cluster file"))
                continue
            leader = st.get("leader", "0") not in ("0", 0, None)
            text = f"etcd {st.get('version', '?')}, " + ("has a leader" if leader else "NO LEADER (quorum lost?)")
            rows.append(Check(f"etcd {endpoint}", PASS if leader else FAIL, text,
                              "" if leader else "bring a majority of the etcd members back up"))
            rows.append(await _etcd_space(control, endpoint, st))
        if any(r.status == PASS for r in rows):
            try:
                nodes = await control.nodes()
                missing = [n.name for n in cluster.nodes if n.name not in nodes]
                text = f"{len(nodes)} of {len(cluster.nodes)} nodes hold live leases"
                rows.append(Check("node leases", WARN if missing else PASS,
                                  text + (f" (none for {', '.join(missing)})" if missing else ""),
                                  "start `dlfs node` on them" if missing else ""))
            except DlfsError as exc:
                rows.append(Check("node leases", FAIL, str(exc)))
    finally:
        await control.aclose()
    return rows


async def _etcd_space(control: Any, endpoint: str, st: dict[str, Any]) -> Check:
    """etcd's alarms and its database against its quota: at the quota (NOSPACE) every ingest, rm,
    gc and new mount stops until it is compacted, defragmented and disarmed."""
    from dlfs.control.etcd import nospace_fix

    label = f"etcd space {endpoint}"
    try:
        alarms, quota = await control.etcd.alarms(endpoint), await control.etcd.quota(endpoint)
    except Exception as exc:  # an older etcd, a proxy without /metrics: the rest of the check stands
        return Check(label, WARN, f"cannot read its alarms or quota: {_etcd_why(exc)}")
    size = int(st.get("dbSize", 0))
    text = f"database {human_bytes(size)}" + (f" of a {human_bytes(quota)} quota ({100 * size // quota}%)"
                                              if quota else "")
    fix = nospace_fix(endpoint, str(st.get("header", {}).get("revision", "REV")))
    if alarms:
        return Check(label, FAIL, f"{text}; alarm {', '.join(alarms)} raised", fix)
    if quota and size > quota * 0.8:
        return Check(label, WARN, text + " (over 80%)", fix)
    return Check(label, PASS, text)


def _etcd_why(exc: Exception) -> str:
    from dlfs.control.etcd import why_failed

    why = why_failed(exc)
    return f"{why} (nothing listens there?)" if why == "connection refused" else why


def check_state_dir(home: Path) -> Check:
    where = home
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Check("state directory", FAIL, f"{home}: {exc.strerror}", f"create it: mkdir -p {home}")
    if not os.access(where, os.W_OK):
        return Check("state directory", FAIL, f"{where} is not writable by uid {os.geteuid()}",
                     f"chown {os.geteuid()} {where}, or choose another with --home / DLFS_HOME")
    text = f"{home}: {human_bytes(usage.free)} free of {human_bytes(usage.total)}"
    if usage.free < FREE_FAIL:
        return Check("state directory", FAIL, text, "free space there (dlfs gc; dlfs rm old versions) or move DLFS_HOME")
    if usage.free < usage.total // 10:
        return Check("state directory", WARN, text + " (under 10%)", "free space there, or move DLFS_HOME")
    return Check("state directory", PASS, text)


def check_disk_cache(root: Path, size: int | None = None) -> Check:
    """A disk cache directory (--cache-dir) as a mount would find it: this user's, private, writable,
    of this dlfs's format, and with room to keep something (`size`: a --cache-dir-size to be given)."""
    from dlfs.mount.diskcache import FREE_SHARE, SCHEMA, contents, damaged, refusal, room_left
    from dlfs.private import OTHERS

    name = f"disk cache {root}"
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.lstat(where)
        usage = shutil.disk_usage(where)
        why = refusal(root) if where == root else None
        held = contents(root) if where == root and why is None else None
    except (OSError, sqlite3.Error) as exc:
        if isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
            return Check(name, WARN, f"its catalogue is damaged ({exc}): the next mount or warmup sets it aside "
                         "and starts empty", f"nothing to do; or rm -r {root} now")
        return Check(name, FAIL, f"{where}: {getattr(exc, 'strerror', None) or exc}",
                     f"check the directory, or remove it (rm -r {root}) and let the next mount make it")
    if why is not None:  # as a mount would refuse it
        return Check(name, FAIL, why[0], why[1])
    if not os.access(where, os.W_OK | os.X_OK):  # not made yet: the directory it would be made in
        return Check(name, FAIL, f"{where} is not writable by uid {os.getuid()}", "name a directory this user can write")
    if held is not None and held.schema not in (None, SCHEMA):
        return Check(name, FAIL, f"holds a disk cache of another format ({held.schema}; this dlfs reads {SCHEMA})",
                     f"remove it: rm -r {root}")
    bound = size if size is not None else held.size if held is not None else None
    has = (f"holds {human_bytes(held.bytes)} in {held.chunks:,} chunk{'s' * (held.chunks != 1)}"
           if held is not None and held.chunks else
           "empty" if where == root else "not made yet (the first mount makes it, mode 0700)")
    disk = f"{human_bytes(usage.free)} free of {human_bytes(usage.total)} on its file system"
    if bound is None:
        room = room_left(where) + (held.bytes if held is not None else 0)
        if room < MIN_DISK_CACHE:  # what it holds and could still take
            return Check(name, WARN, f"{has}; {disk}: with no --cache-dir-size it keeps {FREE_SHARE:.0%} of it "
                         f"free, so it can hold {human_bytes(max(room, 0))} in all",
                         "free space there, or give the mounts (and dlfs warmup) --cache-dir-size")
        detail = f"{has}; may grow to {human_bytes(room)} (keeps {FREE_SHARE:.0%} of its file system free); {disk}"
    else:
        detail = f"{has}; --cache-dir-size {human_mib(bound)}; {disk}"
        if bound - (held.bytes if held is not None else 0) > usage.free:
            return Check(name, WARN, detail + ": the disk fills before the cache does (each write then "
                         "evicts)", "free space there, or give a smaller --cache-dir-size")
    if where == root and st.st_mode & OTHERS:
        return Check(name, WARN, f"{has}, mode {stat.S_IMODE(st.st_mode):04o}: others can read the dataset's "
                     "bytes until a mount tightens it", f"chmod 700 {root}")
    return Check(name, PASS, detail)


def check_disk_caches(home: Path, extra: Path | None = None, size: int | None = None) -> list[Check]:
    """The disk caches of this machine's mounts, and `extra` (doctor's --cache-dir)."""
    from dlfs.mount.records import mount_states

    named: dict[Path, int | None] = {}
    for m in mount_states(home, clean=False):
        if m.record.cache_dir:
            named.setdefault(Path(m.record.cache_dir), None)  # its size is in the catalogue
    if extra is not None:
        named[extra.absolute()] = size
    return [check_disk_cache(root, bound) for root, bound in sorted(named.items())]


# --- all of it ---------------------------------------------------------------------------------
def run_checks(home: Path, cluster_file: str | None, transport: str | None, cache_dir: Path | None = None,
               cache_dir_size: int | None = None) -> list[Check]:
    rows = [check_fuse_device(), check_fusermount(), check_kernel_fuse(), check_native(), check_engine(),
            check_cache_pages(), check_read_buffers(), check_memory()]
    cluster, cluster_rows = load_for_doctor(cluster_file, home)
    rows += check_rdma(transport or (cluster.transport if cluster else "auto"), cluster)
    rows += cluster_rows
    if cluster is not None:
        rows += trio.run(check_nodes, cluster)
        rows += trio.run(check_etcd, cluster)
    rows.append(check_state_dir(home))
    rows += check_disk_caches(home, cache_dir, cache_dir_size)
    return rows


def failed(rows: list[Check]) -> int:
    return sum(r.status == FAIL for r in rows)


def as_json(rows: list[Check]) -> dict[str, Any]:
    return {"checks": [asdict(r) for r in rows], "failed": failed(rows),
            "warnings": sum(r.status == WARN for r in rows)}


def render(rows: list[Check]) -> Any:
    """The table as a rich renderable."""
    from rich.table import Table

    styles = {PASS: "green", WARN: "yellow", FAIL: "bold red", INFO: "cyan"}
    table = Table(title="dlfs doctor", title_justify="left", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found")
    table.add_column("fix")
    for r in rows:
        table.add_row(r.check, f"[{styles[r.status]}]{r.status}[/]", r.detail, r.fix)
    return table


def summary(rows: list[Check]) -> str:
    n_fail, n_warn = failed(rows), sum(r.status == WARN for r in rows)
    n_pass = sum(r.status == PASS for r in rows)
    return f"{n_pass} passed, {n_warn} warnings, {n_fail} failed"
