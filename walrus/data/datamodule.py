"""Lightning DataModule serving one or many Well datasets with a shared field vocabulary.

Every batch comes from ONE dataset (so shapes, fields and boundaries match); the
``MixedBatchSampler`` decides which, in proportion to dataset size or by given weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, Subset

from walrus.data.batch import collate
from walrus.data.stats import load_stats, write_stats
from walrus.data.vocab import FieldVocabulary
from walrus.data.well import WellDataset, WellFile, list_split_files


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
        epoch_fn: called at each ``__iter__`` for the current epoch (e.g. the trainer's), so the
            order changes every epoch and is the same after a resume; else ``set_epoch`` rules.
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
        self.epoch_fn = epoch_fn

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

    def __iter__(self) -> Iterator[list[int]]:
        if self.epoch_fn is not None:
            self.epoch = int(self.epoch_fn())
        world, rank = self._world()
        batches = self._epoch_batches()
        usable = len(batches) - len(batches) % world if world > 1 else len(batches)
        yield from batches[rank:usable:world]

    def __len__(self) -> int:
        world, _ = self._world()
        total = self.num_batches if self.weights is not None and self.num_batches else None
        if total is None:
            total = sum(self._n_batches(n) for n in self.sizes)
        return total // world if world > 1 else total


@dataclass(frozen=True)
class DatasetSpec:
    """One served dataset: folder name, mixing weight, channel subset."""

    name: str
    weight: float | None = None
    fields: tuple[str, ...] | None = None


def parse_dataset_specs(datasets: Sequence[str | Mapping[str, Any]] | str) -> list[DatasetSpec]:
    if isinstance(datasets, str):
        datasets = [datasets]
    specs = []
    for entry in datasets:
        if isinstance(entry, str):
            specs.append(DatasetSpec(entry))
        elif isinstance(entry, Mapping):
            unknown = set(entry) - {"name", "weight", "fields"}
            if "name" not in entry or unknown:
                raise ValueError(
                    f"dataset entry {dict(entry)} needs 'name' and may have only 'weight', 'fields'"
                )
            fields = entry.get("fields")
            specs.append(
                DatasetSpec(
                    str(entry["name"]),
                    None if entry.get("weight") is None else float(entry["weight"]),
                    None if fields is None else tuple(str(f) for f in fields),
                )
            )
        else:
            raise ValueError(f"dataset entry must be a name or a mapping, got {entry!r}")
    if not specs:
        raise ValueError("WellDataModule needs at least one dataset")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate datasets in {names}")
    return specs


class WellDataModule(L.LightningDataModule):
    """Train/val/test loaders over one or many Well datasets under ``root``.

    Args:
        root: data root holding ``{dataset}/data/{split}/*.hdf5``.
        datasets: names, or mappings ``{name, weight, fields}``. With any weight given,
            batches are drawn by weight (missing weights count 1); else by dataset size.
        n_steps_input, n_steps_output: frames per window.
        batch_size: samples per batch (each batch from one dataset).
        num_workers: DataLoader workers (each opens its own HDF5 handles).
        time_stride: int, or ``(lo, hi)`` drawn per training sample; val/test use ``lo``.
        pin_memory: pin batches in the loaders.
        generate_if_missing: generate a missing built-in dataset (``walrus.data.synthetic``).
        generate_kwargs: passed to ``generate`` (``n_traj``, ``resolution``, ``steps``, ``seed``).
        base_vocab: an existing vocabulary (``FieldVocabulary`` or its ``to_dict()``) to extend,
            e.g. a checkpoint's for fine-tuning; its ids never change.
        normalization: ``"rms"`` (per sample, nothing needed) or ``"zscore"`` (``stats.yaml``
            per dataset, computed in ``prepare_data`` when missing).
        seed: sampler seed.
        max_val_windows: evenly spaced windows kept per dataset for val/test (``None``: all).
        batches_per_epoch: training batches per epoch when sampling by weight.
        val_steps_output: target frames per val/test window (default ``n_steps_output``); more
            frames give the validation rollout something to compare against.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        datasets: Sequence[str | Mapping[str, Any]] | str,
        n_steps_input: int = 4,
        n_steps_output: int = 1,
        batch_size: int = 8,
        num_workers: int = 0,
        time_stride: int | Sequence[int] = 1,
        pin_memory: bool = False,
        generate_if_missing: bool = False,
        generate_kwargs: Mapping[str, Any] | None = None,
        base_vocab: FieldVocabulary | Mapping[str, Any] | None = None,
        normalization: str = "rms",
        seed: int = 0,
        max_val_windows: int | None = 256,
        batches_per_epoch: int | None = None,
        val_steps_output: int | None = None,
    ) -> None:
        super().__init__()
        if normalization not in ("rms", "zscore"):
            raise ValueError(f"normalization must be 'rms' or 'zscore', got {normalization!r}")
        self.root = Path(root)
        self.specs = parse_dataset_specs(datasets)
        self.n_steps_input, self.n_steps_output = n_steps_input, n_steps_output
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.time_stride = tuple(time_stride) if not isinstance(time_stride, int) else time_stride
        self.generate_if_missing = generate_if_missing
        self.generate_kwargs = dict(generate_kwargs or {})
        if isinstance(base_vocab, Mapping):
            base_vocab = FieldVocabulary.from_dict(base_vocab)
        self.base_vocab = base_vocab
        self.normalization, self.seed = normalization, seed
        self.max_val_windows, self.batches_per_epoch = max_val_windows, batches_per_epoch
        self.val_steps_output = val_steps_output or n_steps_output
        self._vocab: FieldVocabulary | None = None
        self._sets: dict[str, list[WellDataset]] = {}

    @property
    def dataset_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def prepare_data(self) -> None:
        """Generate missing built-in datasets and, for z-score, missing ``stats.yaml`` files."""
        for spec in self.specs:
            ddir = self.root / spec.name
            if not (ddir / "data").is_dir() and self.generate_if_missing:
                from walrus.data.synthetic import SYSTEMS, generate

                if spec.name not in SYSTEMS:
                    raise FileNotFoundError(
                        f"dataset {ddir} is missing and {spec.name!r} is not a built-in system "
                        f"({', '.join(SYSTEMS)}); download it or fix data.root"
                    )
                generate(spec.name, self.root, **self.generate_kwargs)
            if self.normalization == "zscore" and not (ddir / "stats.yaml").is_file():
                write_stats(ddir)

    @property
    def vocab(self) -> FieldVocabulary:
        """Field vocabulary over all served datasets (``base_vocab`` first, then new names in order)."""
        if self._vocab is None:
            if self.generate_if_missing:
                self.prepare_data()
            vocab = FieldVocabulary(self.base_vocab.names if self.base_vocab is not None else ())
            for spec in self.specs:
                wf = WellFile(list_split_files(self.root, spec.name, "train")[0])
                vocab.add(channel_names(wf, spec.fields))
            self._vocab = vocab
        return self._vocab

    def stats(self, dataset: str) -> dict[str, dict[str, float]]:
        """Z-score statistics of ``dataset`` from its ``stats.yaml``."""
        return load_stats(self.root / dataset / "stats.yaml")

    def _datasets(self, split: str) -> list[WellDataset]:
        if split not in self._sets:
            stride = self.time_stride
            if split != "train" and not isinstance(stride, int):
                stride = stride[0]
            self._sets[split] = [
                WellDataset(
                    self.root,
                    spec.name,
                    split,
                    self.n_steps_input,
                    self.n_steps_output if split == "train" else self.val_steps_output,
                    time_stride=stride,
                    vocab=self.vocab,
                    fields=spec.fields,
                    train=split == "train",
                )
                for spec in self.specs
            ]
        return self._sets[split]

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            self._datasets("train")
            self._datasets("valid")
        if stage in (None, "validate"):
            self._datasets("valid")
        if stage in (None, "test", "predict"):
            self._datasets("test")

    def _world(self) -> tuple[int | None, int | None]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        return None, None

    def _current_epoch(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.current_epoch if trainer is not None else 0

    def _loader(self, members: Sequence[Dataset], sampler: MixedBatchSampler) -> DataLoader:
        return DataLoader(
            ConcatDataset(members),
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            # Worker seeds come from this generator, not the global RNG, so creating an
            # iterator never shifts the training RNG (exact resume depends on it).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        sets = self._datasets("train")
        weights = None
        if any(s.weight is not None for s in self.specs):
            weights = [1.0 if s.weight is None else s.weight for s in self.specs]
        world, rank = self._world()
        sampler = MixedBatchSampler(
            [len(d) for d in sets],
            self.batch_size,
            weights=weights,
            shuffle=True,
            drop_last=True,
            seed=self.seed,
            num_batches=self.batches_per_epoch,
            num_replicas=world,
            rank=rank,
            epoch_fn=self._current_epoch,
        )
        if len(sampler) == 0:
            raise ValueError(
                f"no full training batch: datasets {self.dataset_names} have {[len(d) for d in sets]} "
                f"windows for batch_size={self.batch_size}"
            )
        return self._loader(sets, sampler)

    def _eval_loader(self, split: str) -> DataLoader:
        members: list[Dataset] = []
        for d in self._datasets(split):
            if self.max_val_windows is not None and len(d) > self.max_val_windows:
                keep = np.unique(
                    np.linspace(0, len(d) - 1, self.max_val_windows).round().astype(int)
                )
                members.append(Subset(d, keep.tolist()))
            else:
                members.append(d)
        world, rank = self._world()
        sampler = MixedBatchSampler(
            [len(m) for m in members],
            self.batch_size,
            shuffle=False,
            drop_last=False,
            seed=self.seed,
            num_replicas=world,
            rank=rank,
        )
        return self._loader(members, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def channel_names(wf: WellFile, fields: Sequence[str] | None) -> list[str]:
    """Flattened channel names of ``fields`` (all when ``None``); duplicates are an error."""
    names = [fi.components[c] for fi, comps in wf.select(fields) for c in comps]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(
            f"{wf.path}: fields conflict, channel names {dupes} appear more than once; each channel "
            "needs its own name to get its own vocabulary slot"
        )
    return names
