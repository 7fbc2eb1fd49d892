#!/usr/bin/env python3
"""The price of one request to a FUSE file system: `isatty()` on an open file, as CPython's
`open(path, "rb")` asks it, timed in a loop, beside the same on a local file.

    scripts/fuse-roundtrip.py /mnt/imagenet/some/file.JPEG [/some/local/file]

A FUSE mount answers each one (the kernel forwards TCGETS every time); a local file system answers
it in the kernel. The difference is one round trip to the serving process: what every
`open(path, "rb")` of a framework costs on a warm FUSE mount. Compare `dlfs mount --io-uring on`
and `--io-uring off`, or squashfuse_ll, on the same machine.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import tempfile
import termios
import time


def per_call(path: str, calls: int, rounds: int) -> list[float]:
    """Microseconds per ioctl(TCGETS) on `path`, one figure per round."""
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(64)
    out = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                try:
                    fcntl.ioctl(fd, termios.TCGETS, buf)
                except OSError:
                    pass  # ENOTTY: what is timed is the asking
            out.append((time.perf_counter() - t0) / calls * 1e6)
    finally:
        os.close(fd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a file on the FUSE mount")
    ap.add_argument("local", nargs="?", help="a file on local disk to compare with (default: a temporary one)")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile() as tmp:
        local = args.local or tmp.name
        try:
            fuse, disk = per_call(args.path, args.calls, args.rounds), per_call(local, args.calls, args.rounds)
        except OSError as exc:
            print(f"fuse-roundtrip: {exc}", file=sys.stderr)
            return 1
    med_f, med_d = statistics.median(fuse), statistics.median(disk)
    print(f"{args.path}: {med_f:.1f} us per isatty() (rounds: {', '.join(f'{x:.1f}' for x in fuse)})")
    print(f"{local}: {med_d:.1f} us per isatty() (rounds: {', '.join(f'{x:.1f}' for x in disk)})")
    print(f"one round trip to the file system's process: {med_f - med_d:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
