"""Perturbed ensemble members: the random field, the AR(1) steps, rollouts and infer.py options."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.test_infer import base_overrides, compose_infer, toy, write_checkpoint  # noqa: F401
from walrus.data.batch import Batch
from walrus.inference import run
from walrus.perturbation import (
    DEFAULT_PERTURBATION,
    Perturbation,
    PerturbedSteps,
    smooth_noise,
)
from walrus.rollout import ensemble_rollout, rollout


def test_smooth_noise_has_unit_variance_and_its_correlation_length():
    g = torch.Generator().manual_seed(0)
    r = smooth_noise((4, 2, 64, 64), 4.0, g)  # (N, C, H, W)
    std = r.flatten(2).std(-1)
    torch.testing.assert_close(std, torch.ones_like(std))
    # neighbours agree, points far apart (several lengths) do not
    near = (r * r.roll(1, -1)).mean().item()
    far = (r * r.roll(24, -1)).mean().item()
    assert near > 0.9 and abs(far) < 0.2
    longer = smooth_noise((4, 2, 64, 64), 8.0, torch.Generator().manual_seed(0))
    assert (longer * longer.roll(4, -1)).mean() > (r * r.roll(4, -1)).mean()
    # the same seed draws the same field; a wall axis is cut from a field twice as long
    torch.testing.assert_close(
        r, smooth_noise((4, 2, 64, 64), 4.0, torch.Generator().manual_seed(0))
    )
    wall = smooth_noise((2, 1, 32, 1), 3.0, torch.Generator().manual_seed(1), [False, True])
    assert wall.shape == (2, 1, 32, 1)


def test_perturbed_steps_ramp_up_as_an_ar1_process():
    settings = Perturbation(0.5, 4.0, 0.8)
    steps = PerturbedSteps(settings, seed=3, periodic=[True, True])
    last = torch.zeros(1, 1, 16, 16)
    nxt = torch.ones(1, 1, 16, 16)  # a change of 1 everywhere
    first = steps(last, nxt)  # 1 + 0.5 * r_1, r_1 = 0.6 e_1
    r1 = (first - 1) / 0.5
    torch.testing.assert_close(r1.std(), torch.tensor(0.6), atol=1e-5, rtol=0)
    second = steps(last, nxt)
    r2 = (second - 1) / 0.5
    e2 = (r2 - 0.8 * r1) / 0.6
    torch.testing.assert_close(e2.std(), torch.tensor(1.0), atol=1e-5, rtol=0)
    # no change, no perturbation: a steady state stays steady
    torch.testing.assert_close(steps(nxt, nxt), nxt)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amplitude": 0.0}, "amplitude must be a number > 0"),
        ({"amplitude": 0.1, "length": -1.0}, "length must be a number > 0"),
        ({"amplitude": 0.1, "memory": 1.0}, "memory must be a number in"),
        ({"amplitude": float("inf")}, "amplitude must be finite"),
    ],
)
def test_bad_perturbations_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Perturbation(**kwargs)


class _Drift(torch.nn.Module):
    """Predicts a constant normalised change: members differ by their perturbation alone."""

    def forward(self, x, fields, bcs, *, jitter_seed=None):  # noqa: ANN001
        return torch.ones_like(x[:, -1:])


def _batch() -> Batch:
    x = torch.randn(2, 3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    return Batch(x, x[:, :0], torch.tensor([0]), torch.full((2, 2), 2))


def test_perturbed_members_spread_and_are_reproducible():
    batch = _batch()
    settings = Perturbation(0.3, 4.0, 0.5)
    plain = list(ensemble_rollout(_Drift(), batch, 3, members=4, jitter_seed=1))
    assert all(spread.abs().max() == 0 for _, spread in plain)  # a bare model: no perturbation
    runs = [
        list(
            ensemble_rollout(
                _Drift(),
                batch,
                3,
                members=4,
                jitter_seed=1,
                perturbation=settings,
                keep_members=True,
            )
        )  # fmt: skip
        for _ in range(2)
    ]
    for (_, s1, k1), (_, _, k2) in zip(*runs):
        torch.testing.assert_close(k1, k2)  # seeded
        assert s1.mean() > 0
    spreads = [s.mean().item() for _, s, _ in runs[0]]
    assert spreads[0] < spreads[1] < spreads[2]  # the members drift apart step by step
    # member 0 is rollout() with the same seed and perturbation
    one = list(rollout(_Drift(), batch, 3, jitter_seed=1, perturbation=settings))
    torch.testing.assert_close(runs[0][-1][2][0], one[-1])
    with pytest.raises(ValueError, match="needs a jitter_seed"):
        next(rollout(_Drift(), batch, 1, jitter_seed=None, perturbation=settings))


def test_infer_perturbs_ensembles_by_default_and_names_bad_options(toy, tmp_path: Path):  # noqa: F811
    common = [*base_overrides(toy, tmp_path), "steps=2", "trajectories=0", "plots=false",
              "jitter=true", "save_predictions=false"]  # fmt: skip
    got = {
        name: run(compose_infer([*common, *extra, f"out={tmp_path / name}"]))["metrics"]
        for name, extra in (
            ("default", ["ensemble=2"]),
            ("off", ["ensemble=2", "perturbation=0"]),
            ("set", ["ensemble=2", "perturbation=0.3", "perturbation_memory=0"]),
            ("single", []),
        )
    }
    default = {"amplitude": 0.15, "length": 8.0, "memory": 0.8}
    assert default == asdict(DEFAULT_PERTURBATION)
    assert got["default"]["perturbation"] == default
    assert got["off"]["perturbation"] is None and got["single"]["perturbation"] is None
    assert got["set"]["perturbation"] == {"amplitude": 0.3, "length": 8.0, "memory": 0.0}
    spread = {
        n: got[n]["datasets"]["toy"]["metrics"]["ensemble"]["spread_skill"]["windows"]["u"]["2"]
        for n in ("default", "off")
    }
    assert spread["default"] != spread["off"]
    for bad, match in (
        (["perturbation=0.2"], "perturbs ensemble members: set ensemble=N"),
        (["ensemble=2", "perturbation=-1"], "option perturbation must be a number > 0"),
        (["ensemble=2", "perturbation_memory=1.5"], "option perturbation_memory must be"),
        (["ensemble=2", "perturbation_length=abc"], "option perturbation_length must be a number"),
    ):
        with pytest.raises(ValueError, match=match):
            run(compose_infer([*common, *bad, f"out={tmp_path / 'x'}"]))
