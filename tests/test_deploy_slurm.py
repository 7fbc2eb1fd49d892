"""deploy/slurm against a real one-node Slurm (munged, slurmctld and slurmd started by the test):
the job script builds the cluster, starts the node (and an etcd, or uses one given), ingests,
mounts, trains, and cleans up, also when the job is cancelled or signalled before its time limit."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, _free_ports, mounts_under
from slurmlab import NODE, Slurm, one_node_slurm, why_not

from dlfs.config import parse_cluster_file

HELPER = REPO / "deploy" / "slurm" / "dlfs-slurm"
JOB_SCRIPT = REPO / "deploy" / "slurm" / "dlfs-job.sbatch"
pytestmark = pytest.mark.skipif(why_not() is not None, reason=why_not() or "")

# The training command of these tests: every node reads every file through the mount and checks it.
CHECK = """\
import hashlib, os, sys
mnt, src, out = os.environ["DLFS_MOUNT"], sys.argv[1], sys.argv[2]
n = nbytes = 0
for root, _, files in os.walk(src):
    for f in files:
        rel = os.path.relpath(os.path.join(root, f), src)
        with open(os.path.join(mnt, rel), "rb") as a, open(os.path.join(src, rel), "rb") as b:
            data = a.read()
            assert data == b.read(), rel
        n, nbytes = n + 1, nbytes + len(data)
line = f"checked {n} files, {nbytes} bytes on {os.environ['SLURMD_NODENAME']}"
print(line)
with open(out, "a") as f:
    f.write(line + "\\n")
"""
# One that holds a file of the mount open and waits to be stopped.
HOLD = """\
import os, sys, time
f = open(os.path.join(os.environ["DLFS_MOUNT"], "d0", "f0"), "rb")
f.read(10)
open(sys.argv[1], "w").close()
time.sleep(600)
"""
# One that puts a key in the cluster file's etcd, under its prefix, and records which.
ETCD_PUT = """\
import os, subprocess, sys, tomllib
with open(os.environ["DLFS_CLUSTER"], "rb") as f:
    etcd = tomllib.load(f)["etcd"]
key = etcd.get("prefix", "/dlfs/") + "from-training"
subprocess.run(["etcdctl", "--endpoints=" + ",".join(etcd["endpoints"]), "put", key, "x"], check=True, timeout=30)
with open(sys.argv[1], "w") as f:
    f.write(key)
"""
needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("etcdctl") is None,
                                reason="needs etcd and etcdctl (apt-get install etcd-server etcd-client)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    with one_node_slurm(tmp_path_factory.mktemp("slurm")) as s:
        yield s


def _tree(src: Path) -> tuple[int, int]:
    rng = random.Random(5)
    n = nbytes = 0
    for d in range(3):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(10):
            size = rng.randrange(1, 200_000)
            (src / f"d{d}" / f"f{i}").write_bytes(rng.randbytes(size))
            n, nbytes = n + 1, nbytes + size
    return n, nbytes


def _job_env(slurm: Slurm, work: Path) -> dict[str, str]:
    meta, data = _free_ports(2)
    env = dict(slurm.env)
    env.update(DLFS_BIN=str(Path(sys.executable).with_name("dlfs")), PYTHONPATH=str(REPO),
               DLFS_META_PORT=str(meta), DLFS_DATA_PORT=str(data), DLFS_JOB_DIR=str(work / "job"))
    return env


def _assert_clean(work: Path, state: Path) -> None:
    """Nothing left running: no mount, the node's state lock free, no mount records."""
    assert mounts_under(work) == []
    fd = os.open(state / "run" / "node.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if a node still holds it
    finally:
        os.close(fd)
    assert list((state / "run" / "mounts").glob("*.json")) == []
    logs = work / "job" / "logs"
    assert "unmounted from" in (logs / f"mount-{NODE}.log").read_text()
    assert f"node {NODE}: stopped" in (logs / f"node-{NODE}.log").read_text()


@pytest.mark.timeout(240)
def test_job_script_ingests_mounts_trains_and_cleans_up(slurm: Slurm, tmp_path: Path) -> None:
    src, state, mnt = tmp_path / "src", tmp_path / "state", tmp_path / "mnt" / "train"
    n, nbytes = _tree(src)
    (tmp_path / "check.py").write_text(CHECK)
    env = _job_env(slurm, tmp_path)
    env.update(DATASET="train", SRC=str(src), MNT=str(mnt), STATE=str(state))
    train = ["srun", "--ntasks-per-node=1", sys.executable, str(tmp_path / "check.py"), str(src),
             str(tmp_path / "result.txt")]
    # The job script as shipped, from the checkout (it finds dlfs-slurm beside it via the submit dir).
    job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(JOB_SCRIPT), *train, env=env, cwd=REPO)
    info = slurm.wait(job)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert f"ingesting {src} as train" in out and "mounted on all 1 nodes" in out
    assert (tmp_path / "result.txt").read_text() == f"checked {n} files, {nbytes} bytes on {NODE}\n"
    assert "done (exit 0)" in out
    cluster = parse_cluster_file(tmp_path / "job" / "cluster.toml")
    assert [(s.name, s.meta.host, s.meta.port) for s in cluster.nodes] == [(NODE, "127.0.0.1", int(env["DLFS_META_PORT"]))]
    assert cluster.replicas == 1 and (tmp_path / "job" / "cluster.key").stat().st_mode & 0o077 == 0
    # One node: no etcd, and none started.
    assert "etcd" not in cluster.extra and "etcd" not in out
    _assert_clean(tmp_path, state)

    # A second job on the same node-local state finds the dataset and skips the ingest; the
    # helper runs as the batch script itself here.
    (tmp_path / "result.txt").unlink()
    job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", "--dataset", "train",
                       "--src", str(src), "--mount", str(mnt), "--state", str(state), "--", *train, env=env)
    info = slurm.wait(job)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert "dataset train is already there: no ingest" in out and "ingesting" not in out
    assert (tmp_path / "result.txt").read_text() == f"checked {n} files, {nbytes} bytes on {NODE}\n"
    _assert_clean(tmp_path, state)


