"""A chunk-aware sampler: random epochs that read the dataset a few chunks at a time.

A uniformly random permutation touches a new chunk on almost every sample. Here each epoch shuffles
the order of the chunks, then shuffles the samples within a window of `window` consecutive chunks
(DLFS/DIESEL opportunistic batching): one chunk fetched serves all its samples while it is hot, and
the order is still random at the scale of a few chunks. The epoch's order is split into contiguous
shares, one per rank, each rank reading mostly chunks of its own. Every rank gets the same number of
samples (under DistributedDataParallel a rank with one step more waits forever at the last
collective): as torch's DistributedSampler does, the order is padded with its own first samples up to
a multiple of the world size, so every sample is read at least once per epoch and a few twice; with
`drop_last=True` the tail past the last multiple is left out instead (a different tail each epoch).
The same seed and epoch give the same order in every process.

Usable as `DataLoader(dataset, sampler=ChunkLocalSampler(dataset.chunks, ...))`; call `set_epoch`
before each epoch, as with torch's DistributedSampler.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from dlfs.errors import UsageError


class ChunkLocalSampler:
    def __init__(self, chunks: Sequence[int], *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 window: int = 4, drop_last: bool = False) -> None:
        """`chunks[i]` is the chunk holding sample i (samples of one chunk are read together)."""
        if world_size < 1:
            raise UsageError(f"world_size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is outside 0..{world_size - 1}")
        if window < 1:
            raise UsageError(f"window must be at least 1 chunk, not {window}")
        self.rank, self.world_size, self.seed, self.window = rank, world_size, seed, window
        self.drop_last = drop_last
        self.epoch = 0
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault(c, []).append(i)
        self._groups = [groups[c] for c in sorted(groups)]
        self._n = len(chunks)
        if drop_last and 0 < self._n < world_size:
            raise UsageError(f"drop_last with {self._n} samples over {world_size} ranks leaves every rank none")
        # Samples each rank reads per epoch: the same on every rank.
        self._per_rank = self._n // world_size if drop_last else -(-self._n // world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """This epoch's order of every sample (all ranks' shares, in rank order), before padding."""
        # A string seed is hashed with SHA-512: the same in every process and Python version.
        rng = random.Random(f"dlfs-sampler:{self.seed}:{self.epoch}")
        groups = list(self._groups)
        rng.shuffle(groups)
        out: list[int] = []
        for w in range(0, len(groups), self.window):
            part = [i for g in groups[w : w + self.window] for i in g]
            rng.shuffle(part)
            out += part
        return out

    def padded_order(self) -> list[int]:
        """This epoch's order cut or padded to world_size equal shares, in rank order."""
        order = self.order()
        total = self._per_rank * self.world_size
        while len(order) < total:  # more than once only with fewer samples than ranks
            order += order[: total - len(order)]
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        lo = self.rank * self._per_rank
        return iter(self.padded_order()[lo : lo + self._per_rank])

    def __len__(self) -> int:
        return self._per_rank
