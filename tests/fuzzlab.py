"""A protocol fuzzer for a node's daemons and a mount's control socket, and the checks that follow it.

tests/test_fuzz.py runs a short round, scripts/fuzz.py a long one. The fuzzer knows the protocol and
nothing inside the daemons: the frame header and the message ids (dlfs/wire/protocol.py), and the
handshake (dlfs/wire/auth.py's client_handshake gets a fuzz connection in). Every case is bytes on a
socket and what may come back: valid frames mutated (bad magic, version or kind; truncated headers and
bodies; lengths that lie, up to and past the limits), every real message id and random ones, random
msgpack metas (wrong types, None, huge and negative numbers, deep nesting, byte ids of the wrong length,
unknown fields), random data, and garbage before and after the handshake; and whole ingests whose
index is hostile inside (counts, offsets and references overwritten, checksums made right again).

Each exchange must end, within a bounded wait, in replies or the daemon closing the connection; a
case that may leave a frame unfinished half-closes its side, so the daemon must then close. A hang, a
reply that does not parse, or an "internal error" reply is a finding, named with the seed, the worker
and the case number that replay it.

The fuzzer never deletes what the checks read afterwards: requests that destroy (DELETE_CHUNKS,
PUT_CHUNK over an id, REMOVE, BEGIN_INGEST of a name) only ever name random ids and names, never the
check dataset's; reads may name it. A mount holds each attached process's pin-table row while that
process lives, and a fuzzer never releases one: the control socket is fuzzed from short-lived child
processes (fuzz_in_parts).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import socket
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import trio
import xxhash

from dlfs.config import load_cluster
from dlfs.errors import DlfsError
from dlfs.format.chunk import BLOCK_SUMS_MIN, ChunkWriter, decode_record
from dlfs.format.index import HEADER as INDEX_HEADER
from dlfs.format.index import Index
from dlfs.wire.auth import client_handshake
from dlfs.wire.protocol import (
    DIRECT_BATCH,
    HEADER,
    MAGIC,
    MAX_DATA,
    MAX_META,
    MAX_META_UNAUTHENTICATED,
    REQUEST,
    RESPONSE,
    VERSION,
    FrameStream,
    Msg,
)

TARGETS = ("meta", "data", "control")
CHECK_NAME = "fuzz-check"  # the dataset ingested before the fuzzing and read byte for byte after it
HOSTILE_PREFIX = "fz-"  # datasets the fuzzer commits with hostile indexes
PART_FRAMES = 400  # control socket frames one child process sends (fuzz_in_parts)
EXCHANGE_TIMEOUT = 15.0  # seconds one case may take to end in replies or a close: longer is a hang
ID_BYTES = 16
FD_SPACE = socket.CMSG_SPACE(16 * 4)  # DIRECT_ATTACH sends three descriptors; room for more
EDGE_INTS = (0, 1, -1, 2, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31), 2**32 - 1, 2**32,
             2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, MAX_META, MAX_META + 1, MAX_DATA, MAX_DATA + 1)
EDGE_STRINGS = ("", ".", "..", "/", "a/b", "../../etc", "\x00", "None", "-1", "1e9", " 7 ", "é✓",
                "x" * 129, "fuzz-check/../x")

# What each message's meta holds (for metas that look almost right); any message may get any meta.
FIELDS: dict[int, tuple[str, ...]] = {
    Msg.AUTH: ("nonce", "mac"),
    Msg.GET_DATASET: ("name", "version"),
    Msg.READ_INDEX: ("name", "version", "offset", "length"),
    Msg.BEGIN_INGEST: ("name",),
    Msg.PIN_CHUNKS: ("session", "ids"),
    Msg.PUT_INDEX: ("session", "offset"),
    Msg.COMMIT: ("session", "size", "checksum"),
    Msg.ABORT_INGEST: ("session",),
    Msg.REMOVE: ("name", "version"),
    Msg.CHECK_INDEXES: ("versions", "restore"),
    Msg.PUT_CHUNK: ("id",),
    Msg.READ_RANGE: ("id", "offset", "length"),
    Msg.HAS_CHUNKS: ("ids",),
    Msg.DELETE_CHUNKS: ("ids",),
    Msg.VERIFY_CHUNKS: ("ids",),
    Msg.RDMA_CONNECT: ("qpn", "psn", "lid", "gid", "mtu", "rd_atomic"),
    Msg.RDMA_REGION: ("ids", "release"),
    Msg.DIRECT_ATTACH: ("pid",),
    Msg.DIRECT_READ: ("exts",),
}
# Requests whose valid form destroys or adds what they name: never aimed at the check dataset.
KNOWN_MSGS = frozenset(int(m) for m in Msg)
DESTRUCTIVE = frozenset({Msg.DELETE_CHUNKS, Msg.PUT_CHUNK, Msg.REMOVE, Msg.BEGIN_INGEST})
SERVED: dict[str, tuple[int, ...]] = {
    "meta": (Msg.PING, Msg.STATUS, Msg.TIME, Msg.LIST_DATASETS, Msg.GET_DATASET, Msg.READ_INDEX,
             Msg.BEGIN_INGEST, Msg.PIN_CHUNKS, Msg.PUT_INDEX, Msg.COMMIT, Msg.ABORT_INGEST, Msg.REMOVE,
             Msg.COLLECT, Msg.CHECK_INDEXES),
    "data": (Msg.PING, Msg.STATUS, Msg.TIME, Msg.PUT_CHUNK, Msg.READ_RANGE, Msg.HAS_CHUNKS,
             Msg.DELETE_CHUNKS, Msg.LIST_CHUNKS, Msg.VERIFY_CHUNKS, Msg.RDMA_CONNECT, Msg.RDMA_REGION),
    "control": (Msg.DIRECT_ATTACH, Msg.DIRECT_READ, Msg.DIRECT_STATS),
}


@dataclass
class Pools:
    """What the fuzzer may aim at: the check dataset (for reads only) and sessions it was handed."""

    name: str = CHECK_NAME
    ids: list[bytes] = field(default_factory=list)  # the check dataset's chunk ids
    extents: int = 0  # extents in the check dataset's index (DIRECT_READ's valid range)
    index: bytes = b""  # the check dataset's index file, the model of hostile ones
    sessions: list[str] = field(default_factory=list)  # ingest sessions BEGIN_INGEST answered

    def named(self, value: Any) -> bool:
        """Whether `value` (a meta, at any depth) names the check dataset or one of its chunks."""
        if isinstance(value, bytes):
            return value in self.ids
        if isinstance(value, str):
            return value == self.name
        if isinstance(value, dict):
            return any(self.named(k) or self.named(v) for k, v in value.items())
        if isinstance(value, list):
            return any(self.named(v) for v in value)
        return False


@dataclass
class Case:
    """One exchange: the bytes to send (in pieces) and which replies may come back."""

    kind: str
    pieces: list[bytes]
    frames: int  # frames this case counts as sent
    expect: dict[int, int] = field(default_factory=dict)  # req id -> msg id of cleanly framed requests
    finish: bool = False  # half-close after sending: the daemon must then close
    fresh: bool = False  # on a new connection, before any handshake
    # An index to ingest as a new dataset: BEGIN_INGEST, PIN_CHUNKS, PUT_INDEX, COMMIT, each answered
    # before the next (the session comes from the first answer); `pieces` are unused.
    index: bytes | None = None
    pins: list[bytes] = field(default_factory=list)  # chunk ids the ingest pins before it commits

    def describe(self) -> str:
        if self.index is not None:
            return f"{self.kind}: an ingest of {len(self.index)} index bytes, xxh3 {xxhash.xxh3_64_hexdigest(self.index)}"
        sent = b"".join(self.pieces)
        msgs = sorted({_msg_name(m) for m in self.expect.values()})
        return (f"{self.kind}{' ' + ','.join(msgs) if msgs else ''}, {len(sent)} bytes"
                f"{', half-closed' if self.finish else ''}: {sent[:48].hex()}{'...' if len(sent) > 48 else ''}")


def _msg_name(msg: int) -> str:
    try:
        return Msg(msg).name
    except ValueError:
        return f"msg {msg}"


def frame(msg: int, meta: bytes, data: bytes = b"", req_id: int = 0, *, kind: int = REQUEST, status: int = 0,
          magic: int = MAGIC, version: int = VERSION, meta_len: int | None = None,
          data_len: int | None = None) -> bytes:
    """A frame's bytes, any field of its header as given (a lie included)."""
    head = HEADER.pack(magic, version, kind, msg, status, req_id,
                       len(meta) if meta_len is None else meta_len, len(data) if data_len is None else data_len)
    return head + meta + data


