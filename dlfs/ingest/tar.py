"""Tar and zip shards as an ingest source (`dlfs ingest --expand-tar`): every member becomes a file of
the dataset, under a folder named for its shard (or at the top, with --flatten), read as a stream and
never extracted to disk.

Each shard is read once, from its start: its members are added to the tree as their headers come out
of the stream (TarShards._streamed), and each wanted member's bytes go to the packer there and then;
the tree's totals are known only at the end. Shards are read in the order named and members in shard
order, so the packer puts the members of one shard in the same chunks; the shards in a bucket are
fetched whole by one read-ahead (a zip, whose directory is at its end, in blocks). A file that the
selection leaves out but a later hard link to it takes costs that shard a second pass. A shard must
not change while it is read (its size and mtime; in a bucket, the ETag of every GET).

With --files-from over shards in a bucket, walk() lists every shard first instead (several at once):
a plain tar by its headers alone, so that only the members listed are fetched afterwards.
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import queue
import stat
import struct
import tarfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import partial
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar

from dlfs.errors import SourceError, UsageError
from dlfs.format.index import name_problem
from dlfs.ingest.source import FileReader
from dlfs.ingest.walk import Node, Selection, Tree, TreeBuilder
from dlfs.units import counted

if TYPE_CHECKING:  # boto3 is imported only where a bucket is read
    from dlfs.ingest.s3 import ReadAhead, S3Client
    from dlfs.ingest.s3file import S3Object

log = logging.getLogger(__name__)

# What a directory of shards contributes, and what each leaves of its name as its folder.
SHARD_SUFFIXES = (".tar.gz", ".tgz", ".tar.zst", ".tar.zstd", ".tar", ".zip")
PIECE = 1 << 20  # compressed bytes read at a time; at most this much decompressed output at a time (gzip)
READ_AHEAD = 8  # decompressed pieces made ahead of the packer
CODEC_BYTES = 10  # a shard's first bytes, which say what it is
LIST_AHEAD = 2  # listed shards waiting for the tree builder, per listing thread
NOTHING = "; nothing was published"

REG, DIR, SYM, HARD, OTHER = "file", "directory", "symlink", "hard link", "other"

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Member:
    """One member of a shard, as listed: `name` relative to the shard (normalised, b"" for the shard's own
    top directory), `target` a symlink's target as stored or a hard link's (normalised) target."""

    index: int
    name: bytes
    kind: str
    mode: int  # with the file type bits
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: bytes = b""
    offset: int = 0  # where its bytes start in the tar stream (a plain tar in a bucket is read from there)


@dataclass(slots=True)
class Wanted:
    """A member whose bytes become `node`'s (a regular file the selection takes)."""

    index: int
    name: bytes
    size: int
    node: Node
    offset: int = 0


@dataclass
class Shard:
    path: str
    folder: bytes  # the dataset folder of its members (without --flatten)
    codec: str = ""  # tar, gzip, zstd or zip, from its first bytes
    size: int = 0  # when listed, to tell it was not changed before it is read
    mtime_ns: int = 0
    uid: int = 0
    gid: int = 0
    wanted: list[Wanted] = field(default_factory=list)
    obj: S3Object | None = None  # a shard in a bucket (its `path` is then its s3:// URL)
    ranges: list[tuple[int, int]] = field(default_factory=list)  # a bucket's shard: the GETs that read it


