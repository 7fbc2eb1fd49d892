"""`dlfs csi`: the real plugin process on a Unix socket, a real one-node dlfs cluster, and a gRPC client
making the calls the kubelet makes, in its order: GetPluginInfo, Probe, NodeGetInfo,
NodeGetCapabilities, then NodePublishVolume / NodeUnpublishVolume per pod, repeated, concurrent, and
across a restart of the plugin. What is mounted is read from the kernel's table (/proc/self/mountinfo)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DLFS, REPO, dlfs_env, force_unmount, needs_fuse, pid_alive, run_dlfs, running_node

from dlfs.csi import DRIVER_NAME
from dlfs.csi import csi_pb2 as pb
from dlfs.csi import csi_pb2_grpc as pb_grpc
from dlfs.csi.mountinfo import read_mountinfo
from dlfs.mount.lifecycle import local_mounts, mount_record

pytestmark = [needs_fuse, pytest.mark.timeout(300)]
Mode = pb.VolumeCapability.AccessMode.Mode
CALL_TIMEOUT = 180  # seconds for one call: a publish may start a mount
BASE: list[Path] = []  # this run's pytest directory: what these tests mount is all under it
FILES = {"a.bin": 150_000, "sub/b.bin": 70_000, "sub/deeper/c.txt": 900}


@dataclass
class Cluster:
    base: Path
    node: Any
    src: Path


def make_tree(root: Path, files: dict[str, int], seed: int) -> None:
    for rel, size in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((seed * 31 + i * 7) % 251 for i in range(size)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("csi")
    BASE[:] = [tmp_path_factory.getbasetemp()]
    with running_node(base / "home", base) as node:
        src = base / "src"
        make_tree(src, FILES, 1)
        node.ingest(src, "csi-imgs")
        yield Cluster(base, node, src)


class Plugin:
    """A `dlfs csi` process and a client of its socket, as the kubelet dials it."""

    def __init__(self, home: Path, base: Path) -> None:
        self.home, self.base = home, base
        self.socket = base / "plugin" / "csi.sock"
        self.state = base / "state"
        self.log = base / "csi.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None

    def start(self, *extra: str) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*DLFS, "csi", "--endpoint", f"unix://{self.socket}", "--node-id", "worker-1",
                                          "--state", str(self.state), *extra], env=dlfs_env(self.home), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.identity = pb_grpc.IdentityStub(self.channel)
        self.node = pb_grpc.NodeStub(self.channel)
        # The registrar's first call: bounded, and failing at once if the plugin exits.
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=5, wait_for_ready=True)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.1)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def kill(self) -> None:
        assert self.proc is not None
        self.close_channel()
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        assert self.proc is not None
        self.close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)  # its threads' stacks into the log, for the failure below
                time.sleep(1)
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise AssertionError("dlfs csi did not stop within 30 s of SIGTERM:\n"
                                     + self.log.read_text()[-6000:]) from None
        return self.proc.returncode

    def publish(self, target: Path, attrs: dict[str, str], volume_id: str = "pv-imgs",
                mode: int = Mode.MULTI_NODE_READER_ONLY, capability: Any = None) -> None:
        cap = capability or pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                                access_mode=pb.VolumeCapability.AccessMode(mode=mode))
        request = pb.NodePublishVolumeRequest(volume_id=volume_id, target_path=str(target), volume_capability=cap,
                                              readonly=True, volume_context=attrs)
        self.node.NodePublishVolume(request, timeout=CALL_TIMEOUT)

    def unpublish(self, target: Path, volume_id: str = "pv-imgs") -> None:
        self.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)),
                                      timeout=CALL_TIMEOUT)


@pytest.fixture
def plugin(cluster: Cluster, tmp_path: Path) -> Iterator[Plugin]:
    p = Plugin(cluster.node.home, tmp_path)
    p.start()
    try:
        yield p
    finally:
        rc = p.stop()
        left = force_unmount(tmp_path)  # every test leaves nothing mounted; this only cleans up after a failure
        assert rc == 0, p.log.read_text()
        assert not left, f"left mounted: {left}"


def pod_target(base: Path, pod: str, volume: str = "data") -> Path:
    """Where the kubelet asks for a pod's volume; it makes the parent, the plugin the target itself."""
    parent = base / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume
    parent.mkdir(parents=True, exist_ok=True)
    return parent / "mount"


