"""Nurseries whose failures read as the one error that happened, not an exception group.

trio wraps every error that leaves a nursery in an ExceptionGroup; dlfs's callers (the CLI, the
FUSE boundary) want the DlfsError inside, so a group with one real error is unwrapped here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from dlfs.errors import DlfsError

log = logging.getLogger(__name__)


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


@asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        errors = leaves(group)
        real = [e for e in errors if not isinstance(e, trio.Cancelled)]
        if len(real) == 1:
            raise real[0] from None
        if real and not any(isinstance(e, (KeyboardInterrupt, SystemExit)) for e in real):
            first = next((e for e in real if isinstance(e, DlfsError)), None)
            if first is not None:
                for other in real:
                    if other is not first:
                        log.info("also failed: %r", other)
                raise first from None
        raise
