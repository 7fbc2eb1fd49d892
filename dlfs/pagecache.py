"""What the page cache holds of a file, asked without reading it (cachestat, Linux 6.5+)."""

from __future__ import annotations

import ctypes
import os

PAGE = os.sysconf("SC_PAGE_SIZE")


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)
_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(os.uname().machine)


def cached_pages(fd: int, off: int = 0, n: int = 0) -> int | None:
    """Pages of [off, off+n) of `fd` (n=0: to its end) in the page cache, asked without reading (a read
    with RWF_NOWAIT would start the read-ahead it declines to wait for); None where the kernel cannot say."""
    if _CACHESTAT is None:
        return None
    rng, st = _CachestatRange(off, n), _Cachestat()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return None
    return int(st.nr_cache)


def all_cached(fd: int, off: int, n: int) -> bool:
    """Whether the page cache holds every page of [off, off+n) of `fd`; False where the kernel cannot say."""
    got = cached_pages(fd, off, n)
    return got is not None and got >= (off + n - 1) // PAGE - off // PAGE + 1
