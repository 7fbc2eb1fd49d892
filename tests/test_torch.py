"""dlfs.torch on a real mount: the Dataset's samples are the files' bytes, DataLoader workers and
ranks see every sample exactly once per epoch, and the same Dataset off dlfs reads with open()."""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path

import pytest
from conftest import needs_fuse
from test_direct import make_churn_tree

torch = pytest.importorskip("torch", reason="dlfs.torch needs torch (make install puts it in the venv)")
from torch.utils.data import DataLoader  # noqa: E402

from dlfs.native import native  # noqa: E402
from dlfs.torch import DirectDataset, ViewBatch, as_tensor, collate_bytes, collate_views  # noqa: E402

# torch.frombuffer of a read-only view warns that writes are unsupported: dlfs views are read-only.
pytestmark = [needs_fuse, pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


@pytest.fixture(scope="module")
def mounted_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    from conftest import force_unmount, running_node

    base = tmp_path_factory.mktemp("torch")
    src = base / "src"
    want = make_churn_tree(src, n=300)
    with running_node(base / "home", base) as node:
        node.ingest(src, "t", "--chunk-size", "256K")
        mnt = node.mount("t", base / "mnt", "--cache-size", "64M")
        try:
            yield src, mnt, want
        finally:
            force_unmount(base)


def test_samples_are_the_files(mounted_tree: tuple[Path, Path, dict[str, bytes]]) -> None:
    src, mnt, want = mounted_tree
    ds = DirectDataset(mnt)
    assert ds.direct and len(ds) == len(want)
    assert ds.files == sorted(want) == DirectDataset(src).files
    assert [ds[i] for i in range(len(ds))] == [want[f] for f in ds.files]
    assert list(ds.__getitems__([5, 0, 5])) == [want[ds.files[5]], want[ds.files[0]], want[ds.files[5]]]
    # Real chunks: many files share one, and a file's neighbours mostly share its chunk.
    assert len(set(ds.chunks)) < len(ds) / 4 and ds.chunks == sorted(ds.chunks)
    sub = DirectDataset(mnt / "d3")
    assert sub.files == sorted(f[3:] for f in want if f.startswith("d3/"))
    assert sub[0] == want["d3/" + sub.files[0]]


def test_transform_gets_views(mounted_tree: tuple[Path, Path, dict[str, bytes]]) -> None:
    _, mnt, want = mounted_tree
    ds = DirectDataset(mnt, transform=lambda v: torch.frombuffer(v, dtype=torch.uint8).clone())
    t = ds[3]
    assert isinstance(t, torch.Tensor) and bytes(t.tolist()) == want[ds.files[3]]
    # A transform that keeps the buffer: the bytes stay pinned, and right, while the tensor lives.
    keep = DirectDataset(mnt, transform=lambda v: torch.frombuffer(v, dtype=torch.uint8))
    kept = keep.__getitems__(list(range(10)))
    assert keep.reader._shared.row_pins(keep.reader.row) > 0
    assert [bytes(k.tolist()) for k in kept] == [want[keep.files[i]] for i in range(10)]
    del kept
    assert keep.reader._shared.row_pins(keep.reader.row) == 0


def test_a_batch_crosses_processes_as_paths(mounted_tree: tuple[Path, Path, dict[str, bytes]]) -> None:
    """Pickled (as a worker sends it), a dlfs batch is its paths, mapped again from the shared cache;
    off dlfs it carries the bytes."""
    src, mnt, want = mounted_tree
    batch = DirectDataset(mnt).__getitems__(list(range(50)))
    assert isinstance(batch, ViewBatch) and batch.mountpoint == str(mnt)
    blob = pickle.dumps(batch)
    assert len(blob) < 100 * 50  # paths, not 50 files of up to 40 KB
    again = pickle.loads(blob)
    assert [bytes(v) for v in again] == [bytes(v) for v in batch] == [want[f] for f in sorted(want)[:50]]
    assert all(v.readonly and isinstance(v.obj, native.Pin) for v in again)  # views of the shared cache
    local = pickle.loads(pickle.dumps(DirectDataset(src).__getitems__([0, 1])))
    assert [bytes(v) for v in local] == [want[f] for f in sorted(want)[:2]]


def test_raw_bytes_collate(mounted_tree: tuple[Path, Path, dict[str, bytes]]) -> None:
    _, mnt, want = mounted_tree
    ds = DirectDataset(mnt, transform=as_tensor)
    loader = DataLoader(ds, batch_size=10, num_workers=2, collate_fn=collate_bytes)
    flat, lengths = next(iter(loader))
    expect = [want[f] for f in ds.files[:10]]
    assert lengths.tolist() == [len(e) for e in expect] and bytes(flat.tolist()) == b"".join(expect)


def epoch_samples(loader: DataLoader, by_bytes: dict[bytes, str]) -> list[str]:
    return [by_bytes[bytes(b)] for batch in loader for b in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_sees_every_file_once_per_epoch(mounted_tree: tuple[Path, Path, dict[str, bytes]],
                                                    workers: int) -> None:
    _, mnt, want = mounted_tree
    by_bytes = {v: k for k, v in want.items()}
    ds = DirectDataset(mnt)
    sampler = ds.sampler(seed=4)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=workers, collate_fn=collate_views)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = epoch_samples(loader, by_bytes)
        assert Counter(seen) == Counter(list(want)), f"epoch {epoch}"
        orders.append(seen)
    assert orders[0] != orders[1]  # a fresh permutation each epoch


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_share_an_epoch_exactly(mounted_tree: tuple[Path, Path, dict[str, bytes]], world: int) -> None:
    _, mnt, want = mounted_tree
    by_bytes = {v: k for k, v in want.items()}
    ds = DirectDataset(mnt)
    seen: list[str] = []
    for rank in range(world):
        sampler = ds.sampler(rank=rank, world_size=world, seed=9)
        sampler.set_epoch(3)
        seen += epoch_samples(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2 if rank == 0 else 0,
                                         collate_fn=collate_views), by_bytes)
    assert Counter(seen) == Counter(list(want))


def test_off_dlfs_it_reads_with_open(mounted_tree: tuple[Path, Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, _, want = mounted_tree
    ds = DirectDataset(src)
    assert not ds.direct and "not a dlfs mount" in ds.reader.reason
    loader = DataLoader(ds, batch_size=32, sampler=ds.sampler(seed=1), num_workers=2, collate_fn=collate_views)
    assert Counter(epoch_samples(loader, {v: k for k, v in want.items()})) == Counter(list(want))
    with pytest.raises(NotADirectoryError):
        DirectDataset(src / "d0" / sorted(os.listdir(src / "d0"))[0])
