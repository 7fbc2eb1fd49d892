"""deploy/kubernetes: every manifest parses and holds what the deployment needs; the containers'
commands are valid dlfs invocations, and run here as the kubelet would run them they serve a mount."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, _free_ports, force_unmount, mounts_under, needs_fuse, run_dlfs

from dlfs.cli import build_parser, cmd_mount, cmd_node, cmd_umount
from dlfs.config import parse_cluster_file
from dlfs.errors import UsageError
from dlfs.fuse.mount import mount_record
from dlfs.wire.auth import read_key

K8S = REPO / "deploy" / "kubernetes"
IMAGE = "dlfs:0.1.0"


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every document of every manifest, by (kind, name)."""
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), path.name
            name = doc.get("metadata", {}).get("name", path.stem)
            assert (doc["kind"], name) not in docs, f"{path.name}: {doc['kind']} {name} twice"
            docs[(doc["kind"], name)] = doc
    return docs


def kube_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command arguments."""
    return re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict[str, Any], node_name: str) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[e["name"]] = node_name
    return env


def exec_line(script: str, env: dict[str, str]) -> list[str]:
    """The argv a `sh -c` script ends by exec-ing, with its shell variables filled in."""
    assigned = dict(re.findall(r"(\w+)=(\S+?);", script))
    tail = script.split("exec ", 1)[1]
    words = shlex.split(tail)
    scope = {**env}
    for k, v in assigned.items():
        scope[k] = re.sub(r"\$(\w+)", lambda m: scope.get(m.group(1), ""), v)
    return [re.sub(r"\$(\w+)", lambda m: scope.get(m.group(1), ""), w) for w in words]


def dlfs_args(argv: list[str]) -> Any:
    assert argv[0] == "dlfs", argv
    return build_parser().parse_args(argv[1:])


def by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (item,) = [i for i in items if i["name"] == name]
    return item


def test_manifests_hold_the_deployment(tmp_path: Path) -> None:
    docs = manifests()
    kinds = {kind for kind, _ in docs}
    assert {"Namespace", "ConfigMap", "Secret", "DaemonSet", "Pod", "Kustomization"} <= kinds

    # The ConfigMap's cluster file is one dlfs reads, and the Secret's placeholder is refused.
    cm, secret = docs[("ConfigMap", "dlfs-cluster")], docs[("Secret", "dlfs-key")]
    (tmp_path / "cluster.toml").write_text(cm["data"]["cluster.toml"])
    run_dlfs(tmp_path, "keygen", tmp_path / "cluster.key")
    cluster = parse_cluster_file(tmp_path / "cluster.toml")
    assert len(cluster.nodes) == 3 and cluster.replicas == 2
    (tmp_path / "placeholder.key").write_text(secret["stringData"]["cluster.key"])
    with pytest.raises(UsageError, match="not a hex key"):
        read_key(tmp_path / "placeholder.key")

    ds = docs[("DaemonSet", "dlfs")]
    assert ds["metadata"]["namespace"] == cm["metadata"]["namespace"] == secret["metadata"]["namespace"] == "dlfs"
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostNetwork"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert volumes["mnt"]["hostPath"]["path"] == "/mnt/dlfs"
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/dlfs"
    sources = volumes["config"]["projected"]["sources"]
    (from_cm,) = [s["configMap"] for s in sources if "configMap" in s]
    (from_secret,) = [s["secret"] for s in sources if "secret" in s]
    assert from_cm["name"] == "dlfs-cluster" and from_cm["items"] == [{"key": "cluster.toml", "path": "cluster.toml"}]
    assert from_secret["name"] == "dlfs-key"
    assert from_secret["items"] == [{"key": "cluster.key", "path": "cluster.key", "mode": 0o400}]

    node, mount = by_name(pod["containers"], "node"), by_name(pod["containers"], "mount")
    for c in (node, mount):
        assert c["image"] == IMAGE
        env = container_env(c, "worker-1")
        assert env["DLFS_CLUSTER"] == "/etc/dlfs/cluster.toml" and env["DLFS_HOME"] == "/var/lib/dlfs"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["config"]["mountPath"] == "/etc/dlfs" and mounts["state"]["mountPath"] == "/var/lib/dlfs"
    assert mount["securityContext"]["privileged"] is True
    mnt_mount = by_name(mount["volumeMounts"], "mnt")
    assert mnt_mount["mountPropagation"] == "Bidirectional" and mnt_mount["mountPath"] == "/mnt/dlfs"
    assert by_name(mount["volumeMounts"], "fuse")["mountPath"] == "/dev/fuse"

    # The commands, as the kubelet expands them, through the real parser.
    args = dlfs_args([kube_expand(a, container_env(node, "worker-1")) for a in node["command"]])
    assert args.fn is cmd_node and args.name == "worker-1" and args.metrics == ":9420"
    assert cluster.node("worker-1").meta.port == node["livenessProbe"]["tcpSocket"]["port"]
    assert cluster.node("worker-1").data.port == node["readinessProbe"]["tcpSocket"]["port"]
    shell, flag, script = mount["command"]
    assert (shell, flag) == ("sh", "-c")
    assert subprocess.run(["sh", "-n", "-c", script], timeout=10).returncode == 0
    args = dlfs_args(exec_line(script, container_env(mount, "worker-1")))
    assert args.fn is cmd_mount and args.foreground
    assert (args.dataset, args.mountpoint, args.metrics) == ("imagenet", "/mnt/dlfs/imagenet", ":9421")
    stop = dlfs_args(mount["lifecycle"]["preStop"]["exec"]["command"])
    assert stop.fn is cmd_umount and stop.mountpoint == args.mountpoint

    # The training pod reads that mountpoint from the host, read-only, seeing later mounts too.
    train = docs[("Pod", "train-imagenet")]["spec"]
    (vol,) = train["volumes"]
    assert vol["hostPath"]["path"] == args.mountpoint
    (vm,) = train["containers"][0]["volumeMounts"]
    assert vm["name"] == vol["name"] and vm["mountPropagation"] == "HostToContainer" and vm["readOnly"] is True
    assert vm["mountPath"] in train["containers"][0]["command"]

    kust = docs[("Kustomization", "kustomization")]
    assert all((K8S / r).exists() for r in kust["resources"]) and "secret.yaml" not in kust["resources"]


def test_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout))
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace"]


def test_dockerfile_builds_from_the_checkout() -> None:
    lines = [ln.strip() for ln in (K8S / "Dockerfile").read_text().splitlines()]
    assert f"-t {IMAGE} ." in " ".join(lines)
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and IMAGE.endswith(":" + version.group(1))
    for line in lines:
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    text = "\n".join(lines)
    assert "fuse3" in text and "pip install" in text and "python3-pyverbs" in text
    assert lines[-1] == 'CMD ["dlfs", "node"]'


def _record_pid(home: Path, mountpoint: Path) -> int | None:
    try:
        return int(json.loads(mount_record(home, mountpoint).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


@needs_fuse
@pytest.mark.timeout(120)
def test_containers_run_as_the_kubelet_runs_them(tmp_path: Path) -> None:
    """The DaemonSet's two commands on this machine: the node named by spec.nodeName from the
    projected cluster file and key, the mount script (also after its container was killed,
    leaving a dead mount behind), and the preStop unmount."""
    docs = manifests()
    pod = docs[("DaemonSet", "dlfs")]["spec"]["template"]["spec"]
    node_c, mount_c = by_name(pod["containers"], "node"), by_name(pod["containers"], "mount")
    etc, home, host_mnt = tmp_path / "etc-dlfs", tmp_path / "state", tmp_path / "host-mnt"
    etc.mkdir()
    meta, data, metrics = _free_ports(3)
    (etc / "cluster.toml").write_text(f'replicas = 1\nkey_file = "cluster.key"\n[[node]]\nname = "worker-1"\n'
                                      f'address = "127.0.0.1"\nmeta_port = {meta}\ndata_port = {data}\n')
    run_dlfs(tmp_path, "keygen", etc / "cluster.key")
    dlfs = str(Path(sys.executable).with_name("dlfs"))

    def local(text: str) -> str:  # the container's paths, mapped to this test's directories
        return (text.replace("/etc/dlfs", str(etc)).replace("/var/lib/dlfs", str(home))
                .replace("/mnt/dlfs", str(host_mnt)).replace(":9420", f"127.0.0.1:{metrics}"))

    def env_of(c: dict[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DLFS_")}
        env.update({k: local(v) for k, v in container_env(c, "worker-1").items()})
        env["PATH"] = f"{Path(dlfs).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO)
        return env

    node_env = env_of(node_c)
    argv = [local(kube_expand(a, node_env)) for a in node_c["command"]]
    with open(tmp_path / "node.log", "wb") as log:
        node = subprocess.Popen(argv, env=node_env, stdout=log, stderr=log)
    mount_env = env_of(mount_c)
    shell, flag, script = mount_c["command"]
    script = local(script).replace(":9421", "127.0.0.1:0")
    mnt = host_mnt / "imagenet"
    procs: list[subprocess.Popen[bytes]] = []

    def start_mount() -> subprocess.Popen[bytes]:
        with open(tmp_path / "mount.log", "ab") as log:
            proc = subprocess.Popen([shell, flag, script], env=mount_env, stdout=log, stderr=log)
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not (os.path.ismount(mnt) and _record_pid(home, mnt) == proc.pid):  # sh exec'd dlfs: same pid
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mount.log").read_text()
            time.sleep(0.05)
        return proc

    try:
        deadline = time.monotonic() + 30
        while run_dlfs(home, "--cluster", etc / "cluster.toml", "status", check=False, timeout=10).returncode:
            assert node.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
            time.sleep(0.1)
        src = tmp_path / "src"
        src.mkdir()
        (src / "n01440764.JPEG").write_bytes(os.urandom(120_000))
        run_dlfs(home, "--cluster", etc / "cluster.toml", "ingest", src, "--name", "imagenet")

        first = start_mount()
        assert (mnt / "n01440764.JPEG").read_bytes() == (src / "n01440764.JPEG").read_bytes()
        # A killed container leaves a dead FUSE mount; the restarted one clears it and mounts again.
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert mounts_under(mnt) == [str(mnt)]  # dead, and still there: a plain dlfs mount would refuse it
        second = start_mount()
        assert (mnt / "n01440764.JPEG").read_bytes() == (src / "n01440764.JPEG").read_bytes()

        stop = [local(a) for a in mount_c["lifecycle"]["preStop"]["exec"]["command"]]
        done = subprocess.run(stop, env=mount_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert second.wait(timeout=30) == 0 and not os.path.ismount(mnt)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        force_unmount(tmp_path)
        node.send_signal(signal.SIGTERM)
        rc = node.wait(timeout=30)
    assert rc == 0, (tmp_path / "node.log").read_text()
    assert "[node=worker-1]" in (tmp_path / "node.log").read_text()
