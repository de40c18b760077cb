"""The training loop's own work around the model: validation reuses its one-step forward."""

from __future__ import annotations

import pytest
import torch

from walrus import metrics
from walrus.bcs import BoundaryType
from walrus.data.batch import Batch
from walrus.model.walrus import Walrus
from walrus.rollout import rollout
from walrus.training.module import WalrusModule

P = int(BoundaryType.PERIODIC)


def _module_and_batch(dtype: torch.dtype = torch.float32) -> tuple[WalrusModule, Batch, list]:
    torch.manual_seed(0)
    model = Walrus(3, 32, 2, 4, projection_dim=8, intermediate_dim=16, groups=4).eval()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    module = WalrusModule(model, optimizer=torch.optim.AdamW, val_rollout_steps=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 3, 16, 16, generator=g).to(dtype)  # (B, Ti, C, H, W)
    y = torch.randn(2, 4, 3, 16, 16, generator=g).to(dtype)  # (B, To, C, H, W)
    return module, Batch(x, y, torch.arange(3), torch.full((2, 2), P)), calls


def _validate(module: WalrusModule, batch: Batch) -> dict[str, float]:
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))  # no trainer
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    return logged


def test_validation_rollout_reuses_the_one_step_forward():
    module, batch, calls = _module_and_batch()
    logged = _validate(module, batch)
    assert len(calls) == 4  # one forward per rollout step, the first shared with val/vrmse
    calls.clear()
    ref = [
        metrics.vrmse(p, batch.output_fields[:, s], n_spatial=2).mean()
        for s, p in enumerate(rollout(module.model, batch, 4, check_finite=False))
    ]
    assert len(calls) == 4
    assert logged["val/rollout_vrmse"] == pytest.approx(float(torch.stack(ref).mean()), rel=1e-6)
    assert logged["val/vrmse"] == pytest.approx(float(ref[0]), rel=1e-6)


def test_validation_runs_the_first_rollout_step_when_inputs_are_narrower_than_fp32():
    module, batch, calls = _module_and_batch(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _validate(module, batch)
    assert len(calls) == 5  # the rollout runs on fp32 frames, the one-step forward did not


def test_train_loss_matches_val_loss_without_noise_and_grows_with_it():
    """train/loss and val/loss score the same thing on the same batch once input noise is off
    (docs/guide/training.md, "Reading the losses"); the noise, in delta units, is what lifts
    train/loss above val/loss."""
    module, batch, _ = _module_and_batch()  # eval mode: no patch jitter, no augmentation
    with torch.no_grad():
        clean = float(module._rollout_loss(batch))
        logged = _validate(module, batch)
        assert clean == pytest.approx(logged["val/loss"], rel=1e-6)
        module.train()  # patch jitter on: a little off, not a different scale
        torch.manual_seed(0)
        assert float(module._rollout_loss(batch)) == pytest.approx(clean, rel=0.05)
        module.input_noise, module.noise_units = 1.0, "delta_rms"
        noisy = float(module._rollout_loss(batch))
    assert noisy > 1.2 * clean
