"""dlfs.direct: read a dlfs mount's files straight out of its shared chunk cache.

    import dlfs.direct
    reader = dlfs.direct.connect("/mnt/imagenet")
    with reader.read("/mnt/imagenet/train/n01440764/x.JPEG") as view:   # a read-only memoryview
        decode(view)
    views = reader.read_many(paths)                                      # one round trip at most

A file already in the mount's cache costs no request and no system call: the path is resolved in
the index (mapped here too), the record's slab is pinned in shared memory and the view points at
the bytes where they lie. Files not cached yet are fetched by the mount, a batch per request, and
handed over pinned. A view's bytes never change while it lives: its pin is released when the view
is released (the `with` block, `view.release()`) or dropped, and the mount reuses no pinned slab.

`connect` takes the mount point or any directory or file inside the mount. Files that are not on a
dlfs mount, or on a mount this process may not attach to, are read with plain open() instead (same
results, as read-only memoryviews of bytes), so code written against dlfs.direct runs anywhere; the
reader's `.reason` says why, and so does a log line (a warning when the path is on a dlfs mount).
Errors are the ones open() raises: FileNotFoundError, IsADirectoryError, NotADirectoryError,
PermissionError, and OSError(EIO) for data no replica has intact. After fork() a reader attaches
anew in the child (each process has its own pins), and so it does after a request cut short (a
timeout): the views made before stay valid either way.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import stat
import threading
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from dlfs.errors import DlfsError, ProtocolError, error_from_status
from dlfs.format.index import Index
from dlfs.native import native
from dlfs.procmounts import mount_of
from dlfs.wire.messages import Attached, DirectAnswer, reply
from dlfs.wire.protocol import (
    DIRECT_BATCH,
    DIRECT_REQUEST_BYTES,
    HEADER,
    MAX_DATA,
    MAX_META,
    REQUEST,
    RESPONSE,
    Frame,
    Msg,
    encode_frame,
    parse_header,
    unpack_meta,
)

log = logging.getLogger(__name__)
CONTROL_XATTR = "user.dlfs.control"  # on the mount's root only (dlfs/mount/ops.py)
MOUNT_TYPE = "fuse.dlfs"  # what /proc/self/mounts says of a dlfs mount (subtype=dlfs, dlfs/mount/lifecycle.py)
ROOT_INO = 1  # the inode number of a dlfs mount's root
BIG_RECORD = DIRECT_REQUEST_BYTES  # files with a record bigger than a request can ask are read through the kernel
TIMEOUT = 120.0  # seconds a request may wait for the mount (it fails over replicas meanwhile)
Path = str | bytes | os.PathLike[str] | os.PathLike[bytes]
T = TypeVar("T")

__all__ = ["DirectReader", "PlainReader", "connect"]


def _plain(path: Path) -> memoryview:
    with open(path, "rb", buffering=0) as f:
        return memoryview(f.read())


class PlainReader:
    """The fallback: the same calls as DirectReader, with open() and read()."""

    direct = False

    def __init__(self, root: str, reason: str) -> None:
        self.root = root  # the top of the file system the path given to connect() is on
        self.reason = reason

    def read(self, path: Path) -> memoryview:
        """The file's bytes as a read-only memoryview."""
        return _plain(path)

    def read_many(self, paths: Iterable[Path]) -> list[memoryview]:
        return [_plain(p) for p in paths]

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> PlainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(path: Path) -> DirectReader | PlainReader:
    """A reader for the dlfs mount that `path` is on: the mount point, or any directory or file inside
    it. A DirectReader if this process may attach to the mount; else a PlainReader, whose `.reason`
    says why (logged too: a warning when the path is on a dlfs mount, info when it is not on one)."""
    target = os.path.abspath(os.fsdecode(path))
    os.stat(target)  # what open() would raise: ENOENT, ENOTCONN (a dead mount), EACCES
    root, control = _find_control(target)
    if control is None:
        reason, on_dlfs = _why_no_control(target)
        return _fallback(root, reason, on_dlfs)
    if native is None:
        why = "DLFS_NO_NATIVE is set" if os.environ.get("DLFS_NO_NATIVE") else "not built: reinstall dlfs"
        return _fallback(root, f"dlfs's C helper is not loaded in this process ({why})", True)
    try:
        return DirectReader(root, control)
    except OSError as exc:
        reason = f"cannot attach to the mount's control socket {control}: {exc.strerror or exc}"
        owner = _mount_owner(root)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.ECONNRESET) and owner not in (None, os.getuid()):
            reason += f" (the mount is uid {owner}'s: only that user and root may attach to it)"
        return _fallback(root, reason, True)


