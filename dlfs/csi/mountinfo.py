"""/proc/self/mountinfo, read: what the plugin knows of its volumes after a restart.

Unlike /proc/self/mounts (dlfs/procmounts.py) it gives each mount's device: a bind mount shares the
device of the mount it was made from, which is how a pod's target is traced to the dlfs mount it shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dlfs.procmounts import _unescape

MOUNTINFO = Path("/proc/self/mountinfo")
FSTYPE = "fuse.dlfs"  # what the kernel calls a dlfs mount (subtype=dlfs)
SOURCE_PREFIX = "dlfs:"  # its source is dlfs:NAME@VERSION (fsname)


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    device: str  # "major:minor": every mount of one file system, its bind mounts too, shares it
    root: str  # the directory of that file system mounted here ("/" for the whole)
    fstype: str
    source: str
    super_options: frozenset[str]

    @property
    def dataset(self) -> str | None:
        """NAME@VERSION of a dlfs mount (or a bind of one), else None."""
        if self.fstype != FSTYPE or not self.source.startswith(SOURCE_PREFIX):
            return None
        return self.source[len(SOURCE_PREFIX):]


def read_mountinfo(path: Path = MOUNTINFO) -> list[MountEntry]:
    """Every mount of this process's namespace, in the kernel's order (a later one covers an earlier
    one at the same mountpoint)."""
    entries = []
    for line in path.read_text().splitlines():
        # ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        entries.append(MountEntry(_unescape(fields[4]), fields[2], _unescape(fields[3]), rest[0], _unescape(rest[1]),
                                  frozenset(rest[2].split(","))))
    return entries


def mount_at(path: Path, entries: list[MountEntry]) -> MountEntry | None:
    """The mount that shows at `path` (the topmost), or None when nothing is mounted there."""
    found = None
    for entry in entries:
        if entry.mountpoint == str(path):
            found = entry
    return found