class CaseMaker:
    """The cases for one target, from one seeded random.Random."""

    def __init__(self, rng: random.Random, target: str, pools: Pools) -> None:
        self.rng, self.target, self.pools = rng, target, pools

    # --- values ---

    def string(self) -> str:
        r = self.rng
        pick = r.random()
        if pick < 0.3:
            return r.choice(EDGE_STRINGS)
        if pick < 0.35:
            return "n" * r.randint(1000, 100_000)
        if pick < 0.5:
            return "".join(chr(r.randint(0x80, 0xD7FF)) for _ in range(r.randint(1, 20)))
        return "".join(r.choice("abcdefghijklmnopqrstuvwxyz0123456789._-") for _ in range(r.randint(1, 24)))

    def integer(self) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.4:
            return r.choice(EDGE_INTS)
        if pick < 0.7:
            return r.randint(0, 1 << 20)
        return r.randint(-(2**63), 2**64 - 1)

    def blob(self) -> bytes:
        r = self.rng
        return r.randbytes(r.choice((0, 1, ID_BYTES - 1, ID_BYTES, ID_BYTES + 1, 32, r.randint(0, 300))))

    def scalar(self) -> Any:
        r = self.rng
        return r.choice((
            lambda: None, lambda: r.random() < 0.5, self.integer, self.integer, self.string, self.blob,
            lambda: r.choice((float("nan"), float("inf"), float("-inf"), -0.0, 1.5, 1e300)),
            lambda: msgpack.ExtType(r.randint(0, 127), r.randbytes(r.choice((0, 1, 4, 8, 12, 3)))),
        ))()

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        if depth > 4 or r.random() < 0.6:
            return self.scalar()
        if r.random() < 0.5:
            return [self.value(depth + 1) for _ in range(r.randint(0, 5))]
        return {self.string(): self.value(depth + 1) for _ in range(r.randint(0, 5))}

    def chunk_id(self, readable: bool) -> Any:
        r = self.rng
        if readable and self.pools.ids and r.random() < 0.5:
            return r.choice(self.pools.ids)
        return r.randbytes(ID_BYTES) if r.random() < 0.8 else self.value()

    def ids(self, readable: bool) -> Any:
        r = self.rng
        if r.random() < 0.1:
            return self.value()
        n = r.choice((0, 1, 2, 3, 10, r.randint(0, 100), r.randint(0, 5000) if r.random() < 0.1 else 4))
        return [self.chunk_id(readable) for _ in range(n)]

    def extents(self) -> Any:
        r = self.rng
        n_ext = max(self.pools.extents, 1)
        if r.random() < 0.1:
            return self.value()
        n = r.choice((0, 1, 2, 8, r.randint(0, 64), DIRECT_BATCH if r.random() < 0.05 else 3,
                      DIRECT_BATCH + 1 if r.random() < 0.05 else 5))
        out: list[Any] = [r.randrange(n_ext) for _ in range(n)]
        if out and r.random() < 0.3:
            out[r.randrange(len(out))] = r.choice((-1, n_ext, 2**63 - 1, None, "0", 1.0, True))
        return out

    def field_value(self, msg: int, name: str) -> Any:
        """A value for a known field: right-looking mostly, anything at all sometimes."""
        r, readable = self.rng, msg not in DESTRUCTIVE
        if r.random() < 0.1:
            return self.value()
        if name == "name":
            return self.pools.name if readable and r.random() < 0.5 else self.string()
        if name == "session":
            made = r.randbytes(8).hex()
            pick = r.randrange(1 << 30)
            return self.pools.sessions[pick % len(self.pools.sessions)] if self.pools.sessions and pick % 3 else made
        if name == "id":
            return self.chunk_id(readable)
        if name in ("ids", "release"):
            return self.ids(readable)
        if name == "exts":
            return self.extents()
        if name == "version":
            return r.choice((1, 1, 2, 0, None, self.integer()))
        if name in ("nonce", "mac", "gid"):
            return self.blob() if r.random() < 0.5 else r.randbytes(32)
        if name in ("offset", "length") and r.random() < 0.5:
            return r.randint(0, 1 << 17)
        return self.integer()

    def meta(self, msg: int) -> dict[Any, Any]:
        r = self.rng
        while True:
            meta: dict[Any, Any] = {}
            for name in FIELDS.get(msg, ()):
                if r.random() < 0.95:
                    meta[name] = self.field_value(msg, name)
            if r.random() < 0.3:  # unknown fields
                for _ in range(r.randint(1, 4)):
                    meta[self.string()] = self.value()
            if msg not in DESTRUCTIVE or not self.pools.named(meta):  # (random values never do; made sure)
                return meta

    def meta_bytes(self, msg: int, limit: int) -> bytes:
        """A request's meta as sent: packed mostly; else not a map, bit-flipped, raw str, deeply nested,
        or random bytes."""
        r = self.rng
        pick = r.random()
        if pick < 0.05:
            return b""
        if pick < 0.1:
            return r.randbytes(r.randint(1, 64))
        if pick < 0.14:  # a map whose value nests deeper than anything will ever walk on purpose
            key = r.choice(FIELDS.get(msg, ("name",)) or ("name",))
            return b"\x81" + msgpack.packb(key) + b"\x91" * r.randint(100, 1100) + b"\xc0"
        if pick < 0.16:  # a field holding a timestamp (ext -1) of a right or wrong length
            key = r.choice(FIELDS.get(msg, ("name",)) or ("name",))
            ext = r.choice((b"\xd6\xff", b"\xd7\xff", b"\xd5\xff", b"\xd4\xff"))  # fixext 4, 8, 2, 1
            return b"\x81" + msgpack.packb(key) + ext + r.randbytes(r.choice((1, 2, 4, 8)))
        if pick < 0.18:
            return msgpack.packb(self.value(), use_bin_type=True)
        if pick < 0.2:  # non-string keys
            return msgpack.packb({self.integer(): self.value(), None: 1}, use_bin_type=True, strict_types=False)
        meta = self.meta(msg)
        raw = msgpack.packb(meta, use_bin_type=r.random() < 0.95)
        if len(raw) > limit:
            raw = raw[:limit]
        if raw and r.random() < 0.1:  # a flipped bit
            flip = bytearray(raw)
            i = r.randrange(len(flip))
            flip[i] ^= 1 << r.randrange(8)
            raw = bytes(flip)
        return raw

    def data(self, msg: int) -> bytes:
        r = self.rng
        if msg == Msg.PUT_CHUNK and r.random() < 0.2:
            return self.real_chunk()[1]
        big = r.randint(0, 1 << 20) if r.random() < 0.05 else 0
        return r.randbytes(r.choice((0, 0, 0, 1, r.randint(0, 4096), r.randint(0, 64 << 10), big)))

    def real_chunk(self) -> tuple[bytes, bytes]:
        """A well-formed chunk of random records and its id (stored if sent: an orphan, harmless);
        now and then with a record big enough for block sums (a version-3 chunk: zero padding before it)."""
        r = self.rng
        w = ChunkWriter(1 << 19)
        for _ in range(r.randint(1, 4)):
            w.add(r.randbytes(r.randint(0, 20_000)), compress=r.random() < 0.5)
        if r.random() < 0.2:
            w.add(r.randbytes(r.randint(BLOCK_SUMS_MIN, BLOCK_SUMS_MIN + 20_000)), compress=False)
        cid, view = w.finish()
        return cid, bytes(view)

    def msg(self) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.7:
            return r.choice(SERVED[self.target])
        if pick < 0.9:
            return r.choice(list(Msg))
        return r.randrange(1 << 16)

    def request(self, limit: int = MAX_META) -> tuple[int, bytes, bytes, int]:
        """(msg, meta bytes, data, req id) of a request, honest in its lengths."""
        msg = self.msg()
        if msg == Msg.PUT_CHUNK and self.rng.random() < 0.2:
            cid, data = self.real_chunk()
            if self.rng.random() < 0.3:  # one byte wrong: refused, and nothing stored
                flip = bytearray(data)
                flip[self.rng.randrange(len(flip))] ^= 0xFF
                data = bytes(flip)
            return msg, msgpack.packb({"id": cid}, use_bin_type=True), data, self.rng.randrange(1 << 32)
        return msg, self.meta_bytes(msg, limit), self.data(msg), self.rng.randrange(1 << 32)

    # --- cases ---

    def case(self) -> Case:
        r = self.rng
        if self.target != "control" and r.random() < 0.2:
            return self.before_handshake()
        if self.target == "meta" and self.pools.index and r.random() < 0.05:
            return Case("hostile-index", [], 4, index=self.hostile_index(), pins=self.pools.ids)
        kind = r.choices(("request", "burst", "split", "bad-header", "lie", "truncated", "garbage"),
                         (40, 10, 5, 10, 15, 10, 10))[0]
        if kind == "request":
            msg, meta, data, req = self.request()
            status = r.randrange(1 << 16) if r.random() < 0.1 else 0  # means nothing in a request
            return Case(kind, [frame(msg, meta, data, req, status=status)], 1, {req: msg})
        if kind == "burst":  # several at once: answered in any order, or the connection closed
            expect, blob = {}, b""
            for _ in range(r.randint(2, 8)):
                msg, meta, data, req = self.request()
                while req in expect:
                    req = r.randrange(1 << 32)
                expect[req] = msg
                blob += frame(msg, meta, data, req)
            return Case(kind, [blob], len(expect), expect)
        if kind == "split":  # one request in small pieces: the daemon assembles it
            msg, meta, data, req = self.request()
            raw = frame(msg, meta, data, req)
            cuts = sorted(r.sample(range(1, len(raw)), min(len(raw) - 1, r.randint(1, 12))))
            return Case(kind, [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])], 1, {req: msg})
        msg, meta, data, req = self.request()
        if kind == "bad-header":
            what = r.choice(("magic", "version", "kind", "meta-over", "data-over"))
            raw = frame(msg, meta, data, req,
                        magic=r.randrange(1 << 16) if what == "magic" else MAGIC,
                        version=r.choice((0, 2, 255)) if what == "version" else VERSION,
                        kind=r.choice((RESPONSE, 2, 255)) if what == "kind" else REQUEST,
                        meta_len=r.choice((MAX_META + 1, 2**32 - 1)) if what == "meta-over" else None,
                        data_len=r.choice((MAX_DATA + 1, 2**32 - 1)) if what == "data-over" else None)
            return Case(f"bad-{what}", [raw], 1, finish=True)
        if kind == "lie":  # lengths bigger or smaller than what follows
            meta_len, data_len = len(meta), len(data)
            if r.random() < 0.5:
                meta_len = r.choice((meta_len + 1, meta_len + r.randint(1, 1000), MAX_META,
                                     max(meta_len - r.randint(1, 8), 0)))
            else:
                data_len = r.choice((data_len + 1, data_len + r.randint(1, 1 << 20), MAX_DATA,
                                     max(data_len - r.randint(1, 8), 0)))
            return Case("lie", [frame(msg, meta, data, req, meta_len=meta_len, data_len=data_len)], 1, finish=True)
        raw = frame(msg, meta, data, req)
        if kind == "truncated":  # inside the header, or inside the body
            cut = (r.randint(1, HEADER.size - 1) if r.random() < 0.3
                   else r.randint(HEADER.size, max(len(raw) - 1, HEADER.size)))
            return Case("truncated", [raw[:cut]], 1, finish=True)
        return Case("garbage", [r.randbytes(r.randint(1, 4096))], 1, finish=True)

    def hostile_index(self) -> bytes:
        """The check dataset's index with words of its body overwritten and both checksums made right
        again: it passes what a commit checks first, and lies inside (counts, offsets, references)."""
        r = self.rng
        raw = bytearray(self.pools.index)
        for _ in range(r.randint(1, 8)):
            at = r.randrange(INDEX_HEADER.size, len(raw) - 3) & ~3
            word = r.choice((0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, r.randrange(1 << 32)))
            raw[at : at + 4] = word.to_bytes(4, "little")
        fields = list(INDEX_HEADER.unpack_from(raw))
        fields[-2] = xxhash.xxh3_64_intdigest(bytes(raw[INDEX_HEADER.size :]))  # body_sum, then head_sum
        head = INDEX_HEADER.pack(*fields)
        raw[: INDEX_HEADER.size] = head[:-8] + xxhash.xxh3_64_intdigest(head[:-8]).to_bytes(8, "little")
        return bytes(raw)

    def before_handshake(self) -> Case:
        """Bytes from a peer that never proves the key: each connection must be closed."""
        r = self.rng
        kind = r.choice(("garbage", "frame", "wrong-key", "oversize", "silent"))
        if kind == "garbage":
            return Case("pre-garbage", [r.randbytes(r.randint(1, 512))], 1, finish=True, fresh=True)
        if kind == "silent":
            return Case("pre-silent", [], 0, finish=True, fresh=True)
        if kind == "wrong-key":
            meta = msgpack.packb({"nonce": r.randbytes(32), "mac": r.randbytes(32)}, use_bin_type=True)
            raw = frame(Msg.AUTH, meta, b"", r.randrange(1 << 32))
            return Case("pre-wrong-key", [raw], 1, finish=True, fresh=True)
        msg = r.choice((Msg.AUTH, Msg.AUTH, Msg.HELLO, Msg.AUTH_OK, self.msg()))
        meta, data = self.meta_bytes(msg, MAX_META_UNAUTHENTICATED), b""
        if kind == "oversize":  # over what an unknown peer may send, declared or real
            if r.random() < 0.5:
                meta += r.randbytes(max(MAX_META_UNAUTHENTICATED + 1 - len(meta), 0))
            else:
                data = r.randbytes(r.randint(1, 64))
        raw = frame(msg, meta, data, r.randrange(1 << 32), kind=REQUEST if r.random() < 0.9 else RESPONSE)
        if r.random() < 0.2:
            raw = raw[: r.randint(1, len(raw))]
        return Case(f"pre-{kind}", [raw], 1, finish=True, fresh=True)


