"""``MixedBatchSampler``: batches that each come from one member dataset of a ``ConcatDataset``.

Datasets are drawn in proportion to their size or by given weights; the order is a function of
the seed and the epoch, and ranks get disjoint batches. The position in an epoch is saved and
restored (``state_dict`` / ``load_state_dict``, through :class:`ResumableDataLoader`, which
Lightning stores in a checkpoint's loop state), so a resumed run sees the batches an
uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler


def _dist_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class MixedBatchSampler(Sampler[list[int]]):
    """Batches of indices into a ``ConcatDataset``, each batch from a single member dataset.

    Args:
        sizes: number of samples of each member dataset, in ``ConcatDataset`` order.
        batch_size: samples per batch.
        weights: per-dataset draw probabilities (normalised); ``None`` draws in proportion to
            size (every batch of every dataset once per epoch, shuffled).
        shuffle: shuffle samples and batch order (deterministic given ``seed`` and the epoch).
        drop_last: drop each dataset's last incomplete batch.
        seed: base seed.
        num_batches: batches per epoch with ``weights`` (default: the total number of batches).
        num_replicas, rank: DDP world size and rank (default: from ``torch.distributed`` when
            initialised, else 1 and 0). Ranks get disjoint batches and equal counts.
        pad: with several ranks, serve every batch: the last ranks get repeats of the first
            batches so that the counts stay equal (:meth:`is_padding` names the repeats, which
            an evaluation must leave out). Without it the last ``len % world`` batches are
            left out (training).
        epoch_fn: called at each ``__iter__`` for the current epoch (e.g. the trainer's), so the
            order changes every epoch and is the same after a resume; else ``set_epoch`` rules.
        position_fn: batches of the current epoch this rank has consumed (e.g. the trainer's
            count, which prefetching does not inflate); default: the batches yielded so far.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        batch_size: int,
        weights: Sequence[float] | None = None,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        num_batches: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        epoch_fn: Callable[[], int] | None = None,
        position_fn: Callable[[], int] | None = None,
        pad: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not sizes:
            raise ValueError("MixedBatchSampler needs at least one dataset")
        self.sizes = [int(s) for s in sizes]
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.seed, self.epoch, self.num_batches = seed, 0, num_batches
        self.offsets = np.cumsum([0, *self.sizes[:-1]]).tolist()
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (len(self.sizes),) or (w < 0).any() or w.sum() <= 0:
                raise ValueError(
                    f"weights must be {len(self.sizes)} non-negative numbers, not all 0: {weights}"
                )
            for i, (wi, n) in enumerate(zip(w, self.sizes)):
                if wi > 0 and self._n_batches(n) == 0:
                    raise ValueError(
                        f"dataset {i} has weight {wi} but too few samples ({n}) for a batch of {batch_size}"
                    )
            self.weights: np.ndarray | None = w / w.sum()
        else:
            self.weights = None
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch_fn, self.position_fn = epoch_fn, position_fn
        self.pad = pad
        self._yielded = 0
        self._served = 0  # batches of the epoch before padding, all ranks together
        self._resume: tuple[int, int] | None = None  # (epoch, global batches already served)

    def _n_batches(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Reseed for ``epoch`` (Lightning calls this each epoch)."""
        self.epoch = int(epoch)

    def _world(self) -> tuple[int, int]:
        world, rank = _dist_world()
        world = self.num_replicas if self.num_replicas is not None else world
        rank = self.rank if self.rank is not None else rank
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for {world} replicas")
        return world, rank

    def _dataset_batches(self, d: int, rng: np.random.Generator) -> list[list[int]]:
        n = self.sizes[d]
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        order = order + self.offsets[d]
        return [
            order[i : i + self.batch_size].tolist()
            for i in range(0, self._n_batches(n) * self.batch_size, self.batch_size)
        ]

    def _epoch_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        per = [self._dataset_batches(d, rng) for d in range(len(self.sizes))]
        if self.weights is None:
            batches = [b for bs in per for b in bs]
            if self.shuffle:
                batches = [batches[i] for i in rng.permutation(len(batches))]
            return batches
        total = self.num_batches or sum(len(bs) for bs in per)
        draws = rng.choice(len(self.sizes), size=total, p=self.weights)
        cursor = [0] * len(self.sizes)
        batches = []
        for d in draws:
            if cursor[d] == len(per[d]):
                per[d], cursor[d] = self._dataset_batches(d, rng), 0
            batches.append(per[d][cursor[d]])
            cursor[d] += 1
        return batches

    def state_dict(self) -> dict[str, int]:
        """The position in the epoch: ``epoch``, ``batches`` consumed by this rank, ``world``."""
        done = self.position_fn() if self.position_fn is not None else self._yielded
        return {"epoch": int(self.epoch), "batches": int(done), "world": self._world()[0]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a ``state_dict()``): the next ``__iter__`` over that epoch
        skips the batches already served to all ranks; another epoch starts from its beginning.

        Raises:
            ValueError: ``state`` is not three non-negative ints (it is read from a checkpoint).
        """
        keys = ("epoch", "batches", "world")
        if not isinstance(state, Mapping) or set(state) != set(keys):
            raise ValueError(f"sampler state must have exactly the keys {keys}, got {state!r}")
        values = [state[k] for k in keys]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ValueError(f"sampler state values must be non-negative ints, got {dict(state)}")
        epoch, done, world = values
        self._resume = (epoch, done * max(world, 1))

    def __iter__(self) -> Iterator[list[int]]:
        if self.epoch_fn is not None:
            self.epoch = int(self.epoch_fn())
        world, rank = self._world()
        batches = self._epoch_batches()
        if self._resume is not None:
            epoch, served = self._resume
            self._resume = None
            if epoch == self.epoch:
                batches = batches[served:]
        self._served = len(batches)
        if world > 1 and self.pad and batches:
            repeats = -len(batches) % world
            batches = batches + [batches[i % len(batches)] for i in range(repeats)]
        usable = len(batches) - len(batches) % world if world > 1 else len(batches)
        self._yielded = 0
        for batch in batches[rank:usable:world]:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        world, _ = self._world()
        total = self.num_batches if self.weights is not None and self.num_batches else None
        if total is None:
            total = sum(self._n_batches(n) for n in self.sizes)
        if world > 1 and self.pad:
            return math.ceil(total / world)
        return total // world if world > 1 else total

    def is_padding(self, batch_idx: int) -> bool:
        """Whether this rank's ``batch_idx``-th batch of the current pass is a repeat added by
        ``pad`` (its results must not count)."""
        world, rank = self._world()
        return self.pad and world > 1 and rank + batch_idx * world >= self._served


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position is its batch sampler's ``state_dict``.

    Lightning saves it in the checkpoint's loop state and restores it on resume (its stateful
    data loading); the batch sampler must be a :class:`MixedBatchSampler`.
    """

    def state_dict(self) -> dict[str, int]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
