"""The forward pass's peak memory is estimated before it runs, and a run that cannot fit is
refused in one line naming the file and the options to lower.

The estimate (:func:`walrus.model.peak.activation_bytes`) is checked for how it scales, against
the intermediates it must at least hold, and against the peak PyTorch's ``MemTracker`` measures
on a real forward and training step of tiny models.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import walrus
from tests.conftest import tiny_train_overrides
from tests.test_hostile_input import _cli_error, _compose, save, small_checkpoint
from walrus import memory
from walrus.cli import run_cli
from walrus.data.writer import write_well_file
from walrus.model.peak import activation_bytes
from walrus.model.walrus import Walrus
from walrus.training.train import train

TINY = {"n_fields": 8, "dim": 32, "depth": 2, "heads": 4, "projection_dim": 8}
TINY |= {"intermediate_dim": 16, "groups": 4}
PERIODIC = [[2, 2], [2, 2]]


def _meta(**options) -> Walrus:
    with torch.device("meta"):
        return Walrus(**(TINY | options))


@pytest.mark.parametrize("training", [False, True])
def test_the_estimate_is_linear_in_batch_and_grid_points(training):
    model = _meta(encoder="patch", kernel_sizes=(4, 4), jitter=False)

    def est(batch: int, grid: tuple[int, ...]) -> int:
        return activation_bytes(model, batch, 4, 3, grid, training=training, bcs=PERIODIC)

    assert est(4, (64, 64)) == 4 * est(1, (64, 64))  # exactly proportional to the batch
    assert est(6, (64, 64)) == 3 * est(2, (64, 64))
    ratio = est(2, (512, 1024)) / est(2, (512, 512))
    assert 1.95 <= ratio <= 2.05, ratio  # twice the points: twice the memory (up to edges)
    # the processor's share grows with the width (small patches: many tokens)
    narrow, wide = (_meta(encoder="patch", kernel_sizes=(2, 2), dim=d) for d in (32, 64))
    ests = [activation_bytes(m, 2, 4, 3, (64, 64), training=training) for m in (narrow, wide)]
    assert 1.5 * ests[0] < ests[1] < 2 * ests[0], ests


def test_math_attention_scores_grow_with_the_square_of_the_tokens():
    flash = _meta(encoder="patch", kernel_sizes=(4, 4), jitter=False)
    math_ = _meta(encoder="patch", kernel_sizes=(4, 4), jitter=False, spatial_kernel="math")
    small, large = (256, 256), (512, 512)
    gap_small = activation_bytes(math_, 1, 2, 3, small, training=True, bcs=PERIODIC)
    gap_small -= activation_bytes(flash, 1, 2, 3, small, training=True, bcs=PERIODIC)
    gap_large = activation_bytes(math_, 1, 2, 3, large, training=True, bcs=PERIODIC)
    gap_large -= activation_bytes(flash, 1, 2, 3, large, training=True, bcs=PERIODIC)
    assert gap_large == 16 * gap_small  # 4x the tokens: 16x the S x S scores


@pytest.mark.parametrize("training", [False, True])
def test_the_estimate_holds_the_token_stream_and_the_block_intermediates(training):
    model = _meta()
    b, t, c, grid = 2, 4, 3, (64, 64)
    padded, strides, _ = model.encoder_layout(grid, [[0, 0], [0, 0]])
    (k1, k2), cfg = model.config.kernel_sizes, model.config
    l1 = [(n - k1) // s1 + 1 for n, (s1, _) in zip(padded, strides)]
    s = int(np.prod([(n - k2) // s2 + 1 for n, (_, s2) in zip(l1, strides)]))
    stream = b * t * s * cfg.dim * 4
    fused_linear = b * t * s * (cfg.mlp_dim + 3 * cfg.dim) * 4  # [ff, q, k, v]
    first_conv = b * t * cfg.intermediate_dim * int(np.prod(l1)) * 4
    inputs = 2 * b * t * c * int(np.prod(grid)) * 4  # the input and the prediction
    est = activation_bytes(model, b, t, c, grid, training=training)
    assert est >= stream + fused_linear + inputs
    assert est >= first_conv + inputs
    if training:  # every block's intermediates are kept for backward
        assert est >= cfg.depth * (stream + fused_linear)
        checkpointed = activation_bytes(
            _meta(grad_checkpointing=True), b, t, c, grid, training=True
        )
        assert stream + fused_linear < checkpointed < est


@pytest.mark.parametrize(
    "options",
    [{}, {"grad_checkpointing": True, "dim": 64}, {"spatial_kernel": "math"}],
    ids=["default", "checkpointing", "math"],
)
def test_the_estimate_bounds_the_measured_peak(options):
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = Walrus(**(TINY | options))
    b, t, c, grid = 2, 4, 3, (32, 32)
    x, fields, bcs = torch.randn(b, t, c, *grid), torch.arange(c), [[0, 0], [2, 2]]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for training in (False, True):
        model.train(training)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model, x)
        with tracker:
            if training:
                model(x, fields, bcs).square().mean().backward()
            else:
                with torch.no_grad():
                    model(x, fields, bcs)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        measured = peak - weights * (2 if training else 1) - x.numel() * 4  # + gradients
        est = activation_bytes(model, b, t, c, grid, training=training, bcs=bcs)
        assert measured <= est <= 4 * measured, (training, measured, est)
        model.zero_grad(set_to_none=True)


def test_a_training_step_that_cannot_fit_is_refused_before_it_runs(
    tiny_data_root, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    out = tmp_path / "run"
    cfg = _compose([*tiny_train_overrides(tiny_data_root, out), "data.batch_size=10000000"])
    err = _cli_error(capsys, lambda: train(cfg))
    assert "one training step on 10000000 sample(s) of" in err
    assert "data/train/" in err and ".hdf5: " in err  # the dataset's file
    for option in ("lower data.batch_size=10000000", "model.dim=32", "grad_checkpointing=true"):
        assert option in err, err
    assert not (out / "checkpoints").exists() and not (out / "config.yaml").exists()


def test_an_inference_forward_that_cannot_fit_is_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    root = tmp_path / "data"
    path = root / "toy" / "data" / "test" / "toy.hdf5"
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(32.0), "y": np.arange(32.0)},
        time=np.arange(8.0),
        n_trajectories=2,
        fields={"u": np.ones((2, 8, 32, 32), np.float32)},
    )
    ckpt = small_checkpoint()
    ckpt["walrus"]["data_config"] = {"root": str(root), "datasets": ["toy"], "n_steps_input": 3}
    ckpt_path = save(ckpt, tmp_path / "small.ckpt")
    memory.default_max_sample_bytes()  # fixed now, from the real memory
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 20)  # 1 MiB left
    out = tmp_path / "out"
    for command in ("rollout", "evaluate"):
        err = _cli_error(
            capsys,
            lambda command=command: (
                walrus.infer(
                    command, f"ckpt_path={ckpt_path}", f"out={out}", "batch_size=64", "steps=1"
                )
                if command == "rollout"
                else walrus.infer(command, f"ckpt_path={ckpt_path}", f"out={out}", "batch_size=64")
            ),
        )
        assert err.startswith(f"error: {path}: one forward pass on "), err
        assert "a 32x32 grid" in err and "lower batch_size=64, the model size" in err, err
        assert "more than the 0.000977 GiB this machine has available" in err, err
        assert not out.exists()
    monkeypatch.undo()  # the real memory: the same rollout runs
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    run_cli(
        lambda: walrus.infer(
            "rollout", f"ckpt_path={ckpt_path}", f"out={out}", "steps=1", "plots=false"
        )
    )
    assert (out / "metrics.json").is_file()