class TarShards:
    """Tar (plain, gzip, zstd) and zip shards: the files named, and the shards in the directories named
    (files ending in one of SHARD_SUFFIXES, by name; anything else there is skipped with a warning);
    in a bucket, an s3:// URL ending in one of those names one object, any other the shards directly
    under that prefix. The shards in buckets are all in one bucket."""

    def __init__(self, srcs: Sequence[str], flatten: bool = False, endpoint_url: str | None = None,
                 threads: int | None = None) -> None:
        if not srcs:
            raise UsageError("--expand-tar needs at least one shard")
        remote = [s for s in srcs if s.startswith("s3://")]
        self.client: S3Client | None = None
        if remote:
            from dlfs.ingest.s3 import S3Client
            from dlfs.ingest.s3file import one_bucket

            self.client = S3Client(one_bucket(remote), endpoint_url)
        elif endpoint_url:
            raise UsageError("--endpoint-url goes with s3:// shards")
        self.srcs = list(srcs)
        self.where = srcs[0] if len(srcs) == 1 else f"{srcs[0]} and {len(srcs) - 1} more"
        self.flatten = flatten
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self.shards: list[Shard] = []
        self._tree: Tree | None = None
        self._streaming: tuple[TreeBuilder, list[Shard]] | None = None

    @property
    def streamed(self) -> bool:
        """Whether walk() left the listing to files(): the tree's totals are known only once it is done."""
        return self._streaming is not None

    # --- listing ------------------------------------------------------------------------------
    def walk(self, select: Selection | None) -> Tree:
        shards = find_shards(self.srcs, self.flatten, self.client)
        if shards[0].obj is not None:  # the top directory is the user's, as of now (an s3:// tree's is too)
            b = TreeBuilder(self.where, select, os.getuid(), os.getgid(), time.time_ns())
        else:
            try:
                top = os.stat(self.srcs[0])
            except OSError as exc:
                raise SourceError(f"cannot read {self.srcs[0]}: {exc.strerror}") from None
            b = TreeBuilder(self.where, select, top.st_uid, top.st_gid, top.st_mtime_ns)
        # A shard whose folder the selection leaves out is not even opened.
        shards = [s for s in shards if self.flatten or b.taken(s.folder, True)]
        self.shards = []
        # A list of paths over shards in a bucket is the one case where listing first reads less: a plain
        # tar's headers, then only the members listed. Otherwise each shard is read once, listed as it
        # is packed: the tree grows while files() runs.
        if not (select is not None and select.listed is not None and any(s.obj is not None for s in shards)):
            self._streaming = (b, shards)
            self._tree = Tree(os.fsencode(self.where), b.nodes, b.skipped)
            return self._tree
        firsts: list[int] = []  # each listed shard's first inode, to name the shard of a clash (--flatten)
        for shard, members in in_order(list_shard, shards, self.threads):
            firsts.append(len(b.nodes) + 1)
            self.shards.append(shard)
            b.where = shard.path  # TreeBuilder's messages name the shard
            _add_shard(b, shard, members, self.flatten, lambda ino: self.shards[bisect.bisect(firsts, ino) - 1])
        b.where = self.where
        self._tree = b.finish()
        return self._tree

    # --- reading ------------------------------------------------------------------------------
    def files(self, tree: Tree) -> Iterator[tuple[Node, FileReader]]:
        if tree is not self._tree:
            raise ValueError("files() reads the tree that walk() returned")
        if self._streaming is not None:
            yield from self._streamed(*self._streaming)
            return
        ahead = self._bucket_reads()
        try:
            for shard in self.shards:
                if not shard.wanted:
                    continue
                if shard.codec == "zip":
                    yield from _read_zip(shard)
                elif shard.obj is not None:
                    assert ahead is not None
                    yield from _read_s3_tar(shard, ahead)
                else:
                    yield from _read_tar(shard)
        finally:
            if ahead is not None:
                ahead.close()

    def _streamed(self, b: TreeBuilder, shards: list[Shard]) -> Iterator[tuple[Node, FileReader]]:
        """Each shard read once, in order: its members added to the tree as they come and each wanted one
        handed to the packer straight from the stream. The shards in a bucket (but zips, read at any
        offset) are fetched whole by one read-ahead, the next shard's GETs under way while one is read."""
        firsts: list[int] = []
        ahead = None
        remote = [s for s in shards if s.obj is not None and not s.path.endswith(".zip")]
        if remote:
            from dlfs.ingest.s3 import WINDOW_BYTES, ReadAhead
            from dlfs.ingest.s3file import object_ranges, plan

            assert self.client is not None
            for shard in remote:
                assert shard.obj is not None
                shard.ranges = object_ranges(shard.obj.size)
            total = sum(n for shard in remote for _, n in shard.ranges)
            if total:
                ahead = ReadAhead(self.client, plan([(s.obj, s.ranges) for s in remote if s.obj is not None]),
                                  min(WINDOW_BYTES, total))
        try:
            for shard in shards:
                firsts.append(len(b.nodes) + 1)
                self.shards.append(shard)
                b.where = shard.path
                adder = _ShardAdder(b, shard, self.flatten, lambda ino: self.shards[bisect.bisect(firsts, ino) - 1])
                yield from _stream_shard(shard, adder, ahead if shard.ranges else None)
        finally:
            if ahead is not None:
                ahead.close()
        b.where = self.where
        b.finish()  # a path the list names that no shard held

    def _bucket_reads(self) -> ReadAhead | None:
        """One read-ahead for the tars in the bucket, in the order they are read: each plain tar's wanted
        members (as listed: its ETag keeps them where they were), all of a compressed one."""
        from dlfs.ingest.s3 import WINDOW_BYTES, ReadAhead
        from dlfs.ingest.s3file import member_ranges, object_ranges, plan

        work = []
        for shard in self.shards:
            if shard.obj is None or not shard.wanted or shard.codec == "zip":
                continue
            shard.ranges = (member_ranges([(w.offset, w.size) for w in shard.wanted]) if shard.codec == "tar" else
                            object_ranges(shard.size))
            work.append((shard.obj, shard.ranges))
        total = sum(n for _, ranges in work for _, n in ranges)
        if self.client is None or not total:
            return None
        return ReadAhead(self.client, plan(work), min(WINDOW_BYTES, total))


def find_shards(srcs: Sequence[str], flatten: bool = False, client: S3Client | None = None) -> list[Shard]:
    """The shards `srcs` name, in order: each file named (whatever its name), and the shard files of each
    directory named (not below it), sorted by name; what else a directory holds is skipped with a
    warning; likewise for s3:// URLs through `client`. A shard named twice, or (without `flatten`) two
    shards that would have one folder, are a SourceError."""
    found: list[str] = []
    objects: dict[str, S3Object] = {}
    seen: dict[tuple[int, int], str] = {}
    for src in srcs:
        if src.startswith("s3://"):
            assert client is not None
            for obj in _bucket_shards(client, src):
                if obj.url in objects:
                    raise SourceError(f"{obj.url} is named twice")
                objects[obj.url] = obj
                found.append(obj.url)
            continue
        try:
            st = os.stat(src)
        except OSError as exc:
            raise SourceError(f"cannot read {src}: {exc.strerror}") from None
        if stat.S_ISREG(st.st_mode):
            paths = [(src, st)]
        elif stat.S_ISDIR(st.st_mode):
            paths = _shards_in(src)
        else:
            raise SourceError(f"{src} is not a shard file or a directory of shards")
        for path, pst in paths:
            if (first := seen.setdefault((pst.st_dev, pst.st_ino), path)) != path or path in found:
                raise SourceError(f"{path} is named twice" + (f" (also as {first})" if first != path else ""))
            found.append(path)
    shards: list[Shard] = []
    by_folder: dict[bytes, str] = {}
    for path in found:
        base = os.path.basename(path)
        stem = next((base[: -len(s)] for s in SHARD_SUFFIXES if base.endswith(s) and len(base) > len(s)), base)
        folder = os.fsencode(stem)
        if not flatten and folder in by_folder:
            raise SourceError(f"{by_folder[folder]} and {path} would both be the folder {stem} (each shard's "
                              "members go in a folder named for it; --flatten puts them at the top instead)")
        by_folder[folder] = path
        shards.append(Shard(path, folder, obj=objects.get(path)))
    return shards


