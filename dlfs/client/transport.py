"""Which way a client's chunk reads travel: choose the transport, and with RDMA attach a reader.

The choice is made once, at start, and logged with its reason; `transport = "rdma"` where RDMA
cannot work is a one-line TransportUnavailable error before anything else happens.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from dlfs.client.cluster import ClusterClient
from dlfs.config import Cluster
from dlfs.errors import DlfsError
from dlfs.transport.verbs import TransportChoice, choose_transport

log = logging.getLogger(__name__)
QUEUE_HEADROOM = 16 << 20  # queue pairs and completion queues are pinned too


def arena_for_cache(capacity: int) -> int:
    """Registered memory for a cache of `capacity` bytes: its blocks, plus room for those in flight
    and those replies still hold, and for fragmentation."""
    return capacity + max(capacity // 4, 64 << 20)


def choose_for(cluster: Cluster, arena_bytes: int, what: str) -> TransportChoice:
    """The cluster's (or --transport's) setting applied to this machine, logged with its reason."""
    choice = choose_transport(cluster.transport, arena_bytes + QUEUE_HEADROOM, what,
                              cluster.rdma_device, cluster.rdma_port)
    log.info("%s: chunks travel over %s (%s)", what, choice.name.upper(), choice.reason)
    return choice


@asynccontextmanager
async def chunk_transport(client: ClusterClient, choice: TransportChoice,
                          arena_bytes: int) -> AsyncIterator[TransportChoice]:
    """With RDMA chosen, `client` reads chunk ranges over RDMA (TCP when that fails) into up to
    `arena_bytes` of registered memory, until the block ends; with TCP it is left as it is."""
    if choice.name != "rdma" or choice.port is None:
        yield choice
        return
    from pyverbs.pyverbs_error import PyverbsError  # only where RDMA is used

    from dlfs.client.rdmareads import RdmaReader

    async with AsyncExitStack() as stack:
        try:
            reader = await stack.enter_async_context(RdmaReader.open(client, choice.port, arena_bytes))
        except (PyverbsError, OSError, DlfsError) as exc:
            fallback = choice.failed_to_start(str(exc))  # raises for transport = rdma
            log.info("chunks travel over TCP (%s)", fallback.reason)
            reader = None
        if reader is None:
            yield fallback
            return
        client.rdma = reader
        try:
            yield choice
        finally:
            client.rdma = None
