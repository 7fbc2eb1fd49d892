"""Index files fetched by clients (a mount, `dlfs warmup`, repair) into this machine's index cache under
$DLFS_HOME/mounts/index/, once per version, checked by their checksum."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from dlfs.client.cluster import ClusterClient
from dlfs.errors import NO_ROOM, CorruptData, StorageFull
from dlfs.format.index import file_checksum
from dlfs.private import private_dirs, private_opener
from dlfs.units import human_bytes
from dlfs.wire.messages import VersionInfo
from dlfs.wire.protocol import Msg

INDEX_PIECE = 16 << 20  # bytes asked for per READ_INDEX (the metadata daemon sends at most this much)


async def fetch_index(client: ClusterClient, info: VersionInfo, home: Path) -> Path:
    """The version's index in the local index cache, fetched once and checked by its checksum."""
    cache_dir = private_dirs(home / "mounts" / "index")
    path = cache_dir / f"{info.name}.{info.version}.{info.index_sum:016x}.idx"
    if path.exists() and path.stat().st_size == info.index_size:
        if await trio.to_thread.run_sync(file_checksum, path) == info.index_sum:
            return path
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        with open(tmp, "wb", opener=private_opener) as f:
            offset = 0
            while offset < info.index_size:
                _, piece = await client.call_meta(Msg.READ_INDEX, {"name": info.name, "version": info.version,
                                                                    "offset": offset, "length": INDEX_PIECE})
                if not piece:
                    raise CorruptData(f"index of {info.name}@{info.version} ends early at {offset} bytes")
                f.write(piece)
                offset += len(piece)
        if await trio.to_thread.run_sync(file_checksum, tmp) != info.index_sum:
            raise CorruptData(f"index of {info.name}@{info.version} arrived corrupt (checksum mismatch)")
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
