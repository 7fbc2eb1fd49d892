"""A real one-node Slurm for the tests: munged, slurmctld and slurmd, started under a directory of
the test's own, on free ports, and stopped (by their pids) when the test is done."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import _free_ports

NODE = "dlfstest"  # not a resolvable host name: jobs must use Slurm's NodeAddr for it
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
START_TIMEOUT = 30.0


def why_not() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs Slurm and munge ({', '.join(missing)} missing: apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "needs root (slurmd runs the jobs)"
    return None


@dataclass
class Slurm:
    base: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=False)

    def submit(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env, capture_output=True, text=True,
                              timeout=30, cwd=cwd, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job: str, timeout: float = 120) -> dict[str, str]:
        """The job's record once it has ended (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job)
            if info.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return info
            time.sleep(0.2)
        self.run("scancel", job)
        raise AssertionError(f"job {job} did not end within {timeout} s: {self.job(job)}")


def _write_conf(base: Path, ctld_port: int, slurmd_port: int) -> Path:
    host = socket.gethostname().split(".")[0]
    conf = base / "slurm.conf"
    conf.write_text(f"""\
ClusterName=dlfstest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base}/munge.sock
CredType=cred/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
KillWait=30
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextmanager
def one_node_slurm(base: Path) -> Iterator[Slurm]:
    base.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (base / sub).mkdir(exist_ok=True)
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    env = dict(os.environ)
    slurm = Slurm(base, env)
    logs = open(base / "daemons.log", "ab")  # noqa: SIM115  closed in finally
    try:
        slurm.procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={base}/munge.sock", f"--key-file={key}",
             f"--log-file={base}/munged.log", f"--pid-file={base}/munged.pid", f"--seed-file={base}/munged.seed"],
            stdout=logs, stderr=logs))
        deadline = time.monotonic() + START_TIMEOUT
        while not (base / "munge.sock").exists():
            assert time.monotonic() < deadline and slurm.procs[0].poll() is None, (base / "daemons.log").read_text()
            time.sleep(0.05)
        env["SLURM_CONF"] = str(_write_conf(base, *_free_ports(2)))
        slurm.procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=logs, stderr=logs))
        slurm.procs.append(subprocess.Popen(["slurmd", "-D", "-N", NODE], env=env, stdout=logs, stderr=logs))
        while slurm.run("sinfo", "--noheader", "-o", "%T", "-n", NODE).stdout.strip() != "idle":
            if time.monotonic() > deadline or any(p.poll() is not None for p in slurm.procs):
                raise AssertionError("Slurm did not come up:\n" + "\n".join(
                    (base / f).read_text(errors="replace")[-2000:] for f in ("daemons.log", "slurmctld.log", "slurmd.log")
                    if (base / f).exists()))
            time.sleep(0.1)
        yield slurm
    finally:
        if "SLURM_CONF" in env:  # jobs first: their processes must not outlive slurmd
            for job in slurm.run("squeue", "--noheader", "-o", "%i").stdout.split():
                slurm.run("scancel", job)
            deadline = time.monotonic() + 45
            while slurm.run("squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for proc in reversed(slurm.procs):
            _stop(proc)
        logs.close()