def shown(label: str) -> dict[str, set[str]]:
    """The mounts of dataset version `label` this module made, mountpoints by device: one device is one
    dlfs mount (one FUSE session, one cache), however many places show it."""
    out: dict[str, set[str]] = {}
    for entry in read_mountinfo():
        if entry.dataset == label and entry.mountpoint.startswith(str(BASE[0]) + "/"):
            out.setdefault(entry.device, set()).add(entry.mountpoint)
    return out


def reads_source(target: Path, src: Path) -> bool:
    return all((target / rel).read_bytes() == (src / rel).read_bytes() for rel in FILES)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_kubelet_sequence_shares_one_mount_and_survives_a_restart(cluster: Cluster, plugin: Plugin,
                                                                  tmp_path: Path) -> None:
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
    assert info.name == DRIVER_NAME and info.vendor_version
    assert plugin.identity.Probe(pb.ProbeRequest(), timeout=10).ready.value is True
    assert plugin.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10).node_id == "worker-1"
    assert list(plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(), timeout=10).capabilities) == []
    assert list(plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=10).capabilities) == []

    # A PersistentVolume pinned to version 1, and an inline (ephemeral) volume of the same dataset with
    # no version, as the kubelet sends it: SINGLE_NODE_WRITER and the pod's keys.
    t1, t2 = pod_target(tmp_path, "uid-1"), pod_target(tmp_path, "uid-2")
    plugin.publish(t1, {"dataset": "csi-imgs", "version": "1", "cacheSize": "256M"})
    plugin.publish(t2, {"dataset": "csi-imgs", "csi.storage.k8s.io/ephemeral": "true",
                        "csi.storage.k8s.io/pod.name": "train-0", "csi.storage.k8s.io/pod.namespace": "ml",
                        "csi.storage.k8s.io/pod.uid": "uid-2", "csi.storage.k8s.io/serviceAccount.name": "default"},
                   volume_id="csi-0a1b2c", mode=Mode.SINGLE_NODE_WRITER)
    assert reads_source(t1, cluster.src) and reads_source(t2, cluster.src)
    (device, points), = shown("csi-imgs@1").items()  # one dlfs mount, shown at both targets
    staging = plugin.state / "mounts" / "csi-imgs@1"
    assert points == {str(staging), str(t1), str(t2)}
    assert [label for label, mnt in local_mounts(cluster.node.home) if mnt == staging] == ["csi-imgs@1"]
    with pytest.raises(OSError, match="Read-only file system"):
        (t1 / "new").write_bytes(b"x")

    # Again, as the kubelet does after a restart or a timeout: nothing changes.
    plugin.publish(t1, {"dataset": "csi-imgs", "version": "1", "cacheSize": "256M"})
    plugin.publish(t2, {"dataset": "csi-imgs", "csi.storage.k8s.io/ephemeral": "true"}, volume_id="csi-0a1b2c",
                   mode=Mode.SINGLE_NODE_WRITER)
    assert shown("csi-imgs@1") == {device: points}

    # The plugin killed between publish and unpublish: the new one finds its volumes in the mount table.
    plugin.kill()
    plugin.start()
    assert shown("csi-imgs@1") == {device: points} and reads_source(t2, cluster.src)

    plugin.unpublish(t1)
    assert not t1.exists() and shown("csi-imgs@1") == {device: {str(staging), str(t2)}}
    assert reads_source(t2, cluster.src)
    plugin.unpublish(t1)  # not published any more: fine

    pid = int(json.loads(mount_record(cluster.node.home, staging).read_text())["pid"])
    plugin.kill()  # and again, before the last unpublish
    plugin.start()
    plugin.unpublish(t2, volume_id="csi-0a1b2c")
    assert shown("csi-imgs@1") == {} and not t2.exists() and not staging.exists()
    assert not pid_alive(pid)  # the mount's process ended with it


