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

Labels as torchvision's ImageFolder gives them: `classes` (the sorted names of the directories
directly under root), `class_to_idx`, `samples` ((path, class index) pairs) and `targets` (one label a
sample). With `labels=True` an item is (sample, target) and the samples come in ImageFolder's order,
as its do; files directly under root (in no class) are left out, as ImageFolder leaves them. Without
it every file is a sample, sorted by path (those at the top with target -1), and an item is the
sample alone. `extensions=(".jpg", ...)` or
`is_valid_file=fn(path)` choose the files, as they do for ImageFolder. A transform that needs more than
the bytes takes `sample_transform=fn(view, path, target)`, whose result is the item.

    ds = DirectDataset("/mnt/imagenet/train", labels=True, transform=decode_jpeg, extensions=IMG_EXTENSIONS)
    image, label = ds[0]

With no transform, a batch is a ViewBatch of read-only memoryviews, or of (view, target) pairs with
labels=True (use collate_fn=collate_views).
From a worker process it reaches the training process as the files' paths and is mapped there from
the same shared cache: the worker's read put the files in the cache, and no byte is copied between
the processes. Off a dlfs mount the same Dataset reads with open() (a ViewBatch then carries the
bytes), so it also serves as the baseline it is measured against; `ds.reason` says why it does
(None when it reads from the shared cache).
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

__all__ = ["IMG_EXTENSIONS", "ChunkLocalSampler", "DirectDataset", "ViewBatch", "as_tensor", "collate_bytes",
           "collate_views"]

# The file name endings torchvision's ImageFolder takes as images.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
NO_CLASS = -1  # the target of a file directly under root, which is in no class directory

_readers: dict[tuple[int, str], dlfs.direct.DirectReader | dlfs.direct.PlainReader] = {}


def reader_for(path: str) -> dlfs.direct.DirectReader | dlfs.direct.PlainReader:
    """This process's reader of the mount `path` is on (any path inside it), made once per mount."""
    key = (os.getpid(), os.path.abspath(path))
    reader = _readers.get(key)
    if reader is None:
        reader = dlfs.direct.connect(path)
        known = _readers.setdefault((key[0], reader.root), reader)
        if known is not reader:
            reader.close()
            reader = known
        _readers[key] = reader
    return reader


class ViewBatch(Sequence[Any]):
    """A batch of files' bytes as read-only memoryviews, with their targets for a labelled dataset
    (then an item is (view, target)). Pickled (from a DataLoader worker), a batch of a dlfs mount
    travels as its paths and is mapped again from the shared cache where it lands; any other batch
    travels as its bytes."""

    def __init__(self, views: list[memoryview], mountpoint: str | None = None,
                 paths: list[str] | None = None, targets: list[Any] | None = None) -> None:
        self.views, self.mountpoint, self.paths, self.targets = views, mountpoint, paths, targets

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: Any) -> Any:
        if self.targets is None:
            return self.views[i]
        if isinstance(i, slice):
            return list(zip(self.views[i], self.targets[i]))
        return self.views[i], self.targets[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.views) if self.targets is None else zip(self.views, self.targets)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.mountpoint is not None and self.paths is not None:
            return _remap, (self.mountpoint, self.paths, self.targets)
        return _from_bytes, ([bytes(v) for v in self.views], self.targets)


def _remap(mountpoint: str, paths: list[str], targets: list[Any] | None = None) -> ViewBatch:
    return ViewBatch(reader_for(mountpoint).read_many(paths), mountpoint, paths, targets)


