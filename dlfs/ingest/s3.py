"""An S3 bucket prefix as an ingest source: `dlfs ingest s3://BUCKET[/PREFIX] --name N`.

The listing is read page by page into a TreeBuilder (keys split into directories at `/`), keeping of
each object only its tree node and its ETag. The objects are then read in tree order by CONNECTIONS
threads doing ranged GETs into one ring buffer of at most WINDOW_BYTES (the read-ahead window), so the
packer seldom waits and memory stays bounded whatever the number or size of the objects. Every GET carries If-Match with
the ETag listed (and the answer's ETag is checked too): an object rewritten after the listing fails the
ingest by name, and nothing is published. Transient failures (resets, timeouts, 5xx, SlowDown) are
retried with exponential back-off and jitter, a bounded number of times within a bounded time;
credentials, permissions and a missing bucket fail at once, in one line.

Endpoint, credentials, region and profile are boto3's (`--endpoint-url`, else AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL; AWS_ACCESS_KEY_ID..., AWS_PROFILE, ~/.aws/config and credentials, instance roles).
Where none are found, requests go unsigned, which public buckets allow. (boto3 for that chain, which
is complete; obstore, measured against it, read no faster and used as much CPU per byte.)
"""

from __future__ import annotations

import calendar
import http.client
import itertools
import logging
import os
import queue
import random
import re
import stat
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

# The venv sees the system's site-packages (for pyverbs: see the Makefile), and with them the system's
# pyOpenSSL, which botocore imports through urllib3.contrib.pyopenssl; against a newer cryptography its
# import warns (cryptography 51: "DSA is deprecated"), which would print under every S3 command's answer.
warnings.filterwarnings("ignore", module=r"OpenSSL(\.|$)")

import boto3
import botocore.exceptions
import urllib3.exceptions
from botocore import UNSIGNED
from botocore.config import Config

from dlfs.errors import DlfsError, SourceError, UsageError
from dlfs.format.index import name_problem
from dlfs.ingest.walk import Node, PathClash, Selection, Tree, TreeBuilder

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECTIONS = 16  # parallel GETs: a remote store's latency needs many for small objects (a local one: as fast with 8)
RANGE_SIZE = 8 << 20  # bytes per GET: a bigger object is several GETs, fetched in parallel
WINDOW_BYTES = 128 << 20  # the read-ahead ring: bytes of ranges being fetched, or fetched and not yet packed
WINDOW_RANGES = 256  # ... and ranges, at most: enough small objects to keep every connection busy
PAGE_SIZE = 1000  # keys per listing request (S3's most); DLFS_S3_PAGE_SIZE makes it smaller, for tests
READ_PIECE = 1 << 20  # bytes per read from a response body (urllib3 reads into a temporary of this size)

RETRY_ATTEMPTS = 10  # tries of one request before the ingest fails
RETRY_BASE = 0.1  # seconds: the back-off before try n is uniform in [0, min(RETRY_CAP, RETRY_BASE * 2**n)]
RETRY_CAP = 5.0
RETRY_TOTAL = 120.0  # seconds one request may keep failing before the ingest fails, whatever the tries left
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0  # seconds without a byte from the server: the try fails (and is retried)
RANGE_DEADLINE = 900.0  # seconds the packer waits for one range before it gives up (a bug, or a dead server)
JOIN_TIMEOUT = 5.0  # seconds close() waits for each fetch thread (a GET in flight ends within READ_TIMEOUT)

# Errors S3 (and S3-compatible stores) give for a moment of overload or an internal failure.
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
    "TooManyRequestsException", "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "OperationAborted",
})
# The credentials themselves were refused (as opposed to refused this bucket).
CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
    "InvalidClientTokenId", "UnrecognizedClientException",
})
TRANSIENT_ERRORS = (
    botocore.exceptions.HTTPClientError,  # connection closed, read timeout, broken response stream
    botocore.exceptions.ConnectionError,  # cannot connect (yet), connect timeout
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)
BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class _Stopped(Exception):
    """A fetch thread's way out once the read is closed."""


