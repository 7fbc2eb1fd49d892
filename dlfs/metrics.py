"""Prometheus metrics of a node or a mount, served over HTTP with `--metrics HOST:PORT`.

The numbers are plain counters kept where the work happens (counters.py, the services, the chunk
cache); the collectors here read them only when Prometheus scrapes, so metrics add nothing to the
read path. The HTTP server is a few lines of trio: it lives in the process's nursery like every
other task, and a slow or broken scraper holds one bounded connection, never the process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from dlfs.counters import LATENCY_BOUNDS, LatencyHistogram
from dlfs.errors import UsageError
from dlfs.transport.base import Address
from dlfs.wire.limits import ConnectionStats, HalfOpen, accept_loop, peer_key
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
REQUEST_TIMEOUT = 10.0
# Scrapers are few: connections beyond these close the oldest (a flood cannot take the process's descriptors).
MAX_SCRAPES, MAX_SCRAPES_PER_PEER = 32, 8
MAX_REQUEST_HEAD = 8192


def parse_metrics_address(text: str) -> Address:
    """HOST:PORT, or :PORT for every interface."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"bad --metrics address {text!r}: use HOST:PORT (e.g. 127.0.0.1:9420) or :PORT")
    return Address(host.strip("[]"), int(port))


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels, unit="seconds")


def _add_histogram(family: HistogramMetricFamily, values: list[str], h: LatencyHistogram) -> None:
    family.add_metric(values, h.cumulative(), h.sum)


def _histogram_from_dict(doc: dict[str, Any]) -> LatencyHistogram:
    h = LatencyHistogram()
    counts = list(doc.get("counts", []))
    if len(counts) == len(LATENCY_BOUNDS) + 1:
        h.counts = [int(c) for c in counts]
    h.sum = float(doc.get("sum", 0.0))
    return h


def _msg_label(msg: int) -> str:
    try:
        return Msg(msg).name
    except ValueError:
        return "UNKNOWN"


