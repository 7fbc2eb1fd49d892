"""Unit tests for the frame protocol and the key handshake, over in-memory streams and real sockets."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

from dlfs.errors import AuthError, DlfsError, ProtocolError
from dlfs.wire import auth
from dlfs.wire.auth import client_handshake, server_handshake
from dlfs.wire.protocol import (
    HEADER,
    MAGIC,
    MAX_DATA,
    MAX_META,
    MAX_META_UNAUTHENTICATED,
    REQUEST,
    RESPONSE,
    VERSION,
    Frame,
    FrameStream,
    Msg,
    encode_frame,
    pack_meta,
)

KEY = bytes(range(32))
HANDSHAKE_FAILURES = (DlfsError, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError)
OTHER_KEY = bytes(range(1, 33))


def _memory_pair() -> tuple[FrameStream, FrameStream]:
    a, b = trio.testing.memory_stream_pair()
    return FrameStream(a, "a"), FrameStream(b, "b")


def _socket_pair() -> tuple[FrameStream, FrameStream]:
    a, b = trio.socket.socketpair()
    return FrameStream(trio.SocketStream(a), "a"), FrameStream(trio.SocketStream(b), "b")


PAIRS: dict[str, Callable[[], tuple[FrameStream, FrameStream]]] = {"memory": _memory_pair, "socket": _socket_pair}


def _header(*, magic: int = MAGIC, version: int = VERSION, kind: int = REQUEST, msg: int = Msg.PING,
            status: int = 0, req_id: int = 1, meta_len: int = 0, data_len: int = 0) -> bytes:
    return HEADER.pack(magic, version, kind, msg, status, req_id, meta_len, data_len)


async def _receive_raw(raw: bytes, authenticated: bool = False, close: bool = True) -> Frame:
    """What a FrameStream makes of exactly these bytes from its peer."""
    a, b = trio.testing.memory_stream_pair()
    fs = FrameStream(b, "tester")
    if authenticated:
        fs.authenticated()
    await a.send_all(raw)
    if close:
        await a.send_eof()
    return await fs.receive()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", list(PAIRS))
async def test_frames_round_trip(kind: str) -> None:
    left, right = PAIRS[kind]()
    left.authenticated()
    right.authenticated()
    big = os.urandom(5 << 20)
    sent = [
        Frame(REQUEST, Msg.PING, 1),
        Frame(REQUEST, Msg.READ_RANGE, 2, meta={"id": b"\x00" * 16, "offset": 7, "length": 1 << 40}),
        Frame(RESPONSE, Msg.PUT_CHUNK, 0xFFFFFFFF, 5, {"error": "chunk ab: checksum mismatch \u2603"}),
        Frame(REQUEST, Msg.PUT_CHUNK, 3, meta={"id": b"x" * 16}, data=big),
        Frame(RESPONSE, Msg.LIST_CHUNKS, 4, data=memoryview(b"0123456789abcdef" * 3)),
    ]
    got: list[Frame] = []

    async def reader() -> None:
        for _ in sent:
            got.append(await right.receive())

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        for f in sent:
            await left.send(f)
    assert len(got) == len(sent)
    for s, g in zip(sent, got):
        assert (g.kind, g.msg, g.req_id, g.status, g.meta) == (s.kind, s.msg, s.req_id, s.status, s.meta)
        assert bytes(g.data) == bytes(s.data)
    assert bytes(got[3].data) == big
    # A clean close between frames is the end of the channel, not an error.
    await left.aclose()
    with pytest.raises(trio.EndOfChannel):
        await right.receive()
    await right.aclose()


@pytest.mark.timeout(10)
async def test_socket_stream_uses_recv_into() -> None:
    left, right = _socket_pair()
    assert right._recv_into is not None  # the zero-copy path is the one under test
    right.authenticated()
    payload = os.urandom(3 << 20)
    async with trio.open_nursery() as n:
        n.start_soon(left.send, Frame(REQUEST, Msg.PUT_CHUNK, 9, meta={"k": 1}, data=payload))
        f = await right.receive()
    assert f.meta == {"k": 1} and f.data == payload and isinstance(f.data, bytearray)
    await left.aclose()
    await right.aclose()


async def _tcp_pair() -> tuple[trio.SocketStream, FrameStream]:
    """A raw TCP stream to a FrameStream over loopback (SO_RCVLOWAT works on TCP alone)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    server, _ = await listener.accept()
    listener.close()
    return trio.SocketStream(client), FrameStream(trio.SocketStream(server), "tcp peer")