class _Truncated(Exception):
    """A response body ended before its length: retried like a reset connection."""


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://BUCKET[/PREFIX]`; the prefix is a directory: empty, or ending in `/`,
    so `s3://b/train` and `s3://b/train/` both name the keys under `train/`. A UsageError if not."""
    if not url.startswith("s3://"):
        raise UsageError(f"{url} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not BUCKET_NAME.fullmatch(bucket):
        raise UsageError(f"{url}: {bucket!r} is not a bucket name (s3://BUCKET[/PREFIX])")
    prefix = prefix.rstrip("/")
    return bucket, prefix + "/" if prefix else ""


def mtime_ns(when: datetime) -> int:
    """Nanoseconds since the epoch of an S3 LastModified (exact: no float on the way)."""
    return calendar.timegm(when.utctimetuple()) * 1_000_000_000 + when.microsecond * 1000


def _code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    return (str(exc.response.get("Error", {}).get("Code", "")),
            int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)))


def transient(exc: BaseException) -> bool:
    """Whether a request that failed so may succeed when tried again."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = _code(exc)
        return status >= 500 or status == 429 or code in TRANSIENT_CODES
    return isinstance(exc, TRANSIENT_ERRORS + (_Truncated,))


class S3Client:
    """boto3's S3 client with dlfs's retries and one-line errors; one is shared by all the threads of a
    source (boto3 clients are thread-safe, sessions are not)."""

    def __init__(self, bucket: str, endpoint_url: str | None = None, connections: int = CONNECTIONS) -> None:
        self.bucket = bucket
        self.retries = 0  # requests tried again, for the log
        config = Config(max_pool_connections=connections + 1, connect_timeout=CONNECT_TIMEOUT,
                        read_timeout=READ_TIMEOUT, retries={"mode": "standard", "total_max_attempts": 1})
        try:
            session = boto3.Session()
            # Resolved here, once: the chain may ask the instance metadata service, and a missing profile
            # is better told before the cluster is needed.
            self.signed = session.get_credentials() is not None
            if not self.signed:
                config = config.merge(Config(signature_version=UNSIGNED))
            self.client = session.client("s3", endpoint_url=endpoint_url or None, config=config)
        except botocore.exceptions.ProfileNotFound as exc:
            raise UsageError(f"the AWS profile {exc.kwargs.get('profile')!r} (AWS_PROFILE) is in no AWS config "
                             "file") from None
        except ValueError as exc:  # botocore: "Invalid endpoint: ..."
            raise UsageError(f"S3 endpoint: {exc}") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise SourceError(f"cannot get AWS credentials or set up the S3 client: {exc}") from None
        self.endpoint = self.client.meta.endpoint_url
        if not self.signed:
            log.info("no AWS credentials found: requests to %s go unsigned (anonymous)", self.endpoint)

    def retrying(self, what: str, call: Callable[[], T], stop: threading.Event | None = None) -> T:
        """call(), tried again after a transient failure (back-off with jitter) at most RETRY_ATTEMPTS
        times within RETRY_TOTAL seconds; `stop` ends the wait (_Stopped). What still fails is raised as
        it is: the caller knows what the request was for, and says so (`error`)."""
        started = time.monotonic()
        for attempt in itertools.count(1):
            try:
                return call()
            except Exception as exc:
                if not transient(exc):
                    raise
                delay = random.uniform(0, min(RETRY_CAP, RETRY_BASE * 2 ** attempt))
                if attempt >= RETRY_ATTEMPTS or time.monotonic() - started + delay > RETRY_TOTAL:
                    raise
                self.retries += 1
                log.info("%s: %s; trying again in %.2f s", what, self.describe(exc), delay)
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):
                    raise _Stopped() from None
        raise AssertionError("unreachable")

    def describe(self, exc: BaseException) -> str:
        """What went wrong, briefly."""
        if isinstance(exc, botocore.exceptions.ClientError):
            code, status = _code(exc)
            message = exc.response.get("Error", {}).get("Message") or http.client.responses.get(status, "")
            return f"{code or status}: {message}" if message and message != code else (code or str(status))
        if isinstance(exc, _Truncated):
            return f"the answer ended early ({exc})"
        return str(exc) or type(exc).__name__

    def error(self, exc: BaseException, url: str) -> DlfsError | None:
        """The one line that tells the user what failed (`url` names the bucket, prefix or object);
        None for what is no S3 failure at all (a bug: the caller raises it as it is)."""
        if isinstance(exc, DlfsError):
            return exc
        bucket_url = f"s3://{self.bucket}"
        if isinstance(exc, botocore.exceptions.ClientError):
            code, status = _code(exc)
            if code in CREDENTIAL_CODES:
                return SourceError(f"{bucket_url}: access denied ({code}): the credentials are not accepted by "
                                   f"{self.endpoint}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the "
                                   "profile (AWS_PROFILE)")
            if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem") or status == 403:
                if not self.signed:
                    return SourceError(f"{bucket_url}: access denied ({code or status}) to anonymous requests, and "
                                       "no AWS credentials were found: set AWS_ACCESS_KEY_ID / "
                                       "AWS_SECRET_ACCESS_KEY or a profile (AWS_PROFILE)")
                return SourceError(f"{bucket_url}: access denied ({code or status}): these credentials may not "
                                   "read it: check the bucket's policy, or AWS_ACCESS_KEY_ID / the profile")
            if code == "NoSuchBucket":
                return SourceError(f"{bucket_url}: no such bucket at {self.endpoint}")
            if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
                region = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
                where = f" ({region})" if region else ""
                return SourceError(f"{bucket_url}: the bucket is in another region{where}: set AWS_REGION")
            if code in ("InvalidObjectState", "ObjectNotInActiveTierError"):
                return SourceError(f"{url} is archived (its storage class must be restored before it can be "
                                   "read)")
            return SourceError(f"{url}: {self.describe(exc)}")
        if isinstance(exc, botocore.exceptions.ConnectionError):
            return SourceError(f"{url}: cannot reach {self.endpoint}: {exc}")
        if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.CredentialRetrievalError |
                      botocore.exceptions.PartialCredentialsError):
            return SourceError(f"{bucket_url}: cannot get AWS credentials: {exc}")
        if transient(exc) or isinstance(exc, botocore.exceptions.BotoCoreError):
            return SourceError(f"{url}: {self.describe(exc)}")
        return None

    def list_pages(self, prefix: str, page_size: int) -> Iterator[list[dict[str, Any]]]:
        """The objects under `prefix`, a page at a time, in the order S3 lists them (by UTF-8 bytes)."""
        token: str | None = None
        url = f"s3://{self.bucket}/{prefix}"
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": page_size}
            if token:
                args["ContinuationToken"] = token
            try:
                page = self.retrying(f"listing {url}", lambda a=args: self.client.list_objects_v2(**a))
            except Exception as exc:
                err = self.error(exc, url)
                if err is None:
                    raise
                raise err from None
            yield page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def get_range(self, key: str, etag: str, start: int, view: memoryview, stop: threading.Event) -> None:
        """Fill `view` with the object's bytes from `start` (retried; raised as they come, see `error`).
        A SourceError if the object is no longer the one listed."""
        url = f"s3://{self.bucket}/{key}"
        length = len(view)

        def get() -> None:
            # An empty object is a GET with no range (a range of nothing is an error), for its ETag.
            extra = {"Range": f"bytes={start}-{start + length - 1}"} if length else {}
            if etag:
                extra["IfMatch"] = etag
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=key, **extra)
            except botocore.exceptions.ClientError as exc:
                code, status = _code(exc)
                if code == "PreconditionFailed" or status == 412:
                    raise changed(url, etag, "") from None
                if code == "NoSuchKey":
                    raise SourceError(f"{url} was deleted while being ingested; nothing was published") from None
                raise
            body = resp["Body"]
            try:
                # Stores that ignore If-Match still say which object they sent.
                if etag and resp.get("ETag", "").strip('"') != etag.strip('"'):
                    raise changed(url, etag, resp.get("ETag", ""))
                if resp.get("ContentLength") != length:
                    raise changed(url, etag, f"{resp.get('ContentLength')} bytes from {start}, not {length}")
                got = 0
                while got < length:
                    n = body.readinto(view[got:got + READ_PIECE])
                    if not n:
                        raise _Truncated(f"{got} of {length} bytes")
                    got += n
                body.read()  # the end of the body: the connection goes back to the pool
            finally:
                body.close()

        self.retrying(f"GET {url}", get, stop)


