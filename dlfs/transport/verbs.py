"""What RDMA this machine offers, and which transport a command uses: `auto`, `tcp` or `rdma`.

`auto` picks RDMA only when pyverbs imports, a port of a verbs device is active and the memlock
limit covers the memory the process must register; otherwise TCP, with the reason. `rdma` where
that is impossible is a TransportUnavailable error naming the reason. Nothing here opens more than
a device context for a moment: `dlfs doctor` calls it too.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from pathlib import Path

from dlfs.errors import TransportUnavailable, UsageError
from dlfs.units import human_bytes

log = logging.getLogger(__name__)
SYSFS_IB = Path("/sys/class/infiniband")
CAP_IPC_LOCK = 14  # capability bit: memory registration then ignores RLIMIT_MEMLOCK
MEMLOCK_FIX = "LimitMEMLOCK=infinity in the systemd unit, or `ulimit -l unlimited` before starting dlfs"


@dataclass(frozen=True)
class PortInfo:
    """One port of a verbs device, as the transport uses it."""

    device: str
    port: int
    state: str  # "Active", "Down", ... (pyverbs' words)
    active: bool
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    mtu: int  # active MTU as an ibv_mtu value
    lid: int
    gid_index: int  # the GID the queue pairs use as their source
    gid: bytes  # 16 bytes

    @property
    def ethernet(self) -> bool:
        return self.link_layer == "Ethernet"

    def label(self) -> str:
        return f"{self.device} port {self.port}"


@dataclass
class VerbsReport:
    """pyverbs, the verbs devices and their ports; `error` says why there are none."""

    pyverbs_error: str | None = None  # None when pyverbs imports
    pyverbs_path: str | None = None
    devices: list[str] = field(default_factory=list)
    ports: list[PortInfo] = field(default_factory=list)
    error: str | None = None

    def active_ports(self) -> list[PortInfo]:
        return [p for p in self.ports if p.active]


@dataclass(frozen=True)
class Memlock:
    """RLIMIT_MEMLOCK (bytes; None = unlimited) and whether CAP_IPC_LOCK lifts it."""

    soft: int | None
    hard: int | None
    ipc_lock: bool

    def allows(self, nbytes: int) -> bool:
        return self.ipc_lock or self.soft is None or self.soft >= nbytes

    def describe(self) -> str:
        def one(v: int | None) -> str:
            return "unlimited" if v is None else human_bytes(v)

        text = one(self.soft) if self.soft == self.hard else f"{one(self.soft)} (hard {one(self.hard)})"
        return text + (", CAP_IPC_LOCK" if self.ipc_lock else "")


@dataclass(frozen=True)
class TransportChoice:
    """The transport a command uses, and why."""

    name: str  # "tcp" or "rdma"
    reason: str
    port: PortInfo | None = None
    setting: str = "auto"  # what was asked for

    def failed_to_start(self, why: str) -> TransportChoice:
        """RDMA was chosen but its resources could not be set up: TCP for `auto`, an error for `rdma`."""
        where = self.port.label() if self.port else "RDMA"
        if self.setting == "rdma":
            raise TransportUnavailable(f"transport = rdma, but {where} cannot be used: {why}")
        log.warning("RDMA on %s cannot be used (%s); using TCP", where, why)
        return TransportChoice("tcp", f"auto: RDMA on {where} failed to start: {why}", setting=self.setting)


def _limit(v: int) -> int | None:
    return None if v == resource.RLIM_INFINITY else v


def _has_ipc_lock() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock(raise_soft: bool = False) -> Memlock:
    """This process's memlock limit; with `raise_soft`, the soft limit is raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if raise_soft and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.info("could not raise RLIMIT_MEMLOCK to its hard limit: %s", exc)
    return Memlock(_limit(soft), _limit(hard), _has_ipc_lock())


def sysfs_devices() -> tuple[list[str], str | None]:
    """Device names under /sys/class/infiniband, or why there are none."""
    if not SYSFS_IB.is_dir():
        return [], (f"no RDMA device: {SYSFS_IB} does not exist (kernel without CONFIG_INFINIBAND, "
                    "or no RDMA driver loaded)")
    names = sorted(p.name for p in SYSFS_IB.iterdir())
    if not names:
        return [], f"no RDMA device: {SYSFS_IB} is empty (no RDMA hardware or driver; soft-RoCE: rdma link add)"
    return names, None


def gid_bytes(text: str) -> bytes:
    """pyverbs' GID text ("fe80:0000:...", 8 groups) as its 16 bytes."""
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {text!r}")
    return raw


def gid_text(raw: bytes) -> str:
    """16 GID bytes in pyverbs' text form."""
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