def _fallback(root: str, reason: str, on_dlfs: bool) -> PlainReader:
    log.log(logging.WARNING if on_dlfs else logging.INFO, "dlfs.direct on %s: %s; reading with open() instead",
            root, reason)
    return PlainReader(root, reason)


def _top(path: str) -> str:
    """The highest directory above `path` (or `path` itself) on the same file system, by name."""
    dev = os.stat(path).st_dev
    while path != "/":
        parent = os.path.dirname(path)
        try:
            if os.stat(parent).st_dev != dev:
                break
        except OSError:
            break
        path = parent
    return path


def _find_control(target: str) -> tuple[str, str | None]:
    """The mount's root and its control socket, from the xattr on the root (None if there is none):
    the root found by name first, then by the resolved path (`target` may be reached by a symlink
    into the mount, whose name-wise top is not the mount's root)."""
    tops = [_top(target)]
    real = os.path.realpath(target)
    if real != target:
        tops.append(_top(real))
    for top in tops:
        try:
            return top, os.fsdecode(os.getxattr(top, CONTROL_XATTR))
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise  # ENOTCONN (a dead mount), EACCES: what open() would say too
    return tops[0], None


def _why_no_control(target: str) -> tuple[str, bool]:
    """Why `target` has no control socket above it, and whether it is on a dlfs mount at all."""
    entry = mount_of(target)
    if entry is None:
        return f"not a dlfs mount: {target} is on no mount listed in /proc/self/mounts", False
    if entry.fstype != MOUNT_TYPE:
        return f"not a dlfs mount: {target} is on {entry.fstype} at {entry.point}", False
    if os.stat(entry.point).st_ino != ROOT_INO:
        return (f"{entry.point} is a bind mount of a directory inside the dlfs mount {entry.source}: "
                "dlfs.direct attaches through the root of a mount (bind-mount the whole mount)"), True
    return (f"the dlfs mount {entry.source} at {entry.point} has no control socket: it runs without dlfs's "
            "C helper, so it has no shared cache"), True


def _mount_owner(root: str) -> int | None:
    """The uid that made the FUSE mount `root` is on (its user_id= option), if it says."""
    entry = mount_of(root)
    for opt in entry.options.split(",") if entry is not None else ():
        if opt.startswith("user_id="):
            return int(opt[len("user_id="):])
    return None


def _reply(kind: type[T], meta: dict[str, Any], msg: Msg, root: Path) -> T:
    """A mount's reply as its Struct; OSError(EPROTO) naming the field if it is of the wrong shape."""
    try:
        return reply(kind, meta, msg, f"the dlfs mount at {os.fsdecode(root)}")
    except ProtocolError as exc:
        raise OSError(errno.EPROTO, exc.message) from None


def _error(err: int, path: Path, what: str | None = None) -> OSError:
    return OSError(err, what or os.strerror(err), os.fsdecode(path))


