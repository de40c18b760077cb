"""The LightningModule: normalise, predict deltas, compute the loss, validate with rollouts."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from walrus import metrics
from walrus.data.batch import Batch
from walrus.data.normalization import RMSNormalizer
from walrus.errors import NonFiniteLossError, NonFiniteWeightsError
from walrus.model.compile import compile_model
from walrus.model.fast_blocks import clear_derived
from walrus.rollout import rollout
from walrus.training.augment import (
    PSEUDO_FIELDS,
    build_symmetry,
    check_field_dropout,
    delta_rms,
    field_keep_mask,
    input_noise,
)
from walrus.training.budget import BudgetCallback
from walrus.training.checkpointing import settle_epoch_progress
from walrus.training.losses import (
    LOSSES,
    ensemble_crps,
    ensemble_gradient_crps,
    gradient_loss,
    normalized_loss,
    pooled_ensemble_crps,
)
from walrus.training.optim import (
    OptimizerFactory,
    SchedulerFactory,
    check_lr_scales,
    param_groups,
    scale_group_lrs,
)

# A field is constant when its spatial range is at most this fraction of its magnitude.
CONSTANT_FIELD_RTOL = 1e-6
_NO_STEP = 2**62  # "no bad step yet" in the device-side flag
_MAX_UNCHECKED = 1000  # steps between non-finite checks when logging is off
ROLLOUT_MODES = ("one_step", "pushforward", "unrolled")
NOISE_UNITS = ("input_rms", "input_std", "delta_rms")
LOSS_WEIGHTINGS = ("none", "delta_rms")


def _sum_dtype(device: torch.device) -> torch.dtype:
    """float64 for the validation sums, float32 on MPS (which has no float64)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class WalrusModule(pl.LightningModule):
    """Trains a space-time model to predict the next frame of a PDE simulation.

    Args:
        model: a module called as ``model(x, fields, bcs)`` returning ``(B, T', C, *spatial)``.
        optimizer: ``partial(torch.optim.AdamW, lr=...)``; it receives parameter groups.
        lr_scheduler: ``partial(WarmupCosine, ...)``; ``total_steps`` defaults to the trainer's
            estimate, and the budget callbacks' share used (the largest, see
            ``BudgetCallback``; ``trainer.max_time`` adds a ``TimeBudget``) is passed as
            ``time_fraction`` when the scheduler takes one. ``None`` keeps the learning rate fixed.
        weight_decay: applied to matrices only (not norms, biases, embeddings).
        loss: ``"mae"`` or ``"mse"``, in normalised space.
        loss_multiplier: scales the loss (the Walrus recipe uses one).
        predict_delta: predict the normalised frame delta (default) or the normalised next state.
        normalizer: fits per-sample ``NormStats`` (default ``RMSNormalizer()``).
        val_rollout_steps: length of the validation rollout behind ``val/rollout_vrmse`` (capped
            by the target frames present, ``data.val_steps_output``).
        input_noise: std of Gaussian noise added to training inputs (0 disables it), in
            ``noise_units``; targets lead back to the clean next frames, so the model learns to
            correct the small errors a rollout feeds back to it.
        noise_units: ``"delta_rms"`` (per sample and field, the RMS of the window's
            frame-to-frame changes: the same meaning on every dataset), ``"input_rms"`` (the
            RMS of the window's values: on slowly changing data even a small value swamps the
            signal, and on a field with an offset it measures the offset) or ``"input_std"``
            (the RMS of the window's values about their mean).
        rollout_mode: ``"one_step"`` (train on the next frame only), ``"pushforward"`` (roll
            ``k - 1`` steps without gradient, then train on step ``k`` from the model's own
            predictions) or ``"unrolled"`` (roll ``k`` steps with gradient through all of them,
            loss averaged over the steps). Needs ``data.n_steps_output >= rollout_steps``.
        rollout_steps: ``k``, the longest unroll.
        rollout_curriculum: fraction of the training steps over which ``k`` grows linearly
            from 1 to ``rollout_steps`` (0: ``rollout_steps`` from the start).
        loss_weighting: ``"none"``, or ``"delta_rms"``: weigh each sample and field's error by
            ``delta_scale / RMS(window deltas)``, i.e. measure it in units of the window's
            frame-to-frame change whatever the normaliser's delta unit (with
            ``RMSNormalizer(delta="state")`` slow and fast windows then count alike).
        gradient_loss: weight of a second loss term on the spatial differences of the error
            (:func:`~walrus.training.losses.gradient_loss`, same ``loss`` kind and weighting;
            0: off). It penalises grid-scale error such as seams between decoder patches.
        ensemble_members: ``K``; above 1 the model runs ``K`` times on each training input
            (each run draws its own jitter and, with ``model.noise_dim``, latent noise) and the
            loss is the members' fair CRPS (:func:`~walrus.training.losses.ensemble_crps`, in
            ``loss="mae"`` units) instead of the MAE: training for a calibrated ensemble;
            ``gradient_loss`` then weighs the CRPS of the members' spatial differences
            (:func:`~walrus.training.losses.ensemble_gradient_crps`). With latent noise
            (``model.noise_dim > 0``) the members share one jitter draw and differ by their
            noise alone. Needs ``loss="mae"`` and
            ``rollout_mode="one_step"``; costs ``K`` forward and backward passes per sample.
        crps_alpha: weight of the CRPS's spread term (1: the fair CRPS; the default 0.95 is
            the "almost fair" CRPS: with two members the fair score does not care how far
            apart two members that straddle the truth are, and they drift apart).
        augment_symmetry: ``"none"`` or ``"d4"``: turn each training sample, inputs and targets
            alike, by a random 90-degree rotation or reflection of the grid (rotations only
            among axes of equal length), vector components and boundary conditions with it
            (see :mod:`walrus.training.augment`).
        augment_pseudo: fields whose sign also flips under a reflection (``vorticity``).
        field_dropout: probability of zeroing each input field of a training sample for all
            its input frames, after normalisation (so it reads as the normaliser's shift: 0
            for RMS, the window mean for mean/std); never every field, targets untouched.
        lr_scales: learning-rate factor per top-level part of the model, e.g.
            ``{"blocks": 0.3}`` trains the processor at 0.3 x the optimiser's rate (schedule
            included) and the encoders, decoders and embeddings at the full rate: fine-tuning
            with a slower processor. Names are checked against the model's parts.
        compile: ``torch.compile`` in place (the state dict keeps its keys): ``false``,
            ``"blocks"`` (each processor block; ``true`` means this) or ``"model"`` (the whole
            forward, see :mod:`walrus.model.compile`).
        model_config: the model's resolved config, stored in checkpoints.
        vocab: the field vocabulary as a dict, stored in checkpoints.
        data_config: the resolved data config, stored so inference can default to it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        lr_scheduler: SchedulerFactory | None = None,
        *,
        weight_decay: float = 0.05,
        loss: str = "mae",
        loss_multiplier: float = 1.0,
        predict_delta: bool = True,
        normalizer: Any = None,
        val_rollout_steps: int = 4,
        input_noise: float = 0.0,
        noise_units: str = "delta_rms",
        rollout_mode: str = "one_step",
        rollout_steps: int = 1,
        rollout_curriculum: float = 0.0,
        loss_weighting: str = "none",
        gradient_loss: float = 0.0,
        ensemble_members: int = 1,
        crps_pool: int = 1,
        crps_alpha: float = 0.95,
        augment_symmetry: str = "none",
        augment_pseudo: Sequence[str] = PSEUDO_FIELDS,
        field_dropout: float = 0.0,
        lr_scales: Mapping[str, float] | None = None,
        compile: bool | str = False,
        model_config: dict[str, Any] | None = None,
        vocab: dict[str, Any] | None = None,
        data_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"module.loss must be one of {LOSSES}, got {loss!r}")
        if noise_units not in NOISE_UNITS:
            raise ValueError(
                f"module.noise_units must be one of {NOISE_UNITS}, got {noise_units!r}"
            )
        if rollout_mode not in ROLLOUT_MODES:
            raise ValueError(
                f"module.rollout_mode must be one of {ROLLOUT_MODES}, got {rollout_mode!r}"
            )
        if (
            isinstance(rollout_steps, bool)
            or not isinstance(rollout_steps, int)
            or rollout_steps < 1
        ):
            raise ValueError(f"module.rollout_steps must be an int >= 1, got {rollout_steps!r}")
        if not 0.0 <= rollout_curriculum <= 1.0:
            raise ValueError(
                f"module.rollout_curriculum must be in [0, 1], got {rollout_curriculum!r}"
            )
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"module.loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}"
            )
        if input_noise < 0:
            raise ValueError(f"module.input_noise must be >= 0, got {input_noise!r}")
        if isinstance(gradient_loss, bool) or not gradient_loss >= 0:
            raise ValueError(f"module.gradient_loss must be a number >= 0, got {gradient_loss!r}")
        if isinstance(ensemble_members, bool) or not isinstance(ensemble_members, int):
            raise ValueError(f"module.ensemble_members must be an int, got {ensemble_members!r}")
        if not 1 <= ensemble_members <= 64:
            raise ValueError(f"module.ensemble_members must be in 1..64, got {ensemble_members}")
        if ensemble_members > 1 and (loss != "mae" or rollout_mode != "one_step"):
            raise ValueError(
                f"module.ensemble_members={ensemble_members} (CRPS training) needs loss=mae and "
                f"rollout_mode=one_step; got loss={loss}, rollout_mode={rollout_mode}"
            )
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.weight_decay = weight_decay
        self.loss_kind = loss
        self.loss_multiplier = loss_multiplier
        self.predict_delta = predict_delta
        self.normalizer = normalizer if normalizer is not None else RMSNormalizer()
        self.val_rollout_steps = val_rollout_steps
        self.input_noise = input_noise
        self.noise_units = noise_units
        self.rollout_mode = rollout_mode
        self.rollout_steps = 1 if rollout_mode == "one_step" else rollout_steps
        self.rollout_curriculum = rollout_curriculum
        self.loss_weighting = loss_weighting
        self.gradient_loss = float(gradient_loss)
        self.ensemble_members = ensemble_members
        if isinstance(crps_pool, bool) or not isinstance(crps_pool, int) or crps_pool < 1:
            raise ValueError(f"module.crps_pool must be an int >= 1, got {crps_pool!r}")
        self.crps_pool = crps_pool
        if isinstance(crps_alpha, bool) or not 0.0 < crps_alpha <= 1.0:
            raise ValueError(f"module.crps_alpha must be in (0, 1], got {crps_alpha!r}")
        self.crps_alpha = float(crps_alpha)
        self.symmetry = build_symmetry(augment_symmetry, augment_pseudo)
        self.field_dropout = check_field_dropout(field_dropout)
        self.lr_scales = check_lr_scales(model, lr_scales)
        self.model_config = model_config or {}
        self.vocab = vocab or {}
        self.data_config = data_config or {}
        self.compile_mode = compile_model(model, compile, "module.compile")
        self.clock = time.perf_counter  # seconds, for train/samples_per_s (tests inject one)
        self._step_start = self.clock()  # start of the samples/s interval
        self._rate_samples = 0
        self._val_start = self._step_start
        # Non-finite loss tracking: first bad global step and its loss, on the loss's device
        # (read at checks only), and the host-side facts of the steps since the last check.
        self._first_bad: Tensor | None = None
        self._bad_loss: Tensor | None = None
        self._unchecked: dict[int, tuple[int, dict[str, Any]]] = {}
        # Non-finite weights: first optimizer step after which a parameter was NaN or Inf, and
        # whether a validation loss was, on the parameters' device (read at checks only).
        self._first_bad_weights: Tensor | None = None
        self._val_bad: Tensor | None = None
        self._named_constant: set[tuple[str, str]] = set()  # (dataset, field) already named
        # validation metric -> [sum over batches of batch size x batch mean (float64 but on
        # MPS, on the device), summed batch sizes]; reduced over ranks at the end of validation
        self._val_sums: dict[str, list[Any]] = {}

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor) -> Tensor:
        return self.model(x, fields, bcs)

    def configure_model(self) -> None:
        """Shard the model (FSDP2) under a ``ModelParallelStrategy`` such as ``trainer=fsdp``;
        under any other strategy there is no device mesh and nothing happens."""
        if self.device_mesh is not None:
            from walrus.training.sharding import shard_model

            shard_model(self.model, self.device_mesh)

    def _noise(self, x: Tensor, scale: Tensor) -> Tensor:
        """Gaussian noise of ``input_noise`` units for a window ``x`` ``(B, T, C, *S)``."""
        return input_noise(x, scale, self.input_noise, self.noise_units)

    def _loss(self, pred: Tensor, target: Tensor, window: Tensor, stats: Any) -> Tensor:
        """Loss in normalised space, weighted as ``loss_weighting`` says, plus
        ``gradient_loss`` times the loss of the error's spatial differences. ``pred`` is
        ``(B, T', C, *S)``, or ``(K, B, T', C, *S)`` members scored by their CRPS."""
        if self.loss_weighting == "delta_rms" and self.predict_delta and window.shape[1] > 1:
            w = (stats.delta_scale / (delta_rms(window) + 1e-12)).detach()  # (B, 1, C, 1, ...)
            pred, target = pred * w, target * w
        if pred.ndim == target.ndim + 1:  # members: CRPS of values (and of differences)
            a = self.crps_alpha
            if self.crps_pool > 1:
                loss = pooled_ensemble_crps(pred, target, self.crps_pool, a)
            else:
                loss = ensemble_crps(pred, target, a)
            if self.gradient_loss > 0:
                loss = loss + self.gradient_loss * ensemble_gradient_crps(pred, target, a)
            return loss
        loss = normalized_loss(pred, target, self.loss_kind)
        if self.gradient_loss > 0:
            loss = loss + self.gradient_loss * gradient_loss(pred, target, self.loss_kind)
        return loss

    def _targets(
        self,
        window: Tensor,
        frames: Tensor,
        offset: int,
        names: Any,
        noise: bool = False,
        max_delta_scale: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Any]:
        """Normalised model input and normalised targets for every output frame.

        Args:
            window: ``(B, Ti, C, *S)`` input frames (ground truth, or the model's own predictions
                during an unroll), physical units.
            frames: ``(B, Ti + To, C, *S)`` the sample's true frames.
            offset: ``window`` stands in for ``frames[:, offset : offset + Ti]``.
            names: field names for the normaliser.
            noise: add ``input_noise``; delta targets then lead from the noisy frame to the
                clean next one.
            max_delta_scale: cap on the delta unit, as a rollout applies it (the true
                context's unit).
        """
        stats = self.normalizer.fit(window, names)
        if max_delta_scale is not None:
            stats.delta_scale = torch.minimum(stats.delta_scale, max_delta_scale)
        t_in = window.shape[1]
        x = window + self._noise(window, stats.scale) if noise and self.input_noise > 0 else window
        if getattr(self.model, "causal", True):
            nxt = frames[:, offset + 1 : offset + 1 + t_in]  # (B, Ti, C, *S) clean successors
            prev = x  # (B, Ti, C, *S)
        else:
            nxt = frames[:, offset + t_in : offset + t_in + 1]  # (B, 1, C, *S)
            prev = x[:, -1:]  # (B, 1, C, *S)
        target = stats.normalize_delta(nxt - prev) if self.predict_delta else stats.normalize(nxt)
        return stats.normalize(x), target, stats

    def _next_frame(self, window: Tensor, pred: Tensor, stats: Any) -> Tensor:
        """The physical frame after ``window`` from the model's last output ``(B, 1, C, *S)``."""
        return stats.next_frame(window[:, -1:], pred, self.predict_delta)  # (B, 1, C, *S)

    def unroll_steps(self) -> int:
        """The unroll length ``k`` at the current global step (curriculum applied)."""
        k = self.rollout_steps
        if k == 1 or self.rollout_curriculum <= 0 or self._trainer is None:
            return k
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        ramp = max(self.rollout_curriculum * total, 1.0)
        return 1 + min(k - 1, int((k - 1) * self.global_step / ramp + 0.5))

    def _check_frames(self, batch: Batch, k: int) -> None:
        if batch.output_fields.shape[1] < k:
            raise ValueError(
                f"module.rollout_steps={k} needs {k} target frames per training window, but the "
                f"batch has {batch.output_fields.shape[1]}; set data.n_steps_output >= {k}"
            )

    def _rollout_loss(self, batch: Batch) -> Tensor:
        """Loss of a one-step, pushforward or unrolled prediction (see ``rollout_mode``)."""
        k = self.unroll_steps()
        self._check_frames(batch, k)
        if self.training and self.symmetry is not None:
            batch = self.symmetry(batch)  # one grid symmetry per sample, targets alike
        keep = None
        if self.training and self.field_dropout > 0:
            keep = field_keep_mask(batch.input_fields, self.field_dropout)  # (B, 1, C, 1, ...)
        names = batch.metadata.get("field_names")
        frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)  # (B, Ti+To, C, *S)
        window = batch.input_fields  # (B, Ti, C, *S)
        losses, cap = [], None
        for j in range(k):
            grad = j == k - 1 or self.rollout_mode == "unrolled"
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                x_n, target, stats = self._targets(window, frames, j, names, j == 0, cap)
                if keep is not None:
                    x_n = x_n * keep  # dropped fields read 0; targets stay as they are
                if j == 0 and self.predict_delta:  # later steps: capped as in a rollout
                    cap = stats.delta_scale.detach()
                if grad and self.ensemble_members > 1 and self.training:
                    members = self._members(x_n, batch)  # (K, B, T', C, *S)
                    losses.append(self._loss(members, target, window, stats))
                    pred = members[0]
                else:
                    pred = self(x_n, batch.field_ids, batch.bcs)  # (B, T', C, *S)
                    if grad:
                        losses.append(self._loss(pred, target, window, stats))
                if j < k - 1:
                    nxt = self._next_frame(window, pred[:, -1:].float(), stats)
                    window = torch.cat([window[:, 1:], nxt.to(window.dtype)], dim=1)
        return torch.stack(losses).mean() * self.loss_multiplier

    def _members(self, x: Tensor, batch: Batch) -> Tensor:
        """``ensemble_members`` predictions ``(K, B, T', C, *S)`` of the normalised input ``x``.

        A model with latent noise (``noisy``) runs every member under one shared jitter draw
        and its own noise, so the spread it learns comes from the noise, not from where the
        patch grid falls; a model without noise gives members that differ by their jitter.
        """
        k = self.ensemble_members
        if not getattr(self.model, "noisy", False):
            return torch.stack([self(x, batch.field_ids, batch.bcs) for _ in range(k)])
        seed = int(torch.randint(0, 2**62, (1,)).item())  # global CPU generator: no sync
        return torch.stack(
            [
                self.model(x, batch.field_ids, batch.bcs, jitter_seed=seed, noise_seed=seed + 1 + i)
                for i in range(k)
            ]
        )

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._rollout_loss(batch)
        self._note_loss(loss, batch, batch_idx)
        if self._logs_this_step() or len(self._unchecked) >= _MAX_UNCHECKED:
            self.check_finite()
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        if self._rate_samples and (self._logs_this_step() or self._trainer is None):
            # the steps completed since the last logging step: per step it swings with each
            # batch's dataset
            now = self.clock()
            rate = self._rate_samples / max(now - self._step_start, 1e-9)
            self._step_start, self._rate_samples = now, 0
            self.log("train/samples_per_s", rate, prog_bar=True, batch_size=batch.batch_size)
        self._rate_samples += batch.batch_size
        if self.rollout_steps > 1:
            self.log("train/unroll_steps", float(self.unroll_steps()), batch_size=batch.batch_size)
        return loss

    def _logs_this_step(self) -> bool:
        """Whether Lightning logs this optimizer step (every ``trainer.log_every_n_steps``;
        never without a trainer)."""
        every = self.trainer.log_every_n_steps if self._trainer is not None else 0
        return every > 0 and (self.global_step + 1) % every == 0

    def _note_loss(self, loss: Tensor, batch: Batch, batch_idx: int) -> None:
        """Record, on the device (no host sync), the first step whose loss is not finite."""
        if self._first_bad is None or self._first_bad.device != loss.device:
            self._first_bad = torch.full((), _NO_STEP, dtype=torch.long, device=loss.device)
            self._bad_loss = torch.zeros((), dtype=torch.float32, device=loss.device)
        first = ~torch.isfinite(loss.detach()) & (self._first_bad == _NO_STEP)  # () bool
        self._first_bad = torch.where(first, self.global_step, self._first_bad)
        self._bad_loss = torch.where(first, loss.detach().float(), self._bad_loss)
        self._unchecked[self.global_step] = (batch_idx, batch.metadata)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self._note_weights()

    def _local_params(self, trainable: bool = True) -> list[Tensor]:
        """The (trainable) parameters as plain tensors (a sharded parameter's local shard)."""
        params = [p.detach() for p in self.model.parameters() if p.requires_grad or not trainable]
        return [p.to_local() if hasattr(p, "to_local") else p for p in params]

    def _note_weights(self) -> None:
        """Record, on the device (no host sync), the first step after which a parameter is not
        finite: one max-abs pass over the parameters (NaN propagates through it)."""
        params = self._local_params()
        if not params:
            return
        worst = _max_abs(params)  # ()
        if self._first_bad_weights is None or self._first_bad_weights.device != worst.device:
            self._first_bad_weights = torch.full(
                (), _NO_STEP, dtype=torch.long, device=worst.device
            )
        first = ~torch.isfinite(worst) & (self._first_bad_weights == _NO_STEP)  # () bool
        self._first_bad_weights = torch.where(first, self.global_step, self._first_bad_weights)

    def first_nonfinite_parameter(self) -> str | None:
        """The name of the first model parameter holding NaN or Inf here (a host sync)."""
        for name, p in self.model.named_parameters():
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            if not bool(torch.isfinite(local).all()):
                return name
        return None

    def check_finite_weights(self, before: str = "") -> None:
        """Raise if an optimizer step since training started left a parameter NaN or Inf, or,
        with ``before`` (what is about to happen, e.g. ``"saving a checkpoint"``), if any
        parameter is non-finite now (one max-abs pass). One host sync; under DDP or FSDP every
        rank takes part, and all raise together.

        Raises:
            NonFiniteWeightsError: naming the first bad step and parameter.
        """
        params = self._local_params(trainable=False)
        if not params or (self._first_bad_weights is None and not before):
            return
        device = params[0].device
        step = self._first_bad_weights
        if step is None:
            step = torch.full((), _NO_STEP, dtype=torch.long, device=device)
        now = torch.zeros((), dtype=torch.long, device=device)
        if before:
            now = ~torch.isfinite(_max_abs(params))
        flag = torch.stack([step.to(device), -now.long()])  # (2,): min over ranks of both
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        first, bad_now = (int(v) for v in flag.tolist())
        if first >= _NO_STEP and not bad_now:
            return
        name = self.first_nonfinite_parameter()
        when = (
            f"after the optimizer step at global step {first}"
            if first < _NO_STEP
            else f"before {before} at global step {self.global_step}"
        )
        raise NonFiniteWeightsError(
            f"model weights became non-finite (NaN/Inf) {when}"
            + (f" (first: {name})" if name else " (on another rank)")
            + "; nothing was saved after it and the last finite checkpoint is kept; lower "
            "optimizer.lr, check the data, or resume from an earlier checkpoint"
        )

    def check_finite(self, before: str = "") -> None:
        """:meth:`check_finite_loss` and :meth:`check_finite_weights` (``before`` goes to it),
        raising for whichever went bad first (a loss at step N comes before that step's
        update). Every rank takes the same order."""
        if self._first_bad is not None and self._first_bad_weights is not None:
            steps = torch.stack(
                [self._first_bad, self._first_bad_weights.to(self._first_bad.device)]
            )
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN)
            loss_step, weight_step = steps.tolist()  # (2,) first bad step of each
            if weight_step < loss_step:
                self.check_finite_weights(before)
        self.check_finite_loss()
        self.check_finite_weights(before)

    def check_finite_loss(self) -> None:
        """Raise if a training loss since the last check was NaN or Inf (one host sync).

        Called at logging steps, before every checkpoint save and at the end of training, so a
        saved checkpoint never follows a bad step. Under DDP every rank takes part (the first
        bad step over all ranks is reported).

        Raises:
            NonFiniteLossError: naming the first bad global step, its batch and samples.
        """
        if self._first_bad is None:
            return
        flag = torch.stack([self._first_bad.float(), self._bad_loss])  # (2,)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            step = self._first_bad.clone()
            torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MIN)
            flag[0] = step.float()
        step, value = (float(v) for v in flag.tolist())
        if step >= _NO_STEP:
            self._unchecked.clear()
            return
        step = int(step)
        where = "another rank's batch"
        if step in self._unchecked:
            batch_idx, meta = self._unchecked[step]
            where = (
                f"batch {batch_idx}, dataset {meta.get('dataset')!r}, trajectories "
                f"{_as_list(meta.get('trajectory'))}, starts {_as_list(meta.get('start'))}"
            )
        raise NonFiniteLossError(
            f"training loss became {value if step == int(self._first_bad) else 'non-finite'} at "
            f"global step {step} ({where}); the last good checkpoint is kept"
        )

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        # Lightning ends a run at trainer.max_steps without validating when that step falls
        # inside an epoch; a stop requested here validates first, so best-*.ckpt and the final
        # val/ metrics see the final weights.
        max_steps = self.trainer.max_steps
        if max_steps is not None and max_steps > 0 and self.trainer.global_step >= max_steps:
            self.trainer.should_stop = True

    def on_train_start(self) -> None:
        self._step_start, self._rate_samples = self.clock(), 0

    def on_validation_start(self) -> None:
        self._val_start = self.clock()
        sanity = self._trainer is not None and self._trainer.sanity_checking
        if not sanity:  # no validation (nor best-*.ckpt) of broken weights
            self.check_finite()
        self._val_bad = None
        clear_derived(self.model)  # weights moved since the last validation, maybe unversioned

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def _add(self, name: str, value: Tensor, weight: int) -> None:
        """Add a batch's mean ``value`` (a scalar) with ``weight`` samples to metric ``name``."""
        term = value.detach().to(_sum_dtype(value.device)) * weight
        entry = self._val_sums.get(name)
        if entry is None:
            self._val_sums[name] = [term, weight]
        else:
            entry[0], entry[1] = entry[0] + term, entry[1] + weight

    def on_validation_epoch_end(self) -> None:
        """Log every validation metric as its sample-weighted mean over the whole validation
        set: each rank's sums and sample counts are added over the ranks (a rank that saw no
        batch of a dataset adds zeros for its metrics), so every rank logs the same values and
        the best checkpoint and early stopping see all windows, not one rank's share."""
        self._stop_if_validation_diverged()
        names = sorted(self._val_sums)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and self.trainer.world_size > 1:
            every: list[list[str] | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, names)
            names = sorted({n for rank_names in every for n in rank_names or ()})
        if not names:
            return
        zero = torch.zeros((), dtype=_sum_dtype(self.device), device=self.device)
        sums = torch.stack([self._val_sums.get(n, [zero])[0].to(zero) for n in names])  # (K,)
        counts = torch.tensor(
            [float(self._val_sums.get(n, [0, 0])[1]) for n in names],
            dtype=zero.dtype,
            device=self.device,
        )  # (K,)
        totals = torch.stack([sums, counts])  # (2, K)
        if distributed and self.trainer.world_size > 1:
            torch.distributed.all_reduce(totals)
        means = (totals[0] / totals[1].clamp_min(1)).float()  # (K,)
        seen = (totals[1] > 0).tolist()
        for name, mean, any_seen in zip(names, means, seen, strict=True):
            if any_seen:
                # the value is already the same on every rank; "max" keeps it exactly and
                # marks it synced for Lightning
                self.log(
                    name,
                    mean,
                    prog_bar=name == "val/vrmse",
                    sync_dist=True,
                    reduce_fx="max",
                )

    def on_validation_end(self) -> None:
        # validation time is not training time: move the samples/s interval's start past it
        self._step_start += self.clock() - self._val_start

    def _stop_if_validation_diverged(self) -> None:
        """Finite weights whose one-step prediction on validation data is NaN or Inf (an
        overflow inside the forward pass) are broken too: stop before any checkpoint of them."""
        bad = torch.zeros((), device=self.device)
        if self._val_bad is not None:
            bad = self._val_bad.to(self.device).float()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # all ranks stop
        if bool(bad):
            raise NonFiniteWeightsError(
                f"the model's one-step validation predictions are non-finite (NaN/Inf) at "
                f"global step {self.global_step} (its weights overflow inside the forward "
                "pass); nothing was saved after it and the last finite checkpoint is kept; "
                "lower optimizer.lr or check the data"
            )

    def on_train_end(self) -> None:
        self.check_finite()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._logs_this_step():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads:
                self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads))
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)  # (B, Ti+To, C, *S)
        names = batch.metadata.get("field_names")
        x_n, target, stats = self._targets(batch.input_fields, frames, 0, names)
        pred = self(x_n, batch.field_ids, batch.bcs)
        loaders = self._trainer.val_dataloaders if self._trainer is not None else None
        sampler = getattr(loaders, "batch_sampler", None)
        padding = callable(getattr(sampler, "is_padding", None)) and sampler.is_padding(batch_idx)
        b = 0 if padding else batch.batch_size  # a repeat that evens out the ranks counts 0
        val_loss = normalized_loss(pred, target, self.loss_kind)
        bad = ~torch.isfinite(val_loss.detach())  # () bool, read once per validation
        self._val_bad = bad if self._val_bad is None else self._val_bad | bad
        self._add("val/loss", val_loss, b)

        n_sp = batch.n_spatial
        last = batch.input_fields[:, -1:].float()  # (B, 1, C, *S)
        truth = batch.output_fields[:, 0].float()  # (B, C, *S)
        step = pred[:, -1:].float()  # (B, 1, C, *S)
        nxt = stats.next_frame(last, step, self.predict_delta)  # (B, 1, C, *S)
        nxt, last = nxt[:, 0], last[:, 0]  # (B, C, *S)
        model_err = metrics.vrmse(nxt, truth, n_spatial=n_sp)  # (B, C)
        persist_err = metrics.vrmse(last, truth, n_spatial=n_sp)  # (B, C)
        names = batch.channel_names() or [str(i) for i in batch.field_ids.tolist()]
        dataset = batch.metadata.get("dataset", "data")
        keep = self._varying_fields(truth, n_sp, dataset, names)  # (C,) bool
        self._add("val/vrmse", model_err[:, keep].mean(), b)
        self._add("val/vrmse_persistence", persist_err[:, keep].mean(), b)
        for c, name in enumerate(names):
            if keep[c]:
                self._add(f"val/vrmse/{dataset}/{name}", model_err[:, c].mean(), b)

        steps = min(self.val_rollout_steps, batch.output_fields.shape[1])
        if steps > 1:
            # The rollout's first step normalises the same window the same way (fp32 or wider
            # frames): it reuses ``pred`` instead of running the model again.
            dtype = batch.input_fields.dtype
            same_input = dtype == torch.promote_types(dtype, torch.float32)
            model = _FirstOutputGiven(self.model, pred) if same_input else self.model
            errs = [
                metrics.vrmse(p.float(), batch.output_fields[:, s].float(), n_spatial=n_sp)[
                    :, keep
                ].mean()
                for s, p in enumerate(
                    rollout(
                        model,
                        batch,
                        steps,
                        normalizer=self.normalizer,
                        predict_delta=self.predict_delta,
                        check_finite=False,
                    )
                )
            ]
            self._add("val/rollout_vrmse", torch.stack(errs).mean(), b)

    def _varying_fields(self, truth: Tensor, n_sp: int, dataset: str, names: list[str]) -> Tensor:
        """``(C,)`` bool: fields whose true frame ``truth`` ``(B, C, *S)`` varies in space in some
        sample. Constant ones (a uniform velocity) score a meaningless 0 and stay out of the
        validation means; each is named once. All fields are kept if none varies."""
        dims = tuple(range(2, 2 + n_sp))
        t = truth.float()
        spread = t.amax(dim=dims) - t.amin(dim=dims)  # (B, C)
        size = t.abs().amax(dim=dims)  # (B, C)
        varying = (spread > CONSTANT_FIELD_RTOL * size).any(dim=0)  # (C,)
        if not bool(varying.any()):
            return torch.ones_like(varying)
        constant = [n for n, v in zip(names, varying.tolist()) if not v]
        new = [n for n in constant if (dataset, n) not in self._named_constant]
        if new:
            self._named_constant.update((dataset, n) for n in new)
            rank_zero_info(
                f"validation: {dataset} field(s) {', '.join(new)} are constant in space; they are "
                "left out of val/vrmse, val/vrmse_persistence and val/rollout_vrmse"
            )
        return varying

    def configure_optimizers(self) -> Any:
        groups = param_groups(self.model, self.weight_decay, lr_scales=self.lr_scales)
        optimizer = scale_group_lrs(self.optimizer_factory(groups))
        if self.scheduler_factory is None:
            return optimizer
        kwargs: dict[str, Any] = {}
        if "total_steps" not in getattr(self.scheduler_factory, "keywords", {}):
            total = self.trainer.estimated_stepping_batches
            kwargs["total_steps"] = max(int(total), 1) if math.isfinite(total) else None
        budgets = [c for c in self.trainer.callbacks if isinstance(c, BudgetCallback)]
        if budgets and "time_fraction" in inspect.signature(self.scheduler_factory).parameters:
            kwargs["time_fraction"] = lambda: max(b.fraction() for b in budgets)
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        settle_epoch_progress(checkpoint)  # before Lightning restores its loops from it

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from walrus.checkpoint import CHECKPOINT_FORMAT

        self.check_finite(before="saving a checkpoint")  # never save what a bad step touched

        checkpoint["walrus"] = {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.model_config,
            "vocab": self.vocab,
            "predict_delta": self.predict_delta,
            "data_config": self.data_config,
            "normalizer": self.normalizer.config() if hasattr(self.normalizer, "config") else None,
        }


class _FirstOutputGiven:
    """``model`` for a rollout whose first call would repeat a forward already made: that call
    returns ``first`` (the earlier output), later calls run ``model``."""

    def __init__(self, model: nn.Module, first: Tensor) -> None:
        self.model = model
        self.first: Tensor | None = first

    def __call__(self, x: Tensor, fields: Tensor, bcs: Tensor, **kwargs: Any) -> Tensor:
        if self.first is not None:
            out, self.first = self.first, None
            return out
        return self.model(x, fields, bcs, **kwargs)


def _max_abs(tensors: list[Tensor]) -> Tensor:
    """``()`` the largest ``|x|`` over ``tensors`` (NaN if any holds NaN), one fused pass per
    device and dtype (the kernel ``clip_grad_norm_`` uses)."""
    return torch.stack(torch._foreach_norm(tensors, math.inf)).amax()


def _as_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, Tensor) else value