# --- the wire ------------------------------------------------------------------------------------

class BadReply(Exception):
    """The daemon sent something that is not a frame of the protocol."""


@dataclass
class Reply:
    kind: int
    msg: int
    status: int
    req_id: int
    meta: dict[str, Any]
    data: bytes


class Wire:
    """One fuzz connection: raw bytes out, whole frames in (descriptors sent with them are closed)."""

    def __init__(self, sock: trio.socket.SocketType, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.stream = trio.SocketStream(sock)
        self.buf = bytearray()
        self.eof = False
        self.fds = 0  # descriptors received (and closed)

    @classmethod
    async def open(cls, where: tuple[str, int] | str) -> Wire:
        if isinstance(where, str):
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer = where
        else:
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            peer = f"{where[0]}:{where[1]}"
        try:
            await sock.connect(where)
        except BaseException:
            sock.close()
            raise
        return cls(sock, peer)

    async def handshake(self, key: bytes, service: str) -> None:
        """Prove the key as any client does (the frames after it are ours to make)."""
        await client_handshake(FrameStream(self.stream, self.peer), key, service)

    async def send(self, data: bytes) -> bool:
        """False if the daemon has closed the connection."""
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False
        return True

    def half_close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()

    async def receive(self) -> Reply | None:
        """The next whole frame; None once the daemon has closed (a frame it cut short included)."""
        while True:
            if len(self.buf) >= HEADER.size:
                magic, version, kind, msg, status, req_id, meta_len, data_len = HEADER.unpack_from(self.buf)
                if (magic, version, kind) != (MAGIC, VERSION, RESPONSE) or meta_len > MAX_META or data_len > MAX_DATA:
                    raise BadReply(f"a bad frame header: {bytes(self.buf[:HEADER.size]).hex()}")
                end = HEADER.size + meta_len + data_len
                if len(self.buf) >= end:
                    raw_meta = bytes(self.buf[HEADER.size : HEADER.size + meta_len])
                    data = bytes(self.buf[HEADER.size + meta_len : end])
                    del self.buf[:end]
                    try:
                        meta = msgpack.unpackb(raw_meta, raw=False) if raw_meta else {}
                    except Exception as exc:  # noqa: BLE001  msgpack raises several types on garbage
                        raise BadReply(f"a reply's meta does not decode ({type(exc).__name__})") from None
                    if not isinstance(meta, dict):
                        raise BadReply("a reply's meta is not a map")
                    return Reply(kind, msg, status, req_id, meta, data)
            if self.eof:
                return None
            try:
                data, anc, _, _ = await self.sock.recvmsg(1 << 20, FD_SPACE)
            except (ConnectionResetError, BrokenPipeError):
                self.eof = True
                continue
            for level, typ, payload in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                    fds = [int.from_bytes(payload[i : i + 4], "little") for i in range(0, len(payload) - 3, 4)]
                    for fd in fds:
                        os.close(fd)
                    self.fds += len(fds)
            if not data:
                self.eof = True
            self.buf += data

    async def call(self, msg: int, meta: dict[str, Any], data: bytes = b"", req_id: int = 1) -> Reply | None:
        """A well-formed request and its reply; None if the daemon closed the connection instead."""
        if not await self.send(frame(msg, msgpack.packb(meta, use_bin_type=True), data, req_id)):
            return None
        return await self.receive()

    async def answer(self, msg: int, meta: dict[str, Any], req_id: int = 1) -> Reply:
        """call() for the checks: an AssertionError unless the daemon answers, and answers ok."""
        reply = await self.call(msg, meta, req_id=req_id)
        if reply is None:
            raise AssertionError(f"{self.peer} closed the connection instead of answering {_msg_name(msg)} {meta}")
        if reply.status:
            raise AssertionError(f"{_msg_name(msg)} {meta}: status {reply.status}: {reply.meta.get('error')}")
        return reply


# --- a round ---------------------------------------------------------------------------------------

@dataclass
class Target:
    """Where one target listens: a daemon (TCP, with the key) or a mount's control socket (a path)."""

    name: str
    where: tuple[str, int] | str
    key: bytes | None = None  # None: no handshake (the control socket)

    async def connect(self, authenticate: bool = True) -> Wire:
        wire = await Wire.open(self.where)
        if authenticate and self.key is not None:
            try:
                await wire.handshake(self.key, self.name)
            except BaseException:
                wire.close()
                raise
        return wire


@dataclass
class Tally:
    """What a round saw, per target."""

    seed: int
    frames: Counter[str] = field(default_factory=Counter)
    cases: Counter[str] = field(default_factory=Counter)
    connections: Counter[str] = field(default_factory=Counter)
    closed: Counter[str] = field(default_factory=Counter)  # connections the daemon closed
    kept: Counter[str] = field(default_factory=Counter)  # exchanges answered in full, connection kept
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    by_message: Counter[tuple[str, str, int]] = field(default_factory=Counter)  # (target, message, status)
    fds: int = 0
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: Tally) -> None:
        """Add another part's counts and findings to these."""
        for name in ("frames", "cases", "connections", "closed", "kept", "by_message"):
            getattr(self, name).update(getattr(other, name))
        for target, counts in other.statuses.items():
            self.statuses.setdefault(target, Counter()).update(counts)
        self.fds += other.fds
        self.findings += other.findings

    def reply(self, target: str, reply: Reply) -> None:
        self.statuses.setdefault(target, Counter())[reply.status] += 1
        name = _msg_name(reply.msg) if reply.msg in KNOWN_MSGS else "(unknown ids)"
        self.by_message[target, name, reply.status] += 1

    def lines(self) -> list[str]:
        out = [f"seed {self.seed}: {sum(self.frames.values())} frames in {sum(self.cases.values())} exchanges, "
               f"{self.seconds:.1f} s"]
        for t in TARGETS:
            if not self.cases[t]:
                continue
            by = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.get(t, Counter()).items()))
            out.append(f"  {t:8} frames {self.frames[t]:6}  exchanges {self.cases[t]:6}  connections "
                       f"{self.connections[t]:5}  closed by the daemon {self.closed[t]:5}  kept open "
                       f"{self.kept[t]:5}  replies by status {{{by}}}")
        out.append(f"  descriptors received (DIRECT_ATTACH) and closed: {self.fds}")
        out.append(f"  findings: {len(self.findings)}")
        out += [f"    {f}" for f in self.findings[:20]]
        return out