@pytest.mark.timeout(20)
async def test_a_big_frame_over_tcp_wakes_its_receiver_per_piece_not_per_segment() -> None:
    """A fetched window arrives as many segments: its receiver waits for a piece of RECV_PIECE bytes
    (or what the frame still owes) before it wakes, and for any byte again once the frame is in."""
    raw, fs = await _tcp_pair()
    fs.authenticated()
    calls = 0
    recv_into = fs._recv_into
    assert recv_into is not None

    async def counted(view: memoryview) -> int:
        nonlocal calls
        calls += 1
        return await recv_into(view)

    fs._recv_into = counted
    sizes = [(4 << 20) + 3, (1 << 20) + 1, 100]
    frames = [Frame(RESPONSE, Msg.READ_RANGE, i + 1, data=os.urandom(n)) for i, n in enumerate(sizes)]

    async def trickle() -> None:
        # 32 KiB at a time with a pause, as a disk-bound sender's segments land: unwaited, each
        # would wake the receiver (160 wakeups for these frames).
        for f in frames:
            wire = encode_frame(f) + bytes(f.data)
            for at in range(0, len(wire), 32 << 10):
                await raw.send_all(wire[at:at + (32 << 10)])
                await trio.sleep(0.001)

    got: list[Frame] = []
    async with trio.open_nursery() as n:
        n.start_soon(trickle)
        with trio.fail_after(10):  # a wait for bytes the frame does not owe would hang here
            for _ in frames:
                got.append(await fs.receive())
    assert [bytes(g.data) for g in got] == [bytes(f.data) for f in frames]
    assert calls <= 40, f"{calls} receives for {sum(sizes)} bytes in 32 KiB segments"
    sock = fs.stream.socket  # type: ignore[attr-defined]
    assert sock.getsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVLOWAT) == 1
    await raw.aclose()
    await fs.aclose()


