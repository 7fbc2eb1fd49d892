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

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
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
