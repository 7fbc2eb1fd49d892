"""Loads dlfs's C helper (native/, built by pip as dlfs._native).

It must be loaded with RTLD_GLOBAL before pyfuse3, so that pyfuse3's libfuse session calls bind to the
helper's hooks (native/fusehook.c) and its serving engine can take the device over (native/engine.c).
With DLFS_NO_NATIVE=1 pyfuse3 serves every request from Python; its answers still come from the
helper's table (native/answer.c), loaded then without RTLD_GLOBAL so that neither hook nor engine
takes effect. The helper is built by every install (setup.py); a mount needs it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

from dlfs.format.index import Index

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    if os.environ.get("DLFS_NO_NATIVE"):  # the pure-Python path, for comparison and debugging
        return None
    late = "pyfuse3" in sys.modules
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        _native = importlib.import_module("dlfs._native")
    except ImportError as exc:
        log.warning("dlfs's C helper is not built (%s): reinstall with `make install`", exc)
        return None
    finally:
        sys.setdlopenflags(flags)
    if late:
        log.debug("pyfuse3 was imported before dlfs's C helper: the FUSE hook is inactive")
    return _native


native = _load()


def _table() -> ModuleType | None:
    """The helper for its table of FUSE answers alone (DLFS_NO_NATIVE), or None where it is not built."""
    if native is not None or not os.environ.get("DLFS_NO_NATIVE"):
        return native
    try:
        return importlib.import_module("dlfs._native")  # RTLD_LOCAL: pyfuse3's calls do not bind to the hook
    except ImportError:
        return None


# What pyfuse3's handlers answer metadata with (dlfs/mount/ops.py): the serving threads' own table.
answers = _table()


def fuse_hooked() -> bool:
    """True once the mount's FUSE session carries the inode in READ's fh (OPEN may then be skipped)."""
    return native is not None and native.fuse_hooked()


def engine_max_threads() -> int:
    """The most native threads a mount's engine serves with (native/engine.h)."""
    return int(getattr(native, "ENGINE_MAX_THREADS", 256))


def engine_threads() -> int:
    """One serving thread per CPU this process may run on (a job's cpuset, not the machine's count), at most
    engine_max_threads(): a 512-CPU machine's default (os.cpu_count()) was past it, and every mount failed
    with `Invalid argument` in its log."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, engine_max_threads()))


def start_engine(index: Index, shared: Any, row: int, timeout: float, threads: int, io_uring: bool,
                 control_path: bytes | None, xattr_name: bytes, local_dir: bytes | None = None,
                 bulk: bool = False) -> bool:
    """Native threads take the mounted session's /dev/fuse over and answer from `index` and the shared
    cache `shared` (pinning through `row`), and random reads inside big records from this machine's
    chunk files in `local_dir`; False where they cannot (no helper, or pyfuse3's session was not made
    through the hook): pyfuse3 then serves every request itself. `bulk`: a dataset of big files, whose
    threads take any free CPU and never preempt a reader as they wake (native/engine.c)."""
    if not fuse_hooked():
        return False
    assert native is not None
    return bool(native.engine_start(index.sections(), shared, row=row, timeout=timeout, threads=threads,
                                    io_uring=io_uring, xattr_name=xattr_name if control_path is not None else None,
                                    xattr_value=control_path, local_dir=local_dir, bulk=bulk))


def engine_stats() -> dict[str, Any]:
    """Counters of the serving engine: requests answered natively, forwarded to Python, READs served."""
    return dict(native.engine_stats()) if native is not None else {}


def miss_readers() -> int:
    """Distinct processes behind the latest READs the serving engine sent to Python (0: none, or no engine)."""
    return int(native.miss_readers()) if native is not None else 0