def _pick_gid(ctx: object, port: int, table_len: int, ethernet: bool) -> tuple[int, bytes]:
    """The source GID: index 0 on InfiniBand; on RoCE the first RoCE v2 GID, IPv4-mapped first."""
    import pyverbs.enums as e

    if not ethernet or table_len == 0:
        try:
            return 0, gid_bytes(ctx.query_gid(port, 0).gid) if table_len else bytes(16)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001  pyverbs raises its own error types for an empty table
            return 0, bytes(16)
    best: tuple[int, int, bytes] | None = None  # (rank, index, gid)
    for idx in range(table_len):
        try:
            raw = gid_bytes(ctx.query_gid(port, idx).gid)  # type: ignore[attr-defined]
            kind = ctx.query_gid_type(port, idx)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001  unpopulated entries fail to query
            continue
        if raw == bytes(16):
            continue
        # Prefer RoCE v2 (routable UDP), and an IPv4-mapped address (::ffff:a.b.c.d) over link-local.
        rank = (0 if kind == e.IBV_GID_TYPE_SYSFS_ROCE_V2 else 2) + (0 if raw[:12] == bytes(10) + b"\xff\xff" else 1)
        if best is None or rank < best[0]:
            best = (rank, idx, raw)
    if best is None:
        return 0, bytes(16)
    return best[1], best[2]


def probe(device: str | None = None, quick: bool = False) -> VerbsReport:
    """Import pyverbs and list every port of every verbs device (or of `device`). `quick`: where the
    kernel has no verbs device at all, say so without importing pyverbs (30 ms of every process that
    picks a transport, for nothing)."""
    report = VerbsReport()
    if quick:
        names, error = sysfs_devices()
        if error:
            report.devices, report.error = names, error
            return report
    try:
        import pyverbs
        import pyverbs.device as d
        import pyverbs.enums as e
    except ImportError as exc:
        report.pyverbs_error = f"{type(exc).__name__}: {exc}"
    else:
        report.pyverbs_path = str(Path(pyverbs.__file__ or "?").parent)
    names, report.error = sysfs_devices()
    if report.error or report.pyverbs_error:
        report.devices = names
        return report
    try:
        listed = [dev.name.decode() for dev in d.get_device_list()]
    except Exception as exc:  # noqa: BLE001  PyverbsRDMAError when libibverbs finds no kernel support
        report.error = f"no RDMA device: libibverbs cannot list devices ({exc})"
        return report
    report.devices = listed
    if device is not None and device not in listed:
        report.error = f"no RDMA device named {device!r} (devices: {', '.join(listed) or 'none'})"
        return report
    for name in [device] if device else listed:
        try:
            ctx = d.Context(name=name)
        except Exception as exc:  # noqa: BLE001
            report.error = f"cannot open RDMA device {name}: {exc}"
            continue
        try:
            for port in range(1, ctx.query_device().phys_port_cnt + 1):
                pa = ctx.query_port(port)
                ethernet = pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
                gid_index, gid = _pick_gid(ctx, port, pa.gid_tbl_len, ethernet)
                report.ports.append(PortInfo(
                    name, port, d.port_state_to_str(pa.state).split(" (")[0], pa.state == e.IBV_PORT_ACTIVE,
                    "Ethernet" if ethernet else "InfiniBand", pa.active_mtu, pa.lid, gid_index, gid))
        except Exception as exc:  # noqa: BLE001
            report.error = f"cannot query RDMA device {name}: {exc}"
        finally:
            ctx.close()
    if not listed:
        report.error = "no RDMA device: libibverbs lists none (is the provider library installed? ibverbs-providers)"
    return report


def why_not_rdma(report: VerbsReport, limits: Memlock, need_bytes: int, what: str,
                 port: int | None = None) -> tuple[str | None, PortInfo | None]:
    """(None, the port to use) when RDMA can work here, else (the reason it cannot, None)."""
    if report.pyverbs_error:
        return f"pyverbs does not import ({report.pyverbs_error}; `make install` installs python3-pyverbs)", None
    candidates = [p for p in report.active_ports() if port is None or p.port == port]
    if not candidates:
        if report.ports:
            states = ", ".join(f"{p.label()}: {p.state}" for p in report.ports)
            return f"no active RDMA port ({states})", None
        return report.error or "no RDMA device", None
    if not limits.allows(need_bytes):
        return (f"RLIMIT_MEMLOCK is {limits.describe()}, below the {human_bytes(need_bytes)} {what} registers "
                f"for RDMA (raise it: {MEMLOCK_FIX})"), None
    return None, candidates[0]


def choose_transport(setting: str, need_bytes: int, what: str, device: str | None = None,
                     port: int | None = None, report: VerbsReport | None = None,
                     limits: Memlock | None = None) -> TransportChoice:
    """The transport for `setting` (auto | tcp | rdma); TransportUnavailable if `rdma` cannot work.

    `need_bytes` is the memory `what` (e.g. "the mount's cache") would register.
    """
    if setting not in ("auto", "tcp", "rdma"):
        raise UsageError(f"transport {setting!r}: use auto, tcp or rdma")
    if setting == "tcp":
        return TransportChoice("tcp", "transport = tcp", setting=setting)
    report = report if report is not None else probe(device, quick=setting == "auto")
    limits = limits if limits is not None else memlock(raise_soft=True)
    why, chosen = why_not_rdma(report, limits, need_bytes, what, port)
    if chosen is not None:
        return TransportChoice("rdma", f"{setting}: {chosen.label()} is active ({chosen.link_layer}), "
                                       f"memlock {limits.describe()}", chosen, setting)
    if setting == "rdma":
        raise TransportUnavailable(f"transport = rdma, but {why}")
    return TransportChoice("tcp", f"auto: {why}", setting=setting)