async def exchange(wire: Wire, case: Case, timeout: float) -> tuple[str, list[Reply]]:
    """Send one case while reading what comes back (a daemon may answer before it has read it all),
    and wait, bounded, for how it ends: "kept" (every reply came, the connection stays), "closed" (by
    the daemon), or a finding's text; with the replies that came."""
    pending = dict(case.expect)
    replies: list[Reply] = []
    sent = trio.Event()

    async def send() -> None:
        for i, piece in enumerate(case.pieces):
            if i:
                await trio.sleep(0.001)
            if not await wire.send(piece):
                return  # closed: the reader sees it
        if case.finish:
            wire.half_close()
        sent.set()

    async def outcome() -> str:
        while case.finish or pending:
            reply = await wire.receive()
            if reply is None:
                return "closed"
            replies.append(reply)
            error = str(reply.meta.get("error", ""))
            if "internal error" in error:
                return f"an internal error reply to {_msg_name(reply.msg)}: {error[:200]}"
            if case.fresh or case.finish:
                continue  # a HELLO, an AUTH_OK refusal, or answers to bytes the daemon read as frames
            if pending.get(reply.req_id) != reply.msg:
                return f"a reply to a request never sent: {_msg_name(reply.msg)} id {reply.req_id}"
            del pending[reply.req_id]
        await sent.wait()  # every reply came: the last bytes are in the kernel's hands already or soon
        return "kept"

    if case.index is not None:
        return await ingest_exchange(wire, case.index, case.pins, timeout)
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            try:
                result = await outcome()
            except BadReply as exc:
                result = str(exc)
            nursery.cancel_scope.cancel()
        return result, replies
    return f"a hang: no reply and no close within {timeout:g} s", replies


