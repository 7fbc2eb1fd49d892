"""The node's published volumes: one dlfs mount per dataset version (its staging mount, under the
plugin's state directory) and a read-only bind of it at each pod's target path.

What is published is read from the kernel's mount table, never kept in memory: a target is published
while something is mounted there, the staging mount it shows is the one with its device, and the staging
mount goes when the last target showing it does. A restarted plugin (or kubelet) carries on from there.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from dlfs.config import check_dataset_name, load_cluster
from dlfs.csi.binds import bind_readonly, unmount_one
from dlfs.csi.mountinfo import MountEntry, mount_at, read_mountinfo
from dlfs.errors import Conflict, DlfsError, MountError, OperationPending, Unreachable, UsageError, error_from_status
from dlfs.fsprobe import ANSWERS, probe
from dlfs.private import private_dirs
from dlfs.units import parse_size

log = logging.getLogger(__name__)
MOUNT_TIMEOUT = 120.0  # seconds a new mount may take to be ready (index fetched, FUSE session up)
CATALOG_TIMEOUT = 30.0  # seconds to learn a dataset's newest version
MAX_STACKED = 16  # mounts taken off one target at most (a target holds one; more only after a fault)

# The volume attributes dlfs reads (a PersistentVolume's csi.volumeAttributes, an inline volume's
# volumeAttributes), and what each is.
ATTRIBUTES = {
    "dataset": "the dataset to publish (required)",
    "version": "its version (default: the newest when the volume is published)",
    "cacheSize": "the mount's --cache-size (default auto), when this volume starts the node's mount",
    "readahead": "the mount's --readahead (default 4M), likewise",
}
K8S_PREFIX = "csi.storage.k8s.io/"  # what the kubelet adds (podInfoOnMount): pod name, namespace, ephemeral
EPHEMERAL = K8S_PREFIX + "ephemeral"


@dataclass(frozen=True)
class VolumeSpec:
    """What a NodePublishVolume asks for, from its volume attributes."""

    dataset: str
    version: int | None = None
    cache_size: str = "auto"
    readahead: str = "4M"
    ephemeral: bool = False  # an inline volume in the pod's spec (no PersistentVolume)
    pod: str = ""  # namespace/name, where the kubelet says (for the log)

    @property
    def wanted(self) -> str:
        return self.dataset if self.version is None else f"{self.dataset}@{self.version}"

    def matches(self, label: str) -> bool:
        """Whether NAME@VERSION `label`, already published, is this volume (any version, if none was named)."""
        name, _, version = label.rpartition("@")
        return name == self.dataset and (self.version is None or version == str(self.version))

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, str]) -> VolumeSpec:
        # Keys with a '/' are Kubernetes' own (csi.storage.k8s.io/..., a provisioner's); any other must be ours.
        unknown = sorted(k for k in attributes if "/" not in k and k not in ATTRIBUTES)
        if unknown:
            raise UsageError(f"unknown volume attribute {unknown[0]!r} (dlfs takes: {', '.join(ATTRIBUTES)})")
        dataset = attributes.get("dataset", "")
        if not dataset:
            raise UsageError("volume attribute 'dataset' is required: the dataset to publish (e.g. dataset: imagenet)")
        check_dataset_name(dataset)
        version = attributes.get("version", "").strip()
        if version and not (version.isdigit() and int(version) > 0):
            raise UsageError(f"volume attribute version={version!r} is not a version number (e.g. version: \"2\")")
        cache_size, readahead = attributes.get("cacheSize", "auto"), attributes.get("readahead", "4M")
        for key, value in (("cacheSize", cache_size), ("readahead", readahead)):
            if not (key == "cacheSize" and value == "auto"):
                try:
                    parse_size(value)
                except UsageError:
                    raise UsageError(f"volume attribute {key}={value!r} is not a size (e.g. 8G, 512M)") from None
        namespace, name = attributes.get(K8S_PREFIX + "pod.namespace"), attributes.get(K8S_PREFIX + "pod.name")
        return cls(dataset, int(version) if version else None, cache_size, readahead,
                   attributes.get(EPHEMERAL) == "true", f"{namespace}/{name}" if name else "")


class KeyedLocks:
    """A lock per key (a target path, a dataset version), made on first use and dropped when unused.
    Waits are bounded: past `timeout` the caller hears OperationPending (the kubelet retries)."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            if not lock.acquire(timeout=self.timeout):
                raise OperationPending(f"{self.what} {key}: another operation on it is still running")
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


def alive(path: Path) -> bool:
    """Whether the file system at `path` answers, within a bound (a FUSE mount whose process ended does
    not, nor one whose process is stopped or stuck)."""
    return probe(path).state == ANSWERS


