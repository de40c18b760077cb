"""The quality benchmark (benchmarks/quality.py) and its external data (benchmarks/external_data.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import quality as q
from benchmarks.external_data import write_well_hdf5
from walrus import metrics
from walrus.bcs import BoundaryType
from walrus.data.stats import compute_stats
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import WellFile

ALL_WINDOWS = ["1", "2-10", "11-30", "31-60", "61+"]
# Our side as a seconds-long run: tiny model, tiny batches, one validation batch.
TINY_OURS = [
    "model=tiny",
    "data.batch_size=2",
    "data.max_val_windows=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
]
TINY_FNO = ["--fno-modes", "4", "--fno-hidden", "8", "--fno-layers", "2"]


@pytest.fixture(scope="module")
def gs_root(tmp_path_factory) -> Path:
    """Built-in Gray-Scott, 16x16, 66 frames: the rollout (62 steps) reaches every window."""
    from walrus.data.synthetic import generate

    root = tmp_path_factory.mktemp("quality")
    generate("gray_scott_2d", root, n_traj=[2, 1, 1], resolution=16, steps=66, progress=False)
    return root


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory) -> Path:
    """A Well dataset written by external_data's h5py writer: random fields, 12 frames."""
    out = tmp_path_factory.mktemp("ext") / "random_fields"
    rng = np.random.default_rng(0)
    for split, n in (("train", 2), ("valid", 1), ("test", 1)):
        fields = {k: rng.standard_normal((n, 12, 16, 16)).astype(np.float32) for k in "AB"}
        write_well_hdf5(out / "data" / split / "f.hdf5", fields, np.arange(12.0), {"F": 0.02})
    return out


class ZeroDelta(nn.Module):
    """Predicts a zero normalised delta: with RMS normalisation, the last frame again."""

    def forward(self, x, fields, bcs, *, jitter_seed=None):  # noqa: ANN001
        return torch.zeros_like(x[:, -1:])  # (B, 1, C, *S)


def test_persistence_scores_equal_the_metric_computed_directly(gs_root):
    ref = q.DatasetRef(gs_root, "gray_scott_2d")
    zero = q.Forecaster(ZeroDelta(), q.RMSNormalizer())
    res = q.evaluate(ref, {"zero": zero}, n_steps_input=4, batch_size=5)
    assert res["windows"] == ALL_WINDOWS
    assert res["rollout_steps"] == 62 and res["test_trajectories"] == 1

    traj = WellDataset(gs_root, "gray_scott_2d", "test", 4, 0).trajectory(0)
    last = traj.input_fields[:, -1]  # (1, C, H, W)
    per_step = torch.cat(
        [metrics.vrmse(last, traj.output_fields[:, k]) for k in range(62)]
    )  # (62, C)
    direct = metrics.window_means(per_step)
    persistence = res["models"]["persistence"]["rollout"]
    for c, name in enumerate(res["fields"]):
        for w in ALL_WINDOWS:
            assert persistence["per_field"][name][w] == pytest.approx(float(direct[w][c]), rel=1e-6)
    assert persistence["mean"]["61+"] == pytest.approx(float(direct["61+"].mean()), rel=1e-6)

    windows_ds = WellDataset(gs_root, "gray_scott_2d", "test", 4, 1)
    one = torch.stack(
        [
            metrics.vrmse(windows_ds[i].input_fields[:, -1], windows_ds[i].output_fields[:, 0])[0]
            for i in range(len(windows_ds))
        ]
    ).mean(0)  # (C,)
    got = res["models"]["persistence"]["one_step"]["per_field"]
    assert [got[n] for n in res["fields"]] == pytest.approx(one.tolist(), rel=1e-6)
    # A model that repeats the last frame goes through the rollout path and scores the same.
    assert res["models"]["zero"]["rollout"]["mean"] == pytest.approx(persistence["mean"], rel=1e-6)
    assert res["models"]["zero"]["one_step"]["mean"] == pytest.approx(
        res["models"]["persistence"]["one_step"]["mean"], rel=1e-6
    )


def test_cpu_budget_callback_stops_training(gs_root, tmp_path):
    ref = q.DatasetRef(gs_root, "gray_scott_2d")
    cfg = q.ours_config(ref, tmp_path, 50, TINY_OURS)
    objects, budget, _ = q._fit_ours(cfg, 1e-6)
    assert objects["trainer"].global_step == 1  # stopped after its first step, not at 50
    assert budget.steps == 1 and budget.used > 0 and len(budget.step_cpu) == 1


