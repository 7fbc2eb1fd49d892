"""The chunk-aware sampler: exactness across ranks, determinism, chunk locality."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from dlfs.errors import UsageError
from dlfs.sampler import ChunkLocalSampler


def layout(n_chunks: int = 37, seed: int = 3) -> list[int]:
    """Samples in chunk order with uneven chunk sizes (1..60 samples), as ingest lays them out."""
    rng = random.Random(seed)
    return [c for c in range(n_chunks) for _ in range(rng.randint(1, 60))]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_sample_exactly_once_per_epoch_across_ranks(world: int) -> None:
    chunks = layout()
    for epoch in range(3):
        seen: list[int] = []
        for rank in range(world):
            s = ChunkLocalSampler(chunks, rank=rank, world_size=world, seed=5)
            s.set_epoch(epoch)
            got = list(s)
            assert len(got) == len(s)
            seen += got
        assert sorted(seen) == list(range(len(chunks))), f"epoch {epoch}"
        sizes = [len(ChunkLocalSampler(chunks, rank=r, world_size=world)) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1


def test_deterministic_for_seed_and_epoch_and_across_processes() -> None:
    chunks = layout()
    a = ChunkLocalSampler(chunks, seed=11)
    a.set_epoch(4)
    b = ChunkLocalSampler(chunks, seed=11)
    b.set_epoch(4)
    assert list(a) == list(b)
    b.set_epoch(5)
    assert list(a) != list(b), "each epoch is a fresh permutation"
    c = ChunkLocalSampler(chunks, seed=12)
    c.set_epoch(4)
    assert list(a) != list(c)
    # Another interpreter with another hash seed gets the same order (DataLoader workers, ranks).
    code = ("from dlfs.sampler import ChunkLocalSampler; import sys, json; s = ChunkLocalSampler(json.loads(sys.argv[1]), "
            "seed=11); s.set_epoch(4); print(json.dumps(list(s)))")
    out = subprocess.run([sys.executable, "-c", code, str(chunks)], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert [int(x) for x in out.stdout.strip()[1:-1].split(",")] == list(a)


def test_reads_a_few_chunks_at_a_time() -> None:
    chunks = layout(n_chunks=200)
    for window in (1, 4):
        s = ChunkLocalSampler(chunks, window=window, seed=1)
        order = list(s)
        # Within any run of samples from `window` consecutive chunk groups, only those chunks appear.
        first_seen: dict[int, int] = {}
        for pos, i in enumerate(order):
            first_seen.setdefault(chunks[i], pos)
        starts = sorted(first_seen.values())
        assert len(starts) == 200
        # Chunk c is finished before the chunk `window` groups later starts.
        last_seen = {chunks[i]: pos for pos, i in enumerate(order)}
        by_start = sorted(first_seen, key=first_seen.__getitem__)
        for k in range(len(by_start) - window):
            assert last_seen[by_start[k]] < first_seen[by_start[k + window]]
    # And the order is random beyond that: not the chunk order, not the same as another seed.
    assert list(ChunkLocalSampler(chunks, seed=1)) != sorted(range(len(chunks)))


def test_ranks_read_mostly_their_own_chunks() -> None:
    chunks = layout(n_chunks=100)
    per_rank = []
    for rank in range(4):
        per_rank.append({chunks[i] for i in ChunkLocalSampler(chunks, rank=rank, world_size=4, seed=2)})
    shared = sum(len(a & b) for k, a in enumerate(per_rank) for b in per_rank[k + 1 :])
    assert shared <= 3 * 4, "only the windows at share boundaries are split between ranks"


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="rank 2 is outside 0..1"):
        ChunkLocalSampler([0, 0, 1], rank=2, world_size=2)
    with pytest.raises(UsageError, match="world_size"):
        ChunkLocalSampler([0], world_size=0)
    with pytest.raises(UsageError, match="window"):
        ChunkLocalSampler([0], window=0)
    assert list(ChunkLocalSampler([])) == []