class NodeVolumes:
    """Publish and unpublish on this node. One lock per target path and one per dataset version
    (always taken in that order): concurrent calls for one target or one version run one at a time."""

    def __init__(self, home: Path, state: Path, cluster_file: str | None, mount_timeout: float = MOUNT_TIMEOUT,
                 cache_dir: Path | None = None, cache_dir_size: int | None = None) -> None:
        self.home, self.cluster_file, self.mount_timeout = home, cluster_file, mount_timeout
        # The node's disk cache, shared by every mount made here (a plugin flag: a volume's attributes,
        # which any PersistentVolume's author writes, must not choose a path in this privileged container).
        self.cache_dir, self.cache_dir_size = cache_dir, cache_dir_size
        self.staging_root = private_dirs(state / "mounts")
        self.targets = KeyedLocks("target", mount_timeout + CATALOG_TIMEOUT + 30)
        self.versions = KeyedLocks("dataset", mount_timeout + 30)

    def staging(self, label: str) -> Path:
        return self.staging_root / label

    # --- publish ---------------------------------------------------------------------------------
    def publish(self, target: Path, spec: VolumeSpec) -> str:
        """Show `spec`'s dataset version read-only at `target`; returns its NAME@VERSION. Again for a
        target that already shows it: nothing to do."""
        with self.targets.hold(str(target)):
            entry = mount_at(target, read_mountinfo())
            if entry is not None:
                shown = entry.dataset
                if shown is None or not spec.matches(shown):
                    what = shown or f"a {entry.fstype} mount of {entry.source}"
                    raise Conflict(f"{target} already holds {what}, not {spec.wanted}")
                if alive(target):
                    return shown
                log.warning("%s shows %s, whose mount process has ended or does not answer: publishing it again",
                            target, shown)
                self._unbind_all(target)
            if not target.parent.is_dir():
                raise MountError(f"the directory of the target path {target} does not exist")
            label = self._resolve(spec)
            with self.versions.hold(label):
                source = self._source(label, spec)
                created = self._make_target(target)
                try:
                    bind_readonly(source, target)
                except MountError:
                    if created:
                        self._remove_target(target)
                    self._drop_if_unused(label)
                    raise
        log.info("published %s at %s%s", label, target, f" for pod {spec.pod}" if spec.pod else "")
        return label

    def _resolve(self, spec: VolumeSpec) -> str:
        """NAME@VERSION to publish. With no version: the newest committed one, asked of the catalog now,
        so every pod of this node that publishes while it is the newest shares its mount (a pod that must
        read what its peers read across an ingest names the version)."""
        if spec.version is not None:
            label = f"{spec.dataset}@{spec.version}"
            if alive(self.staging(label)) and mount_at(self.staging(label), read_mountinfo()) is not None:
                return label  # mounted already: the catalog need not be up to share it
        name, version = self._catalog_version(spec.dataset, spec.version)
        return f"{name}@{version}"

    def _catalog_version(self, name: str, version: int | None) -> tuple[str, int]:
        from dlfs.client.cluster import ClusterClient
        from dlfs.tasks import open_nursery
        from dlfs.wire.messages import META_DAEMON, VersionInfo, reply
        from dlfs.wire.protocol import Msg

        cluster = load_cluster(self.cluster_file, self.home)

        async def ask() -> VersionInfo:
            async with open_nursery() as nursery:
                client = ClusterClient(cluster, nursery)
                meta, _ = await client.call_meta(Msg.GET_DATASET, {"name": name, "version": version},
                                                 timeout=CATALOG_TIMEOUT)
                nursery.cancel_scope.cancel()
            return reply(VersionInfo, meta, Msg.GET_DATASET, META_DAEMON)

        info = trio.run(ask)  # this gRPC worker thread's own event loop, for one call
        return info.name, info.version

    def _source(self, label: str, spec: VolumeSpec) -> Path:
        """A live mount of `label` on this node to bind from: the staging mount, started if need be, or
        a mount someone made with `dlfs mount` that every user may read."""
        from dlfs.mount.lifecycle import local_mounts, unmount

        staging = self.staging(label)
        entries = read_mountinfo()
        entry = mount_at(staging, entries)
        if entry is not None:
            if entry.dataset == label and alive(staging):
                return staging
            log.warning("the mount of %s at %s has ended or does not answer: mounting it again", label, staging)
            unmount(self.home, staging)  # lazily: pods still holding it see only errors until they restart
        for shown, mountpoint in local_mounts(self.home):
            other = mount_at(mountpoint, entries)
            if (shown == label and mountpoint.parent != self.staging_root and other is not None
                    and other.dataset == label and "allow_other" in other.super_options):
                log.info("%s: sharing its mount at %s", label, mountpoint)
                return mountpoint
        self._mount(label, spec, staging)
        return staging

    def _mount(self, label: str, spec: VolumeSpec, staging: Path) -> None:
        """`dlfs mount` of `label` at `staging`: it returns once the mount is ready, and the mount's own
        process (a session of its own) outlives this plugin."""
        try:
            staging.mkdir(mode=0o700)
        except FileExistsError:
            pass
        cmd = [sys.executable, "-m", "dlfs", "--home", str(self.home)]
        if self.cluster_file:
            cmd += ["--cluster", self.cluster_file]
        cmd += ["mount", "--cache-size", spec.cache_size, "--readahead", spec.readahead]
        if self.cache_dir is not None:
            cmd += ["--cache-dir", str(self.cache_dir)]
            if self.cache_dir_size is not None:
                cmd += ["--cache-dir-size", str(self.cache_dir_size)]
        cmd += [label, str(staging)]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=self.mount_timeout)
        except subprocess.TimeoutExpired:
            raise Unreachable(f"the mount of {label} was not ready within {self.mount_timeout:g} s") from None
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            said = [ln.removeprefix("dlfs: error: ") for ln in lines if ln.startswith("dlfs: error: ")]
            message = said[-1] if said else f"dlfs mount exited {proc.returncode}: {lines[-1] if lines else ''}"
            self._remove_target(staging)
            raise error_from_status(proc.returncode, message)  # its exit code is its error's class
        for line in proc.stderr.splitlines():  # (its warnings, the memory it may need: for the plugin's log)
            if line.startswith("dlfs: warning: "):
                log.warning("mount of %s: %s", label, line.removeprefix("dlfs: warning: "))
        log.info("mounted %s at %s", label, staging)

    @staticmethod
    def _make_target(target: Path) -> bool:
        """Create the target directory (the plugin's to make, says the spec); True if it did."""
        try:
            target.mkdir(mode=0o750)
            return True
        except FileExistsError:
            if not target.is_dir():
                raise MountError(f"the target path {target} exists and is not a directory") from None
            return False

    # --- unpublish -------------------------------------------------------------------------------
    def unpublish(self, target: Path) -> str | None:
        """Take the volume off `target` and remove the directory; the staging mount goes with its last
        target. Returns what was published there (None: nothing was, which is fine too)."""
        with self.targets.hold(str(target)):
            entries = read_mountinfo()
            entry = mount_at(target, entries)
            if entry is None:
                self._remove_target(target)
                return None
            label = self._staging_of(entry, entries)
            if label is None:  # a bind of a mount this plugin does not own, or of one already gone
                self._unbind_all(target)
                self._remove_target(target)
                log.info("unpublished %s from %s", entry.dataset or entry.source, target)
                return entry.dataset
            with self.versions.hold(label):
                self._unbind_all(target)
                self._remove_target(target)
                self._drop_if_unused(label)
        log.info("unpublished %s from %s", label, target)
        return label

    def _staging_of(self, entry: MountEntry, entries: list[MountEntry]) -> str | None:
        for other in entries:
            if other.device == entry.device and Path(other.mountpoint).parent == self.staging_root:
                return Path(other.mountpoint).name
        return None

    def _unbind_all(self, target: Path) -> None:
        for _ in range(MAX_STACKED):
            if not unmount_one(target):
                return
        raise MountError(f"{target} still holds a mount after {MAX_STACKED} unmounts")

    @staticmethod
    def _remove_target(path: Path) -> None:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise MountError(f"cannot remove {path}: {exc.strerror}") from None
            log.warning("left %s in place: it is not empty", path)

    def _drop_if_unused(self, label: str) -> None:
        """Unmount `label`'s staging mount if no target shows it any more (the caller holds its lock)."""
        from dlfs.mount.lifecycle import unmount

        staging = self.staging(label)
        entries = read_mountinfo()
        mine = mount_at(staging, entries)
        if mine is None:
            self._remove_target(staging)
            return
        users = [e for e in entries if e.device == mine.device and Path(e.mountpoint).parent != self.staging_root]
        if users:
            return
        try:
            unmount(self.home, staging)  # and wait for its process to finish
        except MountError as exc:  # busy: the next sweep (a plugin start) tries again
            log.warning("%s has no pods left but stays mounted: %s", label, exc)
            return
        self._remove_target(staging)
        log.info("unmounted %s from %s: no pod on this node uses it now", label, staging)

    def sweep(self) -> None:
        """Unmount every staging mount no target shows (left by a plugin stopped between the two)."""
        for staging in sorted(self.staging_root.iterdir()):
            if not staging.is_dir() and mount_at(staging, read_mountinfo()) is None:
                continue  # not one of ours (a dead mount's stat fails: is_dir() is False for it too)
            with self.versions.hold(staging.name):
                try:
                    self._drop_if_unused(staging.name)
                except DlfsError as exc:  # one stuck mount must not keep the plugin from serving the rest
                    log.warning("%s: %s", staging, exc)
