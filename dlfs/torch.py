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
as a read-only memoryview into the shared cache (what it returns may keep referring to it; the bytes
then stay pinned as long as that lives).

With no transform, a batch is a ViewBatch of read-only memoryviews (use collate_fn=collate_views).
From a worker process it reaches the training process as the files' paths and is mapped there from
the same shared cache: the worker's read put the files in the cache, and no byte is copied between
the processes. Off a dlfs mount the same Dataset reads with open() (a ViewBatch then carries the
bytes), so it also serves as the baseline it is measured against.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.data

import dlfs.direct
from dlfs.sampler import ChunkLocalSampler

__all__ = ["ChunkLocalSampler", "DirectDataset", "ViewBatch", "as_tensor", "collate_bytes", "collate_views"]

_readers: dict[tuple[int, str], dlfs.direct.DirectReader | dlfs.direct.PlainReader] = {}


def reader_for(mountpoint: str) -> dlfs.direct.DirectReader | dlfs.direct.PlainReader:
    """This process's reader of a mount, made once."""
    key = (os.getpid(), mountpoint)
    reader = _readers.get(key)
    if reader is None:
        reader = _readers[key] = dlfs.direct.connect(mountpoint)
    return reader


class ViewBatch(Sequence[memoryview]):
    """A batch of files' bytes as read-only memoryviews. Pickled (from a DataLoader worker), a
    batch of a dlfs mount travels as its paths and is mapped again from the shared cache where it
    lands; any other batch travels as its bytes."""

    def __init__(self, views: list[memoryview], mountpoint: str | None = None,
                 paths: list[str] | None = None) -> None:
        self.views, self.mountpoint, self.paths = views, mountpoint, paths

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: Any) -> Any:
        return self.views[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self.views)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.mountpoint is not None and self.paths is not None:
            return _remap, (self.mountpoint, self.paths)
        return _from_bytes, ([bytes(v) for v in self.views],)


def _remap(mountpoint: str, paths: list[str]) -> ViewBatch:
    return ViewBatch(reader_for(mountpoint).read_many(paths), mountpoint, paths)


def _from_bytes(blobs: list[bytes]) -> ViewBatch:
    return ViewBatch([memoryview(b) for b in blobs])


def collate_views(batch: Any) -> ViewBatch:
    """The collate_fn for a DirectDataset with no transform: its batches pass through as they are."""
    return batch if isinstance(batch, ViewBatch) else ViewBatch(list(batch))


def as_tensor(view: memoryview) -> torch.Tensor:
    """A transform: the file's bytes as a uint8 tensor over the view itself (no copy; read-only
    memory: never write to it). The bytes stay pinned while the tensor lives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that it cannot mark the tensor read-only
        return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


def collate_bytes(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn for raw bytes (with as_tensor): the batch as one flat uint8 tensor and each
    sample's length, the form a GPU decoder takes. In a DataLoader worker the flat tensor is made in
    shared memory, so the bytes are copied once, from the cache into it."""
    lengths = torch.tensor([t.numel() for t in batch], dtype=torch.int64)
    flat = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    if torch.utils.data.get_worker_info() is not None:
        flat.share_memory_()
    torch.cat(batch, out=flat)
    return flat, lengths


class DirectDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Every regular file under `root`, sorted by path; item i is `transform(view of file i)`, or
    the view itself with no transform."""

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[memoryview], Any] | None = None,
                 mountpoint: str | os.PathLike[str] | None = None) -> None:
        """`mountpoint`: the dlfs mount `root` is on (found by walking up from root when omitted)."""
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"{self.root} is not a directory")
        self.transform = transform
        self.mountpoint = os.path.abspath(os.fspath(mountpoint)) if mountpoint is not None else _mount_of(self.root)
        reader = self.reader
        if isinstance(reader, dlfs.direct.DirectReader):
            self.files, self.chunks = reader.files_under(self.root)
        else:
            self.files = _walk(self.root)
            self.chunks = list(range(len(self.files)))  # off dlfs every file is its own "chunk"
        self.paths = [os.path.join(self.root, f) for f in self.files]

    @property
    def reader(self) -> dlfs.direct.DirectReader | dlfs.direct.PlainReader:
        return reader_for(self.mountpoint)

    @property
    def direct(self) -> bool:
        return self.reader.direct

    def sampler(self, *, rank: int = 0, world_size: int = 1, seed: int = 0, window: int = 4,
                drop_last: bool = False) -> ChunkLocalSampler:
        """Chunk-local random epochs over this dataset, this rank's share (call set_epoch each epoch);
        every rank gets the same number of samples (ChunkLocalSampler pads, or drops with drop_last)."""
        return ChunkLocalSampler(self.chunks, rank=rank, world_size=world_size, seed=seed, window=window,
                                 drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        paths = [self.paths[i] for i in indices]
        views = self.reader.read_many(paths)
        if self.transform is None:
            return ViewBatch(views, self.mountpoint if self.reader.direct else None, paths)
        # No release(): a result may refer to its view without holding a buffer export (as
        # torch.frombuffer does), and then only the reference keeps the pin. The rest go here.
        return [self.transform(v) for v in views]


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