def _bucket_shards(client: S3Client, url: str) -> list[S3Object]:
    from dlfs.ingest.s3 import _page_size
    from dlfs.ingest.s3file import head, list_shards, split_url

    _, key = split_url(url)
    if key.endswith(SHARD_SUFFIXES) and not key.endswith("/"):
        return [head(client, key)]
    prefix = key.rstrip("/")
    return list_shards(client, prefix + "/" if prefix else "", SHARD_SUFFIXES, _page_size())


def _shards_in(directory: str) -> list[tuple[str, os.stat_result]]:
    try:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        shards = [(e.path, e.stat()) for e in entries if e.name.endswith(SHARD_SUFFIXES) and e.is_file()]
    except OSError as exc:
        raise SourceError(f"cannot read {exc.filename or directory}: {exc.strerror}") from None
    if not shards:
        raise SourceError(f"{directory} holds no shards (files ending in {', '.join(SHARD_SUFFIXES)})")
    if len(shards) < len(entries):
        taken = {path for path, _ in shards}
        others = [e.name + ("/" if e.is_dir() else "") for e in entries if e.path not in taken]
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        log.warning("skipping %s of %s that are not shards (files ending in %s): %s%s", counted(len(others), "entry", "entries"),
                    directory, ", ".join(SHARD_SUFFIXES), ", ".join(others[:3]), more)
    return shards


def in_order(work: Callable[[T, threading.Event], R], items: Sequence[T], threads: int) -> Iterator[R]:
    """work(item, stop) for each item, in `threads` daemon threads (a walk abandoned on Ctrl-C must not
    keep the process alive), yielded in order; at most LIST_AHEAD results per thread wait to be taken.
    The first error is raised in its turn; `stop` is set once the caller is done, early or not."""
    futures: list[Future[R]] = [Future() for _ in items]
    cond = threading.Condition()
    stop = threading.Event()
    state = {"next": 0, "taken": 0}

    def worker() -> None:
        while True:
            with cond:
                while not stop.is_set() and state["next"] < len(items) and \
                        state["next"] >= state["taken"] + threads * LIST_AHEAD:
                    cond.wait()
                if stop.is_set() or state["next"] >= len(items):
                    return
                i = state["next"]
                state["next"] += 1
            try:
                futures[i].set_result(work(items[i], stop))
            except BaseException as exc:  # handed to the caller, in order
                futures[i].set_exception(exc)

    for k in range(min(threads, len(items))):
        threading.Thread(target=worker, name=f"dlfs-list-shards-{k}", daemon=True).start()
    try:
        for i, fut in enumerate(futures):
            result = fut.result()
            with cond:
                state["taken"] = i + 1
                cond.notify_all()
            yield result
    finally:
        with cond:
            stop.set()
            cond.notify_all()


class _Stopped(Exception):
    """A listing given up because an earlier shard failed."""


def list_shard(shard: Shard, stop: threading.Event) -> tuple[Shard, list[Member]]:
    """Every member of `shard`, in shard order; fills in its codec and what it was when listed."""
    if shard.obj is not None:
        return shard, _list_s3(shard, shard.obj, stop)
    with _open_local(shard, "") as f:
        return shard, _members(shard, f, stop)


def _open_local(shard: Shard, tail: str) -> Any:
    """A local shard opened at its start (the caller closes it); notes its size, mtime, owner and codec."""
    try:
        f = open(shard.path, "rb", buffering=0)
    except OSError as exc:
        raise SourceError(f"cannot read {shard.path}: {exc.strerror}{tail}") from None
    try:
        st = os.fstat(f.fileno())
        shard.size, shard.mtime_ns, shard.uid, shard.gid = st.st_size, st.st_mtime_ns, st.st_uid, st.st_gid
        shard.codec = _codec(shard.path, f)
    except BaseException:
        f.close()
        raise
    return f


def _members(shard: Shard, f: Any, stop: threading.Event) -> list[Member]:
    """The members of `shard` (its codec known), read from `f` at its start."""
    if shard.codec == "zip":
        return _list_zip(shard, f)
    stream = _open_stream(shard, f, "")
    members: list[Member] = []
    for info in _tar_members(shard, stream, ""):
        if stop.is_set():
            raise _Stopped()
        members.append(_tar_member(shard, len(members), info))
    stream.drain()  # a gzip or zstd stream must end as it should: a truncated one is caught here
    return members


def _list_s3(shard: Shard, obj: S3Object, stop: threading.Event) -> list[Member]:
    """A shard in a bucket, listed: a plain tar by its headers and a zip by its central directory (a block
    at a time), a compressed tar read whole (it has no other way to its headers)."""
    from dlfs.ingest.s3 import ReadAhead
    from dlfs.ingest.s3file import LIST_CONNECTIONS, LIST_WINDOW, S3Blocks, S3Stream, object_ranges, plan

    shard.size, shard.mtime_ns, shard.uid, shard.gid = obj.size, obj.mtime_ns, os.getuid(), os.getgid()
    with S3Blocks(obj) as blocks:
        shard.codec = _codec(shard.path, blocks)
        if shard.codec in ("tar", "zip"):
            return _members(shard, blocks, stop)
    ranges = object_ranges(obj.size)
    ahead = ReadAhead(obj.client, plan([(obj, ranges)]), min(LIST_WINDOW, obj.size), LIST_CONNECTIONS)
    try:
        return _members(shard, S3Stream(ahead, obj, ranges), stop)
    finally:
        ahead.close()


def _codec(path: str, f: Any) -> str:
    """What the shard is, by its first bytes (its name may say otherwise); `f` is left at its start."""
    head = f.read(CODEC_BYTES) or b""
    f.seek(0)
    return _codec_of(path, head)


def _codec_of(path: str, head: bytes) -> str:
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    other = ("bzip2" if head.startswith(b"BZh") and head[4:10] == b"1AY&SY" else
             "xz" if head.startswith(b"\xfd7zXZ\x00") else "")
    if other:
        raise SourceError(f"{path} is a {other}-compressed tar: --expand-tar reads plain, gzip and zstd tars, "
                          "and zip")
    return "tar"


