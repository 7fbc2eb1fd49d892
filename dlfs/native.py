"""Loads dlfs's C helper (native/, built by pip as dlfs._native).

It must be loaded with RTLD_GLOBAL before pyfuse3, so that pyfuse3's fuse_session_new binds to the
helper's hook (see native/fusehook.c). Without the helper the mount still works, one request dearer
per open and per close.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType

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


def fuse_hooked() -> bool:
    """True once the mount's FUSE session carries the inode in READ's fh (OPEN may then be skipped)."""
    return native is not None and native.fuse_hooked()


def serve_index(index: Index, timeout: float) -> bool:
    """Answer LOOKUP, GETATTR, OPENDIR and READDIRPLUS from `index` in C; False if the helper cannot."""
    if not fuse_hooked():
        return False
    assert native is not None
    native.serve_index(index.sections(), timeout)
    return True


def stop_index() -> dict[str, int]:
    """Stop answering from the index (before it is closed); how many requests C answered."""
    if native is None:
        return {}
    native.stop_index()
    return dict(native.meta_stats())