def test_concurrent_publish_and_unpublish(cluster: Cluster, plugin: Plugin, tmp_path: Path) -> None:
    targets = [pod_target(tmp_path, f"uid-{i}") for i in range(12)]
    attrs = {"dataset": "csi-imgs"}

    with ThreadPoolExecutor(8) as pool:  # eight pods of one node start at once
        list(pool.map(lambda t: plugin.publish(t, attrs), targets[:8]))
    (device, points), = shown("csi-imgs@1").items()
    assert points == {str(plugin.state / "mounts" / "csi-imgs@1"), *map(str, targets[:8])}

    # Pods ending while others start, and the same targets published and unpublished over each other.
    def publish(t: Path) -> None:
        plugin.publish(t, attrs)

    ops = [(plugin.unpublish, t) for t in targets[:4]] + [(publish, t) for t in targets[8:]]
    ops += [(publish, targets[4]), (plugin.unpublish, targets[5]), (publish, targets[5])] * 3
    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(op, t) for op, t in ops]:
            future.result()
    now = shown("csi-imgs@1")
    (points,) = now.values()
    published = {t for t in targets if str(t) in points}
    assert set(targets[4:5] + targets[6:]) <= published and not published & set(targets[:4])
    for t in published:
        assert reads_source(t, cluster.src)

    with ThreadPoolExecutor(8) as pool:  # every pod gone at once: the mount goes with the last
        list(pool.map(plugin.unpublish, targets))
    assert shown("csi-imgs@1") == {} and not any(t.exists() for t in targets)


def test_bad_requests_get_their_codes(cluster: Cluster, plugin: Plugin, tmp_path: Path) -> None:
    target = pod_target(tmp_path, "uid-bad")
    ok = {"dataset": "csi-imgs", "version": "1"}
    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: plugin.publish(target, ok, volume_id="")) == bad
    assert code_of(lambda: plugin.publish(Path(""), ok)) == bad
    assert code_of(lambda: plugin.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id="v", target_path=str(target), readonly=True, volume_context=ok), timeout=30)) == bad
    assert code_of(lambda: plugin.publish(target, {})) == bad
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-imgs", "verison": "1"})) == bad
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-imgs", "version": "two"})) == bad
    assert code_of(lambda: plugin.publish(target, {"dataset": "../etc"})) == bad
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-imgs", "cacheSize": "lots"})) == bad
    for writer in (Mode.MULTI_NODE_MULTI_WRITER, Mode.MULTI_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_WRITER):
        assert code_of(lambda m=writer: plugin.publish(target, ok, mode=m)) == bad  # writers, on a PersistentVolume
    assert code_of(lambda: plugin.publish(target, {**ok, "csi.storage.k8s.io/ephemeral": "true"},
                                          mode=Mode.MULTI_NODE_MULTI_WRITER)) == bad
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=pb.VolumeCapability.AccessMode(mode=Mode.MULTI_NODE_READER_ONLY))
    assert code_of(lambda: plugin.publish(target, ok, capability=block)) == bad
    flags = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(mount_flags=["rw"]),
                                access_mode=pb.VolumeCapability.AccessMode(mode=Mode.MULTI_NODE_READER_ONLY))
    assert code_of(lambda: plugin.publish(target, ok, capability=flags)) == bad
    assert code_of(lambda: plugin.unpublish(target, volume_id="")) == bad
    assert code_of(lambda: plugin.unpublish(Path("relative/mount"))) == bad

    assert code_of(lambda: plugin.publish(target, {"dataset": "nosuch"})) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-imgs", "version": "99"})) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: plugin.publish(tmp_path / "no" / "such" / "mount", ok)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id="v"), timeout=10)) \
        == grpc.StatusCode.UNIMPLEMENTED
    assert not target.exists() and shown("csi-imgs@1") == {}  # nothing was left behind by the refusals

    # Published, then asked for another dataset (or version) at the same target.
    cluster.node.ingest(cluster.src, "csi-other")
    plugin.publish(target, ok)
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-other"})) == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: plugin.publish(target, {"dataset": "csi-imgs", "version": "2"})) == \
        grpc.StatusCode.ALREADY_EXISTS
    plugin.unpublish(target)
    plugin.unpublish(pod_target(tmp_path, "never-published"))  # unpublish of what is not there: fine
    assert shown("csi-imgs@1") == {} and shown("csi-other@1") == {}


