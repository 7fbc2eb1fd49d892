"""Plain counters kept on the hot paths; metrics.py and the stats file read them when asked.

Recording is an integer addition or one bisect: no locks, no label lookups, no imports beyond the
standard library. Everything here is read by the same process (the metrics server and the stats
writer run in its trio loop), so plain ints are enough.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Upper bounds in seconds, from a cached FUSE read (tens of microseconds) to a failover (seconds).
LATENCY_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                  0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Durations in fixed buckets (Prometheus `le` semantics: a value equal to a bound is in it)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) for every bound and +Inf, as Prometheus exposes them."""
        out, running = [], 0
        for bound, n in zip((*map(repr, LATENCY_BOUNDS), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.sum}


class MessageStats:
    """What one daemon served for one message type."""

    __slots__ = ("requests", "errors", "bytes_in", "bytes_out", "latency")

    def __init__(self) -> None:
        self.requests = self.errors = self.bytes_in = self.bytes_out = 0
        self.latency = LatencyHistogram()
