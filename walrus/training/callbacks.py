"""Training callbacks: exact resume (RNG, data position) and a per-rank audit of data and weights."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from walrus.atomic import write_text_atomic


def capture_rng() -> dict[str, Any]:
    """Every RNG the training loop draws from, as weights-only-loadable values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple | list) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


class RNGStateCallback(pl.Callback):
    """Saves the RNG states in checkpoints and restores them when training resumes.

    The states are applied where an uninterrupted run would be: at the start of the first
    training epoch after a resume at an epoch boundary, or before the first training batch after
    a resume mid-epoch (Lightning calls no epoch-start hook then), so sanity-check validation
    cannot shift them.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def _restore(self) -> None:
        if self._pending is not None:
            restore_rng(self._pending)
            self._pending = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._restore()


class DataPositionCallback(pl.Callback):
    """Makes a mid-epoch resume continue the epoch's batch order where the checkpoint left it.

    Lightning restores a stateful training loader (``state_dict`` / ``load_state_dict``, e.g.
    :class:`~walrus.data.sampler.ResumableDataLoader`) only when it builds the loader after the
    checkpoint is read; a learning-rate schedule that asks for
    ``trainer.estimated_stepping_batches`` builds it before, and the saved position is then
    ignored. This callback applies the position when training starts and starts a fresh
    iterator over the loader.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop
        if not (loop.restarting and loop._combined_loader_states_to_load):
            return
        loop._load_combined_loader_states()
        if loop._data_fetcher is not None:
            iter(loop._data_fetcher)  # the next batch is the first one not yet trained on


class RankAudit(pl.Callback):
    """Writes, per rank, which samples each training step saw and a checksum of the final weights.

    Output: ``{dirpath}/audit_rank{R}.json`` with ``samples`` (list of ``[dataset, trajectory,
    start]`` per sample) and ``weights_sha256``. Useful to check data sharding and replica sync.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.samples: list[list[Any]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        meta = batch.metadata
        traj = meta.get("trajectory")
        start = meta.get("start")
        traj = traj.tolist() if isinstance(traj, torch.Tensor) else list(traj or [])
        start = start.tolist() if isinstance(start, torch.Tensor) else list(start or [])
        for t, s in zip(traj, start):
            self.samples.append([meta.get("dataset"), int(t), int(s)])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        h = hashlib.sha256()
        for name, p in sorted(pl_module.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / f"audit_rank{trainer.global_rank}.json"
        write_text_atomic(
            path, json.dumps({"samples": self.samples, "weights_sha256": h.hexdigest()})
        )