async def ingest_exchange(wire: Wire, index: bytes, pins: list[bytes], timeout: float) -> tuple[str, list[Reply]]:
    """A new dataset (never the check one) committed with `index`, each step answered before the next;
    it ends at the first refusal. Outcomes as exchange()'s."""
    replies: list[Reply] = []
    steps: list[tuple[int, dict[str, Any], bytes]] = [
        (Msg.BEGIN_INGEST, {"name": f"{HOSTILE_PREFIX}{os.urandom(6).hex()}"}, b""),
        (Msg.PIN_CHUNKS, {"ids": pins}, b""),
        (Msg.PUT_INDEX, {"offset": 0}, index),
        (Msg.COMMIT, {"size": len(index), "checksum": xxhash.xxh3_64_intdigest(index)}, b""),
    ]
    session = None
    with trio.move_on_after(timeout):
        try:
            for req, (msg, meta, data) in enumerate(steps, 1):
                if session is not None:
                    meta["session"] = session
                reply = await wire.call(msg, meta, data, req_id=req)
                if reply is None:
                    return "closed", replies
                replies.append(reply)
                error = str(reply.meta.get("error", ""))
                if "internal error" in error:
                    return f"an internal error reply to {_msg_name(msg)} of a hostile index: {error[:200]}", replies
                if reply.status:
                    return "kept", replies
                session = reply.meta.get("session", session)
        except BadReply as exc:
            return str(exc), replies
        return "kept", replies
    return f"a hang: a hostile index's ingest took over {timeout:g} s", replies


