"""Log lines: one line per event, each naming what the process serves (its node or dataset).

Tracebacks and multi-line messages are folded into their line (" | " between the original lines),
so `grep chunk-id` or a log shipper never splits one event in two.
"""

from __future__ import annotations

import logging
import sys

from dlfs.errors import UsageError

FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"
# Libraries that log each request at INFO: etcd's client (httpx) would write a line per lease
# keepalive, every couple of seconds, in every node and mount log. Their failures reach dlfs as errors.
QUIET = ("httpx", "httpcore")
_context = ""


def set_context(context: str) -> None:
    """Put `context` (e.g. "node=n1", "dataset=imagenet@2") on every later log line of this process."""
    global _context
    _context = context


class OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.context = f" [{_context}]" if _context else ""
        return super().format(record).replace("\r", "").replace("\n", " | ")


def setup_logging(level: str, log_file: str | None = None) -> None:
    """Log at `level` to `log_file` (appended), else to stderr."""
    try:
        handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    except OSError as exc:
        raise UsageError(f"cannot write the log file {log_file}: {exc.strerror or exc}") from None
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