def test_newest_version_at_publish_time_and_an_existing_mount(cluster: Cluster, plugin: Plugin,
                                                             tmp_path: Path) -> None:
    """No version: the newest when published (pods publishing before an ingest keep theirs, later ones
    get the new version on a mount of its own). A `dlfs mount` of the version already on the node is
    shared, and never unmounted by the plugin."""
    src = tmp_path / "csi-evolving"
    make_tree(src, FILES, 2)
    cluster.node.ingest(src, "csi-evolving")
    old, new = pod_target(tmp_path, "uid-old"), pod_target(tmp_path, "uid-new")
    plugin.publish(old, {"dataset": "csi-evolving"})
    (src / "added.txt").write_text("version 2\n")
    cluster.node.ingest(src, "csi-evolving")
    plugin.publish(new, {"dataset": "csi-evolving"})
    plugin.publish(old, {"dataset": "csi-evolving"})  # again: it keeps version 1
    assert (new / "added.txt").read_text() == "version 2\n" and not (old / "added.txt").exists()
    assert len(shown("csi-evolving@1")) == 1 and len(shown("csi-evolving@2")) == 1
    plugin.unpublish(old)
    plugin.unpublish(new)
    assert shown("csi-evolving@1") == {} and shown("csi-evolving@2") == {}

    mine = cluster.node.mount("csi-evolving@2", tmp_path / "by-hand")
    try:
        target = pod_target(tmp_path, "uid-shared")
        plugin.publish(target, {"dataset": "csi-evolving", "version": "2"})
        assert shown("csi-evolving@2") == {next(iter(shown("csi-evolving@2"))): {str(mine), str(target)}}
        assert (target / "added.txt").read_text() == "version 2\n"
        plugin.unpublish(target)
        assert os.path.ismount(mine) and shown("csi-evolving@2") == {next(iter(shown("csi-evolving@2"))): {str(mine)}}
    finally:
        cluster.node.umount(mine)


def test_endpoint_and_a_second_plugin_are_refused(cluster: Cluster, plugin: Plugin, tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*DLFS, "csi", *args], env=dlfs_env(cluster.node.home), capture_output=True,
                              text=True, timeout=60, cwd=REPO)

    out = run("--endpoint", "tcp://127.0.0.1:9000", "--state", str(tmp_path / "s2"))
    assert out.returncode == 2 and out.stderr.strip() == \
        "dlfs: error: --endpoint 'tcp://127.0.0.1:9000': use unix:///PATH/csi.sock (an absolute path)"
    out = run("--endpoint", f"unix://{tmp_path / 'other.sock'}", "--state", str(plugin.state))
    assert out.returncode == 10 and out.stderr.strip() == f"dlfs: error: another dlfs csi is running on {plugin.state}"


