"""Where an ingest's files come from: a local tree (here), an S3 bucket (s3.py) or tar shards (tar.py).

A source lists itself into a Tree (walk.py), then hands the packer each regular file of that tree, in
the tree's order, as a reader of exactly the listed size. Each source checks that what it reads is what
it listed, and says so as a SourceError naming the file ("nothing was published").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Protocol

from dlfs.errors import SourceError
from dlfs.ingest.walk import Node, Selection, Tree, walk

READ_AHEAD = 64 << 20  # bytes of a local tree asked of the disk ahead of the packer


class FileReader(Protocol):
    """One file's bytes, read once from the start."""

    name: str  # the file as the user knows it, for messages

    def readinto(self, buf: memoryview) -> int:
        """Fill a prefix of `buf`; returns how much (0 at the end of the file)."""
        ...

    def finish(self) -> None:
        """Called once all `node.size` bytes are read: a SourceError if the file was changed meanwhile."""
        ...

    def close(self) -> None: ...


class Source(Protocol):
    where: str  # what the user named, for messages

    @property
    def streamed(self) -> bool:
        """Whether files() lists the tree as it reads it (tar shards): walk()'s tree is complete, and its
        totals known, only once files() is done."""
        ...

    def walk(self, select: Selection | None) -> Tree: ...

    def files(self, tree: Tree) -> Iterator[tuple[Node, FileReader]]:
        """Each regular file of `tree` in order, with its reader (closed by the caller)."""
        ...


class LocalTree:
    """A directory tree on a local (or network) file system."""

    streamed = False

    def __init__(self, src: str) -> None:
        self.where = src
        self.root = os.fsencode(os.path.abspath(src))

    def walk(self, select: Selection | None) -> Tree:
        tree = walk(self.root, select)
        self.root = tree.root
        return tree

    def files(self, tree: Tree) -> Iterator[tuple[Node, FileReader]]:
        files = tree.files
        ahead = _ReadAhead(tree.root, files)
        try:
            for i, node in enumerate(files):
                ahead.reached(i)
                yield node, _LocalFile(os.fsdecode(os.path.join(tree.root, node.path)), node)
        finally:
            ahead.stop()


class _ReadAhead:
    """Asks the kernel to read the files the packer comes to next (POSIX_FADV_WILLNEED), READ_AHEAD
    bytes ahead of it, from a thread of its own: the disk then serves many files at once instead of one
    small read after another, each waited for (a cold tree of ~110 KB files was read at a third of the
    disk's speed)."""

    def __init__(self, root: bytes, files: list[Node]) -> None:
        self.root, self.files = root, files
        self.cond = threading.Condition()
        self.at = 0  # the file the packer is on
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="dlfs-ingest-readahead", daemon=True)
        self.thread.start()

    def reached(self, i: int) -> None:
        with self.cond:
            self.at = i
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        ends = []  # ends[j]: bytes of files[0..j]
        total = 0
        for n in self.files:
            total += n.size
            ends.append(total)
        for j, node in enumerate(self.files):
            with self.cond:
                # Wait until file j starts within READ_AHEAD bytes of where the packer is.
                while not self.stopped and ends[j] - node.size - (ends[self.at] - self.files[self.at].size) > READ_AHEAD:
                    self.cond.wait(timeout=1.0)
                if self.stopped:
                    return
            if not node.size:
                continue
            try:
                fd = os.open(os.path.join(self.root, node.path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # the packer meets it, and says what is wrong
            try:
                os.posix_fadvise(fd, 0, node.size, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


class _LocalFile:
    def __init__(self, path: str, node: Node) -> None:
        self.path = self.name = path
        self.node = node
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror}; nothing was published") from None
        try:
            st = os.fstat(self.fd)
            if st.st_size != node.size:
                raise SourceError(f"{path} changed while being ingested (size {node.size} -> {st.st_size}); "
                                  "nothing was published")
            self._check_unmodified(st.st_mtime_ns)
        except BaseException:
            os.close(self.fd)
            raise

    def _check_unmodified(self, mtime_ns: int) -> None:
        # A rewrite that keeps the size shows only in the mtime: the index would pair the new
        # bytes with the old time, and the dataset would match no state the source was ever in.
        if mtime_ns != self.node.mtime_ns:
            raise SourceError(f"{self.path} changed while being ingested (modified after it was listed); "
                              "nothing was published")

    def readinto(self, buf: memoryview) -> int:
        try:
            return os.readv(self.fd, [buf])
        except OSError as exc:
            raise SourceError(f"cannot read {self.path}: {exc.strerror}; nothing was published") from None

    def finish(self) -> None:
        if self.readinto(memoryview(bytearray(1))):
            raise SourceError(f"{self.path} grew while being ingested; nothing was published")
        self._check_unmodified(os.fstat(self.fd).st_mtime_ns)

    def close(self) -> None:
        os.close(self.fd)