async def fuzz_worker(target: Target, maker: CaseMaker, frames: int, tally: Tally, label: str,
                      timeout: float, deadline: float) -> None:
    """Cases from `maker` against `target` until `frames` are sent or the deadline passes; an
    authenticated connection is kept for the next case while the daemon keeps it."""
    wire: Wire | None = None
    sent = n = 0
    try:
        while sent < frames and time.monotonic() < deadline:
            case = maker.case()
            n += 1
            where = f"seed {tally.seed} {label} case {n}"
            use = wire
            if case.fresh or use is None:
                try:
                    with trio.fail_after(timeout):
                        use = await target.connect(authenticate=not case.fresh)
                except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.EndOfChannel,
                        DlfsError) as exc:
                    tally.findings.append(f"{where}: a connection to {target.name} failed: {type(exc).__name__}: {exc}")
                    return
                tally.connections[target.name] += 1
                if not case.fresh:
                    wire = use
            sent += case.frames
            tally.frames[target.name] += case.frames
            tally.cases[target.name] += 1
            outcome, replies = await exchange(use, case, timeout)
            tally.fds += use.fds
            use.fds = 0
            for reply in replies:
                tally.reply(target.name, reply)
                session = reply.meta.get("session")
                if reply.msg == Msg.BEGIN_INGEST and not reply.status and isinstance(session, str):
                    maker.pools.sessions.append(session)
                    del maker.pools.sessions[:-64]
            if outcome == "kept":
                tally.kept[target.name] += 1
                continue
            if outcome == "closed":
                tally.closed[target.name] += 1
            else:
                tally.findings.append(f"{where} ({case.describe()}): {outcome}")
            use.close()
            if use is wire:
                wire = None
    finally:
        if wire is not None:
            wire.close()


