"""Typed messages: every message a daemon or a mount's control socket handles has a schema, a body of
the wrong shape is one ProtocolError naming the field (over real connections, which keep serving),
unknown fields are accepted, and VersionInfo reads the same from every source, new fields or not."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import msgpack
import msgspec
import pytest
import xxhash
from conftest import needs_fuse
from test_services import make_chunk, make_index, running_node

from dlfs.control.etcd import KV
from dlfs.control.plane import _version_of
from dlfs.data.service import DataService
from dlfs.data.store import ChunkStore
from dlfs.errors import CorruptData, ProtocolError, status_of
from dlfs.meta.catalog import VersionInfo
from dlfs.meta.engine_sqlite import EmbeddedEngine
from dlfs.meta.service import MetaService
from dlfs.meta.store import MetaStore
from dlfs.mount.directsock import ControlServer
from dlfs.wire import messages
from dlfs.wire.messages import (
    META_DAEMON,
    DatasetList,
    DataStatus,
    IngestBegun,
    MetaStatus,
    ReadRange,
    Removed,
    decode,
    reply,
    request,
)
from dlfs.wire.protocol import (
    DIRECT_BATCH,
    HEADER,
    MAX_META,
    REQUEST,
    RESPONSE,
    Frame,
    Msg,
    encode_frame,
    pack_meta,
    parse_header,
    unpack_meta,
)
from dlfs.wire.rpc import Connection, Route, Service, connect

HANDSHAKE = {Msg.HELLO, Msg.AUTH, Msg.AUTH_OK}  # auth.py's own frames, before any service answers
CID = bytes(range(16))
V = VersionInfo("ds", 3, 100, (1 << 64) - 5, 2, 300, 1, 1 << 20, 1.5)


class NoLedger:
    async def under_replicated(self, ids: list[bytes]) -> dict[bytes, list[str]]:
        return {}

    async def sweep(self, live: set[bytes], only: set[bytes] | None = None) -> tuple[int, list[str]]:
        return 0, []


def request_schemas(tmp_path: Path) -> dict[str, dict[int, type]]:
    """Every handler table there is: what each service takes, by message id."""
    meta = MetaService(EmbeddedEngine(MetaStore(tmp_path / "meta")), b"k" * 32, "n", NoLedger())
    data = DataService(ChunkStore(tmp_path / "data"), b"k" * 32, "n")
    tables: dict[str, dict[int, type]] = {"control": {m: kind for m, (kind, _) in ControlServer.HANDLERS.items()}}
    for name, svc in (("meta", meta), ("data", data), ("any", Service(b"k" * 32, "n"))):
        assert all(isinstance(r, Route) for r in svc.handlers.values()), name
        tables[name] = {m: r.kind for m, r in svc.handlers.items()}
    return tables


def test_every_handled_message_has_a_request_schema(tmp_path: Path) -> None:
    tables = request_schemas(tmp_path)
    handled = set().union(*tables.values())
    assert handled | HANDSHAKE == set(Msg), f"messages nothing handles: {set(Msg) - handled - HANDSHAKE}"
    for table in tables.values():
        for msg, kind in table.items():
            # A schema of messages.py, whose constraints msgspec accepts (it checks them on first use).
            assert issubclass(kind, msgspec.Struct) and getattr(messages, kind.__name__) is kind, (Msg(msg), kind)
            msgspec.msgpack.Decoder(kind)


# --- over real connections ------------------------------------------------------------------------
BAD_META = [
    (Msg.BEGIN_INGEST, {"name": None}, "Expected `str`, got `null` - at `$.name`"),
    (Msg.BEGIN_INGEST, {}, "Object missing required field `name`"),
    (Msg.BEGIN_INGEST, {"name": "../up"}, "Expected `str` matching regex"),
    (Msg.GET_DATASET, {"name": "ds", "version": "2"}, "Expected `int | null`, got `str` - at `$.version`"),
    (Msg.READ_INDEX, {"name": "ds", "version": 1, "offset": -1, "length": 10}, "Expected `int` >= 0 - at `$.offset`"),
    (Msg.PIN_CHUNKS, {"session": "s", "ids": [CID, b"short"]}, "Expected `bytes` of length >= 16 - at `$.ids[1]`"),
    (Msg.PIN_CHUNKS, {"session": "s", "ids": CID}, "Expected `array`, got `bytes` - at `$.ids`"),
    (Msg.PUT_INDEX, {"session": "s", "offset": 1 << 63}, "Expected `int` <= 9223372036854775807 - at `$.offset`"),
    (Msg.COMMIT, {"session": "s", "size": 10, "checksum": -1}, "Expected `int` >= 0 - at `$.checksum`"),
    (Msg.REMOVE, {"name": 7}, "Expected `str`, got `int` - at `$.name`"),
]
BAD_DATA = [
    (Msg.READ_RANGE, {"id": CID, "offset": -1, "length": 10}, "Expected `int` >= 0 - at `$.offset`"),
    (Msg.READ_RANGE, {"id": CID, "offset": 0, "length": True}, "Expected `int`, got `bool` - at `$.length`"),
    (Msg.PUT_CHUNK, {"id": CID + b"x"}, "Expected `bytes` of length <= 16 - at `$.id`"),
    (Msg.PUT_CHUNK, {"id": CID.hex()}, "Expected `bytes`, got `str` - at `$.id`"),  # never taken for base64
    (Msg.HAS_CHUNKS, {"ids": "abc"}, "Expected `array`, got `str` - at `$.ids`"),
    (Msg.DELETE_CHUNKS, {"ids": [None]}, "Expected `bytes`, got `null` - at `$.ids[0]`"),
    (Msg.RDMA_REGION, {"ids": [CID] * 1025}, "Expected `array` of length <= 1024 - at `$.ids`"),
    (Msg.PUT_STAGED, {"id": CID, "path": "/x", "size": (1 << 30) + 1}, "Expected `int` <= 1073741824 - at `$.size`"),
    (Msg.RDMA_CONNECT, {"qpn": 1, "psn": 1, "lid": 0, "gid": bytes(16), "mtu": 9, "rd_atomic": 1},
     "Expected `int` <= 5 - at `$.mtu`"),
]


async def _refused(conn: Connection, msg: Msg, meta: dict, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        await conn.call(msg, meta)
    text = str(caught.value)
    assert text.startswith(f"bad {msg.name} request: ") and words in text and "\n" not in text, text
    assert conn.closed is None  # the connection goes on


@pytest.mark.timeout(30)
async def test_bad_shapes_are_one_line_protocol_errors_and_the_connection_goes_on(tmp_path: Path) -> None:
    cid, chunk, recs, _ = make_chunk(1)
    async with (running_node(tmp_path) as (spec, key), connect(spec.meta, key, "meta") as mconn,
                connect(spec.data, key, "data") as dconn):
        with pytest.raises(ProtocolError) as caught:
            await mconn.call(Msg.BEGIN_INGEST, {"name": None})
        assert str(caught.value) == "bad BEGIN_INGEST request: Expected `str`, got `null` - at `$.name`"
        for msg, meta, words in BAD_META:
            await _refused(mconn, msg, meta, words)
        for msg, meta, words in BAD_DATA:
            await _refused(dconn, msg, meta, words)
        # Nothing was acted on: no session was opened (no dataset "None"), no chunk stored.
        status = reply(MetaStatus, (await mconn.call(Msg.STATUS))[0], Msg.STATUS, "local")
        assert (status.ingests, status.versions) == (0, 0)
        assert reply(DataStatus, (await dconn.call(Msg.STATUS))[0], Msg.STATUS, "local").chunks == 0
        # A file the daemon never staged is not taken for a chunk, whatever it holds.
        foreign = tmp_path / "foreign"
        foreign.write_bytes(chunk)
        with pytest.raises(ProtocolError, match=r"is not a file node local staged for chunk"):
            await dconn.call(Msg.PUT_STAGED, {"id": cid, "path": str(foreign), "size": len(chunk)})
        # Both connections still serve a whole ingest.
        assert (await dconn.call(Msg.PUT_CHUNK, {"id": cid}, chunk))[0] == {"stored": True}
        index = make_index([(cid, chunk, recs)])
        sid = reply(IngestBegun, (await mconn.call(Msg.BEGIN_INGEST, {"name": "ds"}))[0], Msg.BEGIN_INGEST, "local")
        await mconn.call(Msg.PIN_CHUNKS, {"session": sid.session, "ids": [cid]})
        await mconn.call(Msg.PUT_INDEX, {"session": sid.session, "offset": 0}, index)
        meta, _ = await mconn.call(Msg.COMMIT, {"session": sid.session, "size": len(index),
                                                "checksum": xxhash.xxh3_64_intdigest(index)})
        assert reply(VersionInfo, meta, Msg.COMMIT, "local").name == "ds"


@pytest.mark.timeout(30)
async def test_unknown_fields_are_accepted(tmp_path: Path) -> None:
    """A newer peer's extra fields are ignored: a whole ingest, a read and a removal, each request
    carrying one."""
    cid, chunk, recs, _ = make_chunk(2)
    new = {"added_in_a_later_version": [1, {"x": b"y"}]}
    async with (running_node(tmp_path) as (spec, key), connect(spec.meta, key, "meta") as mconn,
                connect(spec.data, key, "data") as dconn):
        assert (await dconn.call(Msg.PING, new))[0] == {"node": "local"}
        assert (await dconn.call(Msg.PUT_CHUNK, {"id": cid, **new}, chunk))[0] == {"stored": True}
        assert (await dconn.call(Msg.HAS_CHUNKS, {"ids": [cid], **new}))[0] == {"missing": []}
        _, got = await dconn.call(Msg.READ_RANGE, {"id": cid, "offset": 0, "length": len(chunk), **new})
        assert bytes(got) == chunk
        index = make_index([(cid, chunk, recs)])
        meta, _ = await mconn.call(Msg.BEGIN_INGEST, {"name": "ds", **new})
        sid = reply(IngestBegun, meta, Msg.BEGIN_INGEST, "local").session
        await mconn.call(Msg.PIN_CHUNKS, {"session": sid, "ids": [cid], **new})
        await mconn.call(Msg.PUT_INDEX, {"session": sid, "offset": 0, **new}, index)
        await mconn.call(Msg.COMMIT, {"session": sid, "size": len(index),
                                      "checksum": xxhash.xxh3_64_intdigest(index), **new})
        got_info = reply(VersionInfo, (await mconn.call(Msg.GET_DATASET, {"name": "ds", **new}))[0],
                         Msg.GET_DATASET, META_DAEMON)
        assert (got_info.name, got_info.version, got_info.index_size) == ("ds", 1, len(index))
        listed = reply(DatasetList, (await mconn.call(Msg.LIST_DATASETS, new))[0], Msg.LIST_DATASETS, META_DAEMON)
        assert listed.datasets == [got_info]
        removed = reply(Removed, (await mconn.call(Msg.REMOVE, {"name": "ds", "version": 1, **new}))[0],
                        Msg.REMOVE, META_DAEMON)
        assert removed.removed[0].version == 1 and removed.freed_chunks == 1


def test_a_reply_of_the_wrong_shape_is_one_line() -> None:
    with pytest.raises(ProtocolError, match=r"^malformed GET_DATASET reply from a metadata daemon: "
                                            r"Object missing required field `version`$"):
        reply(VersionInfo, {"name": "ds"}, Msg.GET_DATASET, META_DAEMON)
    with pytest.raises(ProtocolError, match=r"^malformed LIST_DATASETS reply from n1: Expected `int`, got `str` "
                                            r"- at `\$.datasets\[0\].files`$"):
        reply(DatasetList, {"datasets": [V.to_wire() | {"files": "2"}]}, Msg.LIST_DATASETS, "n1")


def test_request_decodes_what_msgpack_hands_it() -> None:
    meta = unpack_meta(pack_meta({"id": bytearray(CID), "offset": 5, "length": 7, "extra": None}))
    assert request(ReadRange, meta, Msg.READ_RANGE) == ReadRange(CID, 5, 7)


# --- VersionInfo, from every source -------------------------------------------------------------------
def test_version_info_round_trips_with_an_unknown_field(tmp_path: Path) -> None:
    newer = V.to_wire() | {"owner": "team-a"}
    # A reply (msgpack), as a newer metadata daemon sends it.
    assert reply(VersionInfo, unpack_meta(pack_meta(newer)), Msg.GET_DATASET, "n1") == V
    assert reply(DatasetList, {"datasets": [newer]}, Msg.LIST_DATASETS, "n1").datasets == [V]
    # etcd's record of it (JSON), as a newer node wrote it.
    value = json.dumps({"info": newer, "holder": "n2", "freed": False, "since": 1}).encode()
    rec = _version_of(KV("/dlfs/versions/ds/0000000003", value, 1, 9, 0))
    assert (rec.info, rec.holder, rec.freed, rec.mod_revision) == (V, "n2", False, 9)
    # And an older peer's, without the later `removed`: its default.
    older = {k: v for k, v in V.to_wire().items() if k != "removed"}
    assert decode(VersionInfo, older, "version") == V
    # The catalog's old JSON file, with one, imported once.
    root = tmp_path / "meta"
    root.mkdir()
    (root / "catalog.json").write_text(json.dumps({"format": 1, "datasets": {"ds": [newer]}}))
    assert MetaStore(root).all_versions() == [V]


def test_a_damaged_version_record_in_etcd_is_one_line() -> None:
    value = json.dumps({"info": V.to_wire() | {"index_sum": -1}, "holder": "n2"}).encode()
    with pytest.raises(CorruptData, match=r"^malformed version record /dlfs/versions/ds/0000000003 in etcd: "
                                          r"Expected `int` >= 0 - at `\$.info.index_sum`$"):
        _version_of(KV("/dlfs/versions/ds/0000000003", value, 1, 9, 0))


# --- a mount's control socket -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def control_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The control socket of a real mount of a small dataset."""
    from conftest import force_unmount
    from conftest import running_node as running_node_process

    base = tmp_path_factory.mktemp("messages")
    src = base / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_bytes(bytes([i]) * 1000)
    with running_node_process(base / "home", base) as node:
        node.ingest(src, "ds")
        mnt = node.mount("ds", base / "mnt")
        try:
            yield os.fsdecode(os.getxattr(mnt, "user.dlfs.control"))
        finally:
            force_unmount(base)