class NodeCollector:
    """A node's metrics: requests by daemon and message type, its chunk store, its replica count."""

    def __init__(self, node: str, services: list[Any], store: Any = None, data: Any = None,
                 census: Any = None) -> None:
        self.node, self.services, self.store, self.data, self.census = node, services, store, data, census

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "service", "msg"]
        requests = CounterMetricFamily("dlfs_requests", "Requests served, by daemon and message type", labels=labels)
        errors = CounterMetricFamily("dlfs_request_errors", "Requests answered with an error", labels=labels)
        sent = CounterMetricFamily("dlfs_sent_bytes", "Data bytes sent in replies (chunk ranges, index pieces)",
                                   labels=labels)
        received = CounterMetricFamily("dlfs_received_bytes", "Data bytes received in requests (chunk writes)",
                                       labels=labels)
        latency = _histogram("dlfs_request_duration", "Time to handle a request (READ_RANGE: a chunk read)", labels)
        for service in self.services:
            for msg, s in sorted(service.served.items()):
                values = [self.node, service.name, _msg_label(msg)]
                requests.add_metric(values, s.requests)
                errors.add_metric(values, s.errors)
                sent.add_metric(values, s.bytes_out)
                received.add_metric(values, s.bytes_in)
                _add_histogram(latency, values, s.latency)
        yield from (requests, errors, sent, received, latency)
        yield from self._connections()
        if self.services:  # a node's daemons share one budget (node.py)
            memory = self.services[0].memory
            yield _gauge("dlfs_request_memory_bytes", "Bytes held now for requests in flight (frames, index pieces)",
                         self.node, memory.reserved)
            yield _gauge("dlfs_request_memory_limit_bytes", "The most bytes requests in flight may hold",
                         self.node, memory.total)
            waits = CounterMetricFamily("dlfs_request_memory_waits", "Requests that waited for memory to be freed",
                                        labels=["node"])
            waits.add_metric([self.node], memory.waits)
            refusals = CounterMetricFamily("dlfs_request_memory_refusals",
                                           "Requests refused for memory: over the per-connection cap, or busy "
                                           "(no room within the wait bound)", labels=["node", "reason"])
            refusals.add_metric([self.node, "over_cap"], memory.refused)
            refusals.add_metric([self.node, "busy"], memory.busy)
            yield from (waits, refusals)
        if self.store is not None:
            free, total = self.store.disk()
            for name, doc, value in (
                ("dlfs_chunks_stored", "Chunks stored by this data daemon", self.store.count),
                ("dlfs_stored_bytes", "Bytes of the chunks stored by this data daemon", self.store.bytes),
                ("dlfs_disk_free_bytes", "Free bytes on the data daemon's file system", free),
                ("dlfs_disk_size_bytes", "Size of the data daemon's file system", total),
            ):
                yield _gauge(name, doc, self.node, value)
        if self.data is not None:
            c = CounterMetricFamily("dlfs_checksum_failures", "Chunks this data daemon found or received corrupt",
                                    labels=["node"])
            c.add_metric([self.node], self.data.checksum_failures)
            yield c
            lanes = self.data.lane_stats()
            if lanes:  # READ_RANGEs of mounts' serving threads, answered by native threads (not in dlfs_requests)
                yield _gauge("dlfs_range_lanes", "Range lanes open now (connections carrying READ_RANGE alone)",
                             self.node, lanes["open"])
                for name, doc, key in (
                    ("dlfs_range_lane_reads", "READ_RANGEs answered on range lanes", "reads"),
                    ("dlfs_range_lane_bytes", "Bytes sent on range lanes", "bytes"),
                    ("dlfs_range_lane_not_found", "READ_RANGEs on range lanes of chunks not here", "not_found"),
                    ("dlfs_range_lanes_closed_bad", "Range lanes closed for a frame out of shape, a stall or a "
                                                    "failed send", "closed_bad"),
                ):
                    c = CounterMetricFamily(name, doc, labels=["node"])
                    c.add_metric([self.node], lanes[key])
                    yield c
        if self.census is not None and self.census.taken_at:
            k = self.census
            yield _gauge("dlfs_chunks_live", "Chunks referenced by live dataset versions", self.node, k.chunks)
            yield _gauge("dlfs_chunks_under_replicated",
                         "Chunks stored on fewer than the cluster's replicas (reachable data nodes)", self.node,
                         k.under_replicated)
            yield _gauge("dlfs_replicas_missing", "Replicas the under-replicated chunks lack, all together",
                         self.node, k.replicas_missing)
            yield _gauge("dlfs_data_nodes_unreachable", "Data daemons that did not answer the replica count",
                         self.node, k.unreachable)
            yield _gauge("dlfs_replica_count_timestamp_seconds", "When the replica count was taken (Unix time)",
                         self.node, k.taken_at)


    def _connections(self) -> Iterator[Metric]:
        """Each daemon's connections (wire/limits.py): open ones, and what ended others early."""
        open_ = GaugeMetricFamily("dlfs_connections", "Connections open now: half_open (handshake not finished) "
                                  "or authenticated", labels=["node", "service", "state"])
        failed = CounterMetricFamily("dlfs_handshake_failures", "Connections closed before their handshake finished, "
                                     "by reason (cap: dropped for a newer one over the half-open caps)",
                                     labels=["node", "service", "reason"])
        closed = CounterMetricFamily("dlfs_connections_closed", "Authenticated connections the daemon closed, by "
                                     "reason (idle, a stalled frame, a bad frame)", labels=["node", "service", "reason"])
        accept = CounterMetricFamily("dlfs_accept_errors", "Connections not accepted for want of descriptors or "
                                     "memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)", labels=["node", "service"])
        for service in self.services:
            c = service.conns
            open_.add_metric([self.node, service.name, "half_open"], len(service.half_open))
            open_.add_metric([self.node, service.name, "authenticated"], c.authenticated)
            for reason, n in c.handshake_failures.items():
                failed.add_metric([self.node, service.name, reason], n)
            for reason, n in c.closed.items():
                closed.add_metric([self.node, service.name, reason], n)
            accept.add_metric([self.node, service.name], c.accept_errors)
        yield from (open_, failed, closed, accept)


def _gauge(name: str, doc: str, node: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["node"])
    g.add_metric([node], value)
    return g


