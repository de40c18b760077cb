"""Lightning pieces of inference: a module whose predict/test steps call ``walrus.rollout``.

``Trainer.predict`` rolls out whole trajectories (``predict_step``); ``Trainer.test`` scores
one-step predictions of windows (``test_step``). Work is cut into jobs (a batch of trajectories
or windows of one dataset); job ``j`` runs on rank ``j % world_size``, so with ``trainer=ddp``
the trajectories spread over the processes. ``RolloutModule.gather`` then sums the metrics over
ranks and collects predictions on every rank.

Shape legend: B trajectories or windows, T frames, S rollout steps, C fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from walrus.data.batch import Batch, collate
from walrus.data.normalization import Normalizer, RMSNormalizer
from walrus.errors import RolloutDivergedError
from walrus.metrics import RolloutMetrics
from walrus.perturbation import Perturbation
from walrus.rollout import ensemble_rollout, rollout

if TYPE_CHECKING:
    from walrus.inference.loading import Prepared


@dataclass(frozen=True)
class DatasetPlan:
    """What one dataset contributes: its channel names and the number of steps scored."""

    name: str
    field_names: tuple[str, ...]
    steps: int


class JobDataset(Dataset):
    """Job ``j`` is one batch: ``collate([load[dataset](i) for i in indices])``.

    Args:
        jobs: ``(dataset name, sample indices)`` per job.
        load: dataset name -> function returning the ``Batch`` (B=1) of one sample index.
    """

    def __init__(
        self, jobs: Sequence[tuple[str, Sequence[int]]], load: Mapping[str, Callable[[int], Batch]]
    ) -> None:
        self.jobs = [(name, list(idx)) for name, idx in jobs]
        self.load = dict(load)

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, j: int) -> Batch:
        name, indices = self.jobs[j]
        return collate([self.load[name](i) for i in indices])


def make_jobs(indices: Mapping[str, Sequence[int]], batch_size: int) -> list[tuple[str, list[int]]]:
    """Cut each dataset's sample indices into batches of at most ``batch_size``."""
    return [
        (name, list(idx[i : i + batch_size]))
        for name, idx in indices.items()
        for i in range(0, len(idx), batch_size)
    ]


def _as_is(batch: Batch) -> Batch:
    """Collate function for jobs that are already batches."""
    return batch


