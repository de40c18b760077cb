"""Rollout-aware training: noise units, pushforward, unrolled loss, curriculum, checkpoint choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.conftest import tiny_train_overrides
from walrus.data.batch import Batch
from walrus.data.normalization import RMSNormalizer
from walrus.training.losses import gradient_loss, normalized_loss
from walrus.training.module import WalrusModule
from walrus.training.train import train


class LinearStep(nn.Module):
    """A causal toy model: a learned per-channel scale of the normalised input."""

    causal = True

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.3))

    def forward(self, x, fields, bcs):
        return self.w * x  # (B, T, C, *S)


def _batch(t_out: int = 3) -> Batch:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 8, 8, generator=g)
    y = torch.randn(2, t_out, 2, 8, 8, generator=g)
    return Batch(x, y, torch.tensor([0, 1]), torch.full((2, 2), 2))


def _module(**kwargs) -> WalrusModule:
    return WalrusModule(LinearStep(), optimizer=torch.optim.AdamW, **kwargs)


def _manual_loss(module: WalrusModule, batch: Batch, k: int, detach: bool) -> torch.Tensor:
    """Reference: roll the toy model k steps by hand, loss on the steps that get gradient."""
    norm = RMSNormalizer()
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)
    window, t_in, losses = batch.input_fields, batch.input_fields.shape[1], []
    for j in range(k):
        stats = norm.fit(window)
        pred = module.model(stats.normalize(window), None, None)
        target = stats.normalize_delta(frames[:, j + 1 : j + 1 + t_in] - window)
        if j == k - 1 or not detach:
            losses.append(normalized_loss(pred, target))
        nxt = window[:, -1:] + stats.denormalize_delta(pred[:, -1:])
        window = torch.cat([window[:, 1:], nxt.detach() if detach else nxt], dim=1)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("mode", ["pushforward", "unrolled"])
def test_unrolled_losses_and_gradients_match_a_hand_rollout(mode):
    batch = _batch()
    module = _module(rollout_mode=mode, rollout_steps=3)
    loss = module._rollout_loss(batch)
    (grad,) = torch.autograd.grad(loss, module.model.w)
    ref = _manual_loss(module, batch, 3, detach=mode == "pushforward")
    (ref_grad,) = torch.autograd.grad(ref, module.model.w)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_pushforward_and_unrolled_differ_from_one_step_and_each_other():
    batch = _batch()
    losses = {}
    for mode in ("one_step", "pushforward", "unrolled"):
        module = _module(rollout_mode=mode, rollout_steps=3)
        loss = module._rollout_loss(batch)
        losses[mode] = (loss.item(), torch.autograd.grad(loss, module.model.w)[0].item())
    assert losses["one_step"] != losses["pushforward"] != losses["unrolled"]
    one = _manual_loss(_module(), batch, 1, detach=True)
    assert losses["one_step"][0] == pytest.approx(one.item())


def test_curriculum_grows_unroll_from_one_to_k():
    module = _module(rollout_mode="pushforward", rollout_steps=4, rollout_curriculum=0.5)
    seen = []
    for step in (0, 10, 25, 40, 50, 99):
        module._trainer = SimpleNamespace(estimated_stepping_batches=100, global_step=step)
        seen.append(module.unroll_steps())
    assert seen == [1, 2, 3, 3, 4, 4]
    assert _module(rollout_mode="pushforward", rollout_steps=4).unroll_steps() == 4
    assert _module(rollout_steps=4).unroll_steps() == 1  # one_step ignores k


def test_noise_units_delta_rms_scale_with_frame_changes_not_values():
    torch.manual_seed(0)
    base = torch.randn(1, 1, 1, 16, 16)
    # Large values, small changes: input-RMS noise would swamp the dynamics.
    window = 100.0 + base + 0.01 * torch.arange(4.0).view(1, 4, 1, 1, 1)  # (1, 4, 1, 16, 16)
    module = _module(input_noise=1.0, noise_units="delta_rms")
    noise = module._noise(window, scale=torch.full((1, 1, 1, 1, 1), 100.0))
    assert noise.std().item() == pytest.approx(0.01, rel=0.1)
    loud = _module(input_noise=1.0, noise_units="input_rms")._noise(
        window, scale=torch.full((1, 1, 1, 1, 1), 100.0)
    )
    assert loud.std().item() == pytest.approx(100.0, rel=0.1)
    # input_std: the values' spread about their mean (the offset 100 left out)
    spread = window.std(correction=0).item()
    assert 0.9 < spread < 1.1
    quiet = _module(input_noise=1.0, noise_units="input_std")._noise(
        window, scale=torch.full((1, 1, 1, 1, 1), 100.0)
    )
    assert quiet.std().item() == pytest.approx(spread, rel=0.1)


def test_noisy_inputs_get_targets_back_to_clean_frames():
    batch = _batch()
    module = _module(input_noise=0.5)
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)
    clean_in, clean_target, stats = module._targets(batch.input_fields, frames, 0, None)
    noisy_in, noisy_target, _ = module._targets(batch.input_fields, frames, 0, None, noise=True)
    nxt = frames[:, 1:4]
    assert not torch.allclose(noisy_in, clean_in)
    torch.testing.assert_close(clean_target, stats.normalize_delta(nxt - batch.input_fields))
    torch.testing.assert_close(
        noisy_target, stats.normalize_delta(nxt - stats.denormalize(noisy_in))
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_mode": "teacher"}, "rollout_mode"),
        ({"rollout_steps": 0}, "rollout_steps"),
        ({"rollout_curriculum": 2.0}, "rollout_curriculum"),
        ({"noise_units": "std"}, "noise_units"),
        ({"input_noise": -1.0}, "input_noise"),
        ({"loss_weighting": "inverse"}, "loss_weighting"),
        ({"gradient_loss": -0.5}, "gradient_loss"),
    ],
)
def test_bad_training_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _module(**kwargs)


def test_too_few_target_frames_names_the_option():
    module = _module(rollout_mode="pushforward", rollout_steps=3)
    with pytest.raises(ValueError, match=r"data.n_steps_output >= 3"):
        module._rollout_loss(_batch(t_out=2))


def test_pushforward_run_keeps_the_best_rollout_checkpoint(compose_cfg, tiny_data_root, tmp_path):
    overrides = [
        *tiny_train_overrides(tiny_data_root, tmp_path),
        "module.rollout_mode=pushforward",
        "module.rollout_steps=2",
        "module.rollout_curriculum=0.5",
        "data.n_steps_output=2",
        "data.val_steps_output=3",
        "trainer.max_epochs=2",
        "callbacks.model_checkpoint.monitor=val/rollout_vrmse",
    ]
    metrics, objects = train(compose_cfg("train", overrides))
    module, trainer = objects["module"], objects["trainer"]
    assert module.val_rollout_steps == 3
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    ckpt = trainer.checkpoint_callback
    assert ckpt.monitor == "val/rollout_vrmse"
    assert ckpt.best_model_path and ckpt.best_model_score is not None
    assert float(ckpt.best_model_score) <= metrics["val/rollout_vrmse"] + 1e-6


def test_delta_rms_weighting_measures_errors_in_window_delta_units():
    """With state-unit deltas and delta_rms weighting the loss equals the window-unit loss."""
    batch = _batch()
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)
    win = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW)
    state = WalrusModule(
        LinearStep(),
        optimizer=torch.optim.AdamW,
        normalizer=RMSNormalizer(delta="state"),
        loss_weighting="delta_rms",
    )
    x_w, t_w, s_w = win._targets(batch.input_fields, frames, 0, None)
    x_s, t_s, s_s = state._targets(batch.input_fields, frames, 0, None)
    torch.testing.assert_close(x_w, x_s)
    ratio = s_w.delta_scale / s_s.delta_scale  # window unit over state unit
    pred_w = 0.7 * t_w + 0.1  # any prediction, in window units ...
    pred_s = pred_w * ratio  # ... and the same physical deltas in state units
    ref = normalized_loss(pred_w, t_w)
    # equal up to the normaliser's eps (1e-4 on unit-size RMS values)
    torch.testing.assert_close(
        state._loss(pred_s, t_s, batch.input_fields, s_s), ref, rtol=1e-3, atol=0
    )
    unweighted = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW)
    assert not torch.allclose(unweighted._loss(pred_s, t_s, batch.input_fields, s_s), ref)


@pytest.mark.parametrize("units", ["input_rms", "delta_rms"])
def test_fields_that_do_not_change_get_no_noise(units):
    torch.manual_seed(0)
    moving = torch.randn(1, 4, 1, 8, 8)
    steady = torch.randn(1, 1, 1, 8, 8).expand(1, 4, 1, 8, 8)  # e.g. a steady velocity
    window = torch.cat([moving, steady], dim=2)  # (1, 4, 2, 8, 8)
    noise = _module(input_noise=0.1, noise_units=units)._noise(window, torch.ones(1, 1, 2, 1, 1))
    assert noise[:, :, 0].abs().sum() > 0 and torch.count_nonzero(noise[:, :, 1]) == 0


def test_gradient_loss_scores_the_errors_differences_on_constructed_fields():
    target = torch.zeros(1, 1, 1, 4, 6, 1)  # (B, T, C, H, W, D): D of one point is skipped
    i, j = torch.meshgrid(torch.arange(4.0), torch.arange(6.0), indexing="ij")
    checker = ((-1.0) ** (i + j)).view(1, 1, 1, 4, 6, 1)  # every difference is +-2
    assert gradient_loss(checker, target, "mae").item() == pytest.approx(2.0)
    assert gradient_loss(checker, target, "mse").item() == pytest.approx(4.0)
    ramp = (0.5 * j).view(1, 1, 1, 4, 6, 1)  # slope 0.5 along W, flat along H
    assert gradient_loss(ramp, target, "mae").item() == pytest.approx(0.25)
    assert gradient_loss(ramp + 3.0, target, "mae").item() == pytest.approx(0.25)  # offset-free
    # the value-level loss ranks them the other way round: 1.0 for the checkerboard, 1.25 ramp
    assert normalized_loss(checker, target).item() == pytest.approx(1.0)
    assert normalized_loss(ramp, target).item() == pytest.approx(1.25)


def test_gradient_loss_adds_its_weighted_term_to_the_training_loss():
    batch = _batch()
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)
    plain = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW)
    weighted = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW, gradient_loss=0.5)
    _, target, stats = plain._targets(batch.input_fields, frames, 0, None)
    pred = target + 0.1 * torch.randn_like(target)
    base = plain._loss(pred, target, batch.input_fields, stats)
    torch.testing.assert_close(base, normalized_loss(pred, target))
    torch.testing.assert_close(
        weighted._loss(pred, target, batch.input_fields, stats),
        base + 0.5 * gradient_loss(pred, target),
    )
