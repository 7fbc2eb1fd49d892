"""A real S3 server for the tests: moto's standalone server on a free localhost port, and a proxy of
the tests' own in front of it that fails a share of the requests (503 SlowDown, 500, a reset
connection, a body cut short) and can run a hook before it forwards one (to change an object
between the listing and its read)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from etcdlab import free_ports

START_TIMEOUT = 30.0
# What the dlfs subprocesses and the tests' own clients use: moto takes any credentials until auth is
# switched on (`MotoServer.auth`); config files of the user running the tests must not count.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
         "AWS_REGION")


def aws_env(scratch: Path) -> dict[str, str | None]:
    """The environment for an S3 test: fixed credentials, no config files, no endpoint (None: unset)."""
    env: dict[str, str | None] = dict.fromkeys(UNSET)
    env.update(CREDENTIALS)
    env["AWS_CONFIG_FILE"] = str(scratch / "no-aws-config")
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(scratch / "no-aws-credentials")
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata probe for credentials
    return env


class MotoServer:
    """`python -m moto.server` on a free port, in a process of its own (it serves with the GIL of
    that process, not the tests')."""

    def __init__(self, log: Path) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"moto did not start within {START_TIMEOUT} s:\n{log.read_text()}") from None
                time.sleep(0.1)

    def client(self, **kwargs: Any) -> Any:
        import boto3
        from botocore.config import Config

        kwargs.setdefault("aws_access_key_id", CREDENTIALS["AWS_ACCESS_KEY_ID"])
        kwargs.setdefault("aws_secret_access_key", CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        # No checksums computed for uploads: filling the bucket is the tests' longest wait.
        config = Config(max_pool_connections=16, request_checksum_calculation="when_required")
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", config=config, **kwargs)

    def iam_user(self, name: str) -> tuple[str, str]:
        """A user with an access key and no permissions: (key id, secret)."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def _reset_auth(self, count: str) -> None:
        req = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.load(resp)["status"] == "ok"

    @contextmanager
    def auth(self) -> Iterator[None]:
        """While inside: moto checks every request's signature against its IAM users, and their
        permissions (INITIAL_NO_AUTH_ACTION_COUNT = 0), as S3 does."""
        self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth("inf")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
            b"request rate.</Message></Error>")
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>We encountered an '
            b"internal error. Please try again.</Message></Error>")
FAULTS = ("slowdown", "internal", "reset", "truncate")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}


class FlakyProxy:
    """An HTTP proxy to `upstream` that fails `fail_rate` of the requests, one of FAULTS chosen at
    random (seeded), and counts what it did in `faults`. `hooks` run (method, path) before a request
    is forwarded; `strip_if_match` drops If-Match, as a store that ignores it would."""

    def __init__(self, upstream: str, fail_rate: float = 0.0, seed: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.requests = 0
        self.served = 0  # bytes of object data passed on (GET bodies), to tell what a reader fetched
        self.hooks: list[Callable[[str, str], None]] = []
        self.strip_if_match = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="flaky-proxy", daemon=True)
        self.thread.start()

    def pick(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.rng.random() >= self.fail_rate:
                return None
            fault = self.rng.choice(FAULTS)
            self.faults[fault] += 1
            return fault

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream_conn: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes, cut: bool = False) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if cut else body)
        self.wfile.flush()
        if cut:
            self._reset()

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends a RST, as a dropped connection does.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def _forward(self) -> None:
        proxy: FlakyProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fault = proxy.pick()
        if fault == "reset":
            self._reset()
            return
        if fault in ("slowdown", "internal"):
            status, xml = (503, SLOWDOWN) if fault == "slowdown" else (500, INTERNAL)
            self._reply(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(xml)))], xml)
            return
        for hook in proxy.hooks:
            hook(self.command, self.path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if proxy.strip_if_match:
            headers = {k: v for k, v in headers.items() if k.lower() != "if-match"}
        if self.upstream_conn is None:
            self.upstream_conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
        try:
            self.upstream_conn.request(self.command, self.path, body, headers)
            resp = self.upstream_conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.upstream_conn.close()
            self.upstream_conn = None
            self._reset()
            return
        if self.command == "GET" and "list-type" not in self.path:
            with proxy.lock:
                proxy.served += len(data)
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
        self._reply(resp.status, out, data, cut=fault == "truncate" and len(data) > 1)

    def finish(self) -> None:
        super().finish()
        if self.upstream_conn is not None:
            self.upstream_conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward
