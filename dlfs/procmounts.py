"""The kernel's mount table (/proc/self/mounts), read: the one place that parses it.

`os.path.ismount` cannot see a dead FUSE mount (its stat fails with ENOTCONN); the table still lists it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


def _unescape(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as \ooo octal escapes.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(pid: int | None = None) -> list[str]:
    """Every mount point in the table (of process `pid`'s mount namespace, else this one's), in its order."""
    with open(f"/proc/{pid or 'self'}/mounts") as f:
        return [_unescape(line.split()[1]) for line in f]


def fuse_mount_points() -> set[str]:
    """Mount points of FUSE file systems (dlfs's mounts among them)."""
    with open("/proc/self/mounts") as f:
        return {_unescape(fields[1]) for fields in map(str.split, f) if fields[2].split(".")[0] in ("fuse", "fuseblk")}


def mounts_under(base: Path) -> list[Path]:
    """Mount points at or below `base`, deepest first."""
    prefix = str(base.absolute())
    return sorted((Path(m) for m in mount_points() if m == prefix or m.startswith(prefix + "/")),
                  key=lambda p: len(str(p)), reverse=True)


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at `path`, alive or dead."""
    return str(path.absolute()) in mount_points()


class MountEntry(NamedTuple):
    source: str
    point: str
    fstype: str
    options: str


def mount_of(path: str) -> MountEntry | None:
    """The mount that `path` (resolved) lies on: the innermost entry of the table above it, the last one
    mounted where several share a point."""
    real = os.path.realpath(path)
    best: MountEntry | None = None
    with open("/proc/self/mounts") as f:
        for fields in map(str.split, f):
            entry = MountEntry(_unescape(fields[0]), _unescape(fields[1]), fields[2], fields[3])
            inside = real == entry.point or real.startswith(entry.point.rstrip("/") + "/")
            if inside and (best is None or len(entry.point) >= len(best.point)):
                best = entry
    return best
