"""TCP everywhere, and Unix sockets on one node: both are trio socket streams."""

from __future__ import annotations

import os

import trio

from dlfs.transport.base import Address


class SocketTransport:
    """TCP (with TCP_NODELAY, trio's default) or a Unix socket, by the address's kind."""

    name = "tcp"

    async def connect(self, address: Address) -> trio.abc.Stream:
        if address.path:
            return await trio.open_unix_socket(address.path)
        return await trio.open_tcp_stream(address.host, address.port)

    async def listen(self, address: Address) -> list[trio.abc.Listener[trio.abc.Stream]]:
        if address.path:
            try:
                os.unlink(address.path)  # a socket file left by a daemon that died
            except FileNotFoundError:
                pass
            sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
            await sock.bind(address.path)
            sock.listen(128)
            return [trio.SocketListener(sock)]
        return list(await trio.open_tcp_listeners(address.port, host=address.host or None))


TRANSPORT = SocketTransport()
