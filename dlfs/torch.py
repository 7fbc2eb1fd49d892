"""dlfs.torch: a PyTorch Dataset that reads a directory by batch through dlfs.direct, and the
chunk-aware sampler for it. The only part of dlfs that needs torch.

    from torch.utils.data import DataLoader
    from dlfs.torch import DirectDataset

    ds = DirectDataset("/mnt/imagenet/train", transform=decode_jpeg)
    sampler = ds.sampler(rank=rank, world_size=world_size, seed=0)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...

DataLoader hands each batch's indices to `__getitems__`, so a batch costs one read_many: no
request at all for files already in the mount's cache, one for the rest. `transform` gets each file
as a read-only memoryview into the shared cache (valid for the call; what it returns may keep
referring to it, and the bytes then stay pinned as long as that lives). Off a dlfs mount the same
Dataset reads with open(), so it also serves as the baseline it is measured against.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.data

import dlfs.direct
from dlfs.sampler import ChunkLocalSampler

__all__ = ["ChunkLocalSampler", "DirectDataset"]


def _copy(view: memoryview) -> bytes:
    return bytes(view)


class DirectDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Every regular file under `root`, sorted by path; item i is `transform(bytes of file i)`."""

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[memoryview], Any] | None = None,
                 mountpoint: str | os.PathLike[str] | None = None) -> None:
        """`mountpoint`: the dlfs mount `root` is on (found by walking up from root when omitted)."""
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"{self.root} is not a directory")
        self.transform = transform or _copy
        self.mountpoint = os.fspath(mountpoint) if mountpoint is not None else _mount_of(self.root)
        self._reader: dlfs.direct.DirectReader | dlfs.direct.PlainReader | None = None
        reader = self.reader
        if isinstance(reader, dlfs.direct.DirectReader):
            self.files, self.chunks = reader.files_under(self.root)
        else:
            self.files = _walk(self.root)
            self.chunks = list(range(len(self.files)))  # off dlfs every file is its own "chunk"
        self.paths = [os.path.join(self.root, f) for f in self.files]

    @property
    def reader(self) -> dlfs.direct.DirectReader | dlfs.direct.PlainReader:
        if self._reader is None:
            self._reader = dlfs.direct.connect(self.mountpoint)
        return self._reader

    @property
    def direct(self) -> bool:
        return self.reader.direct

    def sampler(self, *, rank: int = 0, world_size: int = 1, seed: int = 0, window: int = 4) -> ChunkLocalSampler:
        """Chunk-local random epochs over this dataset, this rank's share (call set_epoch each epoch)."""
        return ChunkLocalSampler(self.chunks, rank=rank, world_size=world_size, seed=seed, window=window)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        # No release(): a result may refer to its view without holding a buffer export (as
        # torch.frombuffer does), and then only the reference keeps the pin. The rest go here.
        return [self.transform(v) for v in self.reader.read_many([self.paths[i] for i in indices])]

    def __getstate__(self) -> dict[str, Any]:
        # A worker started by spawn attaches on its own; a connection cannot be pickled.
        return {**self.__dict__, "_reader": None}


def _mount_of(path: str) -> str:
    while not os.path.ismount(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _walk(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root))
    return sorted(out)
