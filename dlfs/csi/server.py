"""`dlfs csi`'s lifecycle: the gRPC server on its Unix socket, until SIGTERM or SIGINT."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from dlfs.csi import DRIVER_NAME
from dlfs.csi import csi_pb2_grpc as pb_grpc
from dlfs.csi.service import Identity, Node, node_problem
from dlfs.csi.volumes import NodeVolumes
from dlfs.errors import Conflict, UsageError
from dlfs.private import private_dirs
from dlfs.procs import hold_lock

log = logging.getLogger(__name__)
WORKERS = 16  # requests served at once; calls on one target or one version wait on its lock
GRACE = 10.0  # seconds requests in flight get to finish at shutdown
STOP_POLL = 0.5  # seconds between looks for a stop signal


def socket_path(endpoint: str) -> Path:
    """The path of a unix:///PATH endpoint (the form the kubelet's sidecars take)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "unix" or not rest.startswith("/"):
        raise UsageError(f"--endpoint {endpoint!r}: use unix:///PATH/csi.sock (an absolute path)")
    return Path(rest)


def lock_state(state: Path) -> int:
    """Hold the state directory for this process: two plugins on one node would undo each other's mounts."""
    fd = hold_lock(private_dirs(state) / "csi.lock")
    if fd is None:
        raise Conflict(f"another dlfs csi is running on {state}")
    return fd


def run_plugin(home: Path, cluster_file: str | None, endpoint: str, node_id: str, state: Path,
               mount_timeout: float, cache_dir: Path | None = None, cache_dir_size: int | None = None) -> None:
    """Serve the Identity and Node services at `endpoint` until SIGTERM or SIGINT; the mounts made get
    `cache_dir` (and its size) as their disk cache, where given."""
    path = socket_path(endpoint)
    lock_fd = lock_state(state)
    try:
        volumes = NodeVolumes(home, state, cluster_file, mount_timeout, cache_dir, cache_dir_size)
        volumes.sweep()  # staging mounts a stopped plugin left with no pod on them
        problem = node_problem()
        if problem is not None:
            log.warning("this node cannot mount datasets yet: %s", problem)
        signalled: list[int] = []  # no lock here: a handler that takes one can meet its own thread holding it
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: signalled.append(signum))
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
        server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="dlfs-csi"))
        pb_grpc.add_IdentityServicer_to_server(Identity(), server)
        pb_grpc.add_NodeServicer_to_server(Node(volumes, node_id), server)
        private_dirs(path.parent)
        path.unlink(missing_ok=True)  # the socket of a plugin that was stopped: the kubelet dials this path
        try:
            bound = server.add_insecure_port(f"unix://{path}")
        except RuntimeError:  # grpcio raises where older releases returned 0
            bound = 0
        if bound == 0:
            raise UsageError(f"cannot listen on {path} (a Unix socket path is at most 107 bytes)")
        server.start()
        log.info("%s: node %s, serving CSI on %s (mounts under %s%s)", DRIVER_NAME, node_id, path,
                 volumes.staging_root, f", disk cache {cache_dir}" if cache_dir is not None else "")
        # In slices: a signal the kernel hands to a gRPC thread runs its handler only when this thread
        # next runs Python, which a wait with no end never does.
        while not signalled:
            time.sleep(STOP_POLL)
        log.info("stopping: requests in flight get %g s", GRACE)
        server.stop(GRACE).wait(GRACE + 5)
        path.unlink(missing_ok=True)
        log.info("stopped; the volumes stay published")
    finally:
        os.close(lock_fd)