def _member_path(shard: Shard, name: str) -> bytes:
    """A member's name as a path inside its shard's folder: a leading / or ./ (and any . or doubled /)
    dropped; a name with .. is refused, as it could point anywhere."""
    raw = name.encode("utf-8", "surrogateescape")
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        raise SourceError(f"{shard.path}: member {name} has .. in its path, which could point outside the "
                          "shard: refused")
    for part in parts:
        why = name_problem(part)
        if why:
            raise SourceError(f"{shard.path}: member {name} cannot be a path: a component {why}")
    return b"/".join(parts)


def _entry_path(shard: Shard, name: str, is_dir: bool) -> bytes:
    """_member_path of a member that is listed as a file or a directory: only a directory may name the
    shard's folder itself (`./`, as `tar -C dir .` writes it); a file with no name is refused, not lost."""
    path = _member_path(shard, name)
    if not path and not is_dir:
        raise SourceError(f"{shard.path}: a member that is not a directory has no name ({name!r}): a damaged "
                          "shard? refused")
    return path


class _ShardAdder:
    """Adds one shard's members to the tree as they come, in shard order (a listing's, or a stream's), and
    says which members' bytes the packer takes. Hard links go to their first name (a link to a link is
    to that one's target). A file the selection leaves out gives its bytes to its first hard link the
    selection takes: such a link comes after the file, so its bytes are `late` (the read pass takes
    them in member order; a stream reads the shard again for them)."""

    def __init__(self, b: TreeBuilder, shard: Shard, flatten: bool, shard_of: Callable[[int], Shard]) -> None:
        self.b, self.shard, self.flatten, self.shard_of = b, shard, flatten, shard_of
        self.prefix = b"" if flatten else shard.folder + b"/"
        self.first: dict[bytes, Member] = {}
        self.nodes: dict[int, Node] = {}  # a member's index -> the node that holds its bytes (or is its symlink)
        self.late: list[Wanted] = []

    def begin(self) -> None:
        """The shard's folder, once the shard's own time and owner are known (it is open, or listed)."""
        shard = self.shard
        if not self.flatten:
            self.b.add(shard.folder, stat.S_IFDIR | 0o755, 0, shard.mtime_ns, shard.uid, shard.gid)

    def _add(self, path: bytes, m: Member) -> Node | None:
        if self.flatten:
            _check_clash(self.b, path, m.kind == DIR, self.shard, self.shard_of)
        return self.b.add(path, m.mode, m.size, m.mtime_ns, m.uid, m.gid, m.target if m.kind == SYM else b"")

    def add(self, m: Member) -> Wanted | None:
        """Add member `m`; its bytes as the packer takes them, if it is a regular file the tree takes."""
        shard, b = self.shard, self.b
        target = m  # what a hard link is a link to
        if m.kind == HARD:
            found = self.first.get(m.target)
            if found is None:
                raise SourceError(f"{shard.path}: {os.fsdecode(m.name)} is a hard link to "
                                  f"{os.fsdecode(m.target)}, which is not before it in the shard")
            if found.kind == DIR:
                raise SourceError(f"{shard.path}: {os.fsdecode(m.name)} is a hard link to a directory")
            target = found
        self.first[m.name] = target
        if not m.name:  # the shard's own top directory ("./"): its metadata goes to the shard's folder
            if m.kind == DIR and not self.flatten:
                b.add(shard.folder, m.mode, 0, m.mtime_ns, m.uid, m.gid)
            return None
        path = self.prefix + m.name
        if m.kind == HARD:
            node = self.nodes.get(target.index)
            if node is not None and target.kind == REG:
                if self.flatten:
                    _check_clash(b, path, False, shard, self.shard_of)
                b.link(path, node)
            elif target.kind != REG:  # a hard link to a symlink or a special file: a copy of it
                self._add(path, Member(m.index, m.name, target.kind, target.mode, target.uid, target.gid,
                                       target.size, target.mtime_ns, target.target))
            else:  # the file was left out: this link, if taken, is the file (its bytes are behind us)
                node = self._add(path, target)
                if node is not None:
                    self.nodes[target.index] = node
                    self.late.append(Wanted(target.index, target.name, target.size, node, target.offset))
            return None
        node = self._add(path, m)
        if node is None:
            return None
        self.nodes[m.index] = node
        return Wanted(m.index, m.name, m.size, node, m.offset) if m.kind == REG else None


    def add_listed(self, members: list[Member]) -> None:
        """Add a listed shard's members, in shard order, and note in `shard.wanted` which members' bytes
        the packer will take (in member order, the late ones among them)."""
        wanted = [w for w in map(self.add, members) if w is not None]
        self.shard.wanted = sorted(wanted + self.late, key=lambda w: w.index) if self.late else wanted


def _add_shard(b: TreeBuilder, shard: Shard, members: list[Member], flatten: bool,
               shard_of: Callable[[int], Shard]) -> None:
    """A listed shard's members added to the tree (see _ShardAdder.add_listed)."""
    adder = _ShardAdder(b, shard, flatten, shard_of)
    adder.begin()
    adder.add_listed(members)


def _check_clash(b: TreeBuilder, path: bytes, is_dir: bool, shard: Shard, shard_of: Callable[[int], Shard]) -> None:
    """With --flatten, a path another shard already holds (a directory may be in both) is a SourceError
    naming both shards; within one shard, TreeBuilder says so."""
    parts = path.split(b"/")
    for k in range(1, len(parts) + 1):
        here = b"/".join(parts[:k])
        node = b.by_path.get(here)
        if node is None:
            return
        both_dirs = stat.S_ISDIR(node.mode) and (is_dir or k < len(parts))
        other = shard_of(node.ino)
        if not both_dirs and other is not shard:
            raise SourceError(f"--flatten: {os.fsdecode(here)} is in both {other.path} and {shard.path} (leave "
                              "--flatten out to keep each shard's members in a folder of its own)")