class MountCollector:
    """A mount's metrics, from the same snapshot `dlfs stats` reads (mount/statsfile.py)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        ds = [s["dataset"]]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return _labelled(CounterMetricFamily(name, doc, labels=["dataset"]), ds, value)

        yield counter("dlfs_mount_reads", "FUSE reads answered", s["reads"])
        yield counter("dlfs_mount_read_bytes", "Bytes returned by FUSE reads", s["read_bytes"])
        yield counter("dlfs_mount_read_errors", "FUSE reads that failed (EIO and the like)", s["read_errors"])
        h = _histogram("dlfs_mount_read_duration", "Time to answer a FUSE read", ["dataset"])
        _add_histogram(h, ds, _histogram_from_dict(s["read_seconds"]))
        yield h
        yield counter("dlfs_cache_hits", "Record lookups answered by the chunk cache", s["cache_hits"])
        yield counter("dlfs_cache_misses", "Record lookups that had to fetch", s["cache_misses"])
        yield counter("dlfs_cache_evictions", "Records dropped from the cache's scratch area", s["cache_evictions"])
        yield _labelled(GaugeMetricFamily("dlfs_cache_bytes", "Bytes held by the chunk cache", labels=["dataset"]),
                        ds, s["cache_bytes"])
        yield _labelled(GaugeMetricFamily("dlfs_cache_capacity_bytes", "The chunk cache's capacity",
                                          labels=["dataset"]), ds, s["cache_capacity"])
        fetches = CounterMetricFamily("dlfs_fetches", "Chunk range fetches, by the node that served them",
                                      labels=["dataset", "node"])
        fetched = CounterMetricFamily("dlfs_fetched_bytes", "Bytes fetched, by the node that served them",
                                      labels=["dataset", "node"])
        for node, n in sorted(s["by_node"].items()):
            fetches.add_metric([s["dataset"], node], n["fetches"])
            fetched.add_metric([s["dataset"], node], n["bytes"])
        yield fetches
        yield fetched
        yield counter("dlfs_in_place_bytes", "Bytes read from this machine's chunk files in place, not through a "
                      "data daemon (a copy that failed its check too)", s.get("in_place_bytes", 0))
        h = _histogram("dlfs_fetch_duration", "Time to fetch a chunk range from one replica", ["dataset"])
        _add_histogram(h, ds, _histogram_from_dict(s["fetch_seconds"]))
        yield h
        yield counter("dlfs_failovers", "Fetches retried on another replica after one failed", s["failovers"])
        yield counter("dlfs_checksum_failures", "Fetched records that failed their checksum", s["checksum_failures"])
        yield _labelled(GaugeMetricFamily("dlfs_nodes_failing", "Nodes this mount reads last after a failure",
                                          labels=["dataset"]), ds, len(s["failing_nodes"]))
        dc = s.get("disk_cache")
        if dc:  # --cache-dir
            if dc["held_bytes"] is not None:
                yield _labelled(GaugeMetricFamily("dlfs_disk_cache_bytes", "Bytes the disk cache holds (all its users')",
                                                  labels=["dataset"]), ds, dc["held_bytes"])
            if dc["size_bytes"] is not None:
                yield _labelled(GaugeMetricFamily("dlfs_disk_cache_size_bytes", "The disk cache's --cache-dir-size",
                                                  labels=["dataset"]), ds, dc["size_bytes"])
            yield counter("dlfs_disk_cache_written_bytes", "Bytes this mount wrote to the disk cache",
                          dc["written_bytes"])
            yield counter("dlfs_disk_cache_evicted_bytes", "Bytes this mount evicted from the disk cache",
                          dc["evicted_bytes"])
            yield counter("dlfs_disk_cache_dropped_writes", "Fetched ranges not kept in the disk cache: its writer "
                          "was behind", dc["dropped_writes"])


def _labelled(family: Any, values: list[str], value: float) -> Any:
    family.add_metric(values, value)
    return family


def registry_of(collector: Any) -> CollectorRegistry:
    """A registry with `collector` and the process's own metrics (CPU, memory, open files)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


async def serve_metrics(address: Address, registry: CollectorRegistry,
                        refresh: Callable[[], Awaitable[None]] | None = None, *,
                        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer GET /metrics on `address` until cancelled; reports the bound address.

    `refresh` runs before each scrape (the metadata daemon's replica count, itself rate-limited).
    """
    try:
        listeners = await trio.open_tcp_listeners(address.port, host=address.host or None)
    except OSError as exc:
        raise UsageError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from None
    name = listeners[0].socket.getsockname()
    bound = Address(address.host or name[0], name[1])
    task_status.started(bound)
    gate = HalfOpen(ConnectionStats(), MAX_SCRAPES, MAX_SCRAPES_PER_PEER)

    async def scrape(stream: trio.SocketStream) -> None:
        entry = gate.admit(peer_key(stream))
        try:
            with entry.scope:
                await _answer(registry, refresh, stream)
        finally:
            gate.leave(entry)
            await stream.aclose()

    try:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(accept_loop, listener, scrape, nursery, gate, gate.stats, "metrics")
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8", head: bool = False) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + (b"" if head else body)


async def _answer(registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None,
                  stream: trio.SocketStream) -> None:
    async with stream:
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                head = b""
                while b"\r\n\r\n" not in head and b"\n\n" not in head:
                    more = await stream.receive_some(4096)
                    if not more:
                        break
                    head += more
                    if len(head) > MAX_REQUEST_HEAD:
                        await stream.send_all(_response("431 Request Header Fields Too Large", b"too large\n"))
                        return
                parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
                if len(parts) < 2:
                    await stream.send_all(_response("400 Bad Request", b"bad request\n"))
                    return
                method, path = parts[0], parts[1].split(b"?", 1)[0]
                if method not in (b"GET", b"HEAD"):
                    await stream.send_all(_response("405 Method Not Allowed", b"GET /metrics\n"))
                elif path not in (b"/metrics", b"/"):
                    await stream.send_all(_response("404 Not Found", b"metrics are at /metrics\n"))
                else:
                    if refresh is not None:
                        await refresh()
                    body = generate_latest(registry)
                    await stream.send_all(_response("200 OK", body, CONTENT_TYPE_LATEST, method == b"HEAD"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper went away; nothing to tell it