def changed(url: str, etag: str, now: str) -> SourceError:
    seen = f" -> {now}" if now else ""
    return SourceError(f"{url} changed while being ingested (ETag {etag}{seen}); nothing was published")


@dataclass(eq=False, slots=True)
class _Range:
    """A piece of an object to fetch: the unit of the read-ahead window."""

    key: str
    etag: str
    start: int
    length: int
    off: int = 0  # where in the read-ahead's ring its bytes go
    error: DlfsError | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Ring:
    """The read-ahead's one buffer. Ranges are placed in it one after the other, in the order they
    are taken, and freed in that same order, so the bytes in use are one stretch from `tail` to
    `head` that may wrap around the end (a range never does: it starts again at 0)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.head = self.tail = 0
        self.used = 0  # bytes of the ranges placed and not yet freed

    def place(self, length: int) -> int | None:
        """Where a range of `length` bytes goes; None while there is no room for it."""
        if not length:
            return 0
        if not self.used:
            self.head = self.tail = 0
        head, tail, size = self.head, self.tail, len(self.buf)
        if not self.used or head > tail:  # free: [head, size) and [0, tail)
            if length <= size - head:
                off = head
            elif length <= tail:
                off = 0
            else:
                return None
        elif head < tail and length <= tail - head:  # wrapped: free [head, tail)
            off = head
        else:
            return None
        self.head = off + length
        self.used += length
        return off

    def free(self, off: int, length: int) -> None:
        """The oldest range placed and not yet freed is done with."""
        if length:
            self.used -= length
            self.tail = off + length


class ReadAhead:
    """Ranges taken in order by one consumer, fetched ahead by `connections` threads into one ring
    buffer of `ring_size` bytes (no buffer is allocated per range), at most `window_ranges` of them
    at once. A range that cannot be fetched fails the ranges after it too (with its error), so that
    the consumer meets the first failure at once. Every wait is bounded; close() stops the threads."""

    def __init__(self, client: S3Client, plan: Iterator[_Range], ring_size: int, connections: int = CONNECTIONS,
                 window_ranges: int = WINDOW_RANGES) -> None:
        self.client = client
        self.plan = plan
        self.next = next(plan, None)
        self.ring = _Ring(ring_size)
        self.view = memoryview(self.ring.buf)
        self.window_ranges = window_ranges
        self.ahead: deque[_Range] = deque()
        self.peak_bytes = 0  # the most bytes the ranges in the ring ever were, for the tests
        self.jobs: queue.SimpleQueue[_Range | None] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.failure: DlfsError | None = None
        self.threads = [threading.Thread(target=self._fetch, name=f"dlfs-s3-get-{i}", daemon=True)
                        for i in range(connections)]
        for t in self.threads:
            t.start()

    def _top_up(self) -> None:
        while self.next is not None and len(self.ahead) < self.window_ranges:
            off = self.ring.place(self.next.length)
            if off is None:
                break
            rng, self.next = self.next, next(self.plan, None)
            rng.off = off
            self.ahead.append(rng)
            self.jobs.put(rng)
        self.peak_bytes = max(self.peak_bytes, self.ring.used)

    def take(self) -> _Range:
        """The next range, fetched (waits for it); a DlfsError if it could not be."""
        self._top_up()
        if not self.ahead:
            raise AssertionError("read past the last range")
        rng = self.ahead[0]
        deadline = time.monotonic() + RANGE_DEADLINE
        while not rng.done.wait(1.0):
            if self.stop.is_set():  # closed: the fetch threads are gone, the range will never come
                raise SourceError(f"s3://{self.client.bucket}/{rng.key}: the read was stopped")
            if time.monotonic() > deadline:
                raise SourceError(f"s3://{self.client.bucket}/{rng.key}: no answer within {RANGE_DEADLINE:.0f} s; "
                                  "nothing was published")
        if rng.error is not None:
            raise rng.error
        return rng

    def release(self, rng: _Range) -> None:
        """Done with the range `take` gave last: its room goes to the next."""
        assert self.ahead and self.ahead[0] is rng
        self.ahead.popleft()
        self.ring.free(rng.off, rng.length)
        self._top_up()

    def _fetch(self) -> None:
        while not self.stop.is_set():
            try:
                rng = self.jobs.get(timeout=1.0)
            except queue.Empty:
                continue
            if rng is None:
                return
            try:
                if self.failure is not None:
                    rng.error = self.failure
                    continue
                self.client.get_range(rng.key, rng.etag, rng.start, self.view[rng.off:rng.off + rng.length],
                                      self.stop)
            except _Stopped:
                rng.error = SourceError("the read of the bucket was stopped")
            except BaseException as exc:
                url = f"s3://{self.client.bucket}/{rng.key}"
                err = self.client.error(exc, url)
                if err is None:  # no S3 failure at all: a bug, told as it is
                    log.exception("fetching %s", url)
                    err = SourceError(f"{url}: {type(exc).__name__}: {exc}")
                if not str(err).endswith("nothing was published"):
                    err = type(err)(f"{err}; nothing was published")
                rng.error = err
                self.failure = self.failure or err
            finally:
                rng.done.set()

    def close(self) -> None:
        """Stop the fetch threads: the ranges not yet started are dropped, each GET in flight ends
        within READ_TIMEOUT (its thread is a daemon: it never holds the process up)."""
        self.stop.set()
        for _ in self.threads:
            self.jobs.put(None)
        deadline = time.monotonic() + JOIN_TIMEOUT
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            log.info("S3 fetch threads still in a GET at close; they end with its timeout")
        self.ahead.clear()


class _S3Object:
    """One object's bytes, as the packer reads them: its ranges in turn, from the read-ahead window."""

    def __init__(self, ahead: ReadAhead, url: str, n_ranges: int) -> None:
        self.name = url
        self.ahead = ahead
        self.left = n_ranges  # ranges of this object not yet taken
        self.cur: _Range | None = None
        self.pos = 0

    def readinto(self, buf: memoryview) -> int:
        while True:
            cur = self.cur
            if cur is not None:
                if self.pos < cur.length:
                    n = min(len(buf), cur.length - self.pos)
                    start = cur.off + self.pos
                    buf[:n] = self.ahead.view[start:start + n]
                    self.pos += n
                    return n
                self.cur = None
                self.ahead.release(cur)
            if not self.left:
                return 0
            self.cur, self.pos = self.ahead.take(), 0
            self.left -= 1

    def finish(self) -> None:
        # Whatever is left (for an empty object, its one GET) is taken: its error, if any, is raised here.
        self.skip_rest()

    def skip_rest(self) -> None:
        """Take and release what the packer did not read (each range still checks its ETag)."""
        if self.cur is not None:
            cur, self.cur = self.cur, None
            self.ahead.release(cur)
        while self.left:
            self.ahead.release(self.ahead.take())
            self.left -= 1

    def close(self) -> None:
        pass  # the ranges left are the source's to skip: a reader closed early means the ingest ends


