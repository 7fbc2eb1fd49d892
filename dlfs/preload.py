"""`dlfs run`'s preload library (native/preload.c, built by pip as dlfs._preload): where it is, and an
environment that loads it.

With the library in LD_PRELOAD, isatty() of a regular file answers from fstat() in the process, so
`open(path, "rb")` on CPython <= 3.13 sends the mount no ioctl; every program the process starts
inherits the variable, and with it the library.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path

from dlfs.errors import DlfsError

MODULE = "dlfs._preload"
# ld.so splits LD_PRELOAD at spaces and colons, and has no way to quote them.
_SEPARATORS = re.compile(r"[ :]+")


def library_path() -> Path:
    """The preload library's absolute path; DlfsError if it was not built (or its path cannot be preloaded)."""
    spec = importlib.util.find_spec(MODULE)  # finds the file without loading it: it is no Python module
    if spec is None or spec.origin is None or not os.path.isfile(spec.origin):
        raise DlfsError("dlfs's preload library (dlfs._preload) is not built: reinstall dlfs (`make install`)")
    path = Path(spec.origin).resolve()
    if _SEPARATORS.search(str(path)):
        raise DlfsError(f"dlfs's preload library is at {path}, a path with a space or colon that LD_PRELOAD "
                        "cannot hold: install dlfs elsewhere")
    return path


def environ_with_preload(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of env (default: this process's) whose LD_PRELOAD starts with the library, once."""
    out = dict(os.environ if env is None else env)
    lib = str(library_path())
    others = [p for p in _SEPARATORS.split(out.get("LD_PRELOAD", "")) if p and p != lib]
    out["LD_PRELOAD"] = ":".join([lib, *others])
    return out