async def fuzz(targets: list[Target], frames: dict[str, int], seed: int, pools: Pools, *, workers: int = 2,
               timeout: float = EXCHANGE_TIMEOUT, seconds: float = float("inf"), part: int = 0) -> Tally:
    """`frames[t]` frames against each target, by `workers` concurrent workers each, all targets at once,
    in this process; stops early after `seconds`. Worker w of target t draws from
    Random(f"{seed}:{t}:{w}") (":{part}" added for the parts of a round after the first)."""
    tally = Tally(seed)
    start = time.monotonic()
    async with trio.open_nursery() as nursery:
        for target in targets:
            share = -(-frames.get(target.name, 0) // workers)
            for w in range(workers):
                label = f"{target.name} worker {w}" + (f" part {part}" if part else "")
                maker = CaseMaker(random.Random(f"{seed}:{target.name}:{w}" + (f":{part}" if part else "")),
                                  target.name, pools)
                nursery.start_soon(fuzz_worker, target, maker, share, tally, label, timeout, start + seconds)
    tally.seconds = time.monotonic() - start
    return tally


def _fuzz_part(*args: Any, **kwargs: Any) -> Tally:
    return trio.run(functools.partial(fuzz, *args, **kwargs))


def fuzz_in_parts(target: Target, frames: int, seed: int, pools: Pools, *, workers: int = 2,
                  timeout: float = EXCHANGE_TIMEOUT, seconds: float = float("inf")) -> Tally:
    """fuzz() against a mount's control socket from fresh child processes, PART_FRAMES frames each.

    A mount keeps each attached process's pin-table row while the process lives unless it marks the
    row released in shared memory (dlfs/mount/pinrows.py), which a fuzzer never does: from one process the
    rows would run out, and every later request would be refused the same way."""
    tally = Tally(seed)
    start = time.monotonic()
    ctx = multiprocessing.get_context("forkserver")  # not fork: this runs beside a trio loop's thread
    ctx.set_forkserver_preload([__name__])  # imported once, in the server the children are forked from
    with ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for part in range(-(-frames // PART_FRAMES)):
            left = seconds - (time.monotonic() - start)
            if left <= 0:
                break
            n = min(PART_FRAMES, frames - part * PART_FRAMES)
            got = pool.submit(_fuzz_part, [target], {target.name: n}, seed, pools, workers=workers,
                              timeout=timeout, seconds=left, part=part).result()
            tally.merge(got)
    tally.seconds = time.monotonic() - start
    return tally


def fuzz_round(targets: list[Target], frames: dict[str, int], seed: int, pools: Pools, *, workers: int = 2,
               timeout: float = EXCHANGE_TIMEOUT, seconds: float = float("inf")) -> Tally:
    """A round against every target at once: the daemons from this process, a control socket in parts."""
    start = time.monotonic()
    parts: list[Tally] = []
    daemons = [t for t in targets if t.key is not None]
    kw: dict[str, Any] = {"workers": workers, "timeout": timeout, "seconds": seconds}

    async def control(t: Target) -> None:
        run = functools.partial(fuzz_in_parts, t, frames.get(t.name, 0), seed, pools, **kw)
        parts.append(await trio.to_thread.run_sync(run))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for t in targets:
                if t.key is None:  # a control socket
                    nursery.start_soon(control, t)
            if daemons:
                parts.append(await fuzz(daemons, frames, seed, pools, **kw))

    trio.run(main)
    tally = Tally(seed)
    for part in parts:
        tally.merge(part)
    tally.seconds = time.monotonic() - start
    return tally


# --- the checks ------------------------------------------------------------------------------------

def make_source(root: Path, seed: int) -> dict[str, bytes]:
    """The check dataset's source: files of every small size, bigger than a chunk at --chunk-size 64K,
    random and compressible; returns {relative path: bytes}."""
    rng = random.Random(f"{seed}:source")
    files: dict[str, bytes] = {}
    sizes = [0, 1, 7, 4095, 4096, 4097, 65535, 65536, 65537, 150_000, 300_000]
    sizes += [rng.randint(0, 40_000) for _ in range(30)]
    for i, size in enumerate(sizes):
        if i % 2:
            data = rng.randbytes(size)
        else:
            data = (b"dlfs fuzz %d " % i * (size // 12 + 1))[:size]
        files[f"d{i % 4}/f{i:03}.bin"] = data
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


INGEST_ARGS = ("--chunk-size", "64K", "--compress", "lz4")


def daemon_targets(home: Path, index_path: Path) -> tuple[Target, Target, Pools]:
    """The daemons of the embedded node under `home` as targets (with its key), and the pools of the
    check dataset (ingested already), whose index is fetched to `index_path`."""
    cluster = load_cluster(None, home)
    spec = cluster.nodes[0]
    meta = Target("meta", (spec.meta.host, spec.meta.port), cluster.key)
    data = Target("data", (spec.data.host, spec.data.port), cluster.key)
    index = trio.run(fetch_index, meta, CHECK_NAME, 1, index_path)
    try:
        return meta, data, Pools(CHECK_NAME, index.chunk_ids(), index.totals.extents, index_path.read_bytes())
    finally:
        index.close()


async def fetch_index(meta: Target, name: str, version: int, into: Path) -> Index:
    """The dataset's index, through GET_DATASET and READ_INDEX on a connection of our own."""
    wire = await meta.connect()
    try:
        size = int((await wire.answer(Msg.GET_DATASET, {"name": name, "version": version})).meta["index_size"])
        raw = bytearray()
        while len(raw) < size:
            ask = {"name": name, "version": version, "offset": len(raw), "length": size - len(raw)}
            piece = await wire.answer(Msg.READ_INDEX, ask, req_id=len(raw) + 2)
            if not piece.data:
                raise AssertionError(f"READ_INDEX {ask}: nothing read")
            raw += piece.data
    finally:
        wire.close()
    into.write_bytes(raw)
    return Index(into)


async def served_problems(meta: Target, data: Target, name: str, version: int,
                          files: dict[str, bytes]) -> list[str]:
    """Every file of the dataset read from the daemons (the index from the metadata daemon, each
    record by READ_RANGE from the data daemon) and compared with the source; what differs."""
    problems: list[str] = []
    seen = set()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            index = await fetch_index(meta, name, version, Path(tmp) / "index")
            wire = await data.connect()
        except (AssertionError, OSError, DlfsError) as exc:
            return [f"the dataset's index or the data daemon cannot be had: {exc}"]
        try:
            for req, (path, node) in enumerate(index.walk(), 1):
                if not stat.S_ISREG(node.mode):
                    continue
                rel = os.fsdecode(path)
                seen.add(rel)
                got = bytearray()
                for e in range(node.ref, node.ref + node.count):
                    rec, cid = index.extent(e).record, index.chunk(index.extent(e).chunk).id
                    ask = {"id": cid, "offset": rec.offset, "length": rec.stored_len}
                    got += decode_record((await wire.answer(Msg.READ_RANGE, ask, req_id=req)).data, rec, rel)
                if files.get(rel) != got:
                    problems.append(f"{rel}: {len(got)} bytes read over the protocol differ from the source")
        except (AssertionError, DlfsError) as exc:
            problems.append(f"reading the dataset over the protocol: {exc}")
        finally:
            wire.close()
            index.close()
    if not problems and seen != set(files):
        problems.append(f"the index lists {len(seen)} files, the source has {len(files)}")
    return problems


async def hostile_datasets(meta: Target) -> list[str]:
    """Names of the datasets a round committed with hostile indexes."""
    wire = await meta.connect()
    try:
        listed = (await wire.answer(Msg.LIST_DATASETS, {})).meta["datasets"]
    finally:
        wire.close()
    return sorted({d["name"] for d in listed if str(d["name"]).startswith(HOSTILE_PREFIX)})


def mount_problems(mnt: Path, files: dict[str, bytes]) -> list[str]:
    """Every file read through the mount and through dlfs.direct, compared with the source."""
    import dlfs.direct

    problems = [f"{rel}: read through the mount differs from the source"
                for rel, data in files.items() if (mnt / rel).read_bytes() != data]
    with dlfs.direct.connect(mnt) as reader:
        if not reader.direct:
            return [*problems, f"dlfs.direct did not attach to {mnt}: {getattr(reader, 'reason', '')}"]
        rels = sorted(files)
        for rel, view in zip(rels, reader.read_many([str(mnt / r) for r in rels])):
            with view:
                if view != files[rel]:
                    problems.append(f"{rel}: read through dlfs.direct differs from the source")
    return problems


def log_marks(logs: list[Path]) -> dict[Path, int]:
    """Where each log ends now: log_problems reads only what is written after."""
    return {path: path.stat().st_size if path.exists() else 0 for path in logs}


def log_problems(marks: dict[Path, int]) -> list[str]:
    """Lines the daemons logged since `marks` that say a bug was hit."""
    out = []
    for path, start in marks.items():
        try:
            with open(path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            continue
        out += [f"{path.name}: {line.strip()[:300]}" for line in text.splitlines()
                if "Traceback" in line or "internal error" in line]
    return out


def problems_after(tally: Tally, pids: dict[str, int], alive: Callable[[int], bool], marks: dict[Path, int],
                   meta: Target, data: Target, files: dict[str, bytes], mnt: Path | None = None) -> list[str]:
    """The checks after a round: its findings; every process (`pids`, by what it is) alive; the check
    dataset (version 1) byte for byte over the protocol, and through the mount and dlfs.direct if `mnt`;
    no traceback logged since `marks`."""
    problems = list(tally.findings)
    problems += [f"the {what} (pid {pid}) is gone" for what, pid in pids.items() if not alive(pid)]
    if not problems:
        problems += trio.run(served_problems, meta, data, CHECK_NAME, 1, files)
        if mnt is not None:
            problems += mount_problems(mnt, files)
    return problems + log_problems(marks)
