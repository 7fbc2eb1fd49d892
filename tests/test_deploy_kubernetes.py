"""deploy/kubernetes: every manifest validates against the Kubernetes API's schemas
(kubernetes-validate) and holds what the deployment needs; the containers' commands are valid dlfs
invocations, and run here as the kubelet would run them they serve the node and publish a dataset
into a pod through the CSI socket the registrar names; the etcd StatefulSet's members, run here with
its arguments, form the cluster the ConfigMap names."""

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
import tomllib
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from conftest import REPO, _free_ports, force_unmount, mounts_under, needs_fuse, run_dlfs

from dlfs.cli import build_parser, cmd_csi, cmd_node
from dlfs.config import parse_cluster_file
from dlfs.csi import DRIVER_NAME
from dlfs.csi.server import socket_path
from dlfs.csi.volumes import VolumeSpec
from dlfs.errors import UsageError
from dlfs.wire.auth import read_key

K8S = REPO / "deploy" / "kubernetes"
IMAGE = "dlfs:0.1.0"
KUBERNETES = "1.30.0"  # the oldest release the manifests are for (the newest the validator knows is checked too)


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



def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    """Every object, as the API server would check it (strict: no field it does not know), on the oldest
    release the manifests are meant for and on the newest the validator knows."""
    for (kind, name), doc in manifests().items():
        if kind == "Kustomization":
            continue  # kustomize's own file, not an API object (test_kustomize_renders runs it)
        for version in (KUBERNETES, kubernetes_validate.latest_version()):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{kind} {name} on Kubernetes {version}: {exc.message} "
                                     f"at {'.'.join(map(str, exc.path))}") from None


