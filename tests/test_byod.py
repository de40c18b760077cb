"""The data guide's "bring your own data" example runs as written, and training on its files works."""

from __future__ import annotations

import logging
import re

import h5py

from tests.conftest import REPO, tiny_train_overrides
from walrus.training.train import train

GUIDE = REPO / "docs" / "guide" / "data.md"


def _guide_example() -> str:
    text = GUIDE.read_text()
    section = text.split("## Train on your own data", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python example under 'Train on your own data'"
    return match.group(1)


def test_guide_example_writes_a_dataset_that_trains(compose_cfg, tmp_path, monkeypatch, caplog):
    code = _guide_example()
    assert "write_well_file" in code and len(code.splitlines()) <= 20
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(GUIDE), "exec"), {})
    root = tmp_path / "DATA"
    with h5py.File(root / "my_solver_runs/data/train/train.hdf5") as f:
        assert f.attrs["n_spatial_dims"] == 2 and f.attrs["n_trajectories"] == 4
        assert list(f["dimensions"].attrs["spatial_dims"]) == ["x", "y"]
        for group in ("t0_fields", "t1_fields", "t2_fields"):
            assert "field_names" in f[group].attrs, group  # even the empty ones

    caplog.set_level(logging.INFO)
    overrides = [
        *tiny_train_overrides(root, tmp_path / "run"),
        "data.datasets=[my_solver_runs]",
        "trainer.limit_train_batches=1",  # one step, then the validation
    ]
    metrics, _ = train(compose_cfg("train", overrides))
    assert "val/vrmse/my_solver_runs/u" in metrics
    # depth is constant: out of the means and the per-field metrics, named once in the log
    assert "val/vrmse/my_solver_runs/depth" not in metrics
    named = [r for r in caplog.records if "constant in space" in r.getMessage()]
    assert len(named) == 1 and "my_solver_runs field(s) depth" in named[0].getMessage()