def test_steps_budget_trains_exactly_that_many_steps(gs_root, tmp_path):
    trained, cfg, vocab = q.train_ours(
        q.DatasetRef(gs_root, "gray_scott_2d"), q.Budget("steps", 3), tmp_path, TINY_OURS
    )
    assert trained.info["steps"] == 3 and trained.info["cpu_s"] > 0
    assert int(cfg.trainer.max_steps) == 3 and "A" in vocab
    assert not trained.forecaster.model.training


def test_cpu_budget_planning():
    assert q.cpu_per_step([5.0, 6.0, 8.0, 10.0, 12.0]) == pytest.approx(2.0)  # skips 2 warm-up
    assert q.steps_for_budget(10.0, 3.0) == 4
    with pytest.raises(q.BenchmarkError, match="probe-steps"):
        q.cpu_per_step([1.0, 2.0])
    with pytest.raises(q.BenchmarkError, match="positive"):
        q.Budget("steps", 0)


def test_main_writes_json_for_every_system_model_and_window(gs_root, ext_dir, tmp_path, capsys):
    fno = q.fno_available()
    argv = [
        "--systems=gray_scott_2d",
        f"--data-root={gs_root}",
        f"--dataset={ext_dir}",
        "--steps=2",
        f"--work-dir={tmp_path / 'work'}",
        f"--results-dir={tmp_path}",
        *[f"--ours-override={o}" for o in TINY_OURS],
        *(TINY_FNO if fno else ["--no-fno"]),
    ]
    q.main(argv)
    data = json.loads((tmp_path / "quality.json").read_text())
    models = ["ours", "fno", "persistence"] if fno else ["ours", "persistence"]
    assert data["models"] == models and data["windows"] == ALL_WINDOWS
    assert len(data["loadavg"]["before"]) == 3 and data["torch_threads"] >= 1
    assert data["versions"]["torch"] == torch.__version__ and data["wall_s"] > 0
    runs = {r["system"]: r for r in data["runs"]}
    assert set(runs) == {"gray_scott_2d", "random_fields"}
    assert runs["gray_scott_2d"]["windows"] == ALL_WINDOWS
    assert runs["random_fields"]["windows"] == ["1", "2-10"]  # 12 frames: 8 rollout steps
    for run in runs.values():
        assert set(run["models"]) == set(models)
        for m in models:
            res = run["models"][m]
            assert set(res["rollout"]["mean"]) == set(run["windows"])
            assert set(res["rollout"]["per_field"]) == {"A", "B"}
            assert isinstance(res["one_step"]["mean"], float)
            if m != "persistence":
                assert res["train"]["steps"] == 2 and res["train"]["cpu_s"] > 0
    table = capsys.readouterr().out
    assert "random_fields" in table and "61+" in table and "persistence" in table
    assert ("ours/fno" in table) == fno