class ControlClient:
    """Frames over the control socket, one request at a time (no DIRECT_ATTACH: no descriptors)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.req = 0

    def call(self, msg: Msg, meta: dict) -> tuple[int, dict]:
        self.req += 1
        self.sock.sendall(encode_frame(Frame(REQUEST, msg, self.req, 0, meta)))
        kind, got, status, req_id, meta_len, data_len = parse_header(self._read(HEADER.size), "mount", MAX_META, 1 << 30)
        body = unpack_meta(self._read(meta_len)) if meta_len else {}
        self._read(data_len)
        assert (kind, got, req_id) == (RESPONSE, msg, self.req)
        return status, body

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            block = self.sock.recv(n - len(out))
            assert block, "the mount closed the connection"
            out += block
        return bytes(out)


@needs_fuse
@pytest.mark.timeout(60)
def test_control_socket_refuses_bad_shapes_and_goes_on(control_socket: str) -> None:
    client = ControlClient(control_socket)
    try:
        for meta, words in (({"exts": "abc"}, "Expected `array`, got `str` - at `$.exts`"),
                            ({"exts": [0, -1]}, "Expected `int` >= 0 - at `$.exts[1]`"),
                            ({"exts": [None]}, "Expected `int`, got `null` - at `$.exts[0]`"),
                            ({"exts": [0] * (DIRECT_BATCH + 1)}, f"Expected `array` of length <= {DIRECT_BATCH}"),
                            ({}, "Object missing required field `exts`")):
            status, body = client.call(Msg.DIRECT_READ, meta)
            assert status == status_of(ProtocolError("")) and body["error"].startswith("bad DIRECT_READ request: ")
            assert words in body["error"], body
        # In shape, but past the index's extents: the mount's own check, still one line.
        status, body = client.call(Msg.DIRECT_READ, {"exts": [1 << 40]})
        assert status and "DIRECT_READ takes up to" in body["error"]
        # The same connection still answers, and unknown fields are ignored.
        status, body = client.call(Msg.DIRECT_STATS, {"newer": True})
        assert status == 0 and body["direct_requests"] >= 7
        status, body = client.call(Msg.DIRECT_READ, {"exts": [0], "newer": True})
        assert status == 0 and len(body["at"]) == 1 and body["errors"] == []
    finally:
        client.sock.close()


def test_msgpack_is_the_wire_format_still() -> None:
    """The Structs change nothing on the wire: a reply is the same msgpack map a dict made."""
    as_dict = {"removed": [V.to_wire()], "freed_chunks": 1, "gc_deferred": "", "mounts": []}
    assert msgpack.unpackb(pack_meta(messages.to_meta(Removed([V], 1))), raw=False) == as_dict
