"""S3 objects read as files: the shards of `dlfs ingest --expand-tar s3://BUCKET/PREFIX/`.

Two ways to read one. S3Blocks gives random access through a few cached blocks fetched by ranged GETs:
what listing a plain tar needs (it seeks from one member's header to the next, skipping the data) and
what a zip needs (its central directory is at the end). S3Stream reads forward through ranges queued
in a ReadAhead that fetches them in parallel into its ring (dlfs/ingest/s3.py): the bytes of the
members to pack, or all of a compressed shard. Every GET carries If-Match with the ETag listed, so a
shard rewritten during the ingest fails it by name, as an object of an s3:// tree does.
"""

from __future__ import annotations

import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import botocore.exceptions

from dlfs.errors import SourceError, UsageError
from dlfs.ingest.s3 import RANGE_SIZE, ReadAhead, S3Client, _code, _Range, _Stopped, mtime_ns, parse_url
from dlfs.units import counted

log = logging.getLogger(__name__)

BLOCK = 8 << 20  # bytes per GET of random access: a tar of small members is listed a block at a time
BLOCKS_KEPT = 4  # blocks cached per file: a zip's central directory and the member being read
GAP = 1 << 20  # wanted members this close together are one GET (the bytes between cost less than a request)
LIST_CONNECTIONS = 3  # parallel GETs per compressed shard being listed (several are listed at once)
LIST_WINDOW = 24 << 20  # ... into a ring of this many bytes


@dataclass(frozen=True)
class S3Object:
    """One object, as listed: every read of it must find this ETag."""

    client: S3Client
    key: str
    etag: str
    size: int
    mtime_ns: int

    @property
    def url(self) -> str:
        return f"s3://{self.client.bucket}/{self.key}"


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of `s3://BUCKET/KEY`: the key as written (a trailing / names a prefix)."""
    bucket, _ = parse_url(url)  # the bucket's name checked
    return bucket, url[len("s3://") + len(bucket) + 1:]


def _failed(client: S3Client, exc: BaseException, url: str) -> BaseException:
    err = client.error(exc, url)
    return exc if err is None else err


def head(client: S3Client, key: str) -> S3Object:
    """The object at `key` (a SourceError naming it if there is none, or it cannot be read)."""
    url = f"s3://{client.bucket}/{key}"
    try:
        got = client.retrying(f"HEAD {url}", lambda: client.client.head_object(Bucket=client.bucket, Key=key))
    except botocore.exceptions.ClientError as exc:
        code, status = _code(exc)
        if code in ("404", "NoSuchKey", "NotFound") or status == 404:
            raise SourceError(f"cannot read {url}: no such object") from None
        raise _failed(client, exc, url) from None
    except Exception as exc:
        raise _failed(client, exc, url) from None
    return S3Object(client, key, got.get("ETag", ""), int(got["ContentLength"]), mtime_ns(got["LastModified"]))


def list_shards(client: S3Client, prefix: str, suffixes: tuple[str, ...], page_size: int) -> list[S3Object]:
    """The shards directly under `prefix` (a directory: '' or ending in /), in key order: the objects
    whose names end in one of `suffixes` (not those in deeper "directories"); what else is there is
    skipped with a warning, and a prefix with no shards is a SourceError."""
    shards: list[S3Object] = []
    others: list[str] = []
    for page in client.list_pages(prefix, page_size):
        for obj in page:
            name = obj["Key"][len(prefix):]
            top, slash, _ = name.partition("/")
            if slash:
                if not others or others[-1] != top + "/":
                    others.append(top + "/")
            elif name.endswith(suffixes) and len(name) > min(len(s) for s in suffixes if name.endswith(s)):
                shards.append(S3Object(client, obj["Key"], obj.get("ETag", ""), int(obj["Size"]),
                                       mtime_ns(obj["LastModified"])))
            elif name:
                others.append(name)
    where = f"s3://{client.bucket}/{prefix}"
    if not shards:
        raise SourceError(f"{where} holds no shards (objects directly under it ending in {', '.join(suffixes)})")
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        log.warning("skipping %s of %s that are not shards (objects ending in %s): %s%s", counted(len(others), "entry", "entries"), where,
                    ", ".join(suffixes), ", ".join(others[:3]), more)
    return shards


class S3Blocks(io.RawIOBase):
    """An object read at any offset: BLOCK-sized pieces fetched as they are first needed and the last
    BLOCKS_KEPT kept; a read of a block or more goes straight into the caller's buffer."""

    def __init__(self, obj: S3Object) -> None:
        super().__init__()
        self.obj = obj
        self.pos = 0
        self.blocks: OrderedDict[int, bytearray] = OrderedDict()
        self.stop = threading.Event()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        if base + pos < 0:
            raise OSError(22, "seek before the start of the object")
        self.pos = base + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _get(self, start: int, view: memoryview) -> None:
        try:
            self.obj.client.get_range(self.obj.key, self.obj.etag, start, view, self.stop)
        except _Stopped:
            raise SourceError(f"the read of {self.obj.url} was stopped") from None
        except Exception as exc:
            raise _failed(self.obj.client, exc, self.obj.url) from None

    def head(self, n: int) -> bytes:
        """The object's first `n` bytes (fewer if it is shorter), in one GET of their own."""
        data = bytearray(min(n, self.obj.size))
        if data:
            self._get(0, memoryview(data))
        return bytes(data)

    def _block(self, b: int) -> bytearray:
        data = self.blocks.get(b)
        if data is None:
            start = b * BLOCK
            data = bytearray(min(BLOCK, self.obj.size - start))
            self._get(start, memoryview(data))
            self.blocks[b] = data
            while len(self.blocks) > BLOCKS_KEPT:
                self.blocks.popitem(last=False)
        else:
            self.blocks.move_to_end(b)
        return data

    def pread(self, buf: memoryview, pos: int) -> int:
        """Bytes at `pos` into `buf`, as many as there are (0 at the end)."""
        n = max(0, min(len(buf), self.obj.size - pos))
        if n >= BLOCK:  # big: one GET of its own, into the caller's buffer
            self._get(pos, buf[:n])
            return n
        done = 0
        while done < n:
            b, at = divmod(pos + done, BLOCK)
            data = self._block(b)
            k = min(n - done, len(data) - at)
            buf[done:done + k] = memoryview(data)[at:at + k]
            done += k
        return n

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        n = self.pread(memoryview(buf).cast("B"), self.pos)
        self.pos += n
        return n

    def close(self) -> None:
        self.stop.set()
        self.blocks.clear()
        super().close()


