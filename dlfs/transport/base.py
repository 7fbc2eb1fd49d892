"""Addresses of daemons, and the interface of reads of chunk ranges into memory the transport
provides (RDMA); byte streams are trio's own (dlfs/transport/tcp.py)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dlfs.errors import UsageError

if TYPE_CHECKING:
    from dlfs.config import NodeSpec


@dataclass(frozen=True, slots=True)
class Address:
    """Where a daemon listens: a TCP host and port, or a Unix socket path."""

    host: str = ""
    port: int = 0
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> Address:
        if text.startswith("unix:"):
            return cls(path=text[5:])
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise UsageError(f"not an address: {text!r} (use HOST:PORT or unix:PATH)")
        return cls(host=host.strip("[]"), port=int(port))

    def __str__(self) -> str:
        if self.path:
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class RangeReader(Protocol):
    """Reads byte ranges of chunks from one data node by a path other than the byte stream (RDMA).

    `read_range` returns the bytes (shorter at the chunk's end), in `into` where it can (the caller's
    memory, e.g. a cache slab), raises NotFound when the node
    lacks the chunk, Unreachable when its daemon cannot be reached, and RdmaFailure when this path
    cannot serve the read: the caller then reads it over the byte stream.
    """

    name: str

    async def read_range(self, spec: NodeSpec, cid: bytes, offset: int, length: int,
                         timeout: float, into: memoryview | None = None) -> bytes | bytearray | memoryview: ...

    def attach_arena(self, arena: mmap.mmap, slab_size: int) -> None:
        """Reads with `into` in this arena (the mount's cache, cut in slabs) may land there directly."""

    def stats(self) -> dict[str, int]: ...