@pytest.mark.timeout(20)
async def test_a_slow_sender_of_a_big_frame_over_tcp_is_not_taken_for_a_stalled_one() -> None:
    """Bytes that come slower than a piece per stall bound are still taken as they come (after
    PIECE_WAIT, or a quarter of the bound), so the bound counts from the last byte, as without pieces;
    a sender that stops is still cut off by it."""
    raw, fs = await _tcp_pair()
    fs.authenticated()
    fs.stall = 0.4  # a piece (1 MiB) takes 1.3 s at this rate: waiting for whole pieces would stall
    frame = Frame(RESPONSE, Msg.READ_RANGE, 7, data=os.urandom((1 << 20) + (1 << 19)))
    wire = encode_frame(frame) + bytes(frame.data)

    async def trickle(upto: int) -> None:
        for at in range(0, upto, 64 << 10):
            await raw.send_all(wire[at:min(at + (64 << 10), upto)])
            await trio.sleep(0.08)

    async with trio.open_nursery() as n:
        n.start_soon(trickle, len(wire))
        with trio.fail_after(10):
            got = await fs.receive()
    assert bytes(got.data) == bytes(frame.data)
    async with trio.open_nursery() as n:  # the same frame again, but its sender stops halfway
        n.start_soon(trickle, len(wire) // 2)
        with pytest.raises(ProtocolError, match="stalled: no byte of it for 0.4 s"), trio.fail_after(10):
            await fs.receive()
    await raw.aclose()
    await fs.aclose()


@pytest.mark.timeout(30)
async def test_a_cached_file_range_is_sent_by_the_event_loop_and_others_by_a_thread(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A range of at most INLINE_SEND_MAX whose pages are all in the page cache is sent without a
    worker thread (sendfile cannot wait for the disk); a range not cached, or bigger, goes to one. The
    receiver gets every byte either way; a peer that reads nothing ends the inline send after the
    stall bound, as it ends the thread's."""
    from dlfs.wire import protocol
    from dlfs.wire.protocol import INLINE_SEND_MAX, FileRange

    raw, receiver = await _tcp_pair()  # raw: the client end; its FrameStream sends here
    sender = FrameStream(raw, "sender")
    receiver.authenticated()
    path = tmp_path / "chunk"
    body = os.urandom(3 << 20)
    path.write_bytes(body)
    threads: list[object] = []
    run_sync = trio.to_thread.run_sync

    async def counting(fn, *args, **kw):  # type: ignore[no-untyped-def]
        threads.append(fn)
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)

    def ranged(off: int, n: int, cached: bool) -> FileRange:
        fd = os.open(path, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
        if cached:
            os.pread(fd, n, off)
        return FileRange(fd, off, n)

    cases = [(4096 + 7, 200_000, True, 0), (4096 + 7, 200_000, False, 1), (0, INLINE_SEND_MAX + 1, True, 1)]
    for i, (off, n, cached, in_threads) in enumerate(cases):
        del threads[:]
        r = ranged(off, n, cached)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send, Frame(RESPONSE, Msg.READ_RANGE, i + 1, data=r))
            got = await receiver.receive()
        assert bytes(got.data) == body[off:off + n], i
        assert len(threads) == in_threads, (i, threads)
    # A receiver that reads nothing: the inline send gives up after SENDFILE_STALL.
    monkeypatch.setattr(protocol, "SENDFILE_STALL", 0.3)
    del threads[:]
    r = ranged(0, INLINE_SEND_MAX, True)
    try:
        with pytest.raises(TimeoutError, match="peer read nothing for 0.3 s"):
            for _ in range(64):  # until the socket's buffers are full
                await protocol._sendfile_inline(raw.socket.fileno(), FileRange(r.fd, 0, INLINE_SEND_MAX))
    finally:
        r.close()
    assert not threads
    await raw.aclose()
    await receiver.aclose()


@pytest.mark.timeout(10)
async def test_bad_magic() -> None:
    with pytest.raises(ProtocolError, match="bad magic 0xbeef"):
        await _receive_raw(_header(magic=0xBEEF))


@pytest.mark.timeout(10)
async def test_wrong_version() -> None:
    with pytest.raises(ProtocolError, match="protocol version 2 not spoken"):
        await _receive_raw(_header(version=2))


@pytest.mark.timeout(10)
async def test_bad_kind() -> None:
    with pytest.raises(ProtocolError, match="kind 7"):
        await _receive_raw(_header(kind=7))


@pytest.mark.timeout(10)
async def test_size_limits_before_handshake() -> None:
    with pytest.raises(ProtocolError, match="over the size limit"):
        await _receive_raw(_header(meta_len=MAX_META_UNAUTHENTICATED + 1), close=False)
    with pytest.raises(ProtocolError, match="over the size limit"):
        await _receive_raw(_header(data_len=1), close=False)
    # Exactly at the limit is allowed.
    meta = {"pad": b"p" * (MAX_META_UNAUTHENTICATED - 8)}  # map, key "pad", bin16 header: 8 bytes
    raw = pack_meta(meta)
    assert len(raw) == MAX_META_UNAUTHENTICATED
    f = await _receive_raw(_header(meta_len=len(raw)) + raw)
    assert f.meta == meta


@pytest.mark.timeout(10)
async def test_size_limits_after_handshake() -> None:
    with pytest.raises(ProtocolError, match="over the size limit"):
        await _receive_raw(_header(meta_len=MAX_META + 1), authenticated=True, close=False)
    with pytest.raises(ProtocolError, match="over the size limit"):
        await _receive_raw(_header(data_len=MAX_DATA + 1), authenticated=True, close=False)
    # Bigger than the unauthenticated limits is fine once authenticated.
    meta = pack_meta({"x": b"m" * 10_000})
    f = await _receive_raw(_header(meta_len=len(meta), data_len=100_000) + meta + b"d" * 100_000, authenticated=True)
    assert f.meta == {"x": b"m" * 10_000} and len(f.data) == 100_000


@pytest.mark.timeout(10)
async def test_send_refuses_oversize_meta() -> None:
    left, _right = _memory_pair()
    with pytest.raises(ProtocolError, match="over the 1048576 limit"):
        await left.send(Frame(REQUEST, Msg.PUT_INDEX, 1, meta={"x": b"y" * MAX_META}))


@pytest.mark.timeout(10)
async def test_truncated_frames() -> None:
    meta = pack_meta({"a": 1, "b": b"x" * 50})
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        await _receive_raw(_header(meta_len=len(meta)) + meta[:10])
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        await _receive_raw(_header(meta_len=len(meta), data_len=100) + meta + b"d" * 99, authenticated=True)
    # A peer that stops halfway through a header sent a broken frame too, not a clean end.
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        await _receive_raw(_header()[:7])


@pytest.mark.timeout(10)
async def test_garbage_meta() -> None:
    with pytest.raises(ProtocolError, match="meta does not decode"):
        await _receive_raw(_header(meta_len=5) + b"\xc1" * 5)  # 0xc1 is never valid msgpack
    trailing = pack_meta({"a": 1}) + b"\x01"
    with pytest.raises(ProtocolError, match="meta does not decode"):
        await _receive_raw(_header(meta_len=len(trailing)) + trailing)
    as_list = msgpack.packb([1, 2, 3])
    with pytest.raises(ProtocolError, match="meta is not a map"):
        await _receive_raw(_header(meta_len=len(as_list)) + as_list)


async def _handshake(server_key: bytes, client_key: bytes, client_service: str = "data") -> dict[str, Any]:
    """Run both sides over a memory stream pair; returns each side's result or exception."""
    client_fs, server_fs = _memory_pair()
    out: dict[str, Any] = {}

    async def server() -> None:
        try:
            await server_handshake(server_fs, server_key, "data", "node-7")
            out["server"] = "ok"
        except HANDSHAKE_FAILURES as exc:
            out["server"] = exc
        finally:
            await server_fs.aclose()

    async def client() -> None:
        try:
            out["client"] = await client_handshake(client_fs, client_key, client_service)
        except HANDSHAKE_FAILURES as exc:
            out["client"] = exc
        finally:
            await client_fs.aclose()

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(server)
            n.start_soon(client)
    out["client_fs"], out["server_fs"] = client_fs, server_fs
    return out


@pytest.mark.timeout(10)
async def test_handshake_right_key() -> None:
    out = await _handshake(KEY, KEY)
    assert out["client"] == "node-7" and out["server"] == "ok"
    assert out["client_fs"].max_data == MAX_DATA and out["server_fs"].max_data == MAX_DATA


@pytest.mark.timeout(10)
async def test_handshake_wrong_key() -> None:
    out = await _handshake(KEY, OTHER_KEY)
    assert isinstance(out["client"], AuthError) and "refused us: wrong cluster key" in str(out["client"])
    assert isinstance(out["server"], AuthError) and "wrong cluster key" in str(out["server"])
    # Neither side lifted its size limits.
    assert out["client_fs"].max_data == 0 and out["server_fs"].max_data == 0


@pytest.mark.timeout(10)
async def test_handshake_wrong_service() -> None:
    out = await _handshake(KEY, KEY, client_service="meta")
    assert isinstance(out["client"], ProtocolError) and "is a data daemon, not meta" in str(out["client"])
    assert not isinstance(out["server"], str)  # the server never authenticated that peer


@pytest.mark.timeout(10)
async def test_client_refuses_a_server_without_the_key() -> None:
    """A fake daemon that accepts any client but cannot prove the key is refused by the client."""
    client_fs, server_fs = _memory_pair()

    async def impostor() -> None:
        await server_fs.send(Frame(RESPONSE, Msg.HELLO, 0, meta={"service": "data", "node": "x", "nonce": b"n" * 32}))
        f = await server_fs.receive()
        await server_fs.send(Frame(RESPONSE, Msg.AUTH_OK, f.req_id, meta={"mac": b"m" * 32}))

    async with trio.open_nursery() as n:
        n.start_soon(impostor)
        with pytest.raises(AuthError, match="does not know the cluster key"):
            await client_handshake(client_fs, KEY, "data")
    assert client_fs.max_data == 0


@pytest.mark.timeout(10)
async def test_server_refuses_a_peer_that_skips_the_handshake() -> None:
    client_fs, server_fs = _memory_pair()
    async with trio.open_nursery() as n:
        n.start_soon(client_fs.send, Frame(REQUEST, Msg.PING, 1))
        with pytest.raises(ProtocolError, match="did not start with the handshake"):
            await server_handshake(server_fs, KEY, "data", "n")
        hello = await client_fs.receive()
        assert hello.msg == Msg.HELLO and hello.meta["service"] == "data"


@pytest.mark.timeout(10)
async def test_server_handshake_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    # Virtual time: the clock jumps to each deadline, so the bound is checked exactly, not against a wall clock.
    _client_fs, server_fs = _memory_pair()
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await server_handshake(server_fs, KEY, "data", "n")  # the peer never answers
    assert trio.current_time() - start == pytest.approx(auth.HANDSHAKE_TIMEOUT)