def member_ranges(spans: list[tuple[int, int]], range_size: int = RANGE_SIZE) -> list[tuple[int, int]]:
    """The GETs (start, length) that fetch the byte spans (start, length; ascending, not overlapping) of
    the members to pack: spans less than GAP apart are joined, and no GET is over `range_size`."""
    joined: list[list[int]] = []
    for start, length in spans:
        if not length:
            continue
        if joined and start - joined[-1][1] < GAP:
            joined[-1][1] = start + length
        else:
            joined.append([start, start + length])
    return [(s, min(range_size, end - s)) for start, end in joined for s in range(start, end, range_size)]


def object_ranges(size: int, range_size: int = RANGE_SIZE) -> list[tuple[int, int]]:
    """The GETs that fetch a whole object, in order."""
    return [(s, min(range_size, size - s)) for s in range(0, size, range_size)]


def plan(work: list[tuple[S3Object, list[tuple[int, int]]]]) -> Iterator[_Range]:
    """The ranges of several objects, one after the other, for one ReadAhead."""
    for obj, ranges in work:
        for start, length in ranges:
            yield _Range(obj.key, obj.etag, start, length)


class S3Stream:
    """An object read forward through the `ranges` queued for it in `ahead` (taken in turn, however
    many other objects' ranges the same ReadAhead holds). A read may start anywhere inside a range;
    seek() moves forward only, over what is not needed. close() takes and lets go of what is left, so
    the next object's ranges come next."""

    def __init__(self, ahead: ReadAhead, obj: S3Object, ranges: list[tuple[int, int]]) -> None:
        self.ahead, self.obj = ahead, obj
        self.left = len(ranges)  # ranges not yet taken
        self.cur: _Range | None = None
        self.pos = 0
        self.last = b""  # what the last read() gave (tarfile's stopping point, as _TarStream has it)

    def _current(self) -> _Range | None:
        """The range that holds `pos`: ranges wholly before it are let go; None past the last one."""
        while True:
            cur = self.cur
            if cur is not None and self.pos < cur.start + cur.length:
                if self.pos < cur.start:
                    raise AssertionError(f"{self.obj.url}: byte {self.pos} was not planned to be fetched")
                return cur
            if cur is not None:
                self.cur = None
                self.ahead.release(cur)
            if not self.left:
                return None
            self.cur = self.ahead.take()
            self.left -= 1

    def readinto(self, buf: memoryview) -> int:
        cur = self._current()
        if cur is None:
            return 0
        at = self.pos - cur.start
        n = min(len(buf), cur.length - at)
        buf[:n] = self.ahead.view[cur.off + at:cur.off + at + n]
        self.pos += n
        return n

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = self.readinto(view[got:])
            if not k:
                break
            got += k
        del view
        self.last = bytes(out[:got])
        return self.last

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET or pos < self.pos:
            raise io.UnsupportedOperation("a shard in a bucket is read forward only")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def drain(self) -> None:
        pass  # nothing to check: every GET had the listed ETag

    def close(self, rest: bool = True) -> None:
        """Done with the object; with `rest`, what is left of its ranges is taken and let go (so the next
        object's come next: each still checks the ETag); without, the read is being given up."""
        if not rest:
            self.cur, self.left = None, 0
            return
        if self.cur is not None:
            cur, self.cur = self.cur, None
            self.ahead.release(cur)
        while self.left:
            self.left -= 1
            self.ahead.release(self.ahead.take())


def one_bucket(urls: list[str]) -> str:
    buckets = sorted({split_url(u)[0] for u in urls})
    if len(buckets) > 1:
        raise UsageError(f"the shards of one ingest are in one bucket ({', '.join(buckets)} given)")
    return buckets[0]


__all__ = ["BLOCK", "LIST_CONNECTIONS", "LIST_WINDOW", "S3Blocks", "S3Object", "S3Stream", "head", "list_shards",
           "member_ranges", "object_ranges", "one_bucket", "plan", "split_url"]
