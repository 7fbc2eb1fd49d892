"""Index files fetched by clients (a mount, `dlfs warmup`, repair) into this machine's index cache under
$DLFS_HOME/mounts/index/, once per version, checked by their checksum."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.config import NodeSpec
from dlfs.errors import NO_ROOM, CorruptData, DlfsError, StorageFull
from dlfs.format.index import file_checksum
from dlfs.private import private_dirs, private_opener
from dlfs.units import human_bytes
from dlfs.wire.messages import VersionInfo
from dlfs.wire.protocol import Msg

log = logging.getLogger(__name__)
INDEX_PIECE = 16 << 20  # bytes asked for per READ_INDEX (the metadata daemon sends at most this much)


async def fetch_index(client: ClusterClient, info: VersionInfo, home: Path) -> Path:
    """The version's index in the local index cache, fetched once and checked by its checksum."""
    cache_dir = private_dirs(home / "mounts" / "index")
    path = cache_dir / f"{info.name}.{info.version}.{info.index_sum:016x}.idx"
    if path.exists() and path.stat().st_size == info.index_size:
        if await trio.to_thread.run_sync(file_checksum, path) == info.index_sum:
            return path
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    label = f"{info.name}@{info.version}"
    try:
        # From whichever metadata daemon answers first; where that copy is bad, from each daemon alone in
        # turn: one damaged copy (a bad disk sector) must not keep a version that others hold from mounting.
        why = await _fetch_from(client, None, info, tmp)
        if why:
            # (info: `dlfs verify` reports damaged copies itself; a mount's log keeps these lines)
            log.info("index of %s: %s; fetching it from each metadata daemon in turn", label, why)
            whys = []
            for spec in client.meta_nodes():
                try:
                    why = await _fetch_from(client, spec, info, tmp)
                except DlfsError as exc:  # unreachable, or without the version yet: the next one may have it
                    why = str(exc)
                if not why:
                    log.info("index of %s: a good copy from %s (`dlfs verify` finds the damaged ones, `dlfs "
                             "repair` restores them)", label, spec.name)
                    break
                whys.append(f"{spec.name}: {why}")
            else:
                raise CorruptData(f"index of {label}: no metadata daemon sent a good copy ({'; '.join(whys)}); "
                                  f"`dlfs verify {info.name}` says which are damaged, `dlfs repair` restores them")
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        raise StorageFull(f"no room for the index of {info.name}@{info.version} ({human_bytes(info.index_size)}) in "
                          f"{cache_dir}: {exc.strerror}; free some space there, or give --home (DLFS_HOME) "
                          "on a disk that has it") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


async def _fetch_from(client: ClusterClient, spec: NodeSpec | None, info: VersionInfo, tmp: Path) -> str:
    """The index into `tmp`, from metadata daemon `spec` alone (None: any, as catalog reads ask): why
    it is not the committed one, "" when it is."""
    with open(tmp, "wb", opener=private_opener) as f:
        offset = 0
        while offset < info.index_size:
            meta = {"name": info.name, "version": info.version, "offset": offset, "length": INDEX_PIECE}
            if spec is None:
                _, piece = await client.call_meta(Msg.READ_INDEX, meta)
            else:
                _, piece = await client.call(spec, "meta", Msg.READ_INDEX, meta)
            if not piece:
                return f"it ends early at {offset} of {info.index_size} bytes"
            f.write(piece[: info.index_size - offset])
            offset += len(piece)
    if await trio.to_thread.run_sync(file_checksum, tmp) != info.index_sum:
        return "its copy fails its checksum"
    return ""
