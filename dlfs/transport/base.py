"""Addresses and the transport interface every connection goes through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import trio

from dlfs.errors import UsageError


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


class Transport(Protocol):
    """Opens byte streams to daemons and listens for them."""

    name: str

    async def connect(self, address: Address) -> trio.abc.Stream: ...

    async def listen(self, address: Address) -> list[trio.abc.Listener[trio.abc.Stream]]: ...
