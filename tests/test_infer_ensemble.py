"""`infer.py rollout ensemble=N`: ensemble scores in metrics.json, the tables and the plots; what
is stored (the mean, the members with save_members=true); the Python API's members."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import walrus
from tests.test_infer import base_overrides, compose_infer, write_checkpoint, write_toy
from walrus.data.well_file import read_trajectory
from walrus.inference import run
from walrus.inference.loading import RESULT_FILES
from walrus.metrics import ENSEMBLE, SPATIAL_MEAN, ensemble_scores
from walrus.perturbation import DEFAULT_PERTURBATION


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ensemble")
    write_toy(base / "data")
    return {"base": base, "data": base / "data", "ckpt": write_checkpoint(base / "tiny.ckpt", base / "data")}  # fmt: skip


def test_ensemble_scores_members_file_and_tables(toy, tmp_path: Path, capsys) -> None:
    overrides = [*base_overrides(toy, tmp_path), "steps=3", "trajectories=[0,2]", "jitter=true",
                 "ensemble=3", "save_members=true", "jitter_average=1"]  # fmt: skip
    result = run(compose_infer(overrides))
    printed = capsys.readouterr().out
    entry = result["metrics"]["datasets"]["toy"]
    metrics = entry["metrics"]
    ens = metrics[ENSEMBLE]
    assert ens["members"] == 3 and set(ens["spread_skill"]["per_step"]) == set(metrics["fields"])
    assert list(ens["crps"]["windows"]["u"]) == ["1", "2-3"]
    assert len(ens["rank_histogram"]["per_step"]["u"]) == 3
    assert all(len(h) == 4 for h in ens["rank_histogram"]["per_step"]["u"])
    # members.hdf5: trajectory n * 3 + m is member m of trajectories[n]
    assert entry["members"]["members"] == 3 and entry["members"]["trajectories"] == [0, 2]
    members = np.stack([read_trajectory(tmp_path / "members.hdf5", i)[0] for i in range(6)])
    members = members.reshape(2, 3, *members.shape[1:])  # (N, K, S, C, H, W)
    mean = np.stack(  # (N, S, C, H, W) without the spreads stored beside the fields
        [
            read_trajectory(tmp_path / "predictions.hdf5", i, fields=["u", "velocity"])[0]
            for i in range(2)
        ]
    )
    np.testing.assert_allclose(members.mean(axis=1), mean, rtol=1e-5, atol=1e-6)
    # the scores in metrics.json are those of the stored members against the truth
    truth = np.stack(
        [read_trajectory(toy["data"] / "toy" / "data" / "test" / "toy.hdf5", i)[0] for i in (0, 2)]
    )[:, 3:6]  # (N, S, C, H, W): the frames after 3 context frames
    step2 = ensemble_scores(
        torch.from_numpy(members[:, :, 1]).movedim(1, 0), torch.from_numpy(truth[:, 1])
    )  # members (K, N, C, H, W) at step 2
    assert ens["crps"]["per_step"]["u"][1] == pytest.approx(
        step2["crps"][:, 0].mean().item(), rel=1e-4
    )
    counts = step2["rank_counts"][:, 0].sum(dim=0)
    assert ens["rank_histogram"]["per_step"]["u"][1] == pytest.approx(
        (counts / counts.sum()).tolist()
    )
    for name in ("rank_histogram.png", "fidelity_fields.png", "members.hdf5"):
        assert (tmp_path / name).is_file() and name in RESULT_FILES
    saved = json.loads((tmp_path / "metrics.json").read_text())["datasets"]["toy"]["metrics"]
    assert saved[ENSEMBLE]["spread_skill"] == ens["spread_skill"]
    assert "ensemble of 3 members" in printed and "spread/skill" in printed
    assert "sp.mean" in printed and "worst field" in printed
    # every file written is a result file: the same run again replaces them all
    run(compose_infer([*overrides, "overwrite=true", "plots=true"]))
    assert {p.name for p in tmp_path.iterdir()} - {".hydra", "infer.log"} <= RESULT_FILES


def test_deterministic_rollout_has_no_ensemble_scores(toy, tmp_path: Path) -> None:
    result = run(compose_infer([*base_overrides(toy, tmp_path), "steps=2", "trajectories=0"]))
    metrics = result["metrics"]["datasets"]["toy"]["metrics"]
    assert ENSEMBLE not in metrics and "members" not in result["metrics"]["datasets"]["toy"]
    assert metrics[SPATIAL_MEAN]["vrmse"]["per_step"]["u"][0] == pytest.approx(
        (255 / 256) ** 0.5, rel=1e-4
    )
    assert not (tmp_path / "rank_histogram.png").exists()
    assert (tmp_path / "fidelity_fields.png").is_file()


@pytest.mark.parametrize(
    ("extra", "match"),
    [(["save_members=true"], "save_members=true needs ensemble=2"),
     (["save_members=yes"], "option save_members must be true or false")],
)  # fmt: skip
def test_save_members_option_errors(toy, tmp_path: Path, extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(compose_infer([*base_overrides(toy, tmp_path / "out"), "jitter=true", *extra]))
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_python_api_members(toy) -> None:
    ckpt = walrus.load(toy["ckpt"])
    ds = walrus.open_dataset(ckpt)
    batch = walrus.trajectory_batch(ds, 0, steps=2)
    steps = list(walrus.ensemble_rollout(ckpt, batch, 2, members=3, jitter_seed=5,
                                         keep_members=True))  # fmt: skip
    # a loaded checkpoint's members are perturbed by default: member 0 is the rollout with
    # the same seed and the default perturbation
    one = list(walrus.rollout(ckpt, batch, 2, jitter_seed=5, perturbation=DEFAULT_PERTURBATION))
    for (mean, spread, members), single in zip(steps, one):
        assert members.shape == (3, *mean.shape)
        torch.testing.assert_close(members.mean(dim=0), mean)
        torch.testing.assert_close(members.std(dim=0, correction=0), spread)
        torch.testing.assert_close(members[0], single)
    plain = list(walrus.ensemble_rollout(ckpt, batch, 2, members=3, jitter_seed=5,
                                         keep_members=True, perturbation=None))  # fmt: skip
    unperturbed = list(walrus.rollout(ckpt, batch, 2, jitter_seed=5))
    torch.testing.assert_close(plain[-1][2][0], unperturbed[-1])
    assert (plain[-1][2][0] - steps[-1][2][0]).abs().max() > 0


def test_evaluate_scores_an_ensemble(toy, tmp_path: Path, capsys) -> None:
    overrides = [*base_overrides(toy, tmp_path, "evaluate"), "jitter=true", "ensemble=2",
                 "max_windows=2"]  # fmt: skip
    metrics = run(compose_infer(overrides))["metrics"]["datasets"]["toy"]["metrics"]
    ens = metrics[ENSEMBLE]
    assert ens["members"] == 2 and list(ens["crps"]["windows"]["u"]) == ["1"]
    assert sum(ens["rank_histogram"]["per_step"]["u"][0]) == pytest.approx(1.0)
    assert "ensemble of 2 members" in capsys.readouterr().out


def test_worst_field_is_the_one_furthest_from_one() -> None:
    from walrus.inference.report import format_rollout_table, worst_field
    from walrus.metrics import RolloutMetrics

    g = torch.Generator().manual_seed(0)
    truth = torch.randn(2, 2, 8, 8, generator=g)
    acc = RolloutMetrics(["u", "v"], 1)
    acc.update(1, truth * 1.1, truth, truth * 0.9)
    d = acc.to_dict()

    def put(metric: str, field: str, value: float) -> None:
        d["model"][metric]["windows"][field]["1"] = value

    put("amplitude_ratio", "u", 1.2)  # ln 1.2 = 0.18
    put("amplitude_ratio", "v", 0.9)
    put("change_correlation", "u", 0.95)
    put("change_correlation", "v", 0.5)  # 1 - 0.5 = 0.5: the worst
    assert worst_field(d, ["amplitude_ratio", "change_correlation"], "1") == "v (change corr 0.5)"
    put("amplitude_ratio", "u", 0.25)  # a factor 4 too small: ln 4 = 1.39 beats 0.5
    assert worst_field(d, ["amplitude_ratio", "change_correlation"], "1") == "u (amplitude 0.25)"
    assert "u (amplitude 0.25)" in format_rollout_table("toy", d)