def _held_job(slurm: Slurm, tmp_path: Path, env: dict[str, str], src: Path, state: Path) -> tuple[str, Path]:
    marker = tmp_path / f"holding-{time.monotonic_ns()}"
    (tmp_path / "hold.py").write_text(HOLD)
    job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", "--dataset", "held",
                       "--src", str(src), "--mount", str(tmp_path / "mnt"), "--state", str(state), "--",
                       sys.executable, str(tmp_path / "hold.py"), str(marker), env=env)
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert time.monotonic() < deadline and slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            (tmp_path / f"job-{job}.out").read_text() if (tmp_path / f"job-{job}.out").exists() else slurm.job(job)
        time.sleep(0.1)
    return job, tmp_path / f"job-{job}.out"


@pytest.mark.timeout(240)
def test_cancelled_or_signalled_job_cleans_up(slurm: Slurm, tmp_path: Path) -> None:
    src, state = tmp_path / "src", tmp_path / "state"
    _tree(src)
    env = _job_env(slurm, tmp_path)

    # What --signal=B:TERM@120 does before the time limit: SIGTERM to the batch script only. The
    # helper must stop the training command, the mounts and the nodes itself.
    job, out = _held_job(slurm, tmp_path, env, src, state)
    assert slurm.run("scancel", "--batch", "--signal=TERM", job).returncode == 0
    info = slurm.wait(job)
    text = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "143:0", text
    assert "SIGTERM: stopping" in text and "stopping the training command" in text and "done (exit 143)" in text
    _assert_clean(tmp_path, state)

    # scancel: Slurm signals every step and the script at once; everything still ends cleanly.
    job, out = _held_job(slurm, tmp_path, env, src, state)
    assert slurm.run("scancel", job).returncode == 0
    info = slurm.wait(job)
    text = out.read_text()
    assert info["JobState"] == "CANCELLED", text
    assert "done (exit 143)" in text, text
    _assert_clean(tmp_path, state)


