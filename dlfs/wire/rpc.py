"""Requests and responses over frames: a pipelined client connection and the server's loop."""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Generic, TypeVar

import trio
from msgspec import Struct

from dlfs.counters import MessageStats
from dlfs.errors import AuthError, DlfsError, ProtocolError, Unreachable, error_from_status, status_of
from dlfs.tasks import open_nursery
from dlfs.transport.base import Address
from dlfs.transport.tcp import TRANSPORT
from dlfs.wire import auth
from dlfs.wire.auth import client_handshake, server_handshake
from dlfs.wire.budget import ConnectionShare, MemoryBudget
from dlfs.wire.limits import ConnectionStats, HalfOpen, LogThrottle, accept_loop, peer_key
from dlfs.wire.messages import Clock, Empty, NodeName, msg_name, request, to_meta
from dlfs.wire.protocol import REQUEST, RESPONSE, FileRange, Frame, FrameStream, Msg, Payload

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
CALL_TIMEOUT = 60.0
# A daemon closes an authenticated connection with nothing in flight and no frame either way for this
# long; a client reopens a pooled one idle for half of it, so no call meets that close.
IDLE_TIMEOUT = 300.0
Reply = tuple[Struct | dict[str, Any], Payload]  # what a handler answers: its reply's body (messages.py), data
Response = tuple[dict[str, Any], bytes | bytearray | memoryview]  # what a caller receives
T = TypeVar("T")
Handler = Callable[[T, bytearray], Awaitable[Reply]]


@dataclass(frozen=True)
class Route(Generic[T]):
    """How a service answers one message: its request's schema (a messages.py Struct), which the
    request's meta is decoded into before `handler` runs, and the handler."""

    kind: type[T]
    handler: Handler[T]
    # Once its reply is sent, the connection's socket is given to this (a descriptor the callee owns) and
    # the service reads nothing more from it (Msg.RANGE_LANE). Only with no other request in flight.
    handover: Callable[[int], None] | None = None


@dataclass
class _Waiter:
    event: trio.Event
    frame: Frame | None = None
    error: DlfsError | None = None
    into: memoryview | None = None  # where the response's data should land
    filling: bool = False  # the response is being received into `into` right now