def _n_ranges(size: int, range_size: int) -> int:
    return max(1, -(-size // range_size))


class S3Prefix:
    """The objects under an S3 prefix, as a tree: `s3://b/train` takes the keys under `train/` (a
    trailing / changes nothing), `s3://b` the whole bucket. A key ending in / (a "directory marker")
    is a directory; a key that cannot be a path (an empty, `.` or `..` component, one over 255 bytes,
    a file that is also a directory) is a SourceError naming it, unless --exclude leaves it out."""

    streamed = False

    def __init__(self, url: str, endpoint_url: str | None = None, connections: int = CONNECTIONS,
                 range_size: int = RANGE_SIZE, window_bytes: int = WINDOW_BYTES) -> None:
        self.where = url
        self.bucket, self.prefix = parse_url(url)
        self.connections = connections
        self.range_size = range_size
        self.window_bytes = max(window_bytes, range_size)
        self.page_size = _page_size()
        self.client = S3Client(self.bucket, endpoint_url, connections)
        self.etags: list[str | None] = []  # by inode number - 1: each file's ETag as listed
        self.ahead: ReadAhead | None = None  # while files() runs

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def walk(self, select: Selection | None) -> Tree:
        builder = TreeBuilder(self.where, select, os.getuid(), os.getgid(), time.time_ns())
        etags: list[str | None] = [None]
        listed = 0
        for page in self.client.list_pages(self.prefix, self.page_size):
            for obj in page:
                listed += 1
                node = self._add(builder, obj)
                if node is not None:
                    etags.extend([None] * (len(builder.nodes) - len(etags)))
                    etags[node.ino - 1] = obj.get("ETag", "")  # none: a store that keeps none
        if not listed:
            raise SourceError(f"{self.url(self.prefix)}: no objects under it (s3://BUCKET/PREFIX takes the keys "
                              "that start PREFIX/)")
        tree = builder.finish()
        etags.extend([None] * (len(tree.nodes) - len(etags)))
        self.etags = etags
        log.info("listed %d objects under %s", listed, self.url(self.prefix))
        return tree

    def _add(self, builder: TreeBuilder, obj: dict[str, Any]) -> Node | None:
        """Add one listed object to the tree: its file node (None for a directory, or left out)."""
        key: str = obj["Key"]
        rel = key[len(self.prefix):]
        is_dir = rel.endswith("/")
        path = (rel[:-1] if is_dir else rel).encode()
        if not path or not builder.taken(path, is_dir):
            return None  # the prefix's own marker, or left out (--files-from, --exclude): never a problem
        why = _not_a_path(path)
        if why:
            raise SourceError(f"{self.url(key)} cannot be a path: {why}")
        when = mtime_ns(obj["LastModified"])
        try:
            if is_dir:
                if obj["Size"]:
                    log.warning("%s: a key ending in / is a directory; its %d bytes are left out", self.url(key),
                                obj["Size"])
                builder.add(path, stat.S_IFDIR | 0o755, 0, when)
                return None
            return builder.add(path, stat.S_IFREG | 0o644, obj["Size"], when)
        except PathClash as clash:  # S3 lists `a` before `a/` and `a/b`: the later key is the one named
            raise SourceError(f"{self.url(key)} cannot be a path: {self.url(self.prefix + clash.file.decode())} "
                              "is an object too, and a file system cannot hold a file and a directory of one "
                              "name") from None

    def files(self, tree: Tree) -> Iterator[tuple[Node, _S3Object]]:
        files = tree.files
        # The ring is the window, or all the bytes there are if fewer.
        ring_size = min(self.window_bytes, sum(node.size for node in files))
        ahead = self.ahead = ReadAhead(self.client, self._plan(files), ring_size, self.connections)
        try:
            for node in files:
                obj = _S3Object(ahead, self.url(self.prefix + node.path.decode()),
                                _n_ranges(node.size, self.range_size))
                yield node, obj
                obj.skip_rest()
        finally:
            ahead.close()
            if self.client.retries:
                log.info("%s: %d requests tried again", self.where, self.client.retries)

    def _plan(self, files: list[Node]) -> Iterator[_Range]:
        for node in files:
            key, etag = self.prefix + node.path.decode(), self.etags[node.ino - 1]
            assert etag is not None
            if not node.size:
                yield _Range(key, etag, 0, 0)
            for start in range(0, node.size, self.range_size):
                yield _Range(key, etag, start, min(self.range_size, node.size - start))


def _not_a_path(path: bytes) -> str:
    """Why a key (relative to the prefix, without its trailing /) cannot be a path; '' if it can."""
    for part in path.split(b"/"):
        why = name_problem(part)
        if why:
            return f"a component {why}" + (" (// or a leading /)" if not part else "")
    return ""


def _page_size() -> int:
    text = os.environ.get("DLFS_S3_PAGE_SIZE")
    if text is None:
        return PAGE_SIZE
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= PAGE_SIZE:
        raise UsageError(f"DLFS_S3_PAGE_SIZE must be a number of keys from 1 to {PAGE_SIZE}, not {text!r}")
    return n


__all__ = ["ReadAhead", "S3Client", "S3Prefix", "mtime_ns", "parse_url", "transient"]
