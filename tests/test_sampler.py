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


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n_chunks", [37, 41])
def test_equal_shares_cover_every_sample_each_epoch(world: int, n_chunks: int) -> None:
    """Every rank the same count (DDP steps in lockstep), every sample read each epoch; the padding
    is the fewest repeats that make equal shares. The layouts' sample counts are not divisible by
    2, 3, 4 or 8 (checked), so the padding is exercised."""
    chunks = layout(n_chunks)
    n = len(chunks)
    assert all(n % w for w in (2, 3, 4, 8)), n
    for epoch in range(3):
        seen: list[int] = []
        sizes = []
        for rank in range(world):
            s = ChunkLocalSampler(chunks, rank=rank, world_size=world, seed=5)
            s.set_epoch(epoch)
            got = list(s)
            assert len(got) == len(s)
            sizes.append(len(got))
            seen += got
        assert len(set(sizes)) == 1, f"unequal shares {sizes}"
        assert set(seen) == set(range(n)), f"epoch {epoch}: samples missed"
        assert len(seen) - n == -n % world, "more repeats than equal shares need"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_drop_last_gives_equal_shares_without_repeats(world: int) -> None:
    chunks = layout()
    n = len(chunks)
    seen: list[int] = []
    for rank in range(world):
        s = ChunkLocalSampler(chunks, rank=rank, world_size=world, seed=5, drop_last=True)
        assert len(s) == n // world
        seen += list(s)
    assert len(seen) == len(set(seen)) == n - n % world


def test_fewer_samples_than_ranks() -> None:
    # 3 samples over 8 ranks: each rank reads one, the order repeated; drop_last would leave none.
    shares = [list(ChunkLocalSampler([0, 0, 1], rank=r, world_size=8)) for r in range(8)]
    assert all(len(s) == 1 for s in shares) and {s[0] for s in shares} == {0, 1, 2}
    with pytest.raises(UsageError, match="leaves every rank none"):
        ChunkLocalSampler([0, 0, 1], rank=0, world_size=8, drop_last=True)
    assert list(ChunkLocalSampler([], world_size=2)) == []


DDP_EPOCH = """
import os, sys
import torch
import torch.distributed as dist
from dlfs.sampler import ChunkLocalSampler

rank, world, chunks = int(sys.argv[1]), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
dist.init_process_group("gloo", rank=rank, world_size=world, init_method="tcp://127.0.0.1:" + sys.argv[4],
                        timeout=__import__("datetime").timedelta(seconds=60))
sampler = ChunkLocalSampler(chunks, rank=rank, world_size=world, seed=1)
loader = torch.utils.data.DataLoader(list(range(len(chunks))), sampler=sampler, batch_size=4)
for epoch in range(2):
    sampler.set_epoch(epoch)
    steps = 0
    for batch in loader:
        t = torch.tensor([float(len(batch))])
        dist.all_reduce(t)  # every step is a collective, as DistributedDataParallel's backward is
        steps += 1
    dist.barrier()
    print(epoch, steps, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_two_rank_gloo_epochs_finish(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two processes of torch.distributed (gloo, CPU) run two epochs of one all_reduce per batch over
    1001 samples: with unequal shares (500 and 501) the second rank's last step would wait forever."""
    pytest.importorskip("torch.distributed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chunks = ",".join(str(i // 7) for i in range(1001))
    (tmp_path / "ddp.py").write_text(DDP_EPOCH)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "ddp.py"), str(r), "2", chunks, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-2000:]
            outs.append(out.split())
    finally:
        for p in procs:
            p.kill()
    assert outs[0] == outs[1] == ["0", "126", "1", "126"]  # ceil(1001 / 2) = 501 samples: 126 batches of 4


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
