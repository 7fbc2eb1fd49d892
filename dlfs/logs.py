"""Log lines: one line per event, each naming what the process serves (its node or dataset).

Tracebacks and multi-line messages are folded into their line (" | " between the original lines),
so `grep chunk-id` or a log shipper never splits one event in two.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from dataclasses import dataclass

from dlfs.errors import UsageError

FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"
# Libraries that log each request at INFO: etcd's client (httpx) would write a line per lease
# keepalive, every couple of seconds, in every node and mount log. Their failures reach dlfs as errors.
QUIET = ("httpx", "httpcore")
# Lines of one kind (one logger, one message before its arguments) a process writes per REPEAT_PERIOD;
# past that it counts them and says how many when the period is over: a mount whose reads fail through an
# outage logged two lines a failed read (2.3 MB in 10 s of a reader skipping them), enough to fill the disk
# its home is on in a long one.
REPEAT_BURST = 50
REPEAT_PERIOD = 60.0
_context = ""


def set_context(context: str) -> None:
    """Put `context` (e.g. "node=n1", "dataset=imagenet@2") on every later log line of this process."""
    global _context
    _context = context


class OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.context = f" [{_context}]" if _context else ""
        return super().format(record).replace("\r", "").replace("\n", " | ")


@dataclass
class _Kind:
    start: float  # when its period began (time.monotonic: a clock stepped back must not stretch it)
    wall: float  # ... and by the wall clock, to say so
    level: int
    written: int = 0
    held: int = 0  # lines not written this period
    last: str = ""  # the last of them


class RepeatLimit(logging.Filter):
    """At most REPEAT_BURST lines of each kind per REPEAT_PERIOD (debug lines aside); the last one written
    says that the rest are counted, and one line says how many were not written, and the last of them,
    once the period is over (with the next line of any kind, or at exit)."""

    def __init__(self, burst: int = REPEAT_BURST, period: float = REPEAT_PERIOD) -> None:
        super().__init__()
        self.burst, self.period = burst, period
        self._kinds: dict[tuple[str, str], _Kind] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True  # asked for (--log-level debug): all of it
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            over = self._over(now)
            kind = self._kinds.get(key)
            if kind is None:
                kind = self._kinds[key] = _Kind(now, record.created, record.levelno)
            kind.written += 1
            if kind.written > self.burst:
                kind.held += 1
                kind.last = record.getMessage()
        self._say(over, now)
        if kind.written == self.burst:
            record.msg = f"{record.msg} (line {self.burst} like it in {self.period:g} s: the rest are counted, not written)"
        return kind.written <= self.burst

    def _over(self, now: float) -> list[tuple[tuple[str, str], _Kind]]:
        """The kinds whose period ended by `now` (forgotten: their next line begins a new one)."""
        over = [(key, k) for key, k in self._kinds.items() if now - k.start >= self.period]
        for key, _ in over:
            del self._kinds[key]
        return over

    def _say(self, over: list[tuple[tuple[str, str], _Kind]], now: float) -> None:
        for (name, _), k in over:
            if k.held:
                logging.getLogger(name).log(k.level, "%d more lines like this were not written in the %.0f s after "
                                            "%s; the last: %s", k.held, min(now - k.start, self.period),
                                            time.strftime("%H:%M:%S", time.localtime(k.wall)), k.last)

    def flush(self) -> None:
        """Say what every period held back so far (at exit)."""
        with self._lock:
            over = [(key, k) for key, k in self._kinds.items() if k.held]
            for key, _ in over:
                del self._kinds[key]
        self._say(over, time.monotonic())


def setup_logging(level: str, log_file: str | None = None) -> None:
    """Log at `level` to `log_file` (appended), else to stderr."""
    try:
        handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    except OSError as exc:
        raise UsageError(f"cannot write the log file {log_file}: {exc.strerror or exc}") from None
    handler.setFormatter(OneLineFormatter(FORMAT))
    limit = RepeatLimit()
    handler.addFilter(limit)
    atexit.register(limit.flush)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