class JobDataModule(pl.LightningDataModule):
    """Serves this rank's share of the jobs (``j % world_size == rank``), in order, to predict and test."""

    def __init__(self, jobs: JobDataset) -> None:
        super().__init__()
        self.jobs = jobs

    def _loader(self) -> DataLoader:
        world, rank = (
            (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        )
        mine = Subset(self.jobs, list(range(rank, len(self.jobs), world)))
        return DataLoader(mine, batch_size=None, shuffle=False, collate_fn=_as_is)

    def predict_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()


class RolloutModule(pl.LightningModule):
    """Rolls a model out (predict) or scores its next-frame prediction (test), with metrics.

    Args:
        model: a walrus model (``model(x, fields, bcs, *, jitter_seed=None)``).
        plans: dataset name -> ``DatasetPlan``; ``steps`` sizes the metric accumulators.
        predict_delta: the checkpoint's ``predict_delta``.
        normalizer: per-window normaliser (``RMSNormalizer()`` as in training by default).
        jitter_seed: ``None`` turns patch jitter off; an int makes it on and reproducible.
        members: ensemble size; more than one rolls out that many jittered copies of each
            trajectory (needs ``jitter_seed``), scores their mean and the ensemble
            (``walrus.metrics.ensemble_scores``) and keeps their spread.
        cap_delta_unit: cap each step's delta unit at the true context's (``walrus.rollout``).
        jitter_average: jitter draws averaged at every step (``walrus.rollout``; needs
            ``jitter_seed`` when above 1).
        spectral_limit: limit of each step's change per wavenumber shell (``walrus.rollout``;
            0: off).
        perturbation: perturb every ensemble member's steps (``walrus.perturbation``); not
            used with one member.
        autocast_dtype: e.g. ``torch.bfloat16`` to run the model under autocast.
        keep_predictions: keep every predicted frame (on the CPU) for ``predictions.hdf5``.
        keep_members: also keep every member's frames (``members > 1``) for ``members.hdf5``.
        progress: show a progress bar of rollout steps (rank 0 only).
        job_steps: rollout steps of each job, in job order (sizes the progress bar).

    Attributes (after a run and ``gather``):
        metrics: dataset name -> ``RolloutMetrics``.
        predictions: ``(dataset, trajectory)`` -> ``(S_done, C, *spatial)`` float32 array (the
            ensemble mean with ``members > 1``).
        spreads: like ``predictions``, the members' standard deviation (``members > 1`` only).
        member_predictions: like ``predictions``, ``(K, S_done, C, *spatial)`` (``keep_members``).
        diverged: one record per batch that hit NaN/Inf: dataset, trajectories, step, fields.
    """

    def __init__(
        self,
        model: nn.Module,
        plans: Mapping[str, DatasetPlan],
        *,
        predict_delta: bool = True,
        normalizer: Normalizer | None = None,
        jitter_seed: int | None = None,
        members: int = 1,
        cap_delta_unit: bool = True,
        jitter_average: int = 1,
        spectral_limit: float = 0.0,
        perturbation: Perturbation | None = None,
        autocast_dtype: torch.dtype | None = None,
        keep_predictions: bool = True,
        keep_members: bool = False,
        progress: bool = False,
        job_steps: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.plans = dict(plans)
        self.predict_delta = predict_delta
        self.normalizer = normalizer if normalizer is not None else RMSNormalizer()
        if members > 1 and jitter_seed is None:
            raise ValueError(f"an ensemble of {members} members needs jitter on (a jitter seed)")
        self.jitter_seed = jitter_seed
        self.members = members
        self.cap_delta_unit = cap_delta_unit
        self.jitter_average = jitter_average
        self.spectral_limit = spectral_limit
        self.perturbation = perturbation
        self.autocast_dtype = autocast_dtype
        self.keep_predictions = keep_predictions
        self.keep_members = keep_members and members > 1
        self.progress = progress
        self.job_steps = list(job_steps)
        self._bar: Progress | None = None
        self._task: Any = None
        self._reset()

    @classmethod
    def from_prepared(
        cls, prep: Prepared, plans: Mapping[str, DatasetPlan], **kwargs: Any
    ) -> RolloutModule:
        """The module for an inference command: model, normaliser, jitter, ensemble, delta cap
        and autocast from ``prep``; ``kwargs`` (``keep_predictions``, ``keep_members``,
        ``progress``, ``job_steps``) as for the constructor."""
        return cls(
            prep.ckpt.model,
            plans,
            predict_delta=prep.ckpt.predict_delta,
            normalizer=prep.ckpt.normalizer,
            jitter_seed=prep.jitter_seed,
            members=prep.members,
            cap_delta_unit=prep.cap_delta_unit,
            jitter_average=prep.jitter_average,
            spectral_limit=prep.spectral_limit,
            perturbation=prep.perturbation,
            autocast_dtype=prep.autocast_dtype,
            **kwargs,
        )

    def _reset(self) -> None:
        self.metrics = {
            name: RolloutMetrics(
                plan.field_names, plan.steps, device=self.device, members=self.members
            )
            for name, plan in self.plans.items()
        }
        self.predictions: dict[tuple[str, int], np.ndarray] = {}
        self.spreads: dict[tuple[str, int], np.ndarray] = {}
        self.member_predictions: dict[tuple[str, int], np.ndarray] = {}
        self.diverged: list[dict[str, Any]] = []

    def _rollout(self, batch: Batch, steps: int) -> Any:
        """Yields ``(prediction, spread, members)`` per step: ``(B, C, *sp)``, the same or
        ``None``, and ``(K, B, C, *sp)`` or ``None`` (one member)."""
        kwargs = {
            "normalizer": self.normalizer,
            "predict_delta": self.predict_delta,
            "autocast_dtype": self.autocast_dtype,
            "cap_delta_unit": self.cap_delta_unit,
            "jitter_average": self.jitter_average,
            "spectral_limit": self.spectral_limit,
        }
        if self.members > 1:
            yield from ensemble_rollout(
                self.model,
                batch,
                steps,
                members=self.members,
                jitter_seed=self.jitter_seed,
                keep_members=True,
                perturbation=self.perturbation,
                **kwargs,
            )
            return
        for pred in rollout(self.model, batch, steps, jitter_seed=self.jitter_seed, **kwargs):
            yield pred, None, None

    def _start(self, total: int | None) -> None:
        self.model.eval()
        self._reset()
        if self.progress and self.trainer.is_global_zero and total:
            self._bar = Progress(
                TextColumn("rollout steps"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            self._task = self._bar.add_task("rollout", total=total)
            self._bar.start()

    def _stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def on_predict_start(self) -> None:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        self._start(sum(self.job_steps[rank::world]))

    def on_predict_end(self) -> None:
        self._stop()

    def on_test_start(self) -> None:
        self._start(None)

    def _record_divergence(self, batch: Batch, err: RolloutDivergedError) -> None:
        self.diverged.append(
            {
                "dataset": batch.metadata["dataset"],
                "trajectories": [int(i) for i in batch.metadata["trajectory"].tolist()],
                "start": [int(i) for i in batch.metadata["start"].tolist()],
                "step": err.step,
                "fields": list(err.fields),
            }
        )

    def predict_step(self, batch: Batch, batch_idx: int) -> int:
        """Roll the batch's trajectories out for every target frame it holds, scoring each step.

        Returns:
            The number of steps completed before the end or a NaN/Inf.
        """
        name = batch.metadata["dataset"]
        metrics = self.metrics[name]
        steps = batch.output_fields.shape[1]
        last = batch.input_fields[:, -1]  # (B, C, *sp) persistence prediction
        frames: list[torch.Tensor] = []
        spreads: list[torch.Tensor] = []
        member_frames: list[torch.Tensor] = []
        done = 0
        prev_pred, prev_truth = last, last  # (B, C, *sp) the frames before each step's
        try:
            for step, (pred, spread, members) in enumerate(self._rollout(batch, steps), start=1):
                truth = batch.output_fields[:, step - 1]  # (B, C, *sp)
                metrics.update(
                    step,
                    pred,
                    truth,
                    last,
                    spread,
                    members=members,
                    prev_pred=prev_pred,
                    prev_truth=prev_truth,
                )
                prev_pred, prev_truth = pred, truth
                if self.keep_predictions:
                    frames.append(pred.float().cpu())  # (B, C, *sp)
                    if spread is not None:
                        spreads.append(spread.float().cpu())
                if self.keep_members:
                    member_frames.append(members.float().cpu())  # (K, B, C, *sp)
                done = step
                if self._bar is not None:
                    self._bar.advance(self._task)
        except RolloutDivergedError as err:
            self._record_divergence(batch, err)
            if self._bar is not None:
                self._bar.advance(self._task, steps - done)
        if self.keep_predictions:
            stacked = (
                torch.stack(frames, dim=1)  # (B, S_done, C, *sp)
                if frames
                else batch.output_fields[:, :0].float().cpu()
            )
            spread_stack = torch.stack(spreads, dim=1) if spreads else None  # (B, S_done, C, *sp)
            for b, traj in enumerate(batch.metadata["trajectory"].tolist()):
                self.predictions[(name, int(traj))] = stacked[b].numpy()
                if spread_stack is not None:
                    self.spreads[(name, int(traj))] = spread_stack[b].numpy()
        if self.keep_members:
            member_stack = (
                torch.stack(member_frames, dim=2)  # (K, B, S_done, C, *sp)
                if member_frames
                else torch.zeros(self.members, *batch.output_fields[:, :0].shape)
            )
            for b, traj in enumerate(batch.metadata["trajectory"].tolist()):
                self.member_predictions[(name, int(traj))] = member_stack[:, b].numpy()
        return done

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        """Score the one-step prediction of each window against its target frame."""
        name = batch.metadata["dataset"]
        try:
            pred, spread, members = next(iter(self._rollout(batch, 1)))  # (B, C, *sp)
        except RolloutDivergedError as err:
            self._record_divergence(batch, err)
            return
        self.metrics[name].update(
            1, pred, batch.output_fields[:, 0], batch.input_fields[:, -1], spread, members=members
        )

    def gather(self) -> None:
        """Sum the metrics over all ranks and give every rank all predictions and divergences.

        Call on every rank after ``Trainer.predict``/``Trainer.test`` (a no-op in one process).
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        for name in sorted(self.metrics):
            self.metrics[name].all_reduce()
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(
            gathered, (self.predictions, self.spreads, self.member_predictions, self.diverged)
        )
        self.predictions, self.spreads, self.member_predictions, self.diverged = {}, {}, {}, []
        for preds, spreads, member_preds, diverged in gathered:
            self.predictions.update(preds)
            self.spreads.update(spreads)
            self.member_predictions.update(member_preds)
            self.diverged.extend(diverged)
        self.diverged.sort(key=lambda d: (d["dataset"], d["trajectories"]))
