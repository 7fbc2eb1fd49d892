"""The chunk store: immutable chunk files under one directory, no network.

    chunks/<2 hex>/<32 hex>   one file per chunk, named by its content hash
    tmp/                      chunks being written; renamed into place once whole and synced
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from dlfs.errors import NO_ROOM, CorruptData, DlfsError, NotFound, StorageFull
from dlfs.format.chunk import HEADER, check_header, chunk_id, verify_chunk
from dlfs.private import DIR_MODE, FILE_MODE, private_dirs
from dlfs.wire.protocol import FileRange

log = logging.getLogger(__name__)


def boot_id() -> str:
    """This kernel's boot id: two processes that report the same one share a machine (and disk)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def chunk_path(chunk_dir: Path, cid: bytes) -> Path:
    h = cid.hex()
    return chunk_dir / h[:2] / h


def _pread_whole(fd: int) -> bytes:
    size, got, pieces = os.fstat(fd).st_size, 0, []
    while got < size:
        piece = os.pread(fd, size - got, got)
        if not piece:
            break  # shorter than it said: the check that follows says so
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


class ChunkStore:
    """Chunk files on local disk. Thread-safe: the service calls it from worker threads."""

    def __init__(self, root: Path, open_files: int = 256) -> None:
        self.root = root
        self.chunk_dir = root / "chunks"
        self.tmp_dir = root / "tmp"
        private_dirs(self.chunk_dir)
        private_dirs(self.tmp_dir)
        for leftover in self.tmp_dir.iterdir():  # half-written chunks of a daemon that died
            leftover.unlink(missing_ok=True)
        self._fds: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()  # cid -> (fd, st_dev, st_ino)
        self._open_files = open_files
        self._lock = threading.Lock()
        self.count, self.bytes = 0, 0
        for cid in self.list():
            self.count += 1
            self.bytes += self.path(cid).stat().st_size

    def path(self, cid: bytes) -> Path:
        return chunk_path(self.chunk_dir, cid)

    def put(self, cid: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Store a chunk after checking it whole; False if it was already here."""
        path = self.path(cid)
        if path.exists():
            return False
        verify_chunk(data, cid)
        tmp = self.tmp_dir / f"{cid.hex()}.{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._failed(cid, exc) from None
        return self._place(cid, tmp, len(data))

    def stage(self, cid: bytes) -> Path:
        """A fresh, empty file under tmp/ for a client on this machine to write chunk `cid` into
        (then `adopt`); private to this daemon's user, as every chunk file is."""
        for _ in range(8):
            path = self.tmp_dir / f"{cid.hex()}.staged.{secrets.token_hex(8)}"
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE))
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                raise self._failed(cid, exc) from None
        raise DlfsError(f"data daemon cannot stage chunk {cid.hex()}: no free name under {self.tmp_dir}")

    def adopt(self, cid: bytes, path: Path, size: int) -> bool:
        """Take the staged file at `path` as chunk `cid` once its header checks out and it is synced;
        False if the chunk was already here. The bytes are not hashed again: the client that wrote them
        hashed them as it packed them, and nothing came between (no network, no copy)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise CorruptData(f"staged chunk {cid.hex()}: cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_nlink != 1:
                raise CorruptData(f"staged chunk {cid.hex()}: {path} holds {st.st_size} bytes, not the {size} "
                                  "the client wrote")
            # The header, not every record: the records' framing and sums are the packer's, like its hashes,
            # and the client wrote the chunk past the page cache (reading it all back would read the disk).
            check_header(os.pread(fd, HEADER.size, 0), size, f"staged chunk {cid.hex()}")
            os.fsync(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise self._failed(cid, exc) from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return self._place(cid, path, size)

    def _place(self, cid: bytes, tmp: Path, size: int) -> bool:
        """Rename a whole, synced chunk file into place; False (and it is dropped) if one was there."""
        path = self.path(cid)
        try:
            path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
            # Two puts of one chunk may race here: only the first into place counts it.
            with self._lock:
                if path.exists():
                    tmp.unlink()
                    return False
                os.rename(tmp, path)
                self.count += 1
                self.bytes += size
            self._forget(cid)  # a descriptor kept of a file deleted by hand is of the old inode
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._failed(cid, exc) from None
        return True

    def _failed(self, cid: bytes, exc: OSError) -> DlfsError:
        if exc.errno in NO_ROOM:
            return StorageFull(f"data daemon disk is full at {self.root}")  # the caller names the chunk
        return DlfsError(f"data daemon cannot store chunk {cid.hex()}: {exc.strerror}")

    def _fd(self, cid: bytes, kept_only: bool = False) -> int | None:
        """A descriptor of the chunk file that the caller owns and closes (with `kept_only`, None unless
        a descriptor of it is kept open already).

        A duplicate of the cached one: eviction or deletion may close the cached one while the
        caller reads, and its number may be reused at once by another chunk's file. The cached one
        is trusted only while the path still names its inode (a stat, cheap beside the read): a chunk
        file deleted or replaced by hand is never read from its old inode.
        """
        if kept_only:
            with self._lock:
                if cid not in self._fds:  # no stat of a path nothing pins: it might read the disk
                    return None
        path = self.path(cid)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._forget(cid)
            raise NotFound(f"chunk {cid.hex()} is not on this node") from None
        with self._lock:
            kept = self._fds.get(cid)
            if kept is not None and kept[1:] == (st.st_dev, st.st_ino):
                self._fds.move_to_end(cid)
                return os.dup(kept[0])
        if kept_only:
            return None
        self._forget(cid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"chunk {cid.hex()} is not on this node") from None
        st = os.fstat(fd)
        with self._lock:
            if cid in self._fds:  # another thread opened it meanwhile
                os.close(fd)
                return os.dup(self._fds[cid][0])
            self._fds[cid] = (fd, st.st_dev, st.st_ino)
            while len(self._fds) > self._open_files:
                _, old = self._fds.popitem(last=False)
                os.close(old[0])
            return os.dup(fd)

    def open_range(self, cid: bytes, offset: int, length: int) -> FileRange:
        """Bytes [offset, offset+length) of a chunk as a file range to sendfile; shorter if the file
        is (the reader checks)."""
        if offset < 0 or length < 0:
            raise ValueError("negative offset or length")
        fd = self._fd(cid)
        assert fd is not None
        return self._range(cid, fd, offset, length)

    def open_kept_range(self, cid: bytes, offset: int, length: int) -> FileRange | None:
        """open_range for a chunk whose file is kept open, else None. Nothing here waits for the disk
        (the open descriptor pins the path's entries and the inode), so the event loop may call it,
        saving a trip to a thread per range."""
        if offset < 0 or length < 0:
            raise ValueError("negative offset or length")
        fd = self._fd(cid, kept_only=True)
        return None if fd is None else self._range(cid, fd, offset, length)

    def _range(self, cid: bytes, fd: int, offset: int, length: int) -> FileRange:
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise CorruptData(f"chunk {cid.hex()}: stat failed ({exc.strerror})") from None
        return FileRange(fd, offset, max(0, min(length, size - offset)))

    def _forget(self, cid: bytes) -> None:
        with self._lock:
            kept = self._fds.pop(cid, None)
        if kept is not None:
            os.close(kept[0])

    def has(self, cid: bytes) -> bool:
        return self.path(cid).exists()

    def delete(self, cid: bytes) -> bool:
        self._forget(cid)
        path = self.path(cid)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            self.count -= 1
            self.bytes -= size
        return True

    def list(self) -> list[bytes]:
        out = []
        for sub in sorted(self.chunk_dir.iterdir()):
            for f in sorted(sub.iterdir()):
                try:
                    out.append(bytes.fromhex(f.name))
                except ValueError:
                    log.warning("ignoring stray file %s in the chunk store", f)
        return out

    def verify(self, cid: bytes) -> str | None:
        """None if the chunk is whole and matches its id, else why not: read as readers are served (`_fd`)."""
        try:
            fd = self._fd(cid)
            assert fd is not None
        except NotFound:
            return "missing"
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
        try:
            data = _pread_whole(fd)  # at offsets: a dup shares its file position with the kept descriptor
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
        finally:
            os.close(fd)
        try:
            verify_chunk(data, cid)
        except CorruptData as exc:
            return str(exc)
        return None

    def disk(self) -> tuple[int, int]:
        """(bytes free, bytes total) on the store's file system."""
        u = shutil.disk_usage(self.root)
        return u.free, u.total

    def close(self) -> None:
        with self._lock:
            for fd, _, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


__all__ = ["ChunkStore", "chunk_id"]
