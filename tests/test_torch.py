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
from dlfs.torch import (  # noqa: E402
    IMG_EXTENSIONS,
    DirectDataset,
    ViewBatch,
    as_tensor,
    collate_bytes,
    collate_views,
)

# torch.frombuffer of a read-only view warns that writes are unsupported: dlfs views are read-only.
pytestmark = [needs_fuse, pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


@pytest.fixture(scope="module")
def mounted_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    from conftest import force_unmount, running_node

    base = tmp_path_factory.mktemp("torch")
    src = base / "src"
    want = make_churn_tree(src, n=300)
    make_labelled_tree(base / "labelled")
    with running_node(base / "home", base) as node:
        node.ingest(src, "t", "--chunk-size", "256K")
        mnt = node.mount("t", base / "mnt", "--cache-size", "64M")
        node.ingest(base / "labelled", "lab", "--chunk-size", "64K")
        node.mount("lab", base / "mnt-labelled")
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


# --- labels as ImageFolder gives them -------------------------------------------------------------
# An ImageFolder tree whose labels are known: classes whose names sort differently from their
# paths ("cat-2/" before "cat/"), nested directories ("sub-x/" before "sub/" by path), endings of any
# case, files that are not images, files in no class, and a class with no image at all.
LABELLED = {"cat/a.jpg": 0, "cat/b.PNG": 0, "cat/notes.txt": 0, "cat/sub/c.jpg": 0, "cat/sub-x/d.jpeg": 0,
            "cat-2/e.jpg": 1, "dog/f.jpg": 2, "dog/g.webp": 2, "none/only.txt": 3, "top.jpg": -1, "readme.txt": -1}
CLASSES = ["cat", "cat-2", "dog", "none"]
# ImageFolder's order: class by class, then directory by directory, then by name; only images.
IMAGE_ORDER = ["cat/a.jpg", "cat/b.PNG", "cat/sub/c.jpg", "cat/sub-x/d.jpeg", "cat-2/e.jpg", "dog/f.jpg",
               "dog/g.webp"]


def make_labelled_tree(root: Path) -> None:
    for rel in LABELLED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(f"the bytes of {rel}".encode())


@pytest.fixture(scope="module")
def labelled(mounted_tree: tuple[Path, Path, dict[str, bytes]]) -> tuple[Path, Path]:
    """The labelled tree (src) and its dlfs mount."""
    base = mounted_tree[0].parent
    return base / "labelled", base / "mnt-labelled"


def rel_samples(ds: DirectDataset) -> list[tuple[str, int]]:
    return [(os.path.relpath(p, ds.root), t) for p, t in ds.samples]


@pytest.mark.parametrize("where", ["dlfs", "local"])
def test_labels_are_imagefolders(labelled: tuple[Path, Path], where: str) -> None:
    src, mnt = labelled
    root = mnt if where == "dlfs" else src
    ds = DirectDataset(root, labels=True, extensions=IMG_EXTENSIONS, allow_empty=True)
    assert ds.direct == (where == "dlfs")
    assert ds.classes == CLASSES and ds.class_to_idx == {c: i for i, c in enumerate(CLASSES)}
    assert rel_samples(ds) == [(f, LABELLED[f]) for f in IMAGE_ORDER]
    assert ds.targets == [LABELLED[f] for f in IMAGE_ORDER] and len(ds) == len(IMAGE_ORDER)
    assert ds.samples[4] == (str(root / "cat-2/e.jpg"), 1) and len(ds.samples) == len(ds)
    # An item is (sample, target), as ImageFolder's; a batch of them read at once.
    items = ds.__getitems__(list(range(len(ds))))
    assert [(bytes(v), t) for v, t in items] == [((src / f).read_bytes(), LABELLED[f]) for f in IMAGE_ORDER]
    if where == "dlfs":
        assert all(isinstance(v.obj, native.Pin) for v, _ in items)  # views of the shared cache
    named = DirectDataset(root, labels=True, transform=bytes, target_transform=CLASSES.__getitem__,
                          extensions=IMG_EXTENSIONS, allow_empty=True)
    assert named[4] == ((src / "cat-2/e.jpg").read_bytes(), "cat-2")
    # A class with no file is an error unless allowed, as in ImageFolder; so is a root with no class.
    with pytest.raises(FileNotFoundError, match="none"):
        DirectDataset(root, labels=True, extensions=IMG_EXTENSIONS)
    with pytest.raises(FileNotFoundError, match="no class directory"):
        DirectDataset(root / "cat" / "sub", labels=True)


@pytest.mark.parametrize("where", ["dlfs", "local"])
def test_without_labels_every_file_is_a_sample(labelled: tuple[Path, Path], where: str) -> None:
    """The behaviour before labels: every file, by path; those in no class have target -1."""
    src, mnt = labelled
    ds = DirectDataset(mnt if where == "dlfs" else src)
    assert ds.files == sorted(LABELLED) and ds.classes == CLASSES
    assert rel_samples(ds) == [(f, LABELLED[f]) for f in sorted(LABELLED)]
    assert [bytes(v) for v in ds.__getitems__([0, 1])] == [(src / f).read_bytes() for f in sorted(LABELLED)[:2]]
    chosen = DirectDataset(mnt if where == "dlfs" else src, is_valid_file=lambda p: p.endswith(".txt"))
    assert chosen.files == ["cat/notes.txt", "none/only.txt", "readme.txt"] and chosen.targets == [0, 3, -1]
    with pytest.raises(ValueError, match="not both"):
        DirectDataset(src, extensions=".jpg", is_valid_file=bool)


def test_imagefolder_of_torchvision_agrees(labelled: tuple[Path, Path]) -> None:
    try:
        from torchvision.datasets import ImageFolder
    except Exception as exc:  # missing, or a build for another torch (RuntimeError: torchvision::nms)
        pytest.skip(f"torchvision does not import here: {exc}")
    src, mnt = labelled
    theirs = ImageFolder(str(src), loader=lambda p: p, allow_empty=True)
    for root in (src, mnt):
        ours = DirectDataset(root, labels=True, extensions=IMG_EXTENSIONS, allow_empty=True)
        assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
        assert ours.targets == theirs.targets
        assert rel_samples(ours) == [(os.path.relpath(p, src), t) for p, t in theirs.samples]


def test_sample_transform_gets_path_and_label(labelled: tuple[Path, Path]) -> None:
    src, mnt = labelled

    def item(view: memoryview, path: str, target: int) -> tuple[bytes, str, int, bool]:
        return bytes(view), path, target, isinstance(view.obj, native.Pin)

    ds = DirectDataset(mnt, labels=True, sample_transform=item, extensions=IMG_EXTENSIONS, allow_empty=True)
    got = ds.__getitems__([3, 0, 6])
    for (data, path, target, pinned), i in zip(got, [3, 0, 6]):
        rel = IMAGE_ORDER[i]
        assert (data, path, target, pinned) == ((src / rel).read_bytes(), str(mnt / rel), LABELLED[rel], True)
    # Through DataLoader workers too; files in no class come with target -1 when every file is a sample.
    every = DirectDataset(mnt, sample_transform=lambda v, p, t: (os.path.relpath(p, mnt), t, bytes(v)))
    seen = [s for batch in DataLoader(every, batch_size=4, num_workers=2, collate_fn=list) for s in batch]
    assert seen == [(f, LABELLED[f], (src / f).read_bytes()) for f in sorted(LABELLED)]
    with pytest.raises(ValueError, match="alone"):
        DirectDataset(mnt, sample_transform=item, transform=bytes)


@pytest.mark.parametrize("workers", [0, 2])
def test_labelled_batches_cross_processes_as_paths(labelled: tuple[Path, Path], workers: int) -> None:
    """With no transform, a labelled batch is a ViewBatch of (view, target): from a worker it comes as
    paths and targets, mapped again from the shared cache."""
    src, mnt = labelled
    ds = DirectDataset(mnt, labels=True, extensions=IMG_EXTENSIONS, allow_empty=True)
    loader = DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=collate_views)
    seen = []
    for batch in loader:
        assert isinstance(batch, ViewBatch) and len(pickle.dumps(batch)) < 1000
        assert all(isinstance(v.obj, native.Pin) for v, _ in batch)
        seen += [(bytes(v), t) for v, t in batch]
    assert seen == [((src / f).read_bytes(), LABELLED[f]) for f in IMAGE_ORDER]


def test_a_subdirectory_or_symlink_finds_its_mount(labelled: tuple[Path, Path], tmp_path: Path) -> None:
    src, mnt = labelled
    sub = DirectDataset(mnt / "cat", labels=True, allow_empty=True)
    assert sub.direct and sub.mountpoint == str(mnt) and sub.classes == ["sub", "sub-x"]
    assert rel_samples(sub) == [("sub/c.jpg", 0), ("sub-x/d.jpeg", 1)]
    (tmp_path / "link").symlink_to(mnt / "cat")
    via = DirectDataset(tmp_path / "link", labels=True, allow_empty=True)
    assert via.direct and via.reason is None and via.root == str(mnt / "cat")
    assert [bytes(v) for v, _ in via.__getitems__([0, 1])] == [(src / "cat/sub/c.jpg").read_bytes(),
                                                             (src / "cat/sub-x/d.jpeg").read_bytes()]
