"""The rollout generator ``rollout(model, batch, steps)`` and the one-step ``predict_next``.

The model sees a normalised window of past frames and predicts, for its last frame, either the
normalised delta to the next frame (``predict_delta=True``, the Walrus default) or the normalised
next frame itself. ``predict_next`` maps that back to physical units; ``rollout`` repeats it,
feeding each prediction back into a sliding window of fixed length.

Delta unit cap: with a per-window normaliser the predicted delta is scaled by the RMS of the
window's own frame changes. Once the window holds predictions, an overshoot enlarges that unit,
which enlarges the next prediction: errors compound and the rollout blows up (the 2D
Navier-Stokes demo reached VRMSE 10^3 by step 76). ``rollout`` therefore caps the delta unit of
every step at the one fitted on the true context window (``cap_delta_unit=True``). The unit may
still shrink when the dynamics slow down, as on Gray-Scott, where fixing it would overshoot.
Dynamics that speed up beyond the context's pace are limited by the cap; turn it off for them.

``ensemble_rollout`` runs several jittered rollouts of the same trajectories side by side and
yields their mean and spread (and, with ``keep_members=True``, the members). ``rollout`` is the
deterministic path: one prediction per step, fixed by the seed.

Jitter averaging (``jitter_average=K``): every step runs the model under K jitter draws and
feeds the mean prediction back. A patch model's seams sit at different places in each draw,
so the mean loses most of their high-wavenumber power before it can accumulate over steps
(unlike an ensemble, whose members each carry their own seams to the end).

Spectral limit (``spectral_limit=r``): each step's change from the last frame may carry, in
each radial shell of wavenumbers, at most ``r`` times the amplitude the last frame has there
(:func:`walrus.nn.spectral.limit_spectral_change`). A smooth field thus keeps its fine scales
as smooth as they were, within a factor ``(1 + r)**2`` in power per step, instead of taking on
the grid-scale noise of a patch decoder; fields with fine scales of their own keep their
changes. It applies to every member and jitter draw's mean.

Perturbed members (``ensemble_rollout(..., perturbation=Perturbation(a))``): each member's
changes are multiplied by ``1 + a * r`` with ``r`` a smooth random field, correlated in time and
seeded by the member (:mod:`walrus.perturbation`), so the members' spread grows with the
dynamics. A deterministic rollout is not perturbed unless asked.

Model interface: ``model(x (B, T, C, *spatial), fields (C,) long, bcs (n_spatial, 2) long, *,
jitter_seed=None) -> (B, T', C, *spatial)`` with ``T' = T`` (causal) or ``T' = 1``.

In place of a model, ``rollout`` and ``ensemble_rollout`` take what ``walrus.load`` returns;
they then default to its normaliser, ``predict_delta`` and jitter setting (seed 0 when it
jitters), exactly as ``infer.py rollout`` runs it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from walrus.bcs import BoundaryType
from walrus.data.batch import Batch
from walrus.data.normalization import Normalizer, RMSNormalizer
from walrus.errors import RolloutDivergedError
from walrus.nn.spectral import limit_spectral_change
from walrus.perturbation import DEFAULT_PERTURBATION, Perturbation, PerturbedSteps
from walrus.signals import check_stop

if TYPE_CHECKING:
    from walrus.inference.loading import InferenceCheckpoint

# `jitter_seed` default of `rollout`: the loaded checkpoint's jitter setting (no jitter for a model)
CHECKPOINT = "checkpoint"

# Ensemble member m rolls out with jitter seeds jitter_seed + m * MEMBER_SEED_STRIDE + step - 1.
MEMBER_SEED_STRIDE = 1_000_003
# Jitter-averaged draw k of a step with seed s uses seed s + k * DRAW_SEED_STRIDE.
DRAW_SEED_STRIDE = 7_919


def predict_next(
    model: nn.Module,
    window: Tensor,
    field_ids: Tensor,
    bcs: Tensor,
    *,
    normalizer: Normalizer | None = None,
    field_names: Sequence[str] | None = None,
    predict_delta: bool = True,
    jitter_seed: int | None = None,
    max_delta_scale: Tensor | None = None,
    jitter_average: int = 1,
    spectral_limit: float = 0.0,
) -> Tensor:
    """Predict the frame after ``window``, in physical units.

    Args:
        model: callable as ``model(x, fields, bcs, *, jitter_seed=None)``.
        window: ``(B, T, C, *spatial)`` past frames in physical units.
        field_ids: ``(C,)`` long vocabulary ids.
        bcs: ``(n_spatial, 2)`` long boundary codes.
        normalizer: fits the per-sample statistics; ``RMSNormalizer()`` by default.
        field_names: C names, needed by ``ZScoreNormalizer``.
        predict_delta: the model predicts the normalised delta to the next frame (True) or the
            normalised next frame (False).
        jitter_seed: passed to the model; ``None`` lets the model decide.
        max_delta_scale: ``(B, 1, C, 1, ...)`` upper bound on the fitted delta unit.
        jitter_average: run the model under this many jitter draws (seeds ``jitter_seed +
            k * DRAW_SEED_STRIDE``) and use their mean; needs ``jitter_seed`` when above 1.
        spectral_limit: limit the step's change shell by shell to this many times the last
            frame's amplitude (see the module docstring); 0 is no limit.

    Returns:
        ``(B, C, *spatial)`` float32 (or wider, following ``window``) next frame.
    """
    if window.ndim < 4 or window.ndim > 6:
        raise ValueError(
            f"window must be (B, T, C, *spatial) with 1-3 spatial axes, got {tuple(window.shape)}"
        )
    draws = _check_jitter_average(jitter_average, jitter_seed)
    normalizer = RMSNormalizer() if normalizer is None else normalizer
    stats = normalizer.fit(window, field_names)
    if max_delta_scale is not None:
        stats.delta_scale = torch.minimum(stats.delta_scale, max_delta_scale)
    x = stats.normalize(window)  # (B, T, C, *spatial)
    # a noisy model's draws share the step's latent noise: the mean is over jitter alone
    noise = {"noise_seed": jitter_seed} if getattr(model, "noisy", False) else {}
    out = model(x, field_ids, bcs, jitter_seed=jitter_seed)
    check_stop()  # a command's SIGTERM/SIGINT stops it within one model call
    for k in range(1, draws):  # the mean over jitter draws
        seed = jitter_seed + k * DRAW_SEED_STRIDE
        out = out + model(x, field_ids, bcs, jitter_seed=seed, **noise)
        check_stop()
    if draws > 1:
        out = out / draws
    if (
        not isinstance(out, Tensor)
        or out.ndim != window.ndim
        or out.shape[0] != window.shape[0]
        or out.shape[2:] != window.shape[2:]
        or out.shape[1] < 1
    ):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"model output must be (B, T', C, *spatial) matching the window {tuple(window.shape)} "
            f"outside the time axis, got {got}"
        )
    pred = out[:, -1:].to(torch.promote_types(window.dtype, torch.float32))  # (B, 1, C, *sp)
    last = window[:, -1:].to(pred.dtype)  # (B, 1, C, *spatial)
    nxt = stats.next_frame(last, pred, predict_delta).squeeze(1)  # (B, C, *spatial)
    if spectral_limit:
        nxt = limit_spectral_change(last.squeeze(1), nxt, spectral_limit, _periodic(bcs))
    return nxt


def rollout(
    model: nn.Module | InferenceCheckpoint,
    batch: Batch,
    steps: int,
    *,
    normalizer: Normalizer | None = None,
    field_names: Sequence[str] | None = None,
    predict_delta: bool | None = None,
    jitter_seed: int | None | Literal["checkpoint"] = CHECKPOINT,
    autocast_dtype: torch.dtype | None = None,
    check_finite: bool = True,
    cap_delta_unit: bool | None = None,
    jitter_average: int | None = None,
    spectral_limit: float | None = None,
    perturbation: Perturbation | None = None,
) -> Iterator[Tensor]:
    """Roll a model out autoregressively from ``batch.input_fields``.

    Each step predicts the next frame from the current window of ``T_in`` frames, yields it, and
    slides the window (drop the oldest frame, append the prediction). The model runs under
    ``torch.inference_mode`` (and ``torch.autocast`` when ``autocast_dtype`` is set), entered and
    left inside each step, so the caller's grad mode is untouched between yields. Only the fixed
    window stays alive, so memory does not grow with ``steps``. Put the model in ``eval()`` first.

    Args:
        model: callable as ``model(x, fields, bcs, *, jitter_seed=None)``, or a checkpoint from
            ``walrus.load`` / ``walrus.from_pretrained``, whose settings are then the defaults
            (the same numbers as ``infer.py rollout`` with its default options).
        batch: ``input_fields (B, T_in, C, *spatial)`` are the initial window; ``output_fields``
            are not used.
        steps: number of frames to predict (>= 0).
        normalizer: refitted on every window; default: the checkpoint's, else ``RMSNormalizer()``.
        field_names: C names (for ``ZScoreNormalizer`` and error messages); defaults to
            ``batch.metadata['field_names']`` when present.
        predict_delta: see ``predict_next``; default: the checkpoint's, else True.
        jitter_seed: if given, step ``k`` (1-based) uses seed ``jitter_seed + k - 1``, so runs
            are reproducible; ``None`` passes ``None`` to the model (no jitter). The default
            ``"checkpoint"`` is seed 0 for a checkpoint that jitters by default, else ``None``.
        autocast_dtype: e.g. ``torch.bfloat16`` to run the model under autocast; the window and
            the outputs stay float32.
        check_finite: raise ``RolloutDivergedError`` on the first prediction with NaN/Inf
            (one host sync per step).
        cap_delta_unit: cap every step's delta unit at the true context window's (see the
            module docstring); no effect with ``predict_delta=False``; default: the
            checkpoint's, else True.
        jitter_average: jitter draws averaged at every step (see the module docstring); needs
            a jitter seed when above 1; default: the checkpoint's (``DEFAULT_JITTER_AVERAGE``
            for a patch model that jitters), else 1.
        spectral_limit: limit each step's change per wavenumber shell (see the module
            docstring; 0: no limit); default: the checkpoint's (``DEFAULT_SPECTRAL_LIMIT``
            for a patch model), else 0.
        perturbation: perturb every step's change (see the module docstring), seeded by
            ``jitter_seed`` (required then); ``None``: no perturbation.

    Yields:
        ``(B, C, *spatial)`` predicted frame in physical units, detached, a normal (non-inference)
        tensor on the batch's device.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    model, normalizer, predict_delta, jitter_seed, cap_delta_unit, jitter_average, limit = (
        _settings(
            model,
            normalizer,
            predict_delta,
            jitter_seed,
            cap_delta_unit,
            jitter_average,
            spectral_limit,
        )
    )
    _check_jitter_average(jitter_average, jitter_seed)
    check_spectral_limit(limit)
    perturb = None
    if perturbation is not None:
        if not isinstance(perturbation, Perturbation):
            raise ValueError(f"perturbation must be a Perturbation, got {perturbation!r}")
        if jitter_seed is None:
            raise ValueError("a perturbed rollout needs a jitter_seed: its draws come from it")
        perturb = PerturbedSteps(perturbation, jitter_seed, _periodic(batch.bcs))
    names = batch.channel_names(field_names)
    window = batch.input_fields.detach()  # (B, T_in, C, *spatial)
    if not window.is_floating_point():
        raise ValueError(f"input_fields must be floating point, got {window.dtype}")
    window = window.to(torch.promote_types(window.dtype, torch.float32))
    device_type = window.device.type
    cap = None
    if cap_delta_unit and predict_delta:
        fit = (RMSNormalizer() if normalizer is None else normalizer).fit
        cap = fit(window, names).delta_scale  # (B, 1, C, 1, ...) of the true context
    for step in range(1, steps + 1):
        seed = None if jitter_seed is None else jitter_seed + step - 1
        autocast = (
            torch.autocast(device_type=device_type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with torch.inference_mode(), autocast:
            pred = predict_next(
                model,
                window,
                batch.field_ids,
                batch.bcs,
                normalizer=normalizer,
                field_names=names,
                predict_delta=predict_delta,
                jitter_seed=seed,
                max_delta_scale=cap,
                jitter_average=jitter_average,
                spectral_limit=limit,
            ).to(window.dtype)  # (B, C, *spatial)
            if perturb is not None:
                pred = perturb(window[:, -1], pred)  # (B, C, *spatial)
            window = torch.cat([window[:, 1:], pred.unsqueeze(1)], dim=1)  # (B, T_in, C, *sp)
        if check_finite:
            _check_finite(pred, step, names)
        yield pred.clone()


def ensemble_rollout(
    model: nn.Module | InferenceCheckpoint,
    batch: Batch,
    steps: int,
    *,
    members: int,
    jitter_seed: int,
    keep_members: bool = False,
    perturbation: Perturbation | None | Literal["checkpoint"] = CHECKPOINT,
    **kwargs: Any,
) -> Iterator[tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]]:
    """Roll ``members`` jittered copies of each trajectory out side by side.

    Member ``m`` is :func:`rollout` with jitter seed ``jitter_seed + m * MEMBER_SEED_STRIDE``, so
    members differ by their jitter draws (patch-grid shifts, latent rolls; a noisy model's
    latent noise; with ``perturbation=`` in ``kwargs``, their perturbations) and every run is
    reproducible. Member 0 is exactly ``rollout(..., jitter_seed=jitter_seed)`` with the same
    ``kwargs``.

    Args:
        model: as for :func:`rollout` (a model or a loaded checkpoint); it must jitter when
            given a seed.
        batch: as for :func:`rollout`.
        steps: as for :func:`rollout`.
        members: ensemble size (>= 1).
        jitter_seed: base seed (required: without jitter the members would be identical).
        keep_members: also yield the members themselves, e.g. for
            ``walrus.metrics.ensemble_scores`` or ``RolloutMetrics(members=K)``.
        perturbation: perturb each member's steps (:mod:`walrus.perturbation`); the default
            ``"checkpoint"`` is ``DEFAULT_PERTURBATION`` for a loaded checkpoint and 2 or more
            members (as ``infer.py rollout ensemble=K``), else none.
        **kwargs: passed to :func:`rollout` (normalizer, predict_delta, autocast_dtype, ...).

    Yields:
        ``(mean, spread)``, each ``(B, C, *spatial)``: the members' mean and their standard
        deviation (population, 0 for one member) at each step; with ``keep_members``
        ``(mean, spread, members)``, members ``(K, B, C, *spatial)``.

    Raises:
        RolloutDivergedError: a member's prediction held NaN/Inf (when ``check_finite``).
    """
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"members must be an int >= 1, got {members!r}")
    if jitter_seed is None:
        raise ValueError("an ensemble needs a jitter_seed: its members differ by their jitter")
    if isinstance(perturbation, str):
        if perturbation != CHECKPOINT:
            raise ValueError(f"perturbation must be a Perturbation, None or {CHECKPOINT!r}")
        loading = sys.modules.get("walrus.inference.loading")
        loaded = loading is not None and isinstance(model, loading.InferenceCheckpoint)
        perturbation = DEFAULT_PERTURBATION if loaded and members > 1 else None
    runs = [
        rollout(
            model,
            batch,
            steps,
            jitter_seed=jitter_seed + m * MEMBER_SEED_STRIDE,
            perturbation=perturbation,
            **kwargs,
        )
        for m in range(members)
    ]
    for preds in zip(*runs):
        stack = torch.stack(preds)  # (M, B, C, *spatial)
        spread, mean = torch.std_mean(stack, dim=0, correction=0)
        yield (mean, spread, stack) if keep_members else (mean, spread)


