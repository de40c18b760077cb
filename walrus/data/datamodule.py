"""Lightning DataModule serving one or many Well datasets with a shared field vocabulary.

Every batch comes from ONE dataset (so shapes, fields and boundaries match); the
``MixedBatchSampler`` decides which, in proportion to dataset size or by given weights.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from walrus.data.batch import collate
from walrus.data.sampler import MixedBatchSampler, ResumableDataLoader
from walrus.data.stats import load_stats, write_stats
from walrus.data.storage import (
    as_location,
    data_root_exists,
    exists,
    is_dir,
    join,
    list_folders,
)
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset, evenly_spaced
from walrus.data.well_file import WellFile, list_split_files


def worker_init(worker_id: int, rank: int = 0) -> None:
    """DataLoader worker start: ignore Ctrl-C (SIGINT), which a terminal sends to the workers
    too, so that they keep serving while training stops after its current step and saves;
    then Lightning's worker seeding, when ``seed_everything(workers=True)`` asked for it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank=rank)


@dataclass(frozen=True)
class DatasetSpec:
    """One served dataset: folder name, mixing weight, channel subset."""

    name: str
    weight: float | None = None
    fields: tuple[str, ...] | None = None


def parse_dataset_specs(datasets: Sequence[str | Mapping[str, Any]] | str) -> list[DatasetSpec]:
    if isinstance(datasets, str):
        datasets = [datasets]
    if not isinstance(datasets, Sequence):
        raise ValueError(
            "data.datasets must be a dataset name or a list of names (or of name/weight/fields "
            f"mappings), got {str(datasets)[:100]!r}"
        )
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
            weight = entry.get("weight")
            if weight is not None and (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not 0 <= weight < float("inf")
            ):
                raise ValueError(
                    f"data.datasets entry {entry['name']!r}: weight must be a finite number "
                    f">= 0, got {weight!r}"
                )
            specs.append(
                DatasetSpec(
                    str(entry["name"]),
                    None if weight is None else float(weight),
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


def resolve_data_root(data_dir: Any, legacy_root: Any) -> str | None:
    """Where the data lives: ``paths.data_dir``, or ``data.root``, its old name as an option.

    Both ``train.py`` and ``infer.py`` take ``paths.data_dir``; a data config's ``root`` follows
    it. A ``data.root`` given on its own or differing from ``paths.data_dir`` still wins, with a
    ``FutureWarning`` naming the option to use instead.

    Returns:
        The root, or ``None`` when neither is set (inference then uses the checkpoint's).
    """
    if legacy_root is not None and str(legacy_root) != str(data_dir):
        warnings.warn(
            f"data.root is the old name of paths.data_dir (the option train.py and infer.py "
            f"both take); "
            f"reading data from {legacy_root}. Pass paths.data_dir={legacy_root} instead",
            FutureWarning,
            stacklevel=2,
        )
        return str(legacy_root)
    return None if data_dir is None else str(data_dir)


class WellDataModule(L.LightningDataModule):
    """Train/val/test loaders over one or many Well datasets under ``root``.

    Args:
        root: data root holding ``{dataset}/data/{split}/*.hdf5``: a local folder or an fsspec
            URL (``hf://datasets/polymathic-ai/``, ``memory://...``); URLs are read-only.
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
        max_sample_bytes: most bytes one window may need (checked from the files' declared
            shapes before anything is read).
        train_trajectories: train on the first N trajectories of each dataset's train split
            (in file order; validation and test are unchanged); ``None``: all. An N above what
            a dataset's train split holds, or below 1, is refused.
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
        max_sample_bytes: int | None = None,
        train_trajectories: int | None = None,
    ) -> None:
        super().__init__()
        if normalization not in ("rms", "zscore"):
            raise ValueError(f"normalization must be 'rms' or 'zscore', got {normalization!r}")
        self.root = as_location(root)
        self.max_sample_bytes = max_sample_bytes
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
        self.train_trajectories = train_trajectories
        self._vocab: FieldVocabulary | None = None
        self._spatial_dims: set[int] = set()
        self._inputs: list[tuple[str, int, tuple[int, ...], Any]] = []
        self._sets: dict[str, list[WellDataset]] = {}

    @property
    def dataset_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def prepare_data(self) -> None:
        """Generate missing built-in datasets (with ``generate_if_missing``) and, for z-score,
        missing ``stats.yaml`` files.

        Raises:
            FileNotFoundError: a dataset folder is missing and generation was not asked for, or
                the name is not a built-in system (the message names the folder and lists what
                the data root holds).
        """
        for spec in self.specs:
            ddir = join(self.root, spec.name)
            if not is_dir(join(ddir, "data")):
                self._generate(spec.name)
            if self.normalization == "zscore" and not exists(join(ddir, "stats.yaml")):
                write_stats(ddir)

    def _generate(self, name: str) -> None:
        """Generate built-in dataset ``name`` under ``root`` if asked to, else raise."""
        from walrus.data.synthetic import SYSTEMS, generate

        if not self.generate_if_missing or name not in SYSTEMS or isinstance(self.root, str):
            raise self._missing(name)  # a URL root is read-only: nothing is generated there
        print(
            f"note: dataset {name!r} is not under {self.root}; generating it there "
            "(data.generate_if_missing=true)",
            flush=True,
        )
        generate(name, self.root, **self.generate_kwargs)

    def _missing(self, name: str) -> FileNotFoundError:
        """The error for dataset ``name`` missing under ``root``: what exists, and what to do."""
        from walrus.data.synthetic import SYSTEMS

        ddir = join(self.root, name, "data")
        found = list_folders(self.root) if data_root_exists(self.root) else None
        if found is not None:
            where = f"data root {self.root} holds {found or 'no datasets'}"
        elif isinstance(self.root, str):
            where = f"nothing is listed under data root {self.root}"
        else:
            where = f"data root {self.root} does not exist"
        if name not in SYSTEMS:
            todo = (
                f"fix paths.data_dir or the dataset name (built-in systems: {', '.join(SYSTEMS)})"
            )
        elif isinstance(self.root, str):
            todo = "fix paths.data_dir or the dataset name (nothing is generated under a URL)"
        elif self.generate_if_missing:
            todo = "call prepare_data() first to generate it"
        else:
            todo = (
                f"{name!r} is built in: generate it with data.generate_if_missing=true or "
                f"python -m walrus.data.synthetic {name} --out {self.root}, or fix paths.data_dir"
            )
        return FileNotFoundError(f"dataset folder {ddir} does not exist; {where}; {todo}")

    @property
    def vocab(self) -> FieldVocabulary:
        """Field vocabulary over all served datasets (``base_vocab`` first, then new names in order).

        Reads one train file per dataset; never generates data (``prepare_data`` does).
        """
        if self._vocab is None:
            vocab = FieldVocabulary(self.base_vocab.names if self.base_vocab is not None else ())
            for spec in self.specs:
                if not is_dir(join(self.root, spec.name, "data")):
                    raise self._missing(spec.name)
                wf = WellFile(list_split_files(self.root, spec.name, "train")[0])
                names = wf.channel_names(spec.fields)
                vocab.add(names)
                self._spatial_dims.add(wf.n_spatial)
                self._inputs.append((str(wf.path), len(names), wf.spatial_shape, wf.bcs))
            self._vocab = vocab
        return self._vocab

    @property
    def spatial_dims(self) -> list[int]:
        """The sorted spatial dimensionalities (1-3) of the served datasets (read like ``vocab``)."""
        _ = self.vocab
        return sorted(self._spatial_dims)

    @property
    def sample_inputs(self) -> list[tuple[str, int, tuple[int, ...], Any]]:
        """Per dataset, from its first train file (read like ``vocab``; every file of a split
        shares the grid): ``(file, fields per frame, spatial grid, boundary codes)``."""
        _ = self.vocab
        return list(self._inputs)

    def stats(self, dataset: str) -> dict[str, dict[str, float]]:
        """Z-score statistics of ``dataset`` from its ``stats.yaml``."""
        return load_stats(join(self.root, dataset, "stats.yaml"))

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
                    max_sample_bytes=self.max_sample_bytes,
                    trajectories=self.train_trajectories if split == "train" else None,
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

    def _batches_done(self) -> int:
        """Training batches of the current epoch consumed by this rank's training loop."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def _loader(
        self, members: Sequence[Dataset], sampler: MixedBatchSampler, cls: type = DataLoader
    ) -> DataLoader:
        rank = self._world()[1] or 0
        return cls(
            ConcatDataset(members),
            batch_sampler=sampler,
            num_workers=self.num_workers,
            worker_init_fn=functools.partial(worker_init, rank=rank) if self.num_workers else None,
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
            position_fn=self._batches_done if getattr(self, "trainer", None) is not None else None,
        )
        if len(sampler) == 0:
            raise ValueError(
                f"no full training batch: datasets {self.dataset_names} have {[len(d) for d in sets]} "
                f"windows for batch_size={self.batch_size}"
            )
        # resumable: Lightning saves its position in checkpoints, so a resume mid-epoch is exact
        return self._loader(sets, sampler, ResumableDataLoader)

    def _eval_loader(self, split: str) -> DataLoader:
        members: list[Dataset] = []
        for d in self._datasets(split):
            keep = evenly_spaced(len(d), self.max_val_windows)
            members.append(d if len(keep) == len(d) else Subset(d, keep))
        world, rank = self._world()
        sampler = MixedBatchSampler(
            [len(m) for m in members],
            self.batch_size,
            shuffle=False,
            drop_last=False,
            seed=self.seed,
            num_replicas=world,
            rank=rank,
            pad=True,  # every window is evaluated; the module leaves the repeats out
        )
        return self._loader(members, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