class DirectReader:
    direct = True
    reason = None  # a PlainReader's says why it is one

    def __init__(self, root: str, control: str) -> None:
        self.root = root
        self.control = control
        self._prefix = os.fsencode(root).rstrip(b"/") + b"/"
        self._lock = threading.Lock()
        self._pid = -1
        self._broken = False  # the stream went out of step: attach anew before the next use
        self._sock: socket.socket  # set by _attach
        self._shared: Any = None  # native.CacheView: this client's half of the shared cache
        self._attach()

    # --- the connection ---

    def _attach(self) -> None:
        """Connect and map the shared cache: at start, again in a forked child, and after a broken stream.
        The views of the attachment before keep their pins (in its row, which the mount holds for them)."""
        if self._pid != -1:
            self._sock.close()  # in a forked child, our copy of the parent's: the parent's stays open
            self._shared.detach()
        self._pid = os.getpid()
        self._broken = True  # until this attach succeeds: the next use tries again
        self._req = 0
        self._pending = bytearray()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(TIMEOUT)
        try:
            self._sock.connect(self.control)
            self._send(Msg.DIRECT_ATTACH, {"pid": self._pid})
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 3)
            if not data:
                raise ConnectionResetError(errno.ECONNRESET, "the mount closed its control socket")
            self._pending += data
            try:
                try:
                    meta, _ = self._receive(Msg.DIRECT_ATTACH)
                except DlfsError as exc:  # refused (no room for another client): say it as open() would
                    raise OSError(exc.errno, exc.message) from None
                if len(fds) != 3:
                    raise OSError(errno.EPROTO, f"the mount sent {len(fds)} descriptors, not 3")
                ctl = mmap.mmap(fds[0], 0, prot=mmap.PROT_READ)  # native.CacheView makes our row writable
                arena = mmap.mmap(fds[1], 0, prot=mmap.PROT_READ)
                self.index = Index(f"/proc/self/fd/{fds[2]}")
            finally:
                for fd in fds:
                    os.close(fd)
            attached = _reply(Attached, meta, Msg.DIRECT_ATTACH, self.root)
            self.row, self.label = attached.row, attached.label
            assert native is not None
            # The socket lives as long as any view: the mount gives the row back when it ends with the
            # row marked released (native/direct.c), or once this process is gone.
            self._shared = native.CacheView(ctl, arena, row=self.row, sections=self.index.sections(),
                                            keep=self._sock)
            self._broken = False
        except BaseException:
            self._sock.close()
            raise
        log.debug("dlfs.direct: attached to %s at %s as row %d", self.label, self.root, self.row)

    def _send(self, msg: Msg, meta: dict[str, Any]) -> None:
        self._req = (self._req + 1) & 0xFFFFFFFF
        self._sock.sendall(encode_frame(Frame(REQUEST, msg, self._req, 0, meta)))

    def _fill(self, view: memoryview) -> None:
        got = min(len(self._pending), len(view))
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError(errno.ECONNRESET, f"the dlfs mount at {self.root} went away")
            got += n

    def _receive(self, msg: Msg) -> tuple[dict[str, Any], bytearray]:
        """The answer to the request just sent; its error, if it is one, as a DlfsError."""
        head = bytearray(HEADER.size)
        self._fill(memoryview(head))
        peer = f"the dlfs mount at {self.root}"
        kind, got_msg, status, req_id, meta_len, data_len = parse_header(head, peer, MAX_META, MAX_DATA)
        raw_meta, data = bytearray(meta_len), bytearray(data_len)
        self._fill(memoryview(raw_meta))
        self._fill(memoryview(data))
        if kind != RESPONSE or got_msg != msg or req_id != self._req:
            raise OSError(errno.EPROTO, f"{peer} answered out of turn")
        meta = unpack_meta(raw_meta) if meta_len else {}
        if status:
            raise error_from_status(status, str(meta.get("error", "mount error")))
        return meta, data

    def _check_open(self) -> None:
        if self._shared is None:
            raise ValueError(f"dlfs.direct reader of {self.root} is closed")

    def _stale(self) -> bool:
        return self._pid != os.getpid() or self._broken

    def _call(self, msg: Msg, meta: dict[str, Any]) -> tuple[dict[str, Any], bytearray]:
        self._check_open()
        with self._lock:
            if self._stale():
                self._attach()
            try:
                self._send(msg, meta)
                return self._receive(msg)
            except DlfsError:
                raise  # a whole answer, saying no: the stream is in step
            except BaseException:
                # Cut short (a timeout in the middle of a frame, say) or out of turn: what comes next on
                # this stream is no answer to the next request. End it; the next use attaches anew (the
                # views made so far keep their pins in this attachment's row, marked released after them).
                self._broken = True
                self._sock.close()
                self._shared.detach()
                raise

    def close(self) -> None:
        """Detach from the mount. Views still alive stay valid: the connection, and with it their
        pins, ends when the last of them is released."""
        shared, sock = self._shared, self._sock
        if shared is None:
            return
        self._shared = self._sock = None  # type: ignore[assignment]
        shared.detach()  # the row is marked released (for the mount to hand on) once no view holds a pin
        if self._pid != os.getpid() or shared.live_pins == 0:
            sock.close()

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reads ---

    def stats(self) -> dict[str, Any]:
        """The mount's cache statistics (fetches, bytes fetched by node, attached clients, ...)."""
        return self._call(Msg.DIRECT_STATS, {})[0]

    def files_under(self, directory: Path) -> tuple[list[str], list[int]]:
        """Every regular file below `directory` (paths relative to it, sorted) and the chunk holding
        each one's first bytes (-1 for an empty file), from the index: no request, no kernel."""
        self._check_open()
        full = os.fsencode(os.path.abspath(os.fsdecode(directory)))
        if full != self._prefix[:-1] and not full.startswith(self._prefix):
            raise ValueError(f"{os.fsdecode(full)} is not under the dlfs mount at {self.root}")
        rel = full[len(self._prefix):]
        ino = 1
        for part in (p for p in rel.split(b"/") if p):
            ino = self.index.lookup(ino, part)
            if ino < 0:
                raise _error(-ino, full)
        if not stat.S_ISDIR(self.index.inode(ino).mode):
            raise _error(errno.ENOTDIR, full)
        out: list[tuple[bytes, int]] = []
        todo = [(b"", ino)]
        while todo:
            base, d = todo.pop()
            for _, name, child in self.index.entries(d):
                mode, *_, ref, count, _ = self.index.inode_fields(child)
                path = base + name
                if stat.S_ISDIR(mode):
                    todo.append((path + b"/", child))
                elif stat.S_ISREG(mode):
                    out.append((path, self.index.extent(ref).chunk if count else -1))
        out.sort()
        return [os.fsdecode(p) for p, _ in out], [c for _, c in out]

    def read(self, path: Path) -> memoryview:
        """The file's bytes, a read-only memoryview into the shared cache, pinned until released."""
        return self.read_many([path])[0]

    def read_many(self, paths: Sequence[Path]) -> list[memoryview]:
        """Every file's bytes, as read() gives them, with at most one request per batch of misses.
        The first path that fails raises its error (the views already made are let go)."""
        self._check_open()
        if self._stale():
            with self._lock:
                if self._stale():
                    self._attach()
        rels: list[bytes] = []
        outside: dict[int, Path] = {}
        prefix = self._prefix
        for i, p in enumerate(paths):
            full = os.fsencode(os.path.abspath(p))
            if full.startswith(prefix):
                rels.append(full[len(prefix):])
            elif full == prefix[:-1]:
                rels.append(b"")
            else:
                rels.append(b"")
                outside[i] = p  # not on this mount: read it plainly
        got: list[Any] = self._shared.read_many(rels)
        ask: dict[int, int] = {}
        for i, r in enumerate(got):
            if isinstance(r, memoryview):
                continue
            if i in outside:
                got[i] = _plain(outside[i])
            elif r < 0:
                raise _error(-r, paths[i], "corrupt index entry" if r == -errno.EIO else None)
            else:
                ask[i] = r
        if ask:
            self._finish(paths, got, ask)
        return got

    def _finish(self, paths: Sequence[Path], got: list[Any], ask: dict[int, int]) -> None:
        """Files not (wholly) in the shared cache: symlinks through the kernel, the rest from the mount."""
        wanted: list[tuple[int, int, int]] = []  # (path position, first extent, extents)
        for i, ino in ask.items():
            node = self.index.inode(ino)
            if stat.S_ISLNK(node.mode):
                got[i] = self._via_symlink(paths[i])
            elif not stat.S_ISREG(node.mode):
                got[i] = _plain(paths[i])  # what open() does with it (a FIFO or device is not ingested)
            elif any(self.index.extent(e).record.raw_len > BIG_RECORD for e in range(node.ref, node.ref + node.count)):
                got[i] = _plain(paths[i])
            else:
                wanted.append((i, node.ref, node.count))
        exts = [e for _, ref, n in wanted for e in range(ref, ref + n)]
        pieces = self._fetch(exts, {e: paths[i] for i, ref, n in wanted for e in range(ref, ref + n)})
        pos = 0
        for i, _, n in wanted:
            mine = pieces[pos : pos + n]
            pos += n
            if n == 1:
                got[i] = mine[0]
                continue
            whole = bytearray(sum(len(m) for m in mine))
            at = 0
            for m in mine:
                whole[at : at + len(m)] = m
                at += len(m)
                m.release()
            got[i] = memoryview(whole).toreadonly()

    def _via_symlink(self, path: Path) -> memoryview:
        target = os.path.realpath(path)  # the kernel follows it, as open() would
        if os.fsencode(target).startswith(self._prefix):
            return self.read_many([target])[0]
        return _plain(target)

    def _fetch(self, exts: list[int], path_of: dict[int, Path]) -> list[memoryview]:
        """Views of these extents' records, asked of the mount in batches."""
        out: list[memoryview] = []
        start = 0
        while start < len(exts):
            end, size = start, 0
            while end < len(exts) and end - start < DIRECT_BATCH:
                size += self.index.extent(exts[end]).record.raw_len
                if size > DIRECT_REQUEST_BYTES and end > start:
                    break
                end += 1
            out += self._fetch_batch(exts[start:end], path_of)
            start = end
        return out

    def _fetch_batch(self, exts: list[int], path_of: dict[int, Path]) -> list[memoryview]:
        try:
            meta, data = self._call(Msg.DIRECT_READ, {"exts": exts})
        except DlfsError as exc:
            raise _error(exc.errno, path_of[exts[0]], exc.message) from None
        answer = _reply(DirectAnswer, meta, Msg.DIRECT_READ, self.root)
        at, errors = answer.at, answer.errors
        if len(at) != len(exts):
            raise OSError(errno.EPROTO, f"the dlfs mount at {self.root} answered a read with the wrong shape")
        out: list[memoryview] = []
        # The pins the mount took for us are each released by the view made of them.
        for i, where in enumerate(at):
            if where is not None:
                out.append(self._shared.take(where[0], where[1], self.index.extent(exts[i]).record.raw_len))
        failed = {i: (status, msg) for i, status, msg in errors}
        if failed:
            i = min(failed)
            err = error_from_status(*failed[i])
            raise _error(err.errno, path_of[exts[i]], err.message)
        views, inline, off = iter(out), memoryview(data).toreadonly(), 0
        result = []
        for i, where in enumerate(at):
            if where is not None:
                result.append(next(views))
            else:
                n = self.index.extent(exts[i]).record.raw_len
                if off + n > len(inline):
                    raise OSError(errno.EPROTO, f"the dlfs mount at {self.root} sent too few bytes")
                result.append(inline[off : off + n])
                off += n
        return result
