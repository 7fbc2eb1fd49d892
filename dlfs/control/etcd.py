"""A small etcd v3 client for trio: the JSON gateway (POST /v3/...) over httpx.

Only what the control plane uses: range, put, delete, transactions, leases and watches. Every
request has a bound (REQUEST_TIMEOUT); an endpoint that refuses, times out or has lost its quorum
is skipped for the next, and when none answers the caller gets one line naming them all
(EtcdUnavailable). Keys and values are bytes on the wire (base64 in JSON); here keys are str.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from dlfs.errors import ControlUnavailable, StorageFull, Unreachable

log = logging.getLogger(__name__)
REQUEST_TIMEOUT = 5.0  # seconds one request waits, over all endpoints; etcd without a leader answers within about this
FIRST_ATTEMPT = 1.5  # seconds one endpoint is given at first: more than an election takes (etcd's default 1 s)
ROUND_PAUSE = 0.2  # between rounds over the endpoints
WATCH_IDLE = 30.0  # a watch that hears nothing (not even progress) for this long is reopened
MAX_RESPONSE = 64 << 20  # the most one reply may hold: the catalog is small, a peer is not trusted


class EtcdUnavailable(ControlUnavailable):
    """No etcd endpoint answered (down, unreachable, or without a quorum)."""


class EtcdRefused(Unreachable):
    """etcd answered with an error that another endpoint would repeat (a bad request)."""


class EtcdFull(StorageFull):
    """etcd's NOSPACE alarm is raised: it takes no write until its space is freed and the alarm disarmed."""


NOSPACE = "database space exceeded"  # etcd's words for a write refused under its NOSPACE alarm


def nospace_fix(endpoints: str, revision: int | str = "REV") -> str:
    """What to run to free a full etcd (one line): compact, defragment, disarm the alarm."""
    e = f"ETCDCTL_API=3 etcdctl --endpoints={endpoints}"
    return (f"{e} compact {revision} && {e} defrag && {e} alarm disarm; if it fills again, raise its "
            "--quota-backend-bytes (dlfs compacts its history after every gc)")


def _b64(raw: str | bytes) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's "prefix" convention)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return raw.decode("latin-1")
        raw.pop()
    return "\0"


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def of(cls, raw: dict[str, Any]) -> KV:
        return cls(_unb64(raw["key"]).decode(), _unb64(raw.get("value", "")), int(raw.get("create_revision", 0)),
                   int(raw.get("mod_revision", 0)), int(raw.get("lease", 0)))

    def json(self) -> Any:
        return json.loads(self.value)


# --- transaction operations (the dicts the gateway takes) -------------------------------------------
def put_op(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"requestPut": body}


def delete_op(key: str, prefix: bool = False) -> dict[str, Any]:
    body = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key).encode("latin-1"))
    return {"requestDeleteRange": body}


def range_op(key: str, prefix: bool = False) -> dict[str, Any]:
    body = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key).encode("latin-1"))
    return {"requestRange": body}