def _check_jitter_average(draws: Any, jitter_seed: int | None) -> int:
    """``draws`` checked: an int >= 1, above 1 only with a jitter seed."""
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"jitter_average must be an int >= 1, got {draws!r}")
    if draws > 1 and jitter_seed is None:
        raise ValueError(
            f"jitter_average={draws} needs jitter on (a jitter seed): the draws differ only "
            "by their jitter"
        )
    return draws


def _periodic(bcs: Tensor | Sequence) -> list[bool]:
    """Per spatial axis, whether both of its boundary codes ``(n_spatial, 2)`` are periodic."""
    codes = torch.as_tensor(bcs).tolist()
    return [all(c == BoundaryType.PERIODIC for c in row) for row in codes]


def check_spectral_limit(limit: Any) -> float:
    """``limit`` checked: a finite number >= 0 (0: no limit)."""
    if (
        isinstance(limit, bool)
        or not isinstance(limit, (int, float))
        or not 0 <= limit < float("inf")
    ):
        raise ValueError(f"spectral_limit must be a finite number >= 0 (0: off), got {limit!r}")
    return float(limit)


def _settings(
    model: Any,
    normalizer: Normalizer | None,
    predict_delta: bool | None,
    jitter_seed: int | None | str,
    cap_delta_unit: bool | None,
    jitter_average: int | None = None,
    spectral_limit: float | None = None,
) -> tuple[nn.Module, Normalizer | None, bool, int | None, bool, int, float]:
    """The model and rollout settings: given values, else the checkpoint's, else the defaults."""
    if isinstance(jitter_seed, str) and jitter_seed != CHECKPOINT:
        raise ValueError(f"jitter_seed must be an int, None or {CHECKPOINT!r}, got {jitter_seed!r}")
    # A loaded checkpoint exists only once its module is imported; looking it up here avoids
    # importing Lightning for a bare model (and the import cycle: walrus.inference imports us).
    loading = sys.modules.get("walrus.inference.loading")
    if loading is not None and isinstance(model, loading.InferenceCheckpoint):
        ckpt = model
        seed = ckpt.default_jitter_seed() if jitter_seed == CHECKPOINT else jitter_seed
        return (
            ckpt.model,
            ckpt.normalizer if normalizer is None else normalizer,
            ckpt.predict_delta if predict_delta is None else predict_delta,
            seed,
            ckpt.cap_delta_unit if cap_delta_unit is None else cap_delta_unit,
            ckpt.default_jitter_average(seed) if jitter_average is None else jitter_average,
            ckpt.default_spectral_limit() if spectral_limit is None else spectral_limit,
        )
    return (
        model,
        normalizer,
        True if predict_delta is None else predict_delta,
        None if jitter_seed == CHECKPOINT else jitter_seed,
        True if cap_delta_unit is None else cap_delta_unit,
        1 if jitter_average is None else jitter_average,
        0.0 if spectral_limit is None else spectral_limit,
    )


def _check_finite(pred: Tensor, step: int, names: Sequence[str] | None) -> None:
    """Raise ``RolloutDivergedError`` if ``pred`` ``(B, C, *spatial)`` has NaN/Inf."""
    bad = ~torch.isfinite(pred).transpose(0, 1).flatten(1).all(dim=1)  # (C,)
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()
        labels = [names[i] if names is not None else f"channel {i}" for i in idx]
        raise RolloutDivergedError(step, labels)
