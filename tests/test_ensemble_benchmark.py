"""benchmarks.ensemble: ensemble and deterministic rollouts of a checkpoint, scored per window."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ensemble
from tests.test_infer import write_checkpoint, write_toy


def test_ensemble_benchmark_scores_each_window(tmp_path: Path) -> None:
    write_toy(tmp_path / "data")
    ckpt = write_checkpoint(tmp_path / "tiny.ckpt", tmp_path / "data")
    overrides = ["trajectories=0", "steps=3", "trainer.accelerator=cpu", "jitter_average=1"]
    result = ensemble.run(str(ckpt), 2, [0], overrides)
    windows = result["per_seed"]["toy"]["0"]
    assert list(windows) == ["1", "2-3"]
    row = windows["2-3"]
    assert row["spread_skill"] > 0 and row["crps"] > 0 and row["rank_max_over_flat"] >= 1
    assert row["worst_spread_skill_field"] in ("u", "velocity_x", "velocity_y")
    # the deterministic rollout is member 0 alone, not the mean: a different VRMSE
    assert row["vrmse_deterministic"] != row["vrmse_ensemble_mean"]
    assert result["summary"]["toy"]["1"]["crps"]["mean"] == windows["1"]["crps"]
    assert "spread/skill" in ensemble.table(result)


def test_ensemble_benchmark_bad_input_is_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        ensemble.main([str(tmp_path / "missing.ckpt"), "--seeds", "0"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("benchmarks.ensemble:") and "\n" not in err
    with pytest.raises(SystemExit):  # overrides after the options are overrides, not an error
        ensemble.main([str(tmp_path / "missing.ckpt"), "--name", "x", "split=valid"])
    assert capsys.readouterr().err.startswith("benchmarks.ensemble:")
    with pytest.raises(SystemExit):
        ensemble.main([str(tmp_path / "missing.ckpt"), "--members", "1"])
    assert "at least 2" in capsys.readouterr().err
