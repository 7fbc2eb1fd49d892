"""The cluster key and the HMAC challenge handshake every connection starts with.

server -> HELLO   {service, node, nonce}
client -> AUTH    {nonce, mac = HMAC-SHA256(key, "dlfs-client" | server nonce | client nonce | service)}
server -> AUTH_OK {mac = HMAC-SHA256(key, "dlfs-server" | client nonce | server nonce | service)}

Both sides prove the key; the key never crosses the wire. A wrong MAC gets an AuthError frame and
the connection is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

import trio

from dlfs.errors import AuthError, DlfsError, KeyExposed, ProtocolError, UsageError, status_of
from dlfs.wire.protocol import REQUEST, RESPONSE, Frame, FrameStream, Msg

log = logging.getLogger(__name__)
KEY_BYTES = 32
HANDSHAKE_TIMEOUT = 10.0


def write_key(path: Path) -> bytes:
    """Create a new random key file, mode 0600; refuses to overwrite."""
    key = secrets.token_bytes(KEY_BYTES)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def key_exposure(mode: int) -> str | None:
    """Who besides its owner may read or change a key file of `mode` ("group", "others", "group and
    others"), or None: the one rule for key files, which the node, every command and `dlfs doctor` apply."""
    return " and ".join(who for who, bits in (("group", 0o070), ("others", 0o007)) if mode & bits) or None


def read_key(path: Path) -> bytes:
    """The key in `path`, refused if anyone but its owner may read or change the file."""
    try:
        with open(path) as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if key_exposure(mode):
                raise KeyExposed(f"cluster key {path} can be read or changed by other users (mode {mode:04o}): "
                                 f"run `chmod 600 {path}`", str(path))
            text = f.read().strip()
    except FileNotFoundError:
        raise UsageError(f"cluster key {path} does not exist (create one with `dlfs keygen {path}`)") from None
    except OSError as exc:
        raise UsageError(f"cannot read cluster key {path}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"cluster key {path} is not a hex key") from None
    if len(key) < 16:
        raise UsageError(f"cluster key {path} is too short ({len(key)} bytes; need 16 or more)")
    return key


def _mac(key: bytes, label: bytes, a: bytes, b: bytes, service: str) -> bytes:
    return hmac.new(key, label + a + b + service.encode(), hashlib.sha256).digest()


async def server_handshake(fs: FrameStream, key: bytes, service: str, node: str) -> None:
    """Challenge a new peer; raises AuthError (after telling it) if it does not know the key."""
    nonce = secrets.token_bytes(32)
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        await fs.send(Frame(RESPONSE, Msg.HELLO, 0, meta={"service": service, "node": node, "nonce": nonce}))
        f = await fs.receive()
        if f.msg != Msg.AUTH or not isinstance(f.meta.get("nonce"), bytes) or not isinstance(f.meta.get("mac"), bytes):
            raise ProtocolError(f"{fs.peer} did not start with the handshake")
        cnonce = f.meta["nonce"]
        if not hmac.compare_digest(f.meta["mac"], _mac(key, b"dlfs-client", nonce, cnonce, service)):
            err = AuthError("wrong cluster key")
            await fs.send(Frame(RESPONSE, Msg.AUTH_OK, f.req_id, status_of(err), {"error": err.message}))
            raise AuthError(f"refused {fs.peer}: wrong cluster key")
        await fs.send(Frame(RESPONSE, Msg.AUTH_OK, f.req_id, meta={"mac": _mac(key, b"dlfs-server", cnonce, nonce, service)}))
    fs.authenticated()


async def client_handshake(fs: FrameStream, key: bytes, service: str) -> str:
    """Prove the key to a daemon and check that it knows it too; returns the daemon's node name."""
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        hello = await fs.receive()
        if hello.msg != Msg.HELLO or not isinstance(hello.meta.get("nonce"), bytes):
            raise ProtocolError(f"{fs.peer} is not a dlfs daemon")
        if hello.meta.get("service") != service:
            raise ProtocolError(f"{fs.peer} is a {hello.meta.get('service')} daemon, not {service}")
        nonce = hello.meta["nonce"]
        cnonce = secrets.token_bytes(32)
        await fs.send(Frame(REQUEST, Msg.AUTH, 0, meta={"nonce": cnonce, "mac": _mac(key, b"dlfs-client", nonce, cnonce, service)}))
        ok = await fs.receive()
        if ok.status:
            raise AuthError(f"{fs.peer} refused us: {ok.meta.get('error', 'wrong cluster key')}")
        mac = ok.meta.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(key, b"dlfs-server", cnonce, nonce, service)):
            raise AuthError(f"{fs.peer} does not know the cluster key")
    fs.authenticated()
    return str(hello.meta.get("node", "?"))


__all__ = ["client_handshake", "server_handshake", "read_key", "write_key", "DlfsError"]
