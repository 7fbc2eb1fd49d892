"""Walking the source tree into numbered inodes, as the index will hold them."""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from dlfs.errors import SourceError, UsageError

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


@dataclass(frozen=True)
class Selection:
    """Which entries of the source an ingest takes: with `listed` (--files-from), the listed paths (a
    directory with everything under it) and the directories that lead to them; never one that an
    `excludes` pattern (--exclude) matches, nor anything under an excluded directory. A pattern with a
    `/` is matched against the path from the source root (a leading `/` anchors it there), one without
    against the entry's name at any depth; a trailing `/` matches directories only; `*` does not stop at
    `/` (fnmatch)."""

    listed: frozenset[bytes] | None = None
    excludes: tuple[str, ...] = ()

    def excluded(self, rel: bytes, is_dir: bool) -> bool:
        path = os.fsdecode(rel)
        for pat in self.excludes:
            if pat.endswith("/"):
                if not is_dir:
                    continue
                pat = pat.rstrip("/")
            if "/" in pat:
                if fnmatch.fnmatchcase(path, pat.lstrip("/")):
                    return True
            elif fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pat):
                return True
        return False

    def under_excluded(self, rel: bytes) -> bool:
        """Whether a directory above `rel` is excluded (so nothing of it is in the tree)."""
        return any(self.excluded(rel[:i], True) for i in range(len(rel)) if rel[i : i + 1] == b"/")

    def leads(self) -> set[bytes]:
        """The directories that lead to a listed path: walked, but only for what is listed below them."""
        return {b"/".join(p.split(b"/")[:k]) for p in self.listed or () for k in range(1, p.count(b"/") + 1)}

    def missing(self, found: set[bytes]) -> tuple[bytes | None, int]:
        """The first listed path (by name) not `found`, and how many there are; under an excluded
        directory is not missing: the exclusion wins, as for what it names itself."""
        gone = sorted(p for p in (self.listed or frozenset()) - found if not self.under_excluded(p))
        return (gone[0] if gone else None), len(gone)


def read_list(lines: Iterable[bytes], root: str | bytes | None, what: str = "--files-from") -> frozenset[bytes]:
    """The paths of a file list (one a line; blank lines skipped), relative to the source `root`: an
    absolute path inside it is made relative, `./` and trailing `/` dropped. A path outside the root
    is a UsageError naming its line; so is any absolute path where `root` is None (a bucket, tar
    shards: sources with no place in this machine's tree)."""
    top = os.fsencode(os.path.abspath(root)) if root is not None else None
    out: set[bytes] = set()
    for number, line in enumerate(lines, 1):
        entry = line.rstrip(b"\r\n")
        if not entry.strip():
            continue
        if entry.startswith(b"/"):
            if top is None:
                raise UsageError(f"{what} line {number}: {os.fsdecode(entry)} is absolute; this source is not "
                                 "a local directory: list paths relative to it, as the dataset will have them")
            if entry.rstrip(b"/") == top:
                raise UsageError(f"{what} line {number}: {os.fsdecode(entry)} is the source itself: leave "
                                 f"{what} out to ingest all of it")
            if not entry.startswith(top + b"/"):
                raise UsageError(f"{what} line {number}: {os.fsdecode(entry)} is not under the source "
                                 f"{os.fsdecode(top)}")
            entry = entry[len(top) + 1 :]
        parts = [p for p in entry.split(b"/") if p not in (b"", b".")]
        if not parts or b".." in parts:
            raise UsageError(f"{what} line {number}: {os.fsdecode(entry)} is not a path inside the source")
        out.add(b"/".join(parts))
    return frozenset(out)


def _display(root: bytes, rel: bytes) -> str:
    return os.fsdecode(os.path.join(root, rel) if rel else root)


def walk(src: str | bytes, select: Selection | None = None) -> Tree:
    """Every directory, regular file and symlink under `src` (those `select` takes), sorted by name,
    depth first.

    Sockets, fifos and device nodes are skipped with a warning that names them. A listed path that is
    not in the tree (or lies under a symlink, which is not followed) is a SourceError naming it.
    """
    select = select or Selection()
    listed = select.listed
    leads = select.leads()
    found: set[bytes] = set()
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
    # (directory, whether all of it is taken: no list, or it is listed or under a listed one)
    stack = [(nodes[0], listed is None)]
    while stack:
        d, whole = stack.pop()
        full = os.path.join(root, d.path) if d.path else root
        try:
            with os.scandir(full) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(f"cannot read directory {_display(root, d.path)}: {exc.strerror}") from None
        subdirs = []
        for e in entries:
            rel = os.path.join(d.path, e.name) if d.path else e.name
            taken = whole or (listed is not None and rel in listed)
            if not taken and rel not in leads:
                continue
            try:
                est = e.stat(follow_symlinks=False)
            except OSError as exc:
                raise SourceError(f"cannot stat {_display(root, rel)}: {exc.strerror}") from None
            mode = est.st_mode
            if listed is not None and rel in listed:
                found.add(rel)
            if select.excludes and select.excluded(rel, stat.S_ISDIR(mode)):
                continue
            if not taken and not stat.S_ISDIR(mode):
                continue  # a file where the list has a directory of that name
            if stat.S_ISREG(mode) and est.st_nlink > 1:
                seen = links.get((est.st_dev, est.st_ino))
                if seen is not None:
                    seen.nlink += 1
                    d.children.append((e.name, seen.ino))
                    continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                log.debug("skipping %s: %s", _display(root, rel), _kind(mode))  # the CLI says it once
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
                subdirs.append((n, taken))
            elif est.st_nlink > 1:
                links[(est.st_dev, est.st_ino)] = n
            nodes.append(n)
            d.children.append((e.name, n.ino))
        stack.extend(reversed(subdirs))
    first, count = select.missing(found)
    if first is not None:
        more = f" (and {count - 1} more)" if count > 1 else ""
        raise SourceError(f"--files-from names {_display(root, first)}{more}, which is not in the source (or lies "
                          "under a symlink, which is not followed)")
    return Tree(root, nodes, skipped)


