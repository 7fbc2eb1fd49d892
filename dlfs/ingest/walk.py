"""Walking the source tree into numbered inodes, as the index will hold them."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field

from dlfs.errors import SourceError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Node:
    """One inode of the tree (a hard-linked file is one Node with several names)."""

    ino: int
    path: bytes  # the first path it was found at, relative to the source root
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    nlink: int = 1
    parent: int = 0
    children: list[tuple[bytes, int]] = field(default_factory=list)
    target: bytes = b""


@dataclass
class Tree:
    root: bytes
    nodes: list[Node]  # nodes[i].ino == i + 1; the root is nodes[0]
    skipped: list[bytes]

    @property
    def files(self) -> list[Node]:
        return [n for n in self.nodes if stat.S_ISREG(n.mode)]


def _display(root: bytes, rel: bytes) -> str:
    return os.fsdecode(os.path.join(root, rel) if rel else root)


def walk(src: str | bytes) -> Tree:
    """Every directory, regular file and symlink under `src`, sorted by name, depth first.

    Sockets, fifos and device nodes are skipped with a warning that names them.
    """
    root = os.fsencode(os.path.abspath(src))
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise SourceError(f"cannot read {os.fsdecode(root)}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{os.fsdecode(root)} is not a directory")
    nodes = [Node(1, b"", st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, nlink=2, parent=1)]
    links: dict[tuple[int, int], Node] = {}
    skipped: list[bytes] = []
    stack = [nodes[0]]
    while stack:
        d = stack.pop()
        full = os.path.join(root, d.path) if d.path else root
        try:
            with os.scandir(full) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(f"cannot read directory {_display(root, d.path)}: {exc.strerror}") from None
        subdirs = []
        for e in entries:
            rel = os.path.join(d.path, e.name) if d.path else e.name
            try:
                est = e.stat(follow_symlinks=False)
            except OSError as exc:
                raise SourceError(f"cannot stat {_display(root, rel)}: {exc.strerror}") from None
            mode = est.st_mode
            if stat.S_ISREG(mode) and est.st_nlink > 1:
                seen = links.get((est.st_dev, est.st_ino))
                if seen is not None:
                    seen.nlink += 1
                    d.children.append((e.name, seen.ino))
                    continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                log.warning("skipping %s: %s", _display(root, rel), _kind(mode))
                skipped.append(rel)
                continue
            n = Node(len(nodes) + 1, rel, mode, est.st_uid, est.st_gid, est.st_size, est.st_mtime_ns, parent=d.ino)
            if stat.S_ISLNK(mode):
                try:
                    n.target = os.readlink(os.path.join(root, rel))
                except OSError as exc:
                    raise SourceError(f"cannot read symlink {_display(root, rel)}: {exc.strerror}") from None
                n.size = len(n.target)
            elif stat.S_ISDIR(mode):
                n.nlink = 2
                d.nlink += 1
                subdirs.append(n)
            elif est.st_nlink > 1:
                links[(est.st_dev, est.st_ino)] = n
            nodes.append(n)
            d.children.append((e.name, n.ino))
        stack.extend(reversed(subdirs))
    return Tree(root, nodes, skipped)


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file, directory or symlink"