def absent(key: str) -> dict[str, Any]:
    """Compare: `key` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def present(key: str) -> dict[str, Any]:
    return {"key": _b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def unchanged(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: `key` was last written at `mod_revision` (it still holds what was read)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


@dataclass
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KV]] = field(default_factory=list)  # each range op's kvs, in order


def _tls(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | bool:
    if not (ca or cert):
        return True
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class Etcd:
    """One client for a list of endpoints (http:// or https:// with the TLS files)."""

    def __init__(self, endpoints: list[str], ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, timeout: float = REQUEST_TIMEOUT) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._verify = _tls(ca_file, cert_file, key_file)
        self._http: httpx.AsyncClient | None = None
        self._first = 0  # the endpoint that answered last is asked first

    def describe(self) -> str:
        return ", ".join(self.endpoints)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(verify=self._verify, timeout=self.timeout,
                                           limits=httpx.Limits(max_connections=32, max_keepalive_connections=4))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self._http.aclose()
            self._http = None

    def _order(self) -> list[str]:
        n = len(self.endpoints)
        return [self.endpoints[(self._first + i) % n] for i in range(n)]

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v3/<path> to the first endpoint that answers for the cluster, within `timeout`.

        Endpoints are tried in rounds, each attempt bounded by FIRST_ATTEMPT at first and twice that
        each round: a member whose leader just died holds a write until a new one is elected (about
        an election timeout), so a short attempt and the next member beat waiting out one long one."""
        errors: dict[str, str] = {}
        deadline = trio.current_time() + self.timeout
        attempt = min(FIRST_ATTEMPT, self.timeout)
        while True:
            for endpoint in self._order():
                left = deadline - trio.current_time()
                if left <= 0:
                    raise EtcdUnavailable(f"etcd is unavailable ({'; '.join(f'{e}: {w}' for e, w in errors.items())})")
                try:
                    with trio.fail_after(min(attempt, left)):
                        r = await self._client().post(f"{endpoint}/v3/{path}", json=body)
                    if len(r.content) > MAX_RESPONSE:
                        raise EtcdRefused(f"etcd at {endpoint}: reply of {len(r.content)} bytes to {path} is too big")
                    doc = r.json() if r.content else {}
                except (httpx.HTTPError, OSError, ValueError, trio.TooSlowError) as exc:
                    why = why_failed(exc)
                    # An attempt the deadline cut short says less than the endpoint's last answer (a refusal).
                    if not (why == "timed out" and left < attempt and endpoint in errors):
                        errors[endpoint] = why
                    continue
                if r.status_code != 200 or "error" in doc:
                    message = str(doc.get("error") or doc.get("message") or f"HTTP {r.status_code}")
                    if NOSPACE in message:
                        raise await self._full()
                    if _retryable(message, r.status_code):
                        errors[endpoint] = message
                        continue
                    raise EtcdRefused(f"etcd at {endpoint} refused {path}: {message}")
                self._first = self.endpoints.index(endpoint)
                return doc
            # Every endpoint failed this round: a pause (refusals come back at once), then longer attempts.
            await trio.sleep(min(ROUND_PAUSE, max(0.0, deadline - trio.current_time())))
            attempt *= 2

    async def _full(self) -> EtcdFull:
        """The one line for a write refused under NOSPACE, with the revision to compact to (reads still work)."""
        endpoints = ",".join(self.endpoints)
        try:
            _, revision = await self.range("\0")
        except ControlUnavailable:
            revision = 0
        return EtcdFull(f"etcd's database is full (NOSPACE alarm at {self.describe()}): no ingest, rm, gc or "
                        f"new mount works until it is freed: {nospace_fix(endpoints, revision or 'REV')}")

    # --- keys -----------------------------------------------------------------------------------------
    async def range(self, key: str, prefix: bool = False, revision: int = 0) -> tuple[list[KV], int]:
        body = range_op(key, prefix)["requestRange"]
        if revision:
            body["revision"] = str(revision)
        doc = await self.call("kv/range", body)
        return [KV.of(kv) for kv in doc.get("kvs", [])], int(doc["header"]["revision"])

    async def get(self, key: str) -> KV | None:
        kvs, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        doc = await self.call("kv/put", put_op(key, value, lease)["requestPut"])
        return int(doc["header"]["revision"])

    async def delete(self, key: str, prefix: bool = False) -> int:
        doc = await self.call("kv/deleterange", delete_op(key, prefix)["requestDeleteRange"])
        return int(doc.get("deleted", 0))

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> TxnResult:
        doc = await self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        out = TxnResult(bool(doc.get("succeeded", False)), int(doc["header"]["revision"]))
        for r in doc.get("responses", []):
            if "response_range" in r:
                out.ranges.append([KV.of(kv) for kv in r["response_range"].get("kvs", [])])
        return out

    async def compact(self, revision: int) -> bool:
        """Drop the history before `revision`; False if it is compacted that far already."""
        try:
            await self.call("kv/compaction", {"revision": str(revision)})
        except EtcdRefused as exc:
            if "compacted" in str(exc) or "future revision" in str(exc):
                return False
            raise
        return True

    # --- leases ---------------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        doc = await self.call("lease/grant", {"TTL": str(ttl)})
        return int(doc["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew a lease once; returns its TTL now, 0 if it has already expired (it is gone)."""
        try:
            doc = await self.call("lease/keepalive", {"ID": str(lease)})
        except EtcdRefused as exc:
            if "not found" in str(exc):
                return 0
            raise
        return int(doc.get("result", doc).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("lease/revoke", {"ID": str(lease)})
        except EtcdRefused as exc:
            if "not found" not in str(exc):
                raise

    # --- watches --------------------------------------------------------------------------------------
    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[int, None]:
        """Yield the revision of every change under `prefix` from `start_revision` on. Ends (returns)
        when the stream breaks or stays silent WATCH_IDLE; the caller re-reads and watches again."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix).encode("latin-1")),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        endpoint = self._order()[0]
        try:
            async with self._client().stream("POST", f"{endpoint}/v3/watch", json=body,
                                             timeout=httpx.Timeout(self.timeout, read=WATCH_IDLE)) as stream:
                if stream.status_code != 200:
                    return
                async for line in stream.aiter_lines():
                    if len(line) > MAX_RESPONSE:
                        return
                    try:
                        result = json.loads(line).get("result", {})
                    except ValueError:
                        return
                    if result.get("canceled") or result.get("compact_revision"):
                        return
                    for ev in result.get("events", []):
                        yield int(ev.get("kv", {}).get("mod_revision", 0))
        except (httpx.HTTPError, OSError):
            return

    # --- health ---------------------------------------------------------------------------------------
    async def status(self, endpoint: str) -> dict[str, Any]:
        """One endpoint's own status (its version, leader, raft index), for `dlfs doctor`."""
        with trio.fail_after(self.timeout + 1):
            r = await self._client().post(f"{endpoint}/v3/maintenance/status", json={})
        doc = r.json()
        if r.status_code != 200 or "error" in doc:
            raise EtcdRefused(str(doc.get("error") or f"HTTP {r.status_code}"))
        return dict(doc)

    async def alarms(self, endpoint: str) -> list[str]:
        """The cluster's raised alarms (NOSPACE, CORRUPT), as one endpoint reports them."""
        with trio.fail_after(self.timeout + 1):
            r = await self._client().post(f"{endpoint}/v3/maintenance/alarm", json={"action": "GET"})
        doc = r.json()
        if r.status_code != 200 or "error" in doc:
            raise EtcdRefused(str(doc.get("error") or f"HTTP {r.status_code}"))
        return sorted({str(a.get("alarm", "?")) for a in doc.get("alarms") or []})

    async def quota(self, endpoint: str) -> int:
        """The member's backend quota in bytes (its /metrics), 0 where it does not say."""
        with trio.fail_after(self.timeout + 1):
            r = await self._client().get(f"{endpoint}/metrics")
        for line in r.text.splitlines() if r.status_code == 200 else []:
            if line.startswith("etcd_server_quota_backend_bytes "):
                return int(float(line.split()[1]))
        return 0


def why_failed(exc: BaseException) -> str:
    """Why a request to an etcd endpoint failed, in a few words: "connection refused" (nothing listens
    there), "network is unreachable", "no route to host", "timed out", ..."""
    if isinstance(exc, trio.TooSlowError | httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        # httpx under trio says "all attempts to connect to H:P failed" whatever the cause: the
        # cause is in the attempts' own errors, underneath.
        causes = sorted({_strerror(e).lower() for e in _os_errors(exc)})
        return "; ".join(causes) or str(exc) or "cannot connect"
    return str(exc) or type(exc).__name__


def _strerror(e: OSError) -> str:
    """An OSError's own words ("Connection refused"), without the "Error connecting to ..." around them."""
    return os.strerror(e.errno) if e.errno is not None and e.errno > 0 else e.strerror or str(e)


def _os_errors(exc: BaseException) -> list[OSError]:
    """The OSErrors with an errno beneath `exc`: its causes, and each attempt of an exception group."""
    found: list[OSError] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            found.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo += [e.__cause__, e.__context__]
    return found


def _retryable(message: str, status: int) -> bool:
    """Errors another member may not have: no leader, timeouts, a member being stopped."""
    text = message.lower()
    return status >= 500 or any(s in text for s in ("no leader", "timed out", "timeout", "stopped", "unavailable",
                                                    "not capable", "leader changed", "too many requests"))