class PathClash(SourceError):
    """An entry that needs `file`, a file already in the tree, to be a directory."""

    def __init__(self, message: str, file: bytes) -> None:
        super().__init__(message)
        self.file = file


class TreeBuilder:
    """A Tree from entries named by path, as a bucket listing or an archive gives them (files in the
    order they will be read, which is the order they are packed in). The directories leading to an
    entry are made as they are first needed (mode 0755, owner and time of the root); an entry that
    `select` does not take is left out. A path that is both a file and a directory, or named twice, is
    a SourceError naming it (`where` tells the user where the entries came from)."""

    def __init__(self, where: str, select: Selection | None = None, uid: int = 0, gid: int = 0,
                 mtime_ns: int = 0) -> None:
        self.where = where
        self.select = select or Selection()
        self.uid, self.gid, self.mtime_ns = uid, gid, mtime_ns
        root = Node(1, b"", stat.S_IFDIR | 0o755, uid, gid, 0, mtime_ns, nlink=2, parent=1)
        self.nodes = [root]
        self.by_path: dict[bytes, Node] = {b"": root}
        self.names: dict[int, set[bytes]] = {1: set()}  # a directory's names so far, for duplicates
        self.found: set[bytes] = set()
        self.skipped: list[bytes] = []
        self.leads = self.select.leads()

    def taken(self, path: bytes, is_dir: bool) -> bool:
        """Whether the selection takes `path` (relative, no leading /): listed, or under a listed path,
        or a directory leading to one; and neither it nor a directory above it excluded."""
        sel = self.select
        wanted = sel.listed is None
        if not wanted:
            parts = path.split(b"/")
            for k in range(1, len(parts) + 1):
                if (prefix := b"/".join(parts[:k])) in sel.listed:
                    self.found.add(prefix)  # found even where excluded, as walk() counts it: not missing
                    wanted = True
            wanted = wanted or (is_dir and path in self.leads)
        return wanted and not (sel.excludes and (sel.under_excluded(path) or sel.excluded(path, is_dir)))

    def _dir(self, path: bytes) -> Node:
        node = self.by_path.get(path)
        if node is not None:
            if not stat.S_ISDIR(node.mode):
                raise PathClash(f"{self.where}: {os.fsdecode(path)} is a file and also a directory (of what "
                                "is listed under it): a file system cannot hold both", path)
            return node
        parent_path, _, name = path.rpartition(b"/")
        return self._link(parent_path, name, Node(0, path, stat.S_IFDIR | 0o755, self.uid, self.gid, 0,
                                                   self.mtime_ns, nlink=2))

    def _link(self, parent_path: bytes, name: bytes, node: Node) -> Node:
        parent = self._dir(parent_path)
        names = self.names[parent.ino]
        if name in names:
            raise SourceError(f"{self.where}: {os.fsdecode(node.path)} is named twice")
        names.add(name)
        node.ino = len(self.nodes) + 1
        node.parent = parent.ino
        self.nodes.append(node)
        self.by_path[node.path] = node
        parent.children.append((name, node.ino))
        if stat.S_ISDIR(node.mode):
            self.names[node.ino] = set()
            parent.nlink += 1
        return node

    def add(self, path: bytes, mode: int, size: int = 0, mtime_ns: int = 0, uid: int | None = None,
            gid: int | None = None, target: bytes = b"") -> Node | None:
        """Add one entry (its path relative to the root, without leading or doubled /, . or ..); returns
        its Node, or None if the selection leaves it out. A directory added after entries under it
        were (archives list them in any order) takes the mode, owner and time given here."""
        is_dir = stat.S_ISDIR(mode)
        if not self.taken(path, is_dir):
            return None
        uid = self.uid if uid is None else uid
        gid = self.gid if gid is None else gid
        if is_dir:
            node = self._dir(path)
            node.mode, node.uid, node.gid, node.mtime_ns = mode, uid, gid, mtime_ns
            return node
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            log.debug("skipping %s: %s", f"{self.where}: {os.fsdecode(path)}", _kind(mode))  # the CLI says it once
            self.skipped.append(path)
            return None
        if path in self.by_path:
            raise SourceError(f"{self.where}: {os.fsdecode(path)} is named twice")
        parent_path, _, name = path.rpartition(b"/")
        node = Node(0, path, mode, uid, gid, len(target) if target else size, mtime_ns, target=target)
        return self._link(parent_path, name, node)

    def link(self, path: bytes, existing: Node) -> None:
        """A hard link: `path` names the same file as `existing`."""
        if not self.taken(path, False):
            return
        parent_path, _, name = path.rpartition(b"/")
        parent = self._dir(parent_path)
        if name in self.names[parent.ino]:
            raise SourceError(f"{self.where}: {os.fsdecode(path)} is named twice")
        self.names[parent.ino].add(name)
        parent.children.append((name, existing.ino))
        existing.nlink += 1

    def finish(self) -> Tree:
        """The tree; a SourceError if a path of the selection's list was never seen."""
        first, count = self.select.missing(self.found)
        if first is not None:
            more = f" (and {count - 1} more)" if count > 1 else ""
            raise SourceError(f"--files-from names {os.fsdecode(first)}{more}, which is not in {self.where}")
        self.names.clear()
        return Tree(os.fsencode(self.where), self.nodes, self.skipped)


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file, directory or symlink"
