"""A training step without host syncs: field ids and boundary codes stay on the host, and the
non-finite loss check reads a device-side flag only at logging steps and checkpoint saves."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import scale
from walrus.data.batch import Batch
from walrus.errors import NonFiniteLossError
from walrus.training.module import WalrusModule


def test_training_step_makes_no_host_sync():
    """Forward (jitter on, checkpointing, bf16), loss, deferred NaN check, backward, grad norm,
    clipping and AdamW on fake tensors: no ``.item()``, no data-dependent shape, no copy to
    the host."""
    args = argparse.Namespace(frames=3, channels=2, grid=[32, 32])
    row = scale.train_step_row(scale.load_preset("tiny"), 2, args)
    assert row["calls"] > 100  # the step did run
    assert row["syncs"] == 0, row["sync_list"]


def test_batch_to_keeps_ids_and_boundaries_on_the_host():
    x = torch.randn(2, 3, 2, 8, 8)
    batch = Batch(x[:, :2], x[:, 2:], torch.tensor([0, 1]), torch.full((2, 2), 2))
    moved = batch.to("meta", dtype=torch.bfloat16)
    assert moved.input_fields.device.type == "meta" and moved.input_fields.dtype == torch.bfloat16
    assert moved.field_ids.device.type == "cpu" and moved.bcs.device.type == "cpu"


def test_non_finite_loss_is_reported_at_the_check_with_its_step():
    module = WalrusModule(torch.nn.Linear(1, 1), optimizer=None)
    x = torch.zeros(1, 2, 1, 4)
    batch = Batch(x[:, :1], x[:, 1:], torch.tensor([0]), torch.full((1, 2), 2), {"dataset": "d"})
    module._note_loss(torch.tensor(1.0), batch, 0)
    module.check_finite_loss()  # finite so far: no error
    module._note_loss(torch.tensor(float("nan")), batch, 3)
    with pytest.raises(
        NonFiniteLossError, match=r"became nan at global step 0 \(batch 3, dataset 'd'"
    ):
        module.check_finite_loss()


def test_progress_bar_reads_logged_metrics_only_every_n_steps(monkeypatch):
    """Reading the logged metrics syncs with the device: the bar does it every N steps only."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from walrus.training.progress import ProgressBar

    reads = []
    monkeypatch.setattr(
        RichProgressBar, "get_metrics", lambda self, trainer, module: reads.append(1) or {"n": 1}
    )
    bar = ProgressBar(metrics_every_n_steps=5)
    trainer = SimpleNamespace(global_step=0, training=True)
    for step in range(1, 21):
        trainer.global_step = step
        assert bar.get_metrics(trainer, None) == {"n": 1}
        assert bar.get_metrics(trainer, None) == {"n": 1}  # twice per step, like Lightning
    assert len(reads) == 1 + 4  # the first call, then steps 5, 10, 15, 20
    trainer.training = False  # validation shows fresh values
    bar.get_metrics(trainer, None)
    assert len(reads) == 6
    with pytest.raises(ValueError, match="metrics_every_n_steps"):
        ProgressBar(metrics_every_n_steps=0)
