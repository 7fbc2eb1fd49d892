"""Human sizes: parse "8M", "16MiB", "1g"; print 1.5 GB; times for --json output."""

from __future__ import annotations

import datetime
import re

from dlfs.errors import UsageError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as 4096, 8M, 16MiB or 1g (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise UsageError(f"not a size: {text!r} (use e.g. 8M, 64MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def counted(count: int, thing: str, things: str = "") -> str:
    """"1 file", "2 files": a count and its noun, singular for one (`things`: a plural not made with -s)."""
    return f"{count} {thing if count == 1 else things or thing + 's'}"


def human_bytes(n: float) -> str:
    """A short decimal rendering: 1.5 GB, 310 kB, 12 B."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_mib(n: int) -> str:
    """A size set in binary units, as it was set: 1 MiB, 0.5 MiB."""
    return f"{n / (1 << 20):g} MiB"


def human_duration(seconds: float) -> str:
    """A short rendering of a duration: 45 s, 12 min 5 s, 3 h 20 min."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def iso_time(unix: float) -> str:
    """A moment for --json output: ISO-8601 in local time with its UTC offset, to the second
    (2026-12-04T10:30:00+01:00); the exact value goes beside it as unix seconds."""
    return datetime.datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")