def test_a_mount_whose_process_died_is_replaced(cluster: Cluster, plugin: Plugin, tmp_path: Path) -> None:
    """As after the plugin's container was replaced (its mounts' processes end with it): the next pod
    gets a fresh mount, a pod's volume published again works again, and the dead one comes off."""
    t1, t2, t3 = (pod_target(tmp_path, f"uid-{i}") for i in (1, 2, 3))
    attrs = {"dataset": "csi-imgs", "version": "1"}
    plugin.publish(t1, attrs)
    plugin.publish(t3, attrs)
    staging = plugin.state / "mounts" / "csi-imgs@1"
    pid = int(json.loads(mount_record(cluster.node.home, staging).read_text())["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"mount process {pid} outlived SIGKILL"
        time.sleep(0.05)
    with pytest.raises(OSError):
        os.statvfs(t1)  # ENOTCONN: its mount's process is gone
    (dead,) = shown("csi-imgs@1")

    plugin.publish(t2, attrs)
    assert reads_source(t2, cluster.src)
    plugin.publish(t1, attrs)  # the kubelet publishing the dead volume again: it works again
    assert reads_source(t1, cluster.src)
    now = shown("csi-imgs@1")
    assert now[dead] == {str(t3)} and len(now) == 2
    assert {str(staging), str(t1), str(t2)} in now.values()

    for t in (t3, t1, t2):
        plugin.unpublish(t)
    assert shown("csi-imgs@1") == {} and not staging.exists()


def test_the_nodes_disk_cache_goes_to_every_mount_the_plugin_makes(cluster: Cluster, tmp_path: Path) -> None:
    """`dlfs csi --cache-dir` (a node's local disk, the admin's flag, not a volume attribute): each mount
    the plugin makes gets it; a directory a mount would refuse stops the plugin in one line at start."""
    cache = tmp_path / "disk-cache"
    p = Plugin(cluster.node.home, tmp_path)
    p.start("--cache-dir", str(cache), "--cache-dir-size", "1G")
    try:
        target = pod_target(tmp_path, "pod-cached")
        p.publish(target, {"dataset": "csi-imgs"})
        assert reads_source(target, cluster.src)
        mounts = json.loads(run_dlfs(cluster.node.home, "mounts", "--json").stdout)["mounts"]
        made = [m for m in mounts if m["mountpoint"].startswith(str(p.state))]
        assert made and all(m["cache_dir"] == str(cache) and m["cache_dir_size"] == 1 << 30 for m in made), mounts
        assert (cache / "catalogue.db").is_file() and stat.S_IMODE(cache.stat().st_mode) == 0o700
        p.unpublish(target)
    finally:
        rc = p.stop()
        left = force_unmount(tmp_path)
        assert rc == 0 and not left, (rc, left, p.log.read_text()[-3000:])
    (tmp_path / "a-file").write_text("x")
    bad = run_dlfs(cluster.node.home, "csi", "--endpoint", f"unix://{tmp_path / 'b.sock'}", "--state",
                   str(tmp_path / "state-b"), "--cache-dir", str(tmp_path / "a-file"), check=False, timeout=30)
    assert bad.returncode == 2 and "is not a directory" in bad.stderr, bad


def test_a_mount_whose_process_is_stopped_is_replaced_within_a_bound(cluster: Cluster, plugin: Plugin,
                                                                      tmp_path: Path) -> None:
    """The staging mount's process stopped (SIGSTOP, or stuck: it answers nothing): the next pod gets a
    fresh mount once the probe's bound has passed (the plugin waited in statvfs for good, and the call
    with it), the stopped one is detached, and once it runs again it ends with its last pod's volume."""
    from dlfs.fsprobe import PROBE_BOUND

    t1, t2 = (pod_target(tmp_path, f"uid-{i}") for i in (1, 2))
    attrs = {"dataset": "csi-imgs", "version": "1"}
    plugin.publish(t1, attrs)
    staging = plugin.state / "mounts" / "csi-imgs@1"
    pid = int(json.loads(mount_record(cluster.node.home, staging).read_text())["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        plugin.publish(t2, attrs)
        assert time.monotonic() - t0 < CALL_TIMEOUT and reads_source(t2, cluster.src)
        assert time.monotonic() - t0 >= PROBE_BOUND  # (it did wait for the stopped one first)
        now = shown("csi-imgs@1")
        assert len(now) == 2 and {str(t1)} in now.values() and {str(staging), str(t2)} in now.values()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert reads_source(t1, cluster.src)  # running again, it serves the pod it still holds
    plugin.unpublish(t1)
    deadline = time.monotonic() + 30
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"mount process {pid} outlived its last volume"
        time.sleep(0.05)
    plugin.unpublish(t2)
    assert shown("csi-imgs@1") == {} and not staging.exists()


def test_a_mounts_warnings_reach_the_plugins_log(cluster: Cluster, plugin: Plugin, tmp_path: Path) -> None:
    """`dlfs mount` says on its stderr what it warns of (here a cache bigger than the machine, as a
    PersistentVolume's cacheSize of 1T typed for 1G): the plugin logs it; it dropped it with the stderr."""
    target = pod_target(tmp_path, "uid-big")
    plugin.publish(target, {"dataset": "csi-imgs", "version": "1", "cacheSize": "1T"}, volume_id="pv-big")
    try:
        assert reads_source(target, cluster.src)
        log = plugin.log.read_text()
        # (the machine's memory, or a memory cgroup's where the plugin runs in one)
        said = [line for line in log.splitlines() if " WARNING " in line and "mount of csi-imgs@1: " in line]
        assert said and ("1.1 TB is more than this machine's memory" in said[0] or "1 TiB" in said[0] or
                         "more than its memory cgroup allows" in said[0]), log[-2000:]
    finally:
        plugin.unpublish(target, volume_id="pv-big")