# --- tar ----------------------------------------------------------------------------------------
class _TarStream(Protocol):
    """A shard's tar bytes, read forward (tarfile seeks only forward when reading headers)."""

    last: bytes  # what the last read() returned: where tarfile stopped, the block it did not take

    def read(self, n: int) -> bytes: ...

    def readinto(self, buf: memoryview) -> int: ...

    def seek(self, pos: int, whence: int = 0) -> int: ...

    def tell(self) -> int: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class _Plain:
    """A plain tar on disk: header reads, seeks over member data, member data read straight into the
    caller's buffer."""

    def __init__(self, f: io.RawIOBase) -> None:
        self.f = f
        self.last = b""

    def read(self, n: int) -> bytes:
        self.last = self.f.read(n) or b""
        return self.last

    def readinto(self, buf: memoryview) -> int:
        return self.f.readinto(buf) or 0

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass  # the file is its opener's


def _inflate(shard: Shard, f: io.RawIOBase, tail: str) -> Iterator[bytes]:
    """The decompressed bytes of a gzip or zstd stream (several members or frames one after the other),
    in pieces; a stream that ends early or does not decompress is a SourceError."""
    import zstandard  # only where compressed shards are read

    gzip = shard.codec == "gzip"

    def decompressor() -> Any:
        return zlib.decompressobj(zlib.MAX_WBITS | 16) if gzip else zstandard.ZstdDecompressor().decompressobj()

    def error(what: str) -> SourceError:
        return SourceError(f"{shard.path}: {what} (a damaged or truncated shard?){tail}")

    d, done = decompressor(), False  # done: the current gzip member or zstd frame is complete
    pending = b""  # compressed bytes read but not yet decompressed
    feed = PIECE  # zstd input at a time: less after a burst (a run of zeros inflates a thousandfold)
    while True:
        if not pending:
            pending = f.read(PIECE) or b""
            if not pending:
                if not done:
                    raise error(f"the {shard.codec} stream ends early")
                return
        if done:  # another gzip member or zstd frame follows (gzip allows zeros between)
            pending = pending.lstrip(b"\0") if gzip else pending
            if not pending:
                continue
            d, done = decompressor(), False
        try:
            if gzip:
                data = d.decompress(pending, PIECE)
                done = d.eof
                pending = d.unused_data if done else d.unconsumed_tail
            else:
                data = d.decompress(pending[:feed])
                pending = pending[feed:]
                done = d.eof
                if done:
                    pending = d.unused_data + pending
                feed = max(1024, feed // 16) if len(data) > 16 * PIECE else min(PIECE, feed * 2)
        except (zlib.error, zstandard.ZstdError) as exc:
            raise error(f"the {shard.codec} stream does not decompress ({exc})") from None
        if data:
            yield data


def _read_ahead(shard: Shard, f: io.RawIOBase, tail: str, depth: int = READ_AHEAD) -> Iterator[bytes]:
    """_inflate(shard, f, tail) in a thread of its own, up to `depth` pieces ahead of the caller (so that
    decompression overlaps packing); an error comes in its turn. Closing this stops the thread, which
    reads a duplicate of `f`'s descriptor: closing `f` then never closes a descriptor that the thread
    is reading, nor lets it read another file opened under the same number."""
    q: queue.Queue[tuple[bytes, BaseException | None]] = queue.Queue(depth)
    stop = threading.Event()
    own = open(os.dup(f.fileno()), "rb", buffering=0)  # the thread closes it

    def put(item: tuple[bytes, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        with own:
            try:
                for piece in _inflate(shard, own, tail):
                    if not put((piece, None)):
                        return
                put((b"", None))
            except BaseException as exc:  # handed to the reader, in its turn
                put((b"", exc))

    threading.Thread(target=make, name=f"dlfs-inflate-{os.path.basename(shard.path)}", daemon=True).start()
    try:
        while True:
            piece, exc = q.get()
            if exc is not None:
                raise exc
            if not piece:
                return
            yield piece
    finally:
        stop.set()


class _Inflated:
    """Decompressed tar bytes, from pieces, read forward only."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self.pieces = pieces
        self.out = memoryview(b"")  # decompressed, not yet read
        self.pos = 0  # bytes read (or skipped) so far
        self.last = b""

    def _fill(self) -> bool:
        """The next piece into `out`; False at the end of the stream."""
        piece = next(self.pieces, b"")
        self.out = memoryview(piece)
        return bool(piece)

    def read(self, n: int) -> bytes:
        parts = []
        while n > 0 and (self.out or self._fill()):
            take = self.out[:n]
            parts.append(take)
            self.out = self.out[len(take) :]
            self.pos += len(take)
            n -= len(take)
        self.last = b"".join(parts)
        return self.last

    def readinto(self, buf: memoryview) -> int:
        if not self.out and not self._fill():
            return 0
        n = min(len(buf), len(self.out))
        buf[:n] = self.out[:n]
        self.out = self.out[n:]
        self.pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != io.SEEK_SET or pos < self.pos:
            raise io.UnsupportedOperation("a compressed shard is read forward only")
        while self.pos < pos and (self.out or self._fill()):
            skip = min(pos - self.pos, len(self.out))
            self.out = self.out[skip:]
            self.pos += skip
        return self.pos

    def tell(self) -> int:
        return self.pos

    def drain(self) -> None:
        while self._fill():
            self.pos += len(self.out)
        self.out = memoryview(b"")

    def close(self) -> None:
        """Stop the read-ahead thread, if there is one (before the file it reads is closed)."""
        close = getattr(self.pieces, "close", None)
        if close is not None:
            close()


def _open_stream(shard: Shard, f: io.RawIOBase, tail: str, ahead: bool = False) -> _TarStream:
    """The tar bytes of `shard` (open as `f`); with `ahead`, a compressed shard is decompressed in a
    thread of its own, ahead of the reader."""
    if shard.codec == "tar":
        return _Plain(f)
    return _Inflated(_read_ahead(shard, f, tail) if ahead else _inflate(shard, f, tail))


def _tar_members(shard: Shard, stream: _TarStream, tail: str) -> Iterator[tarfile.TarInfo]:
    """The members of a tar stream, in order; a damaged or truncated tar is a SourceError."""
    last: str | None = None
    try:
        tf = tarfile.TarFile(fileobj=stream, mode="r",  # type: ignore[arg-type]  # read, seek and tell are all it uses
                             encoding="utf-8", errors="surrogateescape")
        while True:
            info = tf.next()
            if info is None:
                break
            tf.members.clear()  # type: ignore[attr-defined]  # kept for extraction; a million would weigh
            last = info.name
            yield info
    except tarfile.ReadError as exc:
        if last is None:
            raise SourceError(f"{shard.path} is not a tar or zip file ({exc}){tail}") from None
        if str(exc) == "unexpected end of data":
            raise SourceError(f"{shard.path} ends inside member {last} (a truncated shard?){tail}") from None
        raise SourceError(f"{shard.path}: a damaged tar after member {last} ({exc}){tail}") from None
    # tarfile also stops, quietly, at a header that does not parse: only zeros (or nothing) end a tar.
    if stream.last.strip(b"\0"):
        raise SourceError(f"{shard.path}: a damaged tar header at byte {tf.offset}, after member {last} "
                          f"(a corrupt shard?){tail}")


def _tar_member(shard: Shard, index: int, info: tarfile.TarInfo) -> Member:
    name = _entry_path(shard, info.name, info.isdir())
    perm = info.mode & 0o7777
    mtime_ns = _tar_mtime(info)
    if info.isreg():
        if info.issparse():
            raise SourceError(f"{shard.path}: {info.name} is a sparse file, which --expand-tar does not read "
                              "(make the shard without --sparse)")
        kind, mode = REG, stat.S_IFREG | perm
    elif info.isdir():
        kind, mode = DIR, stat.S_IFDIR | perm
    elif info.issym():
        return Member(index, name, SYM, stat.S_IFLNK | perm, info.uid, info.gid, 0, mtime_ns,
                      info.linkname.encode("utf-8", "surrogateescape"))
    elif info.islnk():
        return Member(index, name, HARD, stat.S_IFREG | perm, info.uid, info.gid, 0, mtime_ns,
                      _member_path(shard, info.linkname))
    else:  # a device, fifo, or a type tar does not know: skipped with a warning by the TreeBuilder
        kind = OTHER
        mode = perm | (stat.S_IFCHR if info.ischr() else stat.S_IFBLK if info.isblk() else
                       stat.S_IFIFO if info.isfifo() else 0)
    return Member(index, name, kind, mode, info.uid, info.gid, info.size if kind == REG else 0, mtime_ns,
                  offset=info.offset_data)


def _tar_mtime(info: tarfile.TarInfo) -> int:
    """The mtime in ns: a pax header's to the nanosecond, else the header's whole seconds."""
    exact = info.pax_headers.get("mtime")
    if exact is not None:
        try:
            return int(Decimal(exact) * 1_000_000_000)
        except InvalidOperation:
            pass
    return int(info.mtime) * 1_000_000_000


def _open_again(shard: Shard) -> Any:
    """The shard opened to be read, if it is still as it was listed (one in a bucket: every GET of it
    checks its ETag)."""
    if shard.obj is not None:
        from dlfs.ingest.s3file import S3Blocks

        return S3Blocks(shard.obj)
    try:
        f = open(shard.path, "rb", buffering=0)  # the caller closes it
    except OSError as exc:
        raise SourceError(f"cannot read {shard.path}: {exc.strerror}{NOTHING}") from None
    try:
        _check_unchanged(shard, f)
    except BaseException:
        f.close()
        raise
    return f


def _check_unchanged(shard: Shard, f: Any) -> None:
    if shard.obj is not None:
        return  # its ETag was checked by every GET
    st = os.fstat(f.fileno())
    if (st.st_size, st.st_mtime_ns) != (shard.size, shard.mtime_ns):
        raise SourceError(f"{shard.path} changed while being ingested (modified after it was listed){NOTHING}")


def _changed(shard: Shard, name: bytes) -> SourceError:
    return SourceError(f"{shard.path} changed while being ingested ({os.fsdecode(name)} is not as listed){NOTHING}")


def _stream_shard(shard: Shard, adder: _ShardAdder, ahead: ReadAhead | None) -> Iterator[tuple[Node, FileReader]]:
    """One shard, listed and read in one pass (see TarShards._streamed); `ahead` holds its ranges if it is
    in a bucket (and not a zip). A zip is listed from its directory, then read; a file whose bytes a
    later hard link takes is read in a second pass."""
    if shard.obj is not None:
        from dlfs.ingest.s3file import S3Blocks, S3Stream

        obj = shard.obj
        shard.size, shard.mtime_ns, shard.uid, shard.gid = obj.size, obj.mtime_ns, os.getuid(), os.getgid()
        adder.begin()
        with S3Blocks(obj) as blocks:
            shard.codec = _codec_of(shard.path, blocks.head(CODEC_BYTES))  # not a block: the read-ahead has it
            if shard.codec == "zip":
                if ahead is not None:  # named as something else: its planned GETs are let go
                    S3Stream(ahead, obj, shard.ranges).close()
                adder.add_listed(_list_zip(shard, blocks))
        if shard.codec != "zip" and (ahead is None or not shard.ranges):
            # An empty object (no ranges to fetch): tar says what it makes of nothing.
            yield from _members_as_read(shard, _Plain(io.BytesIO()), adder)  # type: ignore[arg-type]
        elif shard.codec != "zip":
            assert ahead is not None
            raw = S3Stream(ahead, obj, shard.ranges)
            read = False
            try:
                stream: _TarStream = raw if shard.codec == "tar" else _Inflated(_inflate(shard, raw, NOTHING))  # type: ignore[arg-type, assignment]
                yield from _members_as_read(shard, stream, adder)
                read = True
            finally:
                raw.close(rest=read)
    else:
        with _open_local(shard, NOTHING) as f:
            adder.begin()
            if shard.codec == "zip":
                adder.add_listed(_list_zip(shard, f))
            else:
                stream = _open_stream(shard, f, NOTHING, ahead=True)
                try:
                    yield from _members_as_read(shard, stream, adder)
                finally:
                    stream.close()
                _check_unchanged(shard, f)
    if shard.codec == "zip":
        yield from _read_zip(shard)
    elif adder.late:  # rare: a file left out, a hard link to it taken
        shard.wanted = adder.late
        yield from _read_tar(shard)


def _members_as_read(shard: Shard, stream: _TarStream, adder: _ShardAdder) -> Iterator[tuple[Node, FileReader]]:
    """Each member of a tar stream added to the tree as its header is read; a wanted one's bytes handed
    to the packer there and then (tarfile skips whatever of them it does not read)."""
    for index, info in enumerate(_tar_members(shard, stream, NOTHING)):
        want = adder.add(_tar_member(shard, index, info))
        if want is not None:
            yield want.node, _TarMember(stream, want.size, f"{shard.path}: {info.name}",
                                        f"{shard.path} ends inside member {info.name} (a truncated shard?){NOTHING}")
    stream.drain()  # a gzip or zstd stream must end as it should: a truncated one is caught here


def _read_tar(shard: Shard) -> Iterator[tuple[Node, FileReader]]:
    """The wanted members of a tar shard, each as a reader of the stream (read in order, or not at all);
    a shard in a bucket through S3Blocks (only a second pass for a few members reads one so)."""
    with _open_again(shard) as f:
        stream = _open_stream(shard, f, NOTHING, ahead=shard.obj is None)
        try:
            yield from _wanted_in(shard, stream)
        finally:
            stream.close()
        _check_unchanged(shard, f)


def _wanted_in(shard: Shard, stream: _TarStream) -> Iterator[tuple[Node, FileReader]]:
    """The wanted members, found by reading the tar's headers again (each must be as listed)."""
    wanted = iter(shard.wanted)
    want: Wanted | None = next(wanted)
    for index, info in enumerate(_tar_members(shard, stream, NOTHING)):
        assert want is not None
        if index < want.index:
            continue
        if _member_path(shard, info.name) != want.name or not info.isreg() or info.size != want.size:
            raise _changed(shard, want.name)
        yield want.node, _TarMember(stream, want.size, f"{shard.path}: {info.name}")
        want = next(wanted, None)
        if want is None:
            return
    if want is not None:
        raise _changed(shard, want.name)


def _read_s3_tar(shard: Shard, ahead: ReadAhead) -> Iterator[tuple[Node, FileReader]]:
    """The wanted members of a tar in a bucket, from its ranges in `ahead`: a plain tar's from where the
    listing found them (every GET has the listed ETag, so they are still there), a compressed one's by
    decompressing it again, in this thread (the read-ahead already overlaps the network)."""
    from dlfs.ingest.s3file import S3Stream

    assert shard.obj is not None
    stream = S3Stream(ahead, shard.obj, shard.ranges)
    read = False
    try:
        if shard.codec == "tar":
            for want in shard.wanted:
                stream.seek(want.offset)
                yield want.node, _TarMember(stream, want.size, f"{shard.path}: {os.fsdecode(want.name)}")
        else:
            yield from _wanted_in(shard, _Inflated(_inflate(shard, stream, NOTHING)))  # type: ignore[arg-type]
        read = True
    finally:
        stream.close(rest=read)  # what is left of its ranges is let go: the next shard's come next


class _TarMember:
    """One member's bytes, straight from the shard's stream into the packer's buffer."""

    def __init__(self, stream: _TarStream, size: int, name: str, short: str = "") -> None:
        self.stream, self.left, self.name = stream, size, name
        # What a shard that ends inside the member is: listed whole before, it was changed since.
        self.short = short or (f"{name}: the shard ends inside this member (changed or truncated after it was "
                               f"listed){NOTHING}")

    def readinto(self, buf: memoryview) -> int:
        if not self.left:
            return 0
        n = self.stream.readinto(buf[: self.left] if len(buf) > self.left else buf)
        if not n:
            raise SourceError(self.short)
        self.left -= n
        return n

    def finish(self) -> None:
        if self.left:
            raise SourceError(f"{self.name}: {self.left} bytes were not read{NOTHING}")

    def close(self) -> None:
        pass


# --- zip ----------------------------------------------------------------------------------------
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature ... name length, extra length: 30 bytes


def _list_zip(shard: Shard, f: io.RawIOBase) -> list[Member]:
    try:
        zf = zipfile.ZipFile(f)  # type: ignore[arg-type]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise SourceError(f"{shard.path} is not a readable zip file ({exc})") from None
    members = []
    with zf:
        for index, zi in enumerate(zf.infolist()):
            attr = zi.external_attr >> 16 if zi.create_system == 3 else 0  # unix st_mode, where it was made so
            name = _entry_path(shard, zi.filename, zi.is_dir() or stat.S_ISDIR(attr))
            if zi.flag_bits & 0x1:
                raise SourceError(f"{shard.path}: {zi.filename} is encrypted, which --expand-tar does not read")
            if zi.header_offset + _LOCAL_HEADER.size + zi.compress_size > shard.size:
                raise SourceError(f"{shard.path}: {zi.filename} lies past the end of the file (a truncated shard?)")
            extra = _zip_extra(zi.extra)
            uid, gid = _zip_owner(extra.get(0x7875), shard)
            mtime_ns = _zip_mtime(zi, extra.get(0x5455))
            if zi.is_dir() or stat.S_ISDIR(attr):
                members.append(Member(index, name, DIR, stat.S_IFDIR | (attr & 0o7777 or 0o755), uid, gid, 0,
                                      mtime_ns))
            elif stat.S_ISLNK(attr):  # Info-ZIP keeps a symlink's target as its data
                if zi.file_size > 4096:
                    raise SourceError(f"{shard.path}: symlink {zi.filename} has a {zi.file_size}-byte target")
                target = _zip_read(shard, zf, zi, "")
                members.append(Member(index, name, SYM, stat.S_IFLNK | (attr & 0o7777 or 0o777), uid, gid, 0,
                                      mtime_ns, target))
            elif stat.S_IFMT(attr) not in (0, stat.S_IFREG):
                members.append(Member(index, name, OTHER, attr, uid, gid, 0, mtime_ns))
            else:
                members.append(Member(index, name, REG, stat.S_IFREG | (attr & 0o7777 or 0o644), uid, gid,
                                      zi.file_size, mtime_ns))
    return members


def _zip_read(shard: Shard, zf: zipfile.ZipFile, zi: zipfile.ZipInfo, tail: str) -> bytes:
    try:
        return zf.read(zi)
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError) as exc:
        raise SourceError(f"{shard.path}: cannot read {zi.filename} ({exc}){tail}") from None


def _zip_extra(extra: bytes) -> dict[int, bytes]:
    """A zip entry's extra fields by id."""
    out, pos = {}, 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        out[tag] = extra[pos + 4 : pos + 4 + size]
        pos += 4 + size
    return out


def _zip_owner(ux: bytes | None, shard: Shard) -> tuple[int, int]:
    """The owner Info-ZIP records (its "ux" field), else the shard file's."""
    if ux and ux[0] == 1 and len(ux) >= 3:
        n = ux[1]
        m = ux[2 + n] if len(ux) > 2 + n else 0
        if n and m and len(ux) >= 3 + n + m:
            return int.from_bytes(ux[2 : 2 + n], "little"), int.from_bytes(ux[3 + n : 3 + n + m], "little")
    return shard.uid, shard.gid


def _zip_mtime(zi: zipfile.ZipInfo, ut: bytes | None) -> int:
    """The mtime in ns: the extended timestamp (UTC seconds) where there is one, else the entry's local time."""
    if ut and ut[0] & 1 and len(ut) >= 5:
        return int.from_bytes(ut[1:5], "little", signed=True) * 1_000_000_000
    try:
        return int(time.mktime((*zi.date_time, 0, 0, -1))) * 1_000_000_000
    except (OverflowError, ValueError):
        return 0


def _read_zip(shard: Shard) -> Iterator[tuple[Node, FileReader]]:
    """The wanted members of a zip shard: a stored one straight from the file into the packer's buffer,
    a compressed one through zipfile."""
    with _open_again(shard) as f:
        try:
            zf = zipfile.ZipFile(f)  # type: ignore[arg-type]
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise SourceError(f"{shard.path} changed while being ingested (it no longer reads as a zip: {exc})"
                              f"{NOTHING}") from None
        with zf:
            infos = zf.infolist()
            for want in shard.wanted:
                zi = infos[want.index] if want.index < len(infos) else None
                if zi is None or _member_path(shard, zi.filename) != want.name or zi.file_size != want.size:
                    raise _changed(shard, want.name)
                name = f"{shard.path}: {zi.filename}"
                reader: FileReader
                if zi.compress_type == zipfile.ZIP_STORED:
                    pread = f.pread if shard.obj is not None else partial(_pread_fd, f.fileno())
                    head = bytearray(_LOCAL_HEADER.size)
                    del head[pread(memoryview(head), zi.header_offset):]
                    if len(head) < _LOCAL_HEADER.size or not head.startswith(b"PK\x03\x04"):
                        raise _changed(shard, want.name)
                    name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
                    start = zi.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                    reader = _StoredZipMember(pread, start, zi.file_size, zi.CRC, name)
                else:
                    try:
                        reader = _ZipMember(zf.open(zi), zi.file_size, name)
                    except (zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
                        raise SourceError(f"{name}: cannot read it ({exc}){NOTHING}") from None
                yield want.node, reader
        _check_unchanged(shard, f)


def _pread_fd(fd: int, view: memoryview, pos: int) -> int:
    return os.preadv(fd, [view], pos)


class _StoredZipMember:
    """A member stored as is: read from its place in the file, its CRC checked at the end."""

    def __init__(self, pread: Callable[[memoryview, int], int], start: int, size: int, crc: int, name: str) -> None:
        self.pread, self.pos, self.left, self.crc, self.name = pread, start, size, crc, name
        self.got = 0

    def readinto(self, buf: memoryview) -> int:
        if not self.left:
            return 0
        view = buf[: self.left] if len(buf) > self.left else buf
        try:
            n = self.pread(view, self.pos)
        except OSError as exc:
            raise SourceError(f"cannot read {self.name}: {exc.strerror}{NOTHING}") from None
        if not n:
            raise SourceError(f"{self.name}: the shard ends inside this member (truncated?){NOTHING}")
        self.got = zlib.crc32(view[:n], self.got)
        self.pos += n
        self.left -= n
        return n

    def finish(self) -> None:
        if self.got != self.crc:
            raise SourceError(f"{self.name}: its bytes fail their CRC (a corrupt shard?){NOTHING}")

    def close(self) -> None:
        pass


class _ZipMember:
    """A compressed member, as zipfile inflates it (its CRC is checked as its last bytes are read)."""

    def __init__(self, f: IO[bytes], size: int, name: str) -> None:
        self.f, self.left, self.name = f, size, name

    def readinto(self, buf: memoryview) -> int:
        if not self.left:
            return 0
        try:
            data = self.f.read(min(len(buf), self.left))
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
            raise SourceError(f"{self.name}: cannot read it ({exc}){NOTHING}") from None
        if not data:
            raise SourceError(f"{self.name}: the shard ends inside this member (truncated?){NOTHING}")
        buf[: len(data)] = data
        self.left -= len(data)
        return len(data)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.f.close()


__all__ = ["SHARD_SUFFIXES", "TarShards", "find_shards"]