def test_manifests_hold_the_deployment(tmp_path: Path) -> None:
    docs = manifests()
    kinds = {kind for kind, _ in docs}
    assert {"Namespace", "ConfigMap", "Secret", "DaemonSet", "CSIDriver", "Job", "PersistentVolume",
            "PersistentVolumeClaim", "Kustomization", "Service", "StatefulSet"} <= kinds

    # The ConfigMap's cluster file is one dlfs reads, and the Secret's placeholder is refused.
    cm, secret = docs[("ConfigMap", "dlfs-cluster")], docs[("Secret", "dlfs-key")]
    (tmp_path / "cluster.toml").write_text(cm["data"]["cluster.toml"])
    run_dlfs(tmp_path, "keygen", tmp_path / "cluster.key")
    cluster = parse_cluster_file(tmp_path / "cluster.toml")
    assert len(cluster.nodes) == 3 and cluster.replicas == 2
    (tmp_path / "placeholder.key").write_text(secret["stringData"]["cluster.key"])
    (tmp_path / "placeholder.key").chmod(0o400)  # as the DaemonSet mounts it: refused for what it holds
    with pytest.raises(UsageError, match="not a hex key"):
        read_key(tmp_path / "placeholder.key")

    ds, csi = docs[("DaemonSet", "dlfs")], docs[("DaemonSet", "dlfs-csi")]
    for d in (ds, csi):
        assert d["metadata"]["namespace"] == cm["metadata"]["namespace"] == secret["metadata"]["namespace"] == "dlfs"
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        assert d["spec"]["template"]["spec"]["hostNetwork"] is True
    pod, csi_pod = ds["spec"]["template"]["spec"], csi["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"] != csi["spec"]["selector"]["matchLabels"]

    # The data nodes' DaemonSet runs exactly on the cluster file's nodes, by the name `--name` gets;
    # every other node runs only the CSI plugin (no affinity, every taint tolerated): compute-only.
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    named = []
    for term in terms:
        (field,) = term["matchFields"]
        assert (field["key"], field["operator"]) == ("metadata.name", "In") and "matchExpressions" not in term
        named += field["values"]
    assert named == [n.name for n in cluster.nodes]
    assert "affinity" not in csi_pod and "nodeSelector" not in csi_pod and csi_pod["tolerations"] == [{"operator": "Exists"}]
    # Replacing the plugin ends the mounts it serves: only when its pod is deleted.
    assert csi["spec"]["updateStrategy"] == {"type": "OnDelete"}

    volumes = {v["name"]: v for v in pod["volumes"]}
    csi_volumes = {v["name"]: v for v in csi_pod["volumes"]}
    assert volumes["state"] == csi_volumes["state"] and volumes["state"]["hostPath"]["path"] == "/var/lib/dlfs"
    assert volumes["config"] == csi_volumes["config"]
    assert csi_volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    sources = volumes["config"]["projected"]["sources"]
    (from_cm,) = [s["configMap"] for s in sources if "configMap" in s]
    secrets = {s["secret"]["name"]: s["secret"] for s in sources if "secret" in s}
    assert from_cm["name"] == "dlfs-cluster" and from_cm["items"] == [{"key": "cluster.toml", "path": "cluster.toml"}]
    assert set(secrets) == {"dlfs-key", "dlfs-etcd-tls"}
    assert secrets["dlfs-key"]["items"] == [{"key": "cluster.key", "path": "cluster.key", "mode": 0o400}]
    # etcd's TLS files, only when that Secret exists, under the names the cluster file's
    # (commented) ca_file, cert_file and key_file give them, beside it.
    tls = secrets["dlfs-etcd-tls"]
    assert tls["optional"] is True and "optional" not in secrets["dlfs-key"]
    for item in tls["items"]:
        assert item["key"] == item["path"] and f'= "{item["path"]}"' in cm["data"]["cluster.toml"]
    (client_key,) = re.findall(r'^\s*#\s*key_file = "([^"]+)"', cm["data"]["cluster.toml"], re.M)
    assert {i["path"]: i.get("mode") for i in tls["items"]}[client_key] == 0o400

    (node,) = pod["containers"]
    plugin, registrar = by_name(csi_pod["containers"], "plugin"), by_name(csi_pod["containers"], "registrar")
    for c in (node, plugin):
        assert c["image"] == IMAGE
        env = container_env(c, "worker-1")
        assert env["DLFS_CLUSTER"] == "/etc/dlfs/cluster.toml" and env["DLFS_HOME"] == "/var/lib/dlfs"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["config"]["mountPath"] == "/etc/dlfs" and mounts["state"]["mountPath"] == "/var/lib/dlfs"
    assert plugin["securityContext"]["privileged"] is True
    assert by_name(plugin["volumeMounts"], "fuse")["mountPath"] == "/dev/fuse"
    # The kubelet's pod directories, at the same path inside (target paths are host paths), shared both ways.
    pods = by_name(plugin["volumeMounts"], "pods")
    assert pods["mountPropagation"] == "Bidirectional" and pods["mountPath"] == csi_volumes["pods"]["hostPath"]["path"]

    # The commands, as the kubelet expands them, through the real parser.
    args = dlfs_args([kube_expand(a, container_env(node, "worker-1")) for a in node["command"]])
    assert args.fn is cmd_node and args.name == "worker-1" and args.metrics == ":9420"
    assert cluster.node("worker-1").meta.port == node["livenessProbe"]["tcpSocket"]["port"]
    assert cluster.node("worker-1").data.port == node["readinessProbe"]["tcpSocket"]["port"]
    args = dlfs_args([kube_expand(a, container_env(plugin, "gpu-7")) for a in plugin["command"]])
    assert args.fn is cmd_csi and args.node_id == "gpu-7"
    sock = socket_path(args.endpoint)

    # The registrar dials the plugin's socket in the shared plugin directory, and tells the kubelet
    # where that directory is on the host: the kubelet's plugins/<driver name>.
    plugin_dir = by_name(plugin["volumeMounts"], "plugin-dir")
    assert by_name(registrar["volumeMounts"], "plugin-dir")["mountPath"] == plugin_dir["mountPath"] == str(sock.parent)
    flags = dict(a[2:].split("=", 1) for a in registrar["args"])
    assert flags["csi-address"] == str(sock)
    host_dir = csi_volumes["plugin-dir"]["hostPath"]["path"]
    assert host_dir == f"/var/lib/kubelet/plugins/{DRIVER_NAME}" and flags["kubelet-registration-path"] == f"{host_dir}/{sock.name}"
    assert by_name(registrar["volumeMounts"], "registration-dir")["mountPath"] == "/registration"
    assert csi_volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    assert registrar["image"].startswith("registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.")

    driver = docs[("CSIDriver", DRIVER_NAME)]["spec"]
    assert driver["attachRequired"] is False and driver["podInfoOnMount"] is True
    assert sorted(driver["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]

    # The training Job's inline volume and the PersistentVolume ask for what the plugin takes.
    job = docs[("Job", "train-imagenet")]["spec"]["template"]["spec"]
    (vol,) = job["volumes"]
    assert vol["csi"]["driver"] == DRIVER_NAME and vol["csi"]["readOnly"] is True
    spec = VolumeSpec.from_attributes({**vol["csi"]["volumeAttributes"], "csi.storage.k8s.io/ephemeral": "true"})
    assert (spec.dataset, spec.version, spec.ephemeral) == ("imagenet", 3, True)
    (vm,) = job["containers"][0]["volumeMounts"]
    assert vm["name"] == vol["name"] and vm["readOnly"] is True and vm["mountPath"] in job["containers"][0]["command"]
    pv, pvc = docs[("PersistentVolume", "dlfs-imagenet-3")]["spec"], docs[("PersistentVolumeClaim", "imagenet")]["spec"]
    assert pv["csi"]["driver"] == DRIVER_NAME and pv["accessModes"] == pvc["accessModes"] == ["ReadOnlyMany"]
    assert VolumeSpec.from_attributes(pv["csi"]["volumeAttributes"]).wanted == "imagenet@3"
    assert pvc["volumeName"] == "dlfs-imagenet-3" and pv["storageClassName"] == pvc["storageClassName"] == ""

    kust = docs[("Kustomization", "kustomization")]
    assert all((K8S / r).exists() for r in kust["resources"]) and "secret.yaml" not in kust["resources"]
    assert {"etcd.yaml", "daemonset.yaml", "csi-driver.yaml", "csi-plugin.yaml"} <= set(kust["resources"])
    assert not {"training-job.yaml", "pv-example.yaml"} & set(kust["resources"])  # examples: the user's to apply


def etcd_flags(container: dict[str, Any]) -> dict[str, str]:
    """The --flag=value arguments of the etcd container's command, by flag."""
    argv = container["command"]
    assert argv[0].endswith("/etcd") and all(a.startswith("--") and "=" in a for a in argv[1:]), argv
    flags = dict(a[2:].split("=", 1) for a in argv[1:])
    assert len(flags) == len(argv) - 1, "a flag given twice"
    return flags


def etcd_set(docs: dict[tuple[str, str], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    sts = docs[("StatefulSet", "dlfs-etcd")]
    svc = docs[("Service", sts["spec"]["serviceName"])]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, svc, container


def test_etcd_statefulset_is_the_clusters_etcd() -> None:
    docs = manifests()
    sts, svc, etcd = etcd_set(docs)
    ns = sts["metadata"]["namespace"]
    assert ns == svc["metadata"]["namespace"] == "dlfs"
    # Headless, publishing members before they are ready (none is before a quorum), all started at once.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"client": ports["client"], "peer": ports["peer"]}
    assert etcd["image"].startswith("gcr.io/etcd-development/etcd:v3.")

    # Each member: its pod name, its own DNS name under the Service, data on its claim.
    flags = etcd_flags(etcd)
    assert flags["name"] == "$(POD_NAME)"
    assert by_name(etcd["env"], "POD_NAME")["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    members = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    dns = {m: f"{m}.{svc['metadata']['name']}.{ns}.svc" for m in members}
    assert flags["initial-cluster"] == ",".join(f"{m}=http://{dns[m]}:{ports['peer']}" for m in members)
    for m in members:
        assert kube_expand(flags["initial-advertise-peer-urls"], {"POD_NAME": m}) == f"http://{dns[m]}:{ports['peer']}"
    assert flags["initial-cluster-state"] == "new"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = etcd["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"] and flags["data-dir"].startswith(mount["mountPath"] + "/")
    probe = etcd["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and flags["listen-metrics-urls"].endswith(f":{probe['port']}")

    # The cluster file's [etcd] names every member's client URL, as each advertises it.
    etcd_conf = tomllib.loads(docs[("ConfigMap", "dlfs-cluster")]["data"]["cluster.toml"])["etcd"]
    assert etcd_conf["endpoints"] == [kube_expand(flags["advertise-client-urls"], {"POD_NAME": m}) for m in members]
    assert [urlsplit(u).port for u in etcd_conf["endpoints"]] == [ports["client"]] * len(members)
    # The dlfs pods can resolve those names from the host network.
    assert docs[("DaemonSet", "dlfs")]["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"

    etcd_bin = shutil.which("etcd")
    if etcd_bin:  # every flag is one etcd knows (Debian's 3.4 here; the image is 3.5, a superset)
        known = set(re.findall(r"^\s+--([a-z0-9-]+)", subprocess.run([etcd_bin, "--help"], capture_output=True,
                                                                    text=True, timeout=30).stdout, re.M))
        assert set(flags) <= known, set(flags) - known


@pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("etcdctl") is None,
                    reason="needs etcd and etcdctl (apt-get install etcd-server etcd-client)")
@pytest.mark.timeout(120)
def test_etcd_members_form_the_cluster_the_configmap_names(tmp_path: Path) -> None:
    """The StatefulSet's three members run here with its arguments as the kubelet expands them,
    each member's DNS name and ports mapped to a port of its own on 127.0.0.1: they bootstrap one
    cluster (names, peer URLs and --initial-cluster agree), and the ConfigMap's endpoints reach it."""
    docs = manifests()
    sts, svc, etcd = etcd_set(docs)
    flags = etcd_flags(etcd)
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    members = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    local = dict(zip(members, (dict(zip(ports, _free_ports(len(ports)))) for _ in members), strict=True))
    dns = {m: f"{m}.{svc['metadata']['name']}.{sts['metadata']['namespace']}.svc" for m in members}

    def mapped(text: str, me: str | None) -> str:
        """Member names and, for member `me`, its listen addresses, as this machine runs them."""
        for name, port in ports.items():
            for m in members:
                text = text.replace(f"{dns[m]}:{port}", f"127.0.0.1:{local[m][name]}")
            if me is not None:
                text = text.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local[me][name]}")
        return text

    procs: list[subprocess.Popen[bytes]] = []
    try:
        for m in members:
            argv = [mapped(kube_expand(a, {"POD_NAME": m}), m) for a in etcd["command"]]
            argv = [shutil.which("etcd") or "etcd"] + [a.replace(flags["data-dir"], str(tmp_path / m)) for a in argv[1:]]
            assert not any("0.0.0.0" in a or ".svc" in a for a in argv), argv
            with open(tmp_path / f"{m}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=log))
        endpoints = [mapped(u, None) for u in
                     tomllib.loads(docs[("ConfigMap", "dlfs-cluster")]["data"]["cluster.toml"])["etcd"]["endpoints"]]
        deadline = time.monotonic() + 60
        while True:
            health = subprocess.run(["etcdctl", "--endpoints=" + ",".join(endpoints), "endpoint", "health"],
                                    capture_output=True, text=True, timeout=30)
            if health.returncode == 0:
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), health.stderr + "".join(
                (tmp_path / f"{m}.log").read_text()[-1500:] for m in members)
            time.sleep(0.2)
        listed = subprocess.run(["etcdctl", "--endpoints=" + endpoints[0], "member", "list", "-w", "json"],
                                capture_output=True, text=True, timeout=30, check=True)
        assert sorted(m["name"] for m in json.loads(listed.stdout)["members"]) == members
        # The readiness probe's answer on one member.
        probe = etcd["readinessProbe"]["httpGet"]
        port = local[members[0]][next(n for n, p in ports.items() if p == probe["port"])]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['path']}", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["health"] == "true"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)




def test_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout))
    assert kinds == ["CSIDriver", "ConfigMap", "DaemonSet", "DaemonSet", "Namespace", "Service", "StatefulSet"]



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



def _wait_for(what: str, done: Any, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{log.read_text()}"
        time.sleep(0.1)


@needs_fuse
@pytest.mark.timeout(180)
def test_containers_run_as_the_kubelet_runs_them(tmp_path: Path) -> None:
    """The data node's command (named by spec.nodeName, from the projected cluster file and key) and the
    CSI plugin's, on this machine with the hostPaths mapped to this test's directories; then, as the
    kubelet, a dial of the socket the registrar registers and the training Job's inline volume
    published into a pod's volume directory, read, and unpublished."""
    import grpc

    from dlfs.csi import csi_pb2 as pb
    from dlfs.csi import csi_pb2_grpc as pb_grpc

    docs = manifests()
    node_c = docs[("DaemonSet", "dlfs")]["spec"]["template"]["spec"]["containers"][0]
    csi_pod = docs[("DaemonSet", "dlfs-csi")]["spec"]["template"]["spec"]
    plugin_c, registrar = by_name(csi_pod["containers"], "plugin"), by_name(csi_pod["containers"], "registrar")
    plugin_host_dir = by_name(csi_pod["volumes"], "plugin-dir")["hostPath"]["path"]
    etc, home, kubelet = tmp_path / "etc-dlfs", tmp_path / "state", tmp_path / "kubelet"
    etc.mkdir()
    meta, data, metrics = _free_ports(3)
    (etc / "cluster.toml").write_text(f'replicas = 1\nkey_file = "cluster.key"\n[[node]]\nname = "worker-1"\n'
                                      f'address = "127.0.0.1"\nmeta_port = {meta}\ndata_port = {data}\n')
    run_dlfs(tmp_path, "keygen", etc / "cluster.key")
    dlfs = str(Path(sys.executable).with_name("dlfs"))

    def local(text: str) -> str:  # the containers' paths (hostPaths, as each container sees them), mapped here
        return (text.replace(plugin_host_dir, str(kubelet / "plugin")).replace("/csi/", f"{kubelet / 'plugin'}/")
                .replace("/var/lib/kubelet", str(kubelet)).replace("/etc/dlfs", str(etc))
                .replace("/var/lib/dlfs", str(home)).replace(":9420", f"127.0.0.1:{metrics}"))

    def env_of(c: dict[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DLFS_")}
        env.update({k: local(v) for k, v in container_env(c, "worker-1").items()})
        env["PATH"] = f"{Path(dlfs).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO)
        return env

    node_env = env_of(node_c)
    with open(tmp_path / "node.log", "wb") as log:
        node = subprocess.Popen([local(kube_expand(a, node_env)) for a in node_c["command"]], env=node_env,
                                stdout=log, stderr=log)
    plugin_env = env_of(plugin_c)
    plugin: subprocess.Popen[bytes] | None = None
    try:
        _wait_for("the node", lambda: run_dlfs(home, "--cluster", etc / "cluster.toml", "status", check=False,
                                               timeout=10).returncode == 0, node, tmp_path / "node.log")
        src = tmp_path / "src"
        src.mkdir()
        (src / "n01440764.JPEG").write_bytes(os.urandom(120_000))
        run_dlfs(home, "--cluster", etc / "cluster.toml", "ingest", src, "--name", "imagenet")
        for _ in range(2):  # versions 1..3: the Job asks for 3
            (src / "n01440764.JPEG").write_bytes(os.urandom(120_000))
            run_dlfs(home, "--cluster", etc / "cluster.toml", "ingest", src, "--name", "imagenet")

        (kubelet / "pods").mkdir(parents=True)
        with open(tmp_path / "plugin.log", "wb") as log:
            plugin = subprocess.Popen([local(kube_expand(a, plugin_env)) for a in plugin_c["command"]],
                                      env=plugin_env, stdout=log, stderr=log)
        # What the kubelet dials: the path the registrar registers, on the host.
        registered = Path(local(dict(a[2:].split("=", 1) for a in registrar["args"])["kubelet-registration-path"]))
        _wait_for("the plugin's socket", registered.exists, plugin, tmp_path / "plugin.log")
        with grpc.insecure_channel(f"unix://{registered}") as channel:
            identity, csi_node = pb_grpc.IdentityStub(channel), pb_grpc.NodeStub(channel)
            assert identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10).name == DRIVER_NAME
            assert csi_node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10).node_id == "worker-1"
            job = docs[("Job", "train-imagenet")]["spec"]["template"]["spec"]
            (vol,) = job["volumes"]
            target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / vol["name"] / "mount"
            target.parent.mkdir(parents=True)
            cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(
                mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER))  # what the kubelet sends inline volumes
            context = {**vol["csi"]["volumeAttributes"], "csi.storage.k8s.io/ephemeral": "true",
                       "csi.storage.k8s.io/pod.name": "train-imagenet-0", "csi.storage.k8s.io/pod.namespace": "default"}
            csi_node.NodePublishVolume(pb.NodePublishVolumeRequest(
                volume_id="csi-1", target_path=str(target), volume_capability=cap, readonly=vol["csi"]["readOnly"],
                volume_context=context), timeout=120)
            assert (target / "n01440764.JPEG").read_bytes() == (src / "n01440764.JPEG").read_bytes()
            csi_node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="csi-1", target_path=str(target)),
                                         timeout=120)
            assert not target.exists() and not mounts_under(tmp_path)
        plugin.send_signal(signal.SIGTERM)
        assert plugin.wait(timeout=30) == 0, (tmp_path / "plugin.log").read_text()
    finally:
        if plugin is not None and plugin.poll() is None:
            plugin.kill()
        force_unmount(tmp_path)
        node.send_signal(signal.SIGTERM)
        rc = node.wait(timeout=30)
    assert rc == 0, (tmp_path / "node.log").read_text()
    assert "[node=worker-1]" in (tmp_path / "node.log").read_text()