def test_missing_neuraloperator_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "neuralop", None)
    monkeypatch.setitem(sys.modules, "neuralop.models", None)
    with pytest.raises(SystemExit) as e:
        q.main(["--steps=1", "--systems=none", f"--results-dir={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "neuraloperator" in err and "pip install" in err


def test_table_has_a_ratio_row_when_both_models_ran():
    def res(v):
        return {"one_step": {"mean": v}, "rollout": {"mean": {"1": v, "2-10": 2 * v}}}

    run = {
        "budget": {"label": "5 steps"},
        "system": "s",
        "fields": ["a"],
        "windows": ["1", "2-10"],
        "models": {"ours": res(1.0), "fno": res(4.0), "persistence": res(2.0)},
    }
    rows = {r["model"]: r for r in q.table_rows([run])}
    assert rows["ours/fno"]["one-step"] == 0.25 and rows["ours/fno"]["2-10"] == 0.25
    assert rows["persistence"]["2-10"] == 4.0


def test_fno_trains_on_our_windows_and_rolls_out(gs_root):
    pytest.importorskip("neuralop")
    ref = q.DatasetRef(gs_root, "gray_scott_2d")
    opts = q.FNOOptions(modes=4, hidden=8, layers=2)
    trained = q.train_fno(ref, q.Budget("steps", 3), n_steps_input=4, batch_size=2, options=opts)
    assert trained.info["steps"] == 3 and np.isfinite(trained.info["final_loss"])
    batch = WellDataset(gs_root, "gray_scott_2d", "test", 4, 0).trajectory(0)
    preds = list(trained.forecaster.rollout(batch, 5))
    assert len(preds) == 5 and preds[0].shape == batch.input_fields[:, -1].shape
    assert all(torch.isfinite(p).all() for p in preds)

    net3d = q.FNOForecaster(2, 1, (8, 8, 8), q.FNOOptions(modes_3d=2, hidden_3d=4, layers=1))
    assert net3d.fno.hidden_channels == 4 and tuple(net3d.fno.n_modes) == (2, 2, 2)
    assert net3d(torch.randn(3, 2, 1, 8, 8, 8), None, None).shape == (3, 1, 1, 8, 8, 8)

    timed = q.train_fno(
        ref, q.Budget("cpu_seconds", 0.2), n_steps_input=4, batch_size=2, options=opts
    )
    planned = timed.info["probe"]["planned_steps"]
    assert 1 <= timed.info["steps"] <= planned
    assert timed.info["steps"] == planned or timed.info["cpu_s"] >= 0.2


def test_external_writer_files_load_with_our_reader_and_stats(ext_dir):
    wf = WellFile(ext_dir / "data" / "train" / "f.hdf5")
    assert wf.field_names == ["A", "B"] and wf.spatial_shape == (16, 16)
    assert wf.n_trajectories == 2 and wf.n_time == 12 and wf.params == {"F": pytest.approx(0.02)}
    periodic = int(BoundaryType.PERIODIC)
    assert wf.bcs.tolist() == [[periodic, periodic], [periodic, periodic]]
    ds = WellDataset(ext_dir.parent, ext_dir.name, "train", 4, 1)
    item = ds[len(ds) - 1]  # last window of trajectory 1: frames 7..11
    with h5py.File(wf.path) as f:
        a = f["t0_fields/A"][1, 7:11]
    np.testing.assert_array_equal(item.input_fields[0, :, 0].numpy(), a)
    stats = compute_stats(ext_dir)
    with h5py.File(wf.path) as f:
        assert stats["mean"]["B"] == pytest.approx(float(f["t0_fields/B"][()].mean()), abs=1e-6)


@pytest.mark.slow
def test_external_data_simulates_with_py_pde(tmp_path):
    pytest.importorskip("pde")
    from benchmarks.external_data import NAME, generate

    root = generate(tmp_path, n_traj=(2, 1, 1), resolution=32, frames=6, log=lambda _: None)
    assert root == tmp_path / NAME and (root / "stats.yaml").is_file()
    ds = WellDataset(tmp_path, NAME, "test", 4, 0)
    frames = ds.trajectory(0).output_fields
    assert torch.isfinite(frames).all() and frames[:, :, 1].std() > 1e-3


def test_bad_override_is_a_one_line_error_naming_it(tmp_path):
    ref = q.DatasetRef(tmp_path, "x")
    with pytest.raises(q.BenchmarkError, match=r"--ours-override .*model=nonexistent.*model/"):
        q.ours_config(ref, tmp_path, 5, ["model=nonexistent"])
    with pytest.raises(q.BenchmarkError, match="no data/train/valid/test"):
        q.external_dataset(tmp_path)


def test_readme_table_rows_come_from_the_json_with_ratios():
    from benchmarks.quality_table import rows

    def model(one, roll, steps=None):
        out = {"one_step": {"mean": one}, "rollout": {"mean": dict(zip(["1", "2-10"], roll))}}
        if steps:
            out["train"] = {"steps": steps, "cpu_s": 12.3}
        return out

    data = {
        "runs": [
            {
                "dataset": "/d/gs",
                "budget": {"label": "10 steps"},
                "windows": ["1", "2-10"],
                "models": {
                    "ours": model(0.2, [0.1, 0.5], 10),
                    "fno": model(0.4, [0.2, 0.25], 10),
                    "persistence": model(1.0, [1.0, 2.0]),
                },
            }
        ]
    }
    got = rows(data)
    assert [r[2] for r in got] == ["ours", "fno", "persistence", "**ours / fno**"]
    assert got[0][3] == "10 / 12" and got[0][4:] == ["0.2", "0.1", "0.5"]
    assert got[-1][4:] == ["0.5", "0.5", "2"]


def test_fixed_delta_unit_keeps_the_first_windows_unit():
    from benchmarks.delta_cap import FixedDeltaUnit
    from walrus.data.normalization import RMSNormalizer

    torch.manual_seed(0)
    a, b = torch.randn(1, 4, 2, 8, 8), 3.0 * torch.randn(1, 4, 2, 8, 8)
    fixed = FixedDeltaUnit(RMSNormalizer())
    first = fixed.fit(a)
    second = fixed.fit(b)
    torch.testing.assert_close(second.delta_scale, first.delta_scale)
    torch.testing.assert_close(second.scale, RMSNormalizer().fit(b).scale)  # state refitted


def test_benchmarks_is_a_package_on_the_test_path():
    import benchmarks

    # a folder without __init__.py imports as a namespace package, whose __file__ is None
    assert benchmarks.__file__ is not None and benchmarks.__file__.endswith("__init__.py")