class Connection:
    """One authenticated connection to a daemon; many calls may be in flight at once."""

    def __init__(self, fs: FrameStream, node: str) -> None:
        self.fs = fs
        self.node = node
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        self._send_lock = trio.Lock()
        self.closed: DlfsError | None = None
        self.done = trio.Event()
        self.last_used = trio.current_time()  # when a call last began or ended

    def idle_expiring(self) -> bool:
        """No call in flight, and none for half the daemon's idle timeout: reopen rather than use it."""
        return not self._waiting and trio.current_time() - self.last_used > IDLE_TIMEOUT / 2

    async def aclose(self) -> None:
        """Close it from this side; calls made after fail at once."""
        if self.closed is None:
            self.closed = Unreachable(f"connection to {self.node} at {self.fs.peer} closed by this client")
        await self.fs.aclose()

    async def _read_responses(self) -> None:
        try:
            while True:
                f = await self.fs.receive(self._sink)
                w = self._waiting.pop(f.req_id, None)
                if w is not None:
                    w.frame = f
                    w.event.set()
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.closed = Unreachable(f"lost connection to {self.node} at {self.fs.peer} ({type(exc).__name__})")
        except ProtocolError as exc:
            self.closed = exc
        finally:
            if self.closed is None:
                self.closed = Unreachable(f"connection to {self.node} at {self.fs.peer} closed")
            for w in self._waiting.values():
                w.error = self.closed
                w.event.set()
            self._waiting.clear()
            self.done.set()

    def _sink(self, req_id: int, length: int) -> memoryview | None:
        w = self._waiting.get(req_id)
        if w is None or w.into is None or len(w.into) < length:
            return None
        w.filling = True
        return w.into

    async def call(self, msg: Msg, meta: dict[str, Any] | None = None,
                   data: bytes | bytearray | memoryview = b"", timeout: float = CALL_TIMEOUT,
                   into: memoryview | None = None) -> Response:
        """Send one request and wait for its response; a daemon's error is raised here.

        With `into`, a response's data that fits is received straight into it (and the reply's
        data is a view of it)."""
        if self.closed:
            raise self.closed
        req_id = next(self._ids) & 0xFFFFFFFF
        w = _Waiter(trio.Event(), into=into)
        self._waiting[req_id] = w
        self.last_used = trio.current_time()
        try:
            with trio.fail_after(timeout):
                async with self._send_lock:
                    try:
                        await self.fs.send(Frame(REQUEST, msg, req_id, 0, meta or {}, data))
                    except trio.Cancelled:
                        # Part of the frame may be on the wire: nothing sent after it would parse,
                        # so end the connection now and let every other call fail at once.
                        with trio.CancelScope(shield=True):
                            await self.fs.aclose()
                        raise
                await w.event.wait()
        except trio.TooSlowError:
            raise Unreachable(f"{self.node} at {self.fs.peer} did not answer {msg.name} within {timeout:g} s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise Unreachable(f"lost connection to {self.node} at {self.fs.peer} ({type(exc).__name__})") from None
        finally:
            self._waiting.pop(req_id, None)
            self.last_used = trio.current_time()
            if w.filling and not w.event.is_set():
                # Given up while its data is still arriving into the caller's memory: end the
                # connection, so that nothing writes there once the caller reuses it.
                with trio.CancelScope(shield=True):
                    await self.fs.aclose()
        if w.error:
            raise w.error
        assert w.frame is not None
        if w.frame.status:
            raise error_from_status(w.frame.status, str(w.frame.meta.get("error", "daemon error")))
        got = w.frame.data
        assert not isinstance(got, FileRange)  # only ever sent
        return w.frame.meta, got


async def open_stream(address: Address, key: bytes, service: str,
                      timeout: float = CONNECT_TIMEOUT) -> tuple[FrameStream, str]:
    """The frames of a new connection to the `service` daemon at `address`, authenticated, and the
    daemon's node name; Unreachable if it cannot be (the connection closed). The caller closes it."""
    try:
        with trio.fail_after(timeout):
            stream = await TRANSPORT.connect(address)
    except (OSError, trio.TooSlowError) as exc:
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else "timed out"
        raise Unreachable(f"cannot reach the {service} daemon at {address}: {reason}") from None
    fs = FrameStream(stream, str(address))
    try:
        return fs, await client_handshake(fs, key, service)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await fs.aclose()
        if isinstance(exc, trio.TooSlowError):
            raise Unreachable(f"the {service} daemon at {address} did not finish the handshake") from None
        if isinstance(exc, (trio.EndOfChannel, trio.BrokenResourceError, OSError)):
            raise Unreachable(f"the {service} daemon at {address} closed the connection during the handshake") from None
        raise


@asynccontextmanager
async def connect(address: Address, key: bytes, service: str,
                  timeout: float = CONNECT_TIMEOUT) -> AsyncIterator[Connection]:
    """An authenticated connection to the `service` daemon at `address`, closed on exit."""
    fs, node = await open_stream(address, key, service, timeout)
    try:
        conn = Connection(fs, node)
        async with open_nursery() as nursery:
            nursery.start_soon(conn._read_responses, name=f"dlfs-rpc-reader {address}")
            try:
                yield conn
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await fs.aclose()


@dataclass
class Peer:
    """One served connection's own state: what its handlers set up for that peer (an RDMA queue
    pair, registrations it holds) and undo through `on_close` when the connection ends."""

    name: str
    state: dict[str, Any] = field(default_factory=dict)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def on_close(self, fn: Callable[[], None]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:
                # One failed clean-up must not skip the others.
                log.exception("cleaning up after %s failed", self.name)


# Handlers run in tasks spawned by the connection's own task, so each sees its connection's Peer.
_PEER: contextvars.ContextVar[Peer] = contextvars.ContextVar("dlfs_peer")


def current_peer() -> Peer:
    """The Peer of the connection whose request is being handled."""
    return _PEER.get()


@dataclass(eq=False)
class _Request:
    """A request being answered, and the bytes it holds in its daemon's memory budget (its frame's,
    then its reply's too) until its answer is sent."""

    frame: Frame
    share: ConnectionShare
    held: int = 0
    refused: DlfsError | None = None  # not served: its frame found no room (read past, not kept)


# Set in each request's own task, for reserve_reply.
_REQUEST: contextvars.ContextVar[_Request] = contextvars.ContextVar("dlfs_request")


async def reserve_reply(nbytes: int) -> None:
    """Hold `nbytes` of the daemon's memory for the reply being built, until it is sent: for a handler
    whose reply's size is known before it reads it. Raises the budget's refusal (a DlfsError)."""
    req = _REQUEST.get(None)
    if req is None:  # a handler called directly, not by the server: there is no budget to hold
        return
    await req.share.reserve(nbytes)
    req.held += nbytes


class Service:
    """A daemon's request handlers by message id; `serve_stream` runs one connection."""

    name = "service"
    concurrency = 64

    def __init__(self, key: bytes, node: str, memory: MemoryBudget | None = None) -> None:
        self.key = key
        self.node = node
        # Bytes held for requests in flight; a node's daemons share one (node.py).
        self.memory = memory or MemoryBudget(f"node {node}")
        self.handlers: dict[int, Route[Any]] = {Msg.PING: Route(Empty, self._ping), Msg.TIME: Route(Empty, self._time)}
        self.served: dict[int, MessageStats] = {}  # by message id; 0 gathers the unknown ones
        self.conns = ConnectionStats()
        self.half_open = HalfOpen(self.conns)  # caps from limits.py, read now
        # Peers' misdeeds are counted (conns) and logged a line per LOG_INTERVAL at most, per kind.
        self._log_refused_key = LogThrottle(log)
        self._log_handshake = LogThrottle(log)
        self._log_closing = LogThrottle(log)
        self._log_refused_request = LogThrottle(log)

    def _account(self, f: Frame, reply: Frame, seconds: float) -> None:
        # Unknown ids share one entry: a peer sending garbage ids must not grow this without bound.
        key = f.msg if f.msg in self.handlers else 0
        s = self.served.get(key)
        if s is None:
            s = self.served[key] = MessageStats()
        s.requests += 1
        s.errors += reply.status != 0
        s.bytes_in += len(f.data)
        s.bytes_out += len(reply.data)
        s.latency.observe(seconds)

    async def _ping(self, req: Empty, data: bytearray) -> Reply:
        return NodeName(self.node), b""

    async def _time(self, req: Empty, data: bytearray) -> Reply:
        return Clock(self.node, time.time()), b""

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one peer until it leaves; bad frames or keys close this connection only.

        Until its handshake is done the connection is half-open (limits.HalfOpen: dropped first when
        too many are); then it is closed after IDLE_TIMEOUT with nothing in flight."""
        peer = _peer_name(stream)
        fs = FrameStream(stream, peer)
        state = Peer(peer)
        _PEER.set(state)
        share = self.memory.connection()
        try:
            if not await self._handshake(fs, peer_key(stream)):
                return
            self.conns.authenticated += 1
            try:
                await self._serve_requests(fs, share, state)
            finally:
                self.conns.authenticated -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("%s daemon: connection from %s dropped (%s)", self.name, peer, type(exc).__name__)
        except Exception:
            # Whatever one connection does, the daemon keeps serving the others.
            log.exception("%s daemon: connection from %s failed", self.name, peer)
        finally:
            share.close()  # a frame whose body never came still held its bytes
            state.close()
            with trio.CancelScope(shield=True):
                await fs.aclose()

    async def _handshake(self, fs: FrameStream, peer: str) -> bool:
        """True once the peer has proven the key; else why not is counted (conns.handshake_failures)
        and logged at most once per LOG_INTERVAL."""
        entry = self.half_open.admit(peer)
        failed, why = "", ""
        try:
            with entry.scope:  # cancelled when a newer connection needs the slot (counted there)
                await server_handshake(fs, self.key, self.name, self.node)
            return not entry.scope.cancel_called
        except AuthError as exc:
            self.conns.handshake_failures["wrong_key"] += 1
            self._log_refused_key.log(logging.WARNING, "%s daemon: %s", self.name, exc)
            return False
        except trio.TooSlowError:
            failed, why = "timeout", f"handshake not finished within {auth.HANDSHAKE_TIMEOUT:g} s"
        except ProtocolError as exc:
            failed, why = "malformed", f"handshake failed: {exc}"
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            failed, why = "closed", f"the peer left during the handshake ({type(exc).__name__})"
        finally:
            self.half_open.leave(entry)
        self.conns.handshake_failures[failed] += 1
        self._log_handshake.log(logging.INFO, "%s daemon: closing connection from %s: %s", self.name, fs.peer, why)
        return False

    async def _serve_requests(self, fs: FrameStream, share: ConnectionShare, peer: Peer) -> None:
        send_lock = trio.Lock()
        limiter = trio.CapacityLimiter(self.concurrency)
        async with open_nursery() as nursery:
            while True:
                try:
                    if not await self._wait_request(fs, limiter, peer):
                        self.conns.closed["idle"] += 1
                        log.debug("%s daemon: closing connection from %s: idle for %g s", self.name, fs.peer,
                                  IDLE_TIMEOUT)
                        break
                    req = await self._receive_request(fs, share)
                except trio.EndOfChannel:
                    break
                except ProtocolError as exc:
                    self.conns.closed["stall" if fs.stalled else "protocol"] += 1
                    self._log_closing.log(logging.WARNING, "%s daemon: closing connection from %s: %s",
                                          self.name, fs.peer, exc)
                    break
                route = self.handlers.get(req.frame.msg)
                if route is not None and route.handover is not None:
                    if await self._hand_over(fs, send_lock, limiter, req, route):
                        break
                    continue
                token = object()
                await limiter.acquire_on_behalf_of(token)
                nursery.start_soon(self._answer, fs, send_lock, limiter, token, req)
            nursery.cancel_scope.cancel()

    async def _hand_over(self, fs: FrameStream, send_lock: trio.Lock, limiter: trio.CapacityLimiter, req: _Request,
                         route: Route[Any]) -> bool:
        """Answer a request whose route takes the connection over, and give it over: True once given
        (the caller reads no more of it). Refused (an error reply, the connection as it was) while other
        requests are in flight or when the handler says no."""
        f = req.frame
        try:
            if req.refused is not None:
                raise req.refused
            if limiter.borrowed_tokens:
                raise ProtocolError(f"{msg_name(f.msg)} with requests in flight")
            body, _ = await route.handler(request(route.kind, f.meta, f.msg), f.data)  # type: ignore[arg-type]
            reply, given = Frame(RESPONSE, f.msg, f.req_id, 0, to_meta(body)), True
        except DlfsError as exc:
            reply, given = Frame(RESPONSE, f.msg, f.req_id, status_of(exc), {"error": exc.message}), False
        finally:
            req.share.release(req.held)
        async with send_lock:
            await fs.send(reply)
        if not given:
            return False
        try:
            fd = fs.detach()
        except ProtocolError as exc:  # it sent more already: not a peer that waits for the answer
            log.warning("%s daemon: closing connection from %s: %s", self.name, fs.peer, exc)
            return True
        assert route.handover is not None
        try:
            route.handover(fd)
        except OSError as exc:  # the reply is gone: the peer learns of it when the connection closes
            os.close(fd)
            log.warning("%s daemon: could not hand over the connection from %s: %s", self.name, fs.peer, exc)
        return True

    async def _wait_request(self, fs: FrameStream, limiter: trio.CapacityLimiter, peer: Peer) -> bool:
        """Until the next request begins (True), or the connection has been idle for IDLE_TIMEOUT:
        no request in flight, no frame either way, and no RDMA session (whose reads bypass it)."""
        while True:
            left = fs.last_activity + IDLE_TIMEOUT - trio.current_time()
            if left <= 0:
                if not limiter.borrowed_tokens and not peer.state:
                    return False
                left = IDLE_TIMEOUT  # in use: its reply will be activity
            if await fs.wait_frame(left):
                return True

    async def _receive_request(self, fs: FrameStream, share: ConnectionShare) -> _Request:
        """The next request, its frame's bytes reserved before they are read (waiting for room, the
        connection reads nothing more); one that gets no room is read past and comes back refused."""
        head = await fs.receive_head()
        if head.kind != REQUEST:
            raise ProtocolError("a response sent as a request")
        nbytes = head.meta_len + head.data_len
        try:
            await share.reserve(nbytes)
        except DlfsError as exc:
            await fs.skip_body(head)
            self._log_refused_request.log(logging.WARNING, "%s daemon: refused %s from %s: %s", self.name,
                                          msg_name(head.msg), fs.peer, exc)
            return _Request(Frame(REQUEST, head.msg, head.req_id), share, refused=exc)
        return _Request(await fs.receive_body(head), share, held=nbytes)

    async def _answer(self, fs: FrameStream, send_lock: trio.Lock, limiter: trio.CapacityLimiter,
                      token: object, req: _Request) -> None:
        _REQUEST.set(req)
        f = req.frame
        reply: Frame | None = None
        t0 = perf_counter()
        try:
            route = self.handlers.get(f.msg)
            try:
                if req.refused is not None:
                    raise req.refused
                if route is None:
                    raise ProtocolError(f"the {self.name} daemon does not handle message {f.msg}")
                # A body of the wrong shape is refused here, naming the field: handlers see only valid ones.
                body, data = await route.handler(request(route.kind, f.meta, f.msg), f.data)  # type: ignore[arg-type]
                reply = Frame(RESPONSE, f.msg, f.req_id, 0, to_meta(body), data)
            except DlfsError as exc:
                reply = Frame(RESPONSE, f.msg, f.req_id, status_of(exc), {"error": exc.message})
            except Exception as exc:
                # A bug in one handler must not take the daemon down with it.
                log.exception("%s daemon: %s failed", self.name, msg_name(f.msg))
                reply = Frame(RESPONSE, f.msg, f.req_id, 1, {"error": f"internal error in {msg_name(f.msg)}: {exc}"})
            self._account(f, reply, perf_counter() - t0)
            async with send_lock:
                await fs.send(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            if reply is not None and isinstance(reply.data, FileRange):
                reply.data.close()  # never sent (the connection went first)
            req.share.release(req.held)
            limiter.release_on_behalf_of(token)


def _peer_name(stream: trio.abc.Stream) -> str:
    sock = getattr(stream, "socket", None)
    try:
        name = sock.getpeername() if sock is not None else None
    except OSError:
        name = None
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name or "local peer")


async def serve(service: Service, address: Address, *,
                task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on `address` and serve `service` until cancelled; reports the bound addresses."""
    listeners = await TRANSPORT.listen(address)
    bound = []
    for lst in listeners:
        name = lst.socket.getsockname()  # type: ignore[attr-defined]
        bound.append(Address(path=name) if isinstance(name, str) else Address(name[0], name[1]))
    try:
        async with open_nursery() as nursery:
            for lst in listeners:
                assert isinstance(lst, trio.SocketListener)
                nursery.start_soon(accept_loop, lst, service.serve_stream, nursery, service.half_open,
                                   service.conns, f"{service.name} daemon", name=f"dlfs-accept {service.name}")
            task_status.started(bound)
    finally:
        with trio.CancelScope(shield=True):
            for lst in listeners:
                await lst.aclose()
