"""Every message body of the dlfs protocol, one msgspec Struct each.

A frame's meta arrives as a msgpack map (protocol.py). A daemon turns it into its request's Struct
with `request` before the handler runs (rpc.py, the mount's control socket), and a client turns a
reply's into its Struct with `reply`: a body of the wrong shape is one ProtocolError that names the
field, and no handler or caller ever sees it. Unknown fields are ignored and fields added later have
defaults, so a node can talk to one older or newer than itself. A record stored outside frames
(VersionInfo in the catalog's old JSON and in etcd) is read with `decode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from dlfs.errors import DlfsError, ProtocolError
from dlfs.format.chunk import ID_BYTES, MAX_CHUNK_SIZE
from dlfs.wire.protocol import DIRECT_BATCH, MAX_DATA, Msg

T = TypeVar("T")

# Letters, digits, '.', '_' and '-', starting with a letter or digit: a name is a file name on the
# metadata daemon, so nothing may climb out (config.check_dataset_name says it to users).
DATASET_NAME = r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z"

DatasetName = Annotated[str, Meta(pattern=DATASET_NAME)]
ChunkId = Annotated[bytes, Meta(min_length=ID_BYTES, max_length=ID_BYTES)]
I64_MAX = (1 << 63) - 1
Count = Annotated[int, Meta(ge=0)]
Offset = Annotated[int, Meta(ge=0, le=I64_MAX)]  # a file offset (seek takes a signed 64-bit one)
Number = Annotated[int, Meta(ge=0, le=I64_MAX)]  # a version number; 0 names none (NotFound, as any other)
U64 = Annotated[int, Meta(ge=0)]  # msgpack carries no bigger integer (msgspec bounds stop at int64's)
Session = Annotated[str, Meta(min_length=1, max_length=64)]
MAX_REGION_IDS = 1024  # chunk ids per RDMA_REGION request, each list
META_DAEMON = "a metadata daemon"  # who answered a ClusterClient.call_meta: whichever could


# --- records ---------------------------------------------------------------------------------------
class VersionInfo(Struct, frozen=True):
    """One committed version of a dataset (a tombstone once removed): a catalog row, etcd's record of
    it, and the GET_DATASET / COMMIT reply."""

    name: str
    version: Number
    index_size: Count
    index_sum: U64
    files: Count
    bytes: Count
    chunks: Count
    chunk_size: Count
    created: float
    removed: float = 0.0  # when it was removed: the tombstone stops peers bringing it back

    def to_wire(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class QpEndpoint(Struct, frozen=True):
    """What the far side needs to connect to one reliable-connected queue pair (RDMA_CONNECT, both ways)."""

    qpn: Annotated[int, Meta(ge=0, lt=1 << 24)]  # queue pair number
    psn: Annotated[int, Meta(ge=0, lt=1 << 24)]  # first packet sequence number this side sends
    lid: Annotated[int, Meta(ge=0, lt=1 << 16)]  # port LID (InfiniBand); 0 on RoCE, where the GID routes
    gid: Annotated[bytes, Meta(min_length=16, max_length=16)]  # port GID (sgid of the chosen index); zeros when unused
    mtu: Annotated[int, Meta(ge=1, le=5)]  # active path MTU as an ibv_mtu value (1 = 256 ... 5 = 4096)
    rd_atomic: Annotated[int, Meta(ge=1, lt=1 << 8)]  # RDMA READs in flight: wanted (client) or accepted (daemon)

    def to_meta(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class RemoteRegion(Struct, frozen=True):
    """A chunk's registered read-only mapping on a data daemon: the target of RDMA READs."""

    id: ChunkId
    addr: U64  # virtual address of the chunk's first byte in the daemon
    rkey: Annotated[int, Meta(ge=0, lt=1 << 32)]  # remote key of its memory registration
    length: U64  # bytes registered: the whole chunk file

    def to_meta(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class RegionRefused(Struct, frozen=True):
    """A chunk RDMA_REGION could not register, and why (an errors.py status)."""

    id: ChunkId
    error: str
    status: int = 1


# --- requests ----------------------------------------------------------------------------------------
class Empty(Struct, frozen=True):
    """A body with no fields (PING, TIME, STATUS, LIST_DATASETS, COLLECT, LIST_CHUNKS, DIRECT_STATS)."""


class DatasetRef(Struct, frozen=True):
    """GET_DATASET, REMOVE: a dataset, at one version or (None) its latest / all of them."""

    name: DatasetName
    version: Number | None = None


class IndexPiece(Struct, frozen=True):
    """READ_INDEX: up to `length` bytes of a version's index from `offset`."""

    name: DatasetName
    version: Number
    offset: Offset
    length: Count


class IndexCheck(Struct, frozen=True):
    """CHECK_INDEXES: whether this metadata daemon's index files of `versions` (each with its number)
    are the ones committed; `restore`: put a good copy from another metadata daemon in place of a
    damaged or missing one."""

    versions: list[DatasetRef]
    restore: bool = False


class BeginIngest(Struct, frozen=True):
    name: DatasetName


class PinChunks(Struct, frozen=True):
    session: Session
    ids: list[ChunkId]


class PutIndex(Struct, frozen=True):
    """PUT_INDEX: the frame's data is the staged index's bytes from `offset`."""

    session: Session
    offset: Offset


class Commit(Struct, frozen=True):
    session: Session
    size: Offset
    checksum: U64  # xxh3-64 of the whole index


class SessionRef(Struct, frozen=True):
    """ABORT_INGEST."""

    session: Session


class ChunkRef(Struct, frozen=True):
    """PUT_CHUNK: the frame's data is the chunk."""

    id: ChunkId


class StagedChunk(Struct, frozen=True):
    """PUT_STAGED: the chunk `id` is in the file STAGE_CHUNK named, `size` bytes, written by a client on
    the data daemon's own machine (no bytes travel in the frame)."""

    id: ChunkId
    path: Annotated[str, Meta(max_length=4096)]
    size: Annotated[int, Meta(ge=0, le=MAX_CHUNK_SIZE)]


class Staged(Struct, frozen=True):
    """STAGE_CHUNK: the fresh, empty file of the daemon's where a client on its machine writes the chunk."""

    path: str


class ReadRange(Struct, frozen=True):
    id: ChunkId
    offset: Offset
    length: Annotated[int, Meta(ge=0, le=MAX_DATA)]  # the reply must fit one frame


class ChunkIds(Struct, frozen=True):
    """HAS_CHUNKS, DELETE_CHUNKS, VERIFY_CHUNKS."""

    ids: list[ChunkId]


class RegionRequest(Struct, frozen=True):
    """RDMA_REGION: register `ids`, after releasing `release`."""

    ids: Annotated[list[ChunkId], Meta(max_length=MAX_REGION_IDS)] = []
    release: Annotated[list[ChunkId], Meta(max_length=MAX_REGION_IDS)] = []


class DirectAttach(Struct, frozen=True):
    pid: int = 0  # the client's word only: the socket's peer credentials are what count


class DirectRead(Struct, frozen=True):
    """DIRECT_READ: extents of the index (each below its extent count, checked by the mount)."""

    exts: Annotated[list[Count], Meta(max_length=DIRECT_BATCH)]


# --- replies -----------------------------------------------------------------------------------------
class NodeName(Struct, frozen=True):
    """PING."""

    node: str


class Clock(Struct, frozen=True):
    """TIME: the daemon's clock in seconds since the epoch."""

    node: str
    time: float


class MetaStatus(Struct, frozen=True):
    node: str
    datasets: Count = 0
    versions: Count = 0
    ingests: Count = 0


class DataStatus(Struct, frozen=True):
    node: str
    chunks: Count = 0
    bytes: Count = 0
    disk_free: Count = 0
    disk_total: Count = 0
    reads: Count = 0
    bytes_served: Count = 0
    root: str = ""
    chunk_dir: str = ""  # where its chunk files are (short-circuit reads on the same machine)
    boot_id: str = ""  # the machine's boot id: the same one proves the same machine
    transport: str = "tcp"
    transport_reason: str = ""


class DatasetList(Struct, frozen=True):
    """LIST_DATASETS."""

    datasets: list[VersionInfo]


class IngestBegun(Struct, frozen=True):
    """BEGIN_INGEST."""

    session: Session
    ttl: Annotated[float, Meta(ge=0)] = 0.0  # seconds the session outlives its last request (0: not said)


class MountHolder(Struct, frozen=True):
    """A mount that keeps a removed version's chunks (a cluster's REMOVE)."""

    node: str
    mountpoint: str
    version: Number


class Removed(Struct, frozen=True):
    """REMOVE: the versions removed, and the chunks freed (or why not yet)."""

    removed: list[VersionInfo]
    freed_chunks: Count = 0
    gc_deferred: str = ""
    mounts: list[MountHolder] = []


class Collected(Struct, frozen=True):
    """COLLECT."""

    freed_chunks: Count
    gc_deferred: str = ""


class IndexesChecked(Struct, frozen=True):
    """CHECK_INDEXES: the versions whose index file here is still damaged ("name@version" -> why), and
    those restored from a peer."""

    damaged: dict[str, str] = {}
    restored: list[str] = []


class Stored(Struct, frozen=True):
    """PUT_CHUNK: False when the node had it already."""

    stored: bool


class Missing(Struct, frozen=True):
    """HAS_CHUNKS: the ids asked for that the node does not hold."""

    missing: list[ChunkId]


class Deleted(Struct, frozen=True):
    """DELETE_CHUNKS."""

    deleted: Count


class ChunkCount(Struct, frozen=True):
    """LIST_CHUNKS: the frame's data is the ids, 16 bytes each."""

    count: Count


class Verified(Struct, frozen=True):
    """VERIFY_CHUNKS: why each bad chunk is bad, by hex id ("missing" for one not held)."""

    bad: dict[str, str]


class Regions(Struct, frozen=True):
    """RDMA_REGION: per id asked for, a RemoteRegion or a RegionRefused (told apart by "error")."""

    regions: list[dict[str, Any]]


class Attached(Struct, frozen=True):
    """DIRECT_ATTACH (sent with three descriptors)."""

    row: Count
    label: str
    mountpoint: str


class DirectAnswer(Struct, frozen=True):
    """DIRECT_READ: per extent [slab, offset] pinned for the client, or None: inline in the frame's
    data, unless `errors` names it ([position, status, message])."""

    at: list[tuple[Count, Count] | None]
    errors: list[tuple[Count, int, str]] = []


# --- decoding ------------------------------------------------------------------------------------------
NATIVE = (bytes, bytearray)  # msgpack carries bytes itself: a str sent for bytes is refused, not read as base64


def msg_name(msg: int) -> str:
    try:
        return Msg(msg).name
    except ValueError:
        return f"message {msg}"


def request(kind: type[T], meta: Mapping[str, Any], msg: int) -> T:
    """A request's meta as its Struct; ProtocolError "bad X request: <what, where>" if it does not fit."""
    try:
        return msgspec.convert(meta, kind, builtin_types=NATIVE)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad {msg_name(msg)} request: {exc}") from None


def reply(kind: type[T], meta: Mapping[str, Any], msg: int, peer: str) -> T:
    """A reply's meta as its Struct; ProtocolError "malformed X reply from <peer>: ..." if it does not fit."""
    return decode(kind, meta, f"{msg_name(msg)} reply from {peer}")


def decode(kind: type[T], doc: Any, what: str, error: type[DlfsError] = ProtocolError) -> T:
    """`doc` (decoded msgpack or JSON) as `kind`; `error` "malformed <what>: ..." if it does not fit."""
    try:
        return msgspec.convert(doc, kind, builtin_types=NATIVE)
    except msgspec.ValidationError as exc:
        raise error(f"malformed {what}: {exc}") from None


def to_meta(body: Struct | dict[str, Any]) -> dict[str, Any]:
    """A body as the map its frame carries (bytes stay bytes)."""
    if isinstance(body, dict):
        return body
    out: dict[str, Any] = msgspec.to_builtins(body, builtin_types=(bytes, bytearray, memoryview))
    return out