def _etcdctl(url: str, *args: str) -> str:
    proc = subprocess.run(["etcdctl", f"--endpoints={url}", "--command-timeout=10s", *args],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@needs_etcd
@pytest.mark.timeout(240)
def test_job_runs_its_own_etcd_or_uses_a_given_one(slurm: Slurm, tmp_path: Path) -> None:
    src, state = tmp_path / "src", tmp_path / "state"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(50_000))
    (tmp_path / "put.py").write_text(ETCD_PUT)
    env = _job_env(slurm, tmp_path)
    client, peer = _free_ports(2)
    args = ["--dataset", "e", "--src", str(src), "--mount", str(tmp_path / "mnt"), "--state", str(state)]
    train = ["--", sys.executable, str(tmp_path / "put.py"), str(tmp_path / "key.txt")]

    # --etcd job: an etcd of the job's own (as a job of several nodes gets by default), up before the
    # nodes, named in the cluster file, private data in the first node's state, stopped at the end.
    def own_etcd_job(expect: str) -> None:
        job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", *args, "--etcd", "job",
                           "--etcd-port", str(client), "--etcd-peer-port", str(peer), *train, env=env)
        info = slurm.wait(job)
        out = (tmp_path / f"job-{job}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
        url = f"http://127.0.0.1:{client}"
        assert f"starting etcd on {NODE} at {url}" in out and f"etcd is up at {url}" in out and expect in out
        assert out.index("etcd is up") < out.index("starting dlfs node")
        assert out.index("stopping dlfs nodes") < out.index("stopping etcd")
        with open(tmp_path / "job" / "cluster.toml", "rb") as f:
            assert tomllib.load(f)["etcd"] == {"endpoints": [url]}
        assert (tmp_path / "key.txt").read_text() == "/dlfs/from-training"
        data = state / "etcd"
        assert data.stat().st_mode & 0o777 == 0o700 and (data / "member").is_dir()
        assert _refused(client), "the job's etcd still runs"
        _assert_clean(tmp_path, state)

    own_etcd_job(f"ingesting {src} as e")
    # The next job on this state: its etcd comes back with the catalog, as the chunks do.
    own_etcd_job("dataset e is already there: no ingest")

    # DLFS_ETCD_ENDPOINTS: that etcd (here one the test runs), none started; the job's keys under a
    # prefix of its own, deleted at the end, and nothing else in that etcd touched.
    client, peer = _free_ports(2)
    url = f"http://127.0.0.1:{client}"
    with open(tmp_path / "given-etcd.log", "wb") as log:
        given = subprocess.Popen(["etcd", "--name", "given", "--data-dir", str(tmp_path / "given-etcd"),
                                  "--listen-client-urls", url, "--advertise-client-urls", url,
                                  "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                  "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                  "--initial-cluster", f"given=http://127.0.0.1:{peer}"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["etcdctl", f"--endpoints={url}", "endpoint", "health"], capture_output=True,
                             timeout=30, check=False).returncode:
            assert given.poll() is None and time.monotonic() < deadline, (tmp_path / "given-etcd.log").read_text()
            time.sleep(0.1)
        _etcdctl(url, "put", "/other/key", "kept")
        job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", *args, *train,
                           env={**env, "DLFS_ETCD_ENDPOINTS": url})
        info = slurm.wait(job)
        out = (tmp_path / f"job-{job}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
        prefix = f"/dlfs/slurm-{job}/"
        assert f"using etcd at {url} (prefix {prefix})" in out and "starting etcd" not in out
        with open(tmp_path / "job" / "cluster.toml", "rb") as f:
            assert tomllib.load(f)["etcd"] == {"endpoints": [url], "prefix": prefix}
        assert (tmp_path / "key.txt").read_text() == prefix + "from-training"
        assert f"removing {prefix} from etcd" in out
        assert _etcdctl(url, "get", "--prefix", prefix) == ""
        assert _etcdctl(url, "get", "--print-value-only", "/other/key") == "kept\n"
        _assert_clean(tmp_path, state)
    finally:
        given.terminate()
        given.wait(timeout=30)


@pytest.mark.timeout(120)
def test_helper_errors(slurm: Slurm, tmp_path: Path) -> None:
    env = _job_env(slurm, tmp_path)
    outside = subprocess.run([str(HELPER), "run", "--dataset", "x", "--", "true"], env={**env, "SLURM_JOB_ID": ""},
                             capture_output=True, text=True, timeout=30)
    assert outside.returncode == 1
    assert outside.stderr.strip() == "dlfs-slurm: error: not inside a Slurm job (run it from sbatch or salloc)"
    bad = subprocess.run([str(HELPER), "run", "--dataset", "x", "--etcd", "localhost:2379", "--", "true"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1
    assert bad.stderr.strip() == \
        "dlfs-slurm: error: --etcd takes auto, job or http(s):// URLs separated by commas, not localhost:2379"
    # Inside a job: a dataset that is not there and no --src to ingest it from; the node it
    # started is stopped again.
    state = tmp_path / "state"
    job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", "--dataset", "absent",
                       "--state", str(state), "--mount", str(tmp_path / "mnt"), "--", "true", env=env)
    info = slurm.wait(job)
    text = (tmp_path / f"job-{job}.out").read_text()
    assert info["ExitCode"] == "1:0", text
    assert "dlfs-slurm: error: dataset absent is not on these nodes and no --src was given to ingest it from" in text
    assert "stopping dlfs nodes" in text and "done (exit 1)" in text
    assert f"node {NODE}: stopped" in (tmp_path / "job" / "logs" / f"node-{NODE}.log").read_text()

    # The job's etcd cannot start (its port is taken): one line saying so, and no node started.
    if shutil.which("etcd") and shutil.which("etcdctl"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            job = slurm.submit("--nodes=1", f"--output={tmp_path}/job-%j.out", str(HELPER), "run", "--dataset", "x",
                               "--etcd", "job", "--etcd-port", str(taken.getsockname()[1]),
                               "--etcd-peer-port", str(_free_ports(1)[0]), "--", "true", env=env)
            info = slurm.wait(job)
        text = (tmp_path / f"job-{job}.out").read_text()
        assert info["ExitCode"] == "1:0", text
        assert f"dlfs-slurm: error: etcd stopped while starting on {NODE}; see {tmp_path}/job/logs/etcd.log" in text
        assert "starting dlfs node" not in text and "done (exit 1)" in text
        assert "address already in use" in (tmp_path / "job" / "logs" / "etcd.log").read_text()