def _from_bytes(blobs: list[bytes], targets: list[Any] | None = None) -> ViewBatch:
    return ViewBatch([memoryview(b) for b in blobs], targets=targets)


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
    """The regular files under `root` as samples, read by batch through dlfs.direct, with labels as
    torchvision's ImageFolder gives them (see the module's docstring). Symlinks are not followed."""

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[memoryview], Any] | None = None,
                 mountpoint: str | os.PathLike[str] | None = None, *, labels: bool = False,
                 target_transform: Callable[[int], Any] | None = None,
                 sample_transform: Callable[[memoryview, str, int], Any] | None = None,
                 extensions: str | Sequence[str] | None = None, is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False) -> None:
        """`transform(view)` makes the sample, `target_transform(target)` the target (labels=True);
        `sample_transform(view, path, target)` makes the whole item instead of both. `extensions`
        (endings, any case) or `is_valid_file(path)` choose the files; with labels=True a class with
        none is a FileNotFoundError unless `allow_empty`. `mountpoint`: any path on the dlfs mount
        (found from root when omitted)."""
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"{self.root} is not a directory")
        if extensions is not None and is_valid_file is not None:
            raise ValueError("give extensions or is_valid_file, not both")
        if sample_transform is not None and (transform is not None or target_transform is not None):
            raise ValueError("sample_transform makes the whole item: give it alone, without transform or "
                             "target_transform")
        self.transform, self.target_transform, self.sample_transform = transform, target_transform, sample_transform
        self.labels = labels
        reader = reader_for(os.fspath(mountpoint) if mountpoint is not None else self.root)
        self.mountpoint = reader.root
        if isinstance(reader, dlfs.direct.DirectReader):
            if not _under(self.root, reader.root):
                self.root = os.path.realpath(self.root)  # reached through a symlink into the mount
            files, chunks = reader.files_under(self.root)
        else:
            files = _walk(self.root)
            chunks = list(range(len(files)))  # off dlfs every file is its own "chunk"
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        if labels and not self.classes:
            raise FileNotFoundError(f"no class directory in {self.root}")
        chosen = _chooser(self.root, extensions, is_valid_file)
        target_of = self._target_of
        picked = [(f, c, target_of(f)) for f, c in zip(files, chunks) if chosen is None or chosen(f)]
        if labels:
            # As ImageFolder: class by class, then directory by directory, then by name; none at the top.
            picked = sorted((p for p in picked if p[2] != NO_CLASS), key=lambda p: (p[2], *p[0].rpartition("/")))
            empty = set(self.classes) - {self.classes[t] for _, _, t in picked}
            if empty and not allow_empty:
                raise FileNotFoundError(f"no file in the class directories {', '.join(sorted(empty))} of {self.root}"
                                        + (f" (extensions {', '.join(_endings(extensions))})" if extensions else ""))
        self.files = [f for f, _, _ in picked]
        self.chunks = [c for _, c, _ in picked]
        self.targets = [t for _, _, t in picked]
        self.paths = [os.path.join(self.root, f) for f in self.files]

    def _target_of(self, rel: str) -> int:
        head, sep, _ = rel.partition("/")
        return self.class_to_idx[head] if sep else NO_CLASS

    @property
    def samples(self) -> Sequence[tuple[str, int]]:
        """(path, class index) a sample, as ImageFolder's `samples` (-1: a file in no class)."""
        return _Pairs(self.paths, self.targets)

    @property
    def reader(self) -> dlfs.direct.DirectReader | dlfs.direct.PlainReader:
        return reader_for(self.mountpoint)

    @property
    def direct(self) -> bool:
        return self.reader.direct

    @property
    def reason(self) -> str | None:
        """Why the files are read with open() instead of from the shared cache (None when they are not)."""
        return self.reader.reason

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
        # No release(): a result may refer to its view without holding a buffer export (as
        # torch.frombuffer does), and then only the reference keeps the pin. The rest go here.
        if self.sample_transform is not None:
            return [self.sample_transform(v, p, self.targets[i]) for v, p, i in zip(views, paths, indices)]
        targets = None
        if self.labels:
            targets = [self.targets[i] for i in indices]
            if self.target_transform is not None:
                targets = [self.target_transform(t) for t in targets]
        if self.transform is None:
            return ViewBatch(views, self.mountpoint if self.reader.direct else None, paths, targets)
        samples = [self.transform(v) for v in views]
        return samples if targets is None else list(zip(samples, targets))


class _Pairs(Sequence[tuple[str, int]]):
    """paths[i], targets[i] as one sequence of pairs, made as they are asked for (no copy of a
    million-entry list)."""

    def __init__(self, paths: list[str], targets: list[int]) -> None:
        self.paths, self.targets = paths, targets

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.paths[i], self.targets[i]))
        return self.paths[i], self.targets[i]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return zip(self.paths, self.targets)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _endings(extensions: str | Sequence[str]) -> tuple[str, ...]:
    return (extensions,) if isinstance(extensions, str) else tuple(extensions)


def _chooser(root: str, extensions: str | Sequence[str] | None,
             is_valid_file: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """Whether a file (its path under root) is a sample: by `is_valid_file` (given the full path, as
    ImageFolder gives it), by its ending, or None: every file is."""
    if is_valid_file is not None:
        return lambda rel: is_valid_file(os.path.join(root, rel))
    if extensions is None:
        return None
    endings = tuple(e.lower() for e in _endings(extensions))
    return lambda rel: rel.lower().endswith(endings)


def _walk(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root))
    return sorted(out)
