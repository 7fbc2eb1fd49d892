"""The CSI Identity and Node services: check each request, hand it to NodeVolumes, and turn dlfs's
errors into the gRPC codes the spec gives them (this is the one place that does)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from dlfs import __version__
from dlfs.csi import DRIVER_NAME
from dlfs.csi import csi_pb2 as pb
from dlfs.csi import csi_pb2_grpc as pb_grpc
from dlfs.csi.volumes import NodeVolumes, VolumeSpec
from dlfs.errors import Conflict, DlfsError, MountError, NotFound, OperationPending, Unreachable, UsageError

log = logging.getLogger(__name__)
Mode = pb.VolumeCapability.AccessMode.Mode
READERS = {Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY}
# The kubelet asks for SINGLE_NODE_WRITER for every inline volume, whatever the pod says (it maps them
# to ReadWriteOnce): allowed there, as the volume is mounted read-only all the same.
NODE_WRITERS = {Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER}
MOUNT_FLAGS = {"ro"}  # a PersistentVolume's mountOptions that mean what dlfs does anyway

# Most specific first: a subclass before the class it refines.
CODES: list[tuple[type[DlfsError], grpc.StatusCode]] = [
    (OperationPending, grpc.StatusCode.ABORTED),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unreachable, grpc.StatusCode.UNAVAILABLE),
    (MountError, grpc.StatusCode.FAILED_PRECONDITION),
]

F = TypeVar("F", bound=Callable[..., Any])


def status_code(exc: DlfsError) -> grpc.StatusCode:
    return next((code for cls, code in CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)


def answers(handler: F) -> F:
    """A handler whose DlfsError becomes its gRPC status, with the error's one line as the message."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except DlfsError as exc:
            code = status_code(exc)
            log.log(logging.INFO if code == grpc.StatusCode.INVALID_ARGUMENT else logging.WARNING,
                    "%s: %s: %s", handler.__name__, code.name, exc)
            context.abort(code, str(exc))
        except Exception:  # a bug: said in the log with its traceback, INTERNAL to the caller
            log.exception("%s failed", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__} failed: see the dlfs csi log")

    return wrapper  # type: ignore[return-value]


def node_problem() -> str | None:
    """Why this node cannot mount FUSE file systems, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: the plugin's container needs it (hostPath /dev/fuse, privileged)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (the fuse3 package)"
    return None


class Identity(pb_grpc.IdentityServicer):
    @answers
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @answers
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.GetPluginCapabilitiesResponse()  # a node plugin alone: no controller service

    @answers
    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        problem = node_problem()
        if problem is not None:
            raise MountError(problem)
        return pb.ProbeResponse(ready={"value": True})


class Node(pb_grpc.NodeServicer):
    def __init__(self, volumes: NodeVolumes, node_id: str) -> None:
        self.volumes, self.node_id = volumes, node_id

    @answers
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.NodeGetInfoResponse(node_id=self.node_id)

    @answers
    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        # No STAGE_UNSTAGE_VOLUME: the plugin keeps its own shared mount per version, staged on first publish.
        return pb.NodeGetCapabilitiesResponse()

    @answers
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise UsageError("volume_id is required")
        target = _target(request.target_path)
        if not request.HasField("volume_capability"):
            raise UsageError("volume_capability is required")
        spec = VolumeSpec.from_attributes(request.volume_context)
        check_capability(request.volume_capability, spec.ephemeral)
        self.volumes.publish(target, spec)
        return pb.NodePublishVolumeResponse()

    @answers
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise UsageError("volume_id is required")
        self.volumes.unpublish(_target(request.target_path))
        return pb.NodeUnpublishVolumeResponse()


def _target(path: str) -> Path:
    if not path:
        raise UsageError("target_path is required")
    if not os.path.isabs(path):
        raise UsageError(f"target_path {path!r} is not an absolute path")
    return Path(os.path.normpath(path))


def check_capability(cap: Any, ephemeral: bool) -> None:
    """A file-system volume read by this node: readers anywhere, single-node writers only inline."""
    if cap.HasField("block"):
        raise UsageError("dlfs volumes are file systems: use volumeMode Filesystem, not Block")
    if not cap.HasField("mount"):
        raise UsageError("volume_capability needs access_type mount")
    mode = cap.access_mode.mode
    if mode not in READERS and not (ephemeral and mode in NODE_WRITERS):
        raise UsageError(f"access mode {Mode.Name(mode)} is refused: dlfs datasets are read-only "
                         "(use accessModes [ReadOnlyMany] on the PersistentVolume and its claim)")
    flags = [f for f in cap.mount.mount_flags if f not in MOUNT_FLAGS]
    if flags:
        raise UsageError(f"mount option {flags[0]!r} is not supported (dlfs takes its options as volume "
                         "attributes: cacheSize, readahead)")
