"""The training benchmarks: harness, The Well's baselines, quality CLI, model sweep, docs tables, and
the external data (benchmarks/external_data.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import baselines as bl
from benchmarks import candidates as qc
from benchmarks import harness as h
from benchmarks import model_sweep as sweep
from benchmarks import quality as q
from benchmarks import quality_table as qt
from benchmarks import record
from benchmarks.external_data import write_well_hdf5
from walrus import metrics
from walrus.bcs import BoundaryType
from walrus.data.normalization import RMSNormalizer
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
# Two candidates per model, every baseline tiny (16x16 grids: two UNetConvNext stages).
TINY_CANDIDATES = """
ours:
  common: []
  candidates:
    slow: [optimizer.lr=1e-5]
    fast: [optimizer.lr=1e-2]
fno:
  common: {modes: 4, augment: d4, noise: 0.1}
  candidates:
    w4: {width: 4}
    w8: {width: 8}
unet_convnext:
  common: {stages: 2, noise: 0.1}
  candidates:
    w4: {width: 4}
    w4_d4: {width: 4, augment: d4}
"""


def require(module: str) -> None:
    """Skip without ``module`` (the ``baseline`` extra), or fail if WALRUS_REQUIRE_BASELINE=1."""
    try:
        __import__(module)
    except ImportError:
        message = f"{module} is not installed: run make baseline"
        if os.environ.get("WALRUS_REQUIRE_BASELINE") == "1":
            pytest.fail(f"{message} (WALRUS_REQUIRE_BASELINE=1)")
        pytest.skip(message)


def require_baselines() -> None:
    """``require`` for The Well's two baselines (their modules import neuralop and timm)."""
    require("neuralop")
    require("torch_harmonics")
    if importlib.util.find_spec("timm") is None:  # `import timm` itself needs torchvision
        require("timm")
    assert bl.baselines_available(), "the baseline packages import, The Well's models do not"


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
    for split, n in (("train", 2), ("valid", 2), ("test", 1)):
        fields = {k: rng.standard_normal((n, 12, 16, 16)).astype(np.float32) for k in "AB"}
        write_well_hdf5(out / "data" / split / "f.hdf5", fields, np.arange(12.0), {"F": 0.02})
    return out


class ZeroDelta(nn.Module):
    """Predicts a zero normalised delta: with RMS normalisation, the last frame again."""

    def forward(self, x, fields, bcs, *, jitter_seed=None):  # noqa: ANN001
        return torch.zeros_like(x[:, -1:])  # (B, 1, C, *S)


def strings(data) -> list[str]:  # noqa: ANN001
    """Every string (keys included) in a JSON value."""
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in [k, *strings(v)]]
    if isinstance(data, list):
        return [s for v in data for s in strings(v)]
    return [data] if isinstance(data, str) else []


def test_persistence_scores_equal_the_metrics_computed_directly(gs_root):
    ref = h.DatasetRef(gs_root, "gray_scott_2d")
    zero = h.Forecaster(ZeroDelta(), RMSNormalizer())
    res = h.evaluate(ref, {"zero": zero}, n_steps_input=4, batch_size=5)
    assert res["windows"] == ALL_WINDOWS and res["split"] == "test"
    assert res["rollout_steps"] == 62 and res["trajectories"] == 1

    traj = WellDataset(gs_root, "gray_scott_2d", "test", 4, 0).trajectory(0)
    last = traj.input_fields[:, -1]  # (1, C, H, W)
    truth = traj.output_fields[0]  # (62, C, H, W)
    per_step = metrics.vrmse(last.expand_as(truth), truth)  # (62, C)
    direct = metrics.window_means(per_step)
    persistence = res["models"]["persistence"]["rollout"]
    for c, name in enumerate(res["fields"]):
        for w in ALL_WINDOWS:
            assert persistence["per_field"][name][w] == pytest.approx(float(direct[w][c]), rel=1e-6)
    assert persistence["mean"]["61+"] == pytest.approx(float(direct["61+"].mean()), rel=1e-6)
    # fidelity: the amplitude ratio of the last frame against each true frame, mean over fields
    # (undefined where a field is flat: left out of the means)
    amp = metrics.amplitude_ratio(last.expand_as(truth), truth).nanmean(dim=1)  # (62,)
    got = res["models"]["persistence"]["fidelity"]["amplitude_ratio"]
    assert got["2-10"] == pytest.approx(float(amp[1:10].nanmean()), rel=1e-6)
    # persistence does not move: its change correlation is undefined
    assert set(res["models"]["persistence"]["fidelity"]["change_correlation"].values()) == {None}

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
    zero_res = res["models"]["zero"]
    assert zero_res["rollout"]["mean"] == pytest.approx(persistence["mean"], rel=1e-6)
    assert zero_res["fidelity"]["amplitude_ratio"]["11-30"] == pytest.approx(
        res["models"]["persistence"]["fidelity"]["amplitude_ratio"]["11-30"], rel=1e-6
    )


def test_evaluate_reads_the_split_it_is_given(ext_dir):
    ref = h.external_dataset(ext_dir)
    zero = {"zero": h.Forecaster(ZeroDelta(), RMSNormalizer())}
    valid = h.evaluate(ref, zero, split="valid", n_steps_input=4)
    test = h.evaluate(ref, zero, split="test", n_steps_input=4)
    assert (valid["trajectories"], test["trajectories"]) == (2, 1)
    assert valid["models"]["zero"]["one_step"]["mean"] != test["models"]["zero"]["one_step"]["mean"]
    with pytest.raises(h.BenchmarkError, match="'valid' or 'test'"):
        h.evaluate(ref, zero, split="train", n_steps_input=4)


def test_cpu_budget_callback_stops_training(gs_root, tmp_path):
    ref = h.DatasetRef(gs_root, "gray_scott_2d")
    cfg = h.ours_config(ref, tmp_path, 50, TINY_OURS)
    objects, budget, _ = h._fit_ours(cfg, 1e-6)
    assert objects["trainer"].global_step == 1  # stopped after its first step, not at 50
    assert budget.steps == 1 and budget.used > 0 and len(budget.step_cpu) == 1


def test_cpu_budget_ends_the_learning_rate_schedule_not_the_step_limit(gs_root, tmp_path):
    ref = h.DatasetRef(gs_root, "gray_scott_2d")
    cfg = h.ours_config(ref, tmp_path, 100_000, [*TINY_OURS, "trainer.limit_val_batches=0"])
    objects, budget, _ = h._fit_ours(cfg, 1.0)
    trainer = objects["trainer"]
    assert 0 < trainer.global_step < 100_000 and budget.used >= 1.0  # the budget ended it
    assert budget.fraction() == 1.0
    peak = float(cfg.optimizer.lr)
    last_lr = trainer.optimizers[0].param_groups[0]["lr"]
    # at the floor (1 % of the peak), where a schedule over 100k steps would still be warming up
    assert last_lr == pytest.approx(0.01 * peak, rel=1e-6)
    assert h.CPUBudget(None).fraction() == 0.0 and h.CPUBudget(5.0).fraction() == 0.0


def test_steps_budget_trains_exactly_that_many_steps_with_the_seed(gs_root, tmp_path):
    trained, cfg, vocab = h.train_ours(
        h.DatasetRef(gs_root, "gray_scott_2d"), h.Budget("steps", 3), tmp_path, TINY_OURS, seed=7
    )
    assert trained.info["steps"] == 3 and trained.info["cpu_s"] > 0
    assert int(cfg.trainer.max_steps) == 3 and "A" in vocab and int(cfg.seed) == 7
    assert not trained.forecaster.model.training


def test_cpu_budget_planning():
    assert h.cpu_per_step([5.0, 6.0, 8.0, 10.0, 12.0]) == pytest.approx(2.0)  # skips 2 warm-up
    assert h.steps_for_budget(10.0, 3.0) == 4
    assert h.step_ceiling(10) == 15 and h.step_ceiling(1) == 2
    with pytest.raises(h.BenchmarkError, match="probe-steps"):
        h.cpu_per_step([1.0, 2.0])
    with pytest.raises(h.BenchmarkError, match="positive"):
        h.Budget("steps", 0)


def test_run_record_reads_dirty_flag_from_git_status(monkeypatch):
    answers = {"rev-parse": "abc123\n", "status": " M benchmarks/quality.py\n"}
    monkeypatch.setattr(record, "_git", lambda *args: answers[args[0]])
    assert record.run_record(["x"])["dirty"] is True
    answers["status"] = ""
    rec = record.run_record(["x"])
    assert rec["dirty"] is False and rec["commit"] == "abc123"
    monkeypatch.setattr(record, "_git", lambda *args: None)
    assert record.run_record([])["dirty"] is None


def test_paths_are_made_portable():
    inside = record.REPO / "data" / "gray_scott_pypde"
    assert record.portable_path(inside) == "data/gray_scott_pypde"
    assert record.portable_path("/elsewhere/runs/gs") == "gs"
    assert record.portable_path("relative/x") == "relative/x"
    got = record.portable(
        {"a": ["--data-root=/tmp/abc/data", "paths.x=/srv/y/z", "/opt/w"], "n": 3, "s": "a=b"}
    )
    assert got == {"a": ["--data-root=data", "paths.x=z", "w"], "n": 3, "s": "a=b"}


def test_spread_and_aggregate_over_seeds():
    assert record.spread([1.0, 2.0, 3.0]) == {
        "mean": 2.0,
        "std": 1.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
    }
    assert record.spread([0.5])["std"] == 0.0
    assert record.spread([1.0, None])["mean"] is None  # a diverged seed is not averaged away

    def summary(one, roll, amp):
        return {
            "one_step": {"mean": one},
            "rollout": {"mean": {"1": roll, "2-10": 2 * roll}},
            "fidelity": {"amplitude_ratio": {"1": amp}, "change_correlation": {"1": None}},
        }

    agg = q.aggregate([summary(0.1, 1.0, 0.9), summary(0.3, 3.0, 1.1)])
    assert agg["one_step"]["mean"] == pytest.approx(0.2)
    assert agg["one_step"]["std"] == pytest.approx(np.std([0.1, 0.3], ddof=1))
    assert agg["rollout"]["2-10"] == {
        "mean": 4.0,
        "std": pytest.approx(2.828427),
        "min": 2.0,
        "max": 6.0,
        "n": 2,
    }
    assert agg["fidelity"]["amplitude_ratio"]["1"]["mean"] == pytest.approx(1.0)
    assert agg["fidelity"]["change_correlation"]["1"]["mean"] is None


def test_choice_on_validation_picks_the_lower_mean_score():
    # width 64 wins one seed, but 128 has the lower mean over seeds
    scores = {"fno64": [0.30, 0.90], "fno128": [0.40, 0.50]}
    assert q.choose(scores) == "fno128"
    assert q.choose({"a": [1.0], "b": [1.0]}) == "a"
    head = {"rollout": {"per_step_mean": [1.0, 2.0, 3.0] + [100.0] * 40}}
    assert h.selection_score(head) == pytest.approx((6 + 27 * 100) / 30)  # steps 1..30 only
    assert h.selection_score({"rollout": {"per_step_mean": [1.0, None]}}) == float("inf")


def test_candidates_parse_and_reject_interpolation():
    got = q.parse_candidates("a=model.dim=192 optimizer.lr=5e-4; b=")
    assert got == {"a": ["model.dim=192", "optimizer.lr=5e-4"], "b": []}
    for bad in (
        "a=x=${oc.env:HOME}",
        "a=+callbacks.c._target_=os.system",
        "noequals",
        "a=x=1;a=y=2",
    ):
        with pytest.raises(Exception, match="override|NAME"):
            q.parse_candidates(bad)


def test_candidate_file_gives_every_model_the_same_number(tmp_path):
    shipped = qc.load_candidates(qc.CANDIDATES, bl.KINDS)
    counts = shipped.counts()
    assert set(counts) == {"ours", *bl.KINDS} and len(set(counts.values())) == 1
    assert 1 < counts["ours"] <= qc.MAX_CANDIDATES
    for kind, cands in shipped.baselines.items():
        # the levers ours uses, and more than one width
        assert {o.augment for o in cands.values()} == {"d4"}, kind
        assert {o.noise for o in cands.values()} == {0.1}, kind
        assert len({o.width for o in cands.values()}) == 2, kind
        for attr in ("width", "width_3d"):  # no two candidates alike, in 2D or in 3D
            assert len({(getattr(o, attr), o.lr) for o in cands.values()}) == len(cands), kind
    assert len({tuple(o) for o in shipped.ours.values()}) == counts["ours"]
    path = tmp_path / "c.yaml"
    path.write_text(TINY_CANDIDATES)
    tiny = qc.load_candidates(path, ["unet_convnext"])
    assert tiny.counts() == {"ours": 2, "unet_convnext": 2}
    assert tiny.baselines["unet_convnext"]["w4_d4"] == bl.BaselineOptions(
        kind="unet_convnext", stages=2, noise=0.1, width=4, augment="d4"
    )
    bad = {
        "ours:\n  candidates: {a: [x=1]}\nfno:\n  candidates: {a: {}, b: {}}\n": "same number",
        "ours:\n  candidates: {a: [x=1]}\nfno:\n  candidates: {a: {depth: 3}}\n": "fno.a",
        "ours:\n  candidates: {a: [x=1]}\nfno:\n  candidates: {a: {width: 2.5}}\n": "integer",
        "ours:\n  candidates: {a: ['x=${oc.env:HOME}']}\n": "interpolation",
        "ours:\n  candidates: {a: [x=1]}\nmlp: {}\n": "unknown model",
        "ours:\n  candidates: {a: [x=1]}\n": "'fno' must be a mapping",
    }
    for text, message in bad.items():
        path.write_text(text)
        with pytest.raises(h.BenchmarkError, match=message) as e:
            qc.load_candidates(path, ["fno"])
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_baseline_input_noise_matches_ours_units():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 2, 8, 8)
    x[:, :, 1] = 3.0  # a field that does not change in the window gets no noise
    scale = RMSNormalizer().fit(x).scale  # (B, 1, C, 1, 1)
    for units in ("input_rms", "input_std", "delta_rms"):
        opts = bl.BaselineOptions(noise=0.5, noise_units=units)
        torch.manual_seed(1)
        got = bl.input_noise(x, scale, opts)
        torch.manual_seed(1)
        draw = torch.randn_like(x)
        d = (x[:, 1:] - x[:, :-1]).square().mean(dim=(1, 3, 4), keepdim=True).sqrt()
        spread = x.std(dim=(1, 3, 4), keepdim=True, correction=0)
        unit = {"input_rms": scale, "input_std": spread, "delta_rms": d}[units]
        torch.testing.assert_close(got[:, :, 0], (0.5 * unit * draw)[:, :, 0])
        assert (got[:, :, 1] == 0).all()
    with pytest.raises(h.BenchmarkError, match="noise_units"):
        bl.BaselineOptions(noise_units="state")
    with pytest.raises(h.BenchmarkError, match="kind"):
        bl.BaselineOptions(kind="resnet")


@pytest.mark.parametrize(
    "well", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ours", "well_baselines"]
)
def test_main_end_to_end_seeds_choice_jitter_and_record(
    ext_dir, tmp_path, capsys, monkeypatch, well
):
    calls = {"git": 0, "now": 0}
    real_now = record._now

    def fake_git(*args):
        calls["git"] += 1
        return {"rev-parse": f"commit{calls['git']}\n", "status": ""}[args[0]]

    def fake_now():
        calls["now"] += 1
        return real_now().replace(year=2000 + calls["now"])

    monkeypatch.setattr(record, "_git", fake_git)
    monkeypatch.setattr(record, "_now", fake_now)
    if well:
        require_baselines()
    cands = tmp_path / "candidates.yaml"
    cands.write_text(TINY_CANDIDATES)
    argv = [
        "--systems=none",
        f"--dataset={ext_dir}",
        "--steps=2",
        "--seeds=0,1",
        f"--work-dir={tmp_path / 'work'}",
        f"--results-dir={tmp_path}",
        *[f"--ours-override={o}" for o in TINY_OURS],
        f"--candidates={cands}",
        *([] if well else ["--baselines=none"]),
    ]
    q.main(argv)
    text = (tmp_path / "quality.json").read_text()
    data = json.loads(text)
    # read once, when the run started: a re-read at the end would say commit3 / year 2002
    rec = data["record"]
    assert rec["commit"] == "commit1" and rec["dirty"] is False and rec["started"][:4] == "2001"
    assert calls == {"git": 2, "now": 1}
    assert rec["argv"][1] == "--dataset=random_fields" and len(rec["loadavg_after"]) == 3
    # no absolute path anywhere in the JSON (data root, work dir, checkpoints)
    assert str(tmp_path) not in text
    assert not [s for s in strings(data) if s.startswith("/")]

    run = data["runs"][0]
    baselines = list(bl.KINDS) if well else []
    models = ["ours", "ours+jitter", *baselines, "persistence"]
    assert list(run["models"]) == models and run["split"] == "test" and run["seeds"] == [0, 1]
    assert run["windows"] == ["1", "2-10"] and run["dataset"] == "random_fields"
    ours = run["models"]["ours"]
    assert [s["seed"] for s in ours["per_seed"]] == [0, 1]
    assert [s["train"]["seed"] for s in ours["per_seed"]] == [0, 1]
    values = [s["rollout"]["mean"]["2-10"] for s in ours["per_seed"]]
    assert ours["stats"]["rollout"]["2-10"]["mean"] == pytest.approx(np.mean(values))
    assert ours["stats"]["rollout"]["2-10"]["max"] == max(values)
    assert len(run["models"]["persistence"]["per_seed"]) == 1
    picked = run["selection"]["ours"]
    means = {k: np.mean(v) for k, v in picked["valid_scores"].items()}
    assert set(means) == {"slow", "fast"} and picked["chosen"] == min(means, key=means.get)
    lr = f"optimizer.lr={'1e-5' if picked['chosen'] == 'slow' else '1e-2'}"
    assert all(s["train"]["overrides"][-1] == lr for s in ours["per_seed"])
    assert set(ours["stats"]["fidelity"]) == set(metrics.FIDELITY)
    # every model chose among the same number of candidates, each scored on valid for every seed
    for model, names in {"ours": ["slow", "fast"], "fno": ["w4", "w8"]}.items():
        if model not in run["models"]:
            continue
        sel = run["selection"][model]
        assert list(sel["valid_scores"]) == names and list(sel["candidates"]) == names
        assert all(len(v) == 2 and all(np.isfinite(v)) for v in sel["valid_scores"].values())
        means = {k: np.mean(v) for k, v in sel["valid_scores"].items()}
        assert sel["chosen"] == min(means, key=means.get)
    for kind in baselines:
        chosen = run["selection"][kind]["chosen"]
        for s in run["models"][kind]["per_seed"]:
            assert s["train"]["candidate"] == chosen and s["train"]["steps"] == 2
            assert s["train"]["options"] == run["selection"][kind]["candidates"][chosen]
    table = capsys.readouterr().out
    assert "ours+jitter" in table and "ours/persistence" in table and "±" in table
    assert ("ours/fno" in table) == well and ("ours/unet_convnext" in table) == well
    # the docs renderer reads this file
    md = qt.markdown([tmp_path / "quality.json"])
    assert "**ours / persistence**" in md and " ± " in md


def test_missing_baseline_package_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    for name in ("neuralop", "neuralop.models", "the_well.benchmark.models.fno"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as e:
        q.main(["--steps=1", "--systems=none", f"--results-dir={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "neuraloperator" in err and "make baseline" in err


@pytest.mark.parametrize(
    "options",
    [
        bl.BaselineOptions(kind="fno", modes=4, width=8, noise=0.1, augment="d4"),
        bl.BaselineOptions(kind="unet_convnext", stages=2, width=4, noise=0.1, augment="d4"),
    ],
    ids=lambda o: o.kind,
)
def test_well_baseline_trains_on_our_windows_and_rolls_out(gs_root, options):
    require_baselines()
    classes = bl.well_model_classes()
    ref = h.DatasetRef(gs_root, "gray_scott_2d")
    trained = bl.train_baseline(
        ref, h.Budget("steps", 3), n_steps_input=4, batch_size=2, options=options
    )
    net = trained.forecaster.model
    # The Well's own class, built at the tiny size asked for
    assert type(net.net) is classes[options.kind] and type(net.net).__module__.startswith(
        "the_well"
    )
    assert trained.info["steps"] == 3 and np.isfinite(trained.info["final_loss"])
    assert trained.info["options"]["kind"] == options.kind
    assert trained.info["params"] == sum(p.numel() for p in net.parameters()) < 50_000
    batch = WellDataset(gs_root, "gray_scott_2d", "test", 4, 0).trajectory(0)
    preds = list(trained.forecaster.rollout(batch, 5))
    assert len(preds) == 5 and preds[0].shape == batch.input_fields[:, -1].shape
    assert all(torch.isfinite(p).all() for p in preds)
    # predicts the normalised delta, rolled out with walrus.rollout's default capped delta unit
    assert trained.forecaster.predict_delta and trained.forecaster.cap_delta_unit is None

    opts3d = dataclasses.replace(options, width_3d=4, modes_3d=2)
    net3d = bl.WellBaseline(2, 1, (8, 8, 8), opts3d)
    assert net3d(torch.randn(3, 2, 1, 8, 8, 8), None, None).shape == (3, 1, 1, 8, 8, 8)
    if options.kind == "unet_convnext":
        with pytest.raises(h.BenchmarkError, match="divisible by 4"):
            bl.WellBaseline(2, 1, (8, 10), options)
    else:
        timed = bl.train_baseline(
            ref, h.Budget("cpu_seconds", 0.2), n_steps_input=4, batch_size=2, options=options
        )
        planned = timed.info["probe"]["planned_steps"]
        assert timed.info["max_steps"] == h.step_ceiling(planned) > planned
        assert 1 <= timed.info["steps"] <= timed.info["max_steps"]
        assert timed.info["steps"] == timed.info["max_steps"] or timed.info["cpu_s"] >= 0.2


def fake_sweep_run(calls, fail_at=None):  # noqa: ANN001
    """A stand-in for training + validation: the score is the candidate's lr."""

    def run(ref, name, overrides, seed, budget, work, *rest):  # noqa: ANN001
        calls.append((name, seed))
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt  # the sweep is cut here
        lr = float(overrides[-1].split("=")[1])
        return {
            "candidate": name,
            "dataset": ref.name,
            "seed": seed,
            "overrides": list(overrides),
            "score": lr,
            "rollout": {"1": lr},
            "amplitude_ratio": {"11-30": 1.0},
            "change_correlation": {"11-30": 0.5},
            "params": 10,
            "processor_param_share": 0.5,
            "processor_flop_share": None,
        }

    return run


def test_sweep_writes_after_every_run_and_resumes(ext_dir, tmp_path, monkeypatch, capsys):
    cands = tmp_path / "cands.yaml"
    cands.write_text("slow: optimizer.lr=3e-1\nfast: [optimizer.lr=1e-3]\n")
    argv = [
        "--steps=1",
        "--systems=none",
        f"--dataset={ext_dir}",
        f"--candidates={cands}",
        "--seeds=0,1",
        f"--results-dir={tmp_path}",
    ]
    calls: list = []
    monkeypatch.setattr(sweep, "sweep_run", fake_sweep_run(calls, fail_at=3))
    with pytest.raises(KeyboardInterrupt):
        sweep.main(argv)
    out = tmp_path / "model_sweep.json"
    kept = json.loads(out.read_text())
    assert [(r["candidate"], r["seed"]) for r in kept["runs"]] == [("slow", 0), ("fast", 0)]
    assert kept["split"] == "valid" and kept["budget"]["label"] == "1 steps"

    with pytest.raises(SystemExit):  # an existing sweep is not overwritten without --resume
        sweep.main(argv)
    assert "--resume" in capsys.readouterr().err

    calls.clear()
    monkeypatch.setattr(sweep, "sweep_run", fake_sweep_run(calls))
    data = sweep.main([*argv, "--resume"])
    assert calls == [("slow", 1), ("fast", 1)]  # only what was missing
    assert len(data["runs"]) == 4 and len(data["records"]) == 2
    ranked = sweep.ranking(data["runs"])
    assert [r["candidate"] for r in ranked] == ["fast", "slow"]
    assert ranked[0]["val_vrmse_1-30"] == pytest.approx(1e-3) and ranked[0]["runs"] == 2
    assert str(tmp_path) not in out.read_text()

    with pytest.raises(SystemExit):  # same name, other overrides: not the same sweep
        sweep.main([*argv[:3], "--candidate=fast=optimizer.lr=1", *argv[4:], "--resume"])
    assert "had overrides" in capsys.readouterr().err


def test_docs_tables_are_replaced_between_markers(tmp_path):
    def stats(v):
        return {"mean": v, "std": v / 10, "min": v, "max": v, "n": 2}

    def model(v, train=True):
        per_seed = (
            [{"seed": s, "train": {"steps": 10, "cpu_s": 5.0}} for s in (0, 1)] if train else [{}]
        )
        return {
            "per_seed": per_seed,
            "stats": {"one_step": stats(v), "rollout": {"1": stats(v), "2-10": stats(2 * v)}},
        }

    quality = {
        "format": "quality/2",
        "runs": [
            {
                "dataset": "gs",
                "budget": {"label": "150 cpu-s"},
                "selection": {"fno": {"chosen": "fno128_noise0"}, "ours": {"chosen": "std"}},
                "models": {
                    "ours": model(0.2),
                    "ours+jitter": model(0.1),
                    "fno": model(0.4),
                    "persistence": model(1.0, False),
                },
            }
        ],
    }
    (tmp_path / "quality.json").write_text(json.dumps(quality))
    runs = [
        {
            "candidate": c,
            "dataset": "gs",
            "score": s,
            "rollout": {"1": s},
            "amplitude_ratio": {},
            "change_correlation": {},
            "params": 5,
            "processor_param_share": 0.7,
            "processor_flop_share": None,
        }
        for c, s in (("b", 0.3), ("a", 0.1))
    ]
    (tmp_path / "sweep.json").write_text(
        json.dumps({"budget": {"label": "90 cpu-s"}, "split": "valid", "runs": runs})
    )
    results = tmp_path / "results.md"
    results.write_text(
        "intro\n<!-- quality-table:start -->\nold numbers\n<!-- quality-table:end -->\nend\n"
    )
    studies = tmp_path / "studies.md"
    studies.write_text("middle\n<!-- sweep-table:start -->\n<!-- sweep-table:end -->\nend\n")
    qt.write_pages([tmp_path / "quality.json"], tmp_path / "sweep.json", results, studies)
    text = results.read_text()
    assert "old numbers" not in text and text.startswith("intro\n") and text.endswith("end\n")
    lines = text.splitlines()
    ours = next(ln for ln in lines if "| ours (std) |" in ln)  # the candidate chosen on valid
    assert "| 10 / 5 | 0.2 ± 0.02 | 0.2 ± 0.02 | 0.4 ± 0.04 | – | – | – |" in ours
    assert "| 150 cpu-s | gs | fno, width 128, noise 0 |" in text
    assert "| **ours / fno** |  | 0.5 | 0.5 | 0.5 | – |" in text
    assert "| **ours / persistence** |  | 0.2 | 0.2 | 0.2 | – |" in text
    assert "| **ours+jitter / fno** |  | 0.25 | 0.25 | 0.25 | – |" in text
    assert "| **ours+jitter / persistence** |  | 0.1 | 0.1 | 0.1 | – |" in text
    text = studies.read_text()
    lines = text.splitlines()
    sweep_rows = [ln for ln in lines if ln.startswith("| a |") or ln.startswith("| b |")]
    assert [r[:5] for r in sweep_rows] == ["| a |", "| b |"]  # ranked by validation score
    assert text.index("middle") < text.index("| a |") < text.rindex("\nend\n")
    assert "gs: budget 90 cpu-s per run, scored on the valid split." in text
    # several sweep files: one table each, in the order given
    other = json.loads((tmp_path / "sweep.json").read_text())
    other["runs"] = [{**r, "dataset": "ns"} for r in other["runs"]]
    (tmp_path / "sweep_ns.json").write_text(json.dumps(other))
    qt.write_pages(
        [tmp_path / "quality.json"],
        [tmp_path / "sweep_ns.json", tmp_path / "sweep.json"],
        results,
        studies,
    )
    text = studies.read_text()
    assert text.index("ns: budget 90 cpu-s") < text.index("gs: budget 90 cpu-s")
    assert text.count("| a |") == 2

    results.write_text("no markers\n")
    with pytest.raises(ValueError, match="results.md: needs exactly one <!-- quality-table:start"):
        qt.write_pages([tmp_path / "quality.json"], None, results, studies)


def test_table_names_the_cpu_each_file_was_measured_on(tmp_path):
    from benchmarks.common import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: avx2\n")
    assert cpu_model(info) == "AMD EPYC 7B13"
    env = {"cpu_model": "AMD EPYC 7B13", "cpu_capability": "AVX2", "threads": 1}
    assert qt.machine({"environment": env}) == "AMD EPYC 7B13 AVX2, 1 thread(s)"
    assert qt.machine({"environment": {"cpu_capability": "AVX512"}}) == "AVX512"
    assert qt.machine({}) == "CPU not recorded"
    (tmp_path / "quality_a.json").write_text(json.dumps({"runs": [], "environment": env}))
    (tmp_path / "quality_b.json").write_text(json.dumps({"runs": []}))
    last = qt.markdown(sorted(tmp_path.glob("quality_*.json"))).splitlines()[-1]
    assert last.endswith(
        "`quality_a.json`: AMD EPYC 7B13 AVX2, 1 thread(s); `quality_b.json`: CPU not recorded."
    )


def test_table_rows_of_an_old_single_seed_file():
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
    got = qt.rows(data)
    assert [r[2] for r in got] == ["ours", "fno", "persistence", "**ours / fno**"]
    assert got[0][3] == "10 / 12" and got[0][4:] == ["0.2", "0.1", "0.5", "–", "–", "–"]
    assert got[-1][4:] == ["0.5", "0.5", "2", "–", "–", "–"]


def test_external_writer_files_load_with_our_reader_and_stats(ext_dir):
    wf = WellFile(ext_dir / "data" / "train" / "f.hdf5")
    assert wf.field_names == ["A", "B"] and wf.spatial_shape == (16, 16)
    assert wf.n_trajectories == 2 and wf.n_time == 12 and wf.params == {"F": pytest.approx(0.02)}
    periodic = int(BoundaryType.PERIODIC)
    assert wf.bcs.tolist() == [[periodic, periodic], [periodic, periodic]]
    ds = WellDataset(ext_dir.parent, ext_dir.name, "train", 4, 1)
    item = ds[len(ds) - 1]  # last window of trajectory 1: frames 7..11
    with h5py.File(wf.path) as fh:
        a = fh["t0_fields/A"][1, 7:11]
    np.testing.assert_array_equal(item.input_fields[0, :, 0].numpy(), a)
    stats = compute_stats(ext_dir)
    with h5py.File(wf.path) as fh:
        assert stats["mean"]["B"] == pytest.approx(float(fh["t0_fields/B"][()].mean()), abs=1e-6)


@pytest.mark.slow
def test_external_data_simulates_with_py_pde(tmp_path):
    require("pde")
    from benchmarks.external_data import N_TRAJ, NAME, generate

    assert N_TRAJ[2] >= 8  # the default gives the benchmark >= 8 test trajectories
    root = generate(tmp_path, n_traj=(2, 1, 1), resolution=32, frames=6, log=lambda _: None)
    assert root == tmp_path / NAME and (root / "stats.yaml").is_file()
    ds = WellDataset(tmp_path, NAME, "test", 4, 0)
    frames = ds.trajectory(0).output_fields
    assert torch.isfinite(frames).all() and frames[:, :, 1].std() > 1e-3


def test_bad_override_is_a_one_line_error_naming_it(tmp_path):
    ref = h.DatasetRef(tmp_path, "x")
    with pytest.raises(h.BenchmarkError, match=r"--ours-override .*model=nonexistent.*model/"):
        h.ours_config(ref, tmp_path, 5, ["model=nonexistent"])
    with pytest.raises(h.BenchmarkError, match="no data/train/valid/test"):
        h.external_dataset(tmp_path)


def test_fixed_delta_unit_keeps_the_first_windows_unit():
    from benchmarks.studies.delta_cap import FixedDeltaUnit

    torch.manual_seed(0)
    a, b = torch.randn(1, 4, 2, 8, 8), 3.0 * torch.randn(1, 4, 2, 8, 8)
    fixed = FixedDeltaUnit(RMSNormalizer())
    first = fixed.fit(a)
    second = fixed.fit(b)
    torch.testing.assert_close(second.delta_scale, first.delta_scale)
    torch.testing.assert_close(second.scale, RMSNormalizer().fit(b).scale)  # state refitted


def test_fixed_unit_forecaster_restarts_with_each_rollout(gs_root):
    from benchmarks.studies.delta_cap import FixedDeltaUnit, FixedUnitForecaster

    ds = WellDataset(gs_root, "gray_scott_2d", "train", 4, 0)
    a, b = ds.trajectory(0), ds.trajectory(1)
    fc = FixedUnitForecaster(ZeroDelta(), FixedDeltaUnit(RMSNormalizer()), cap_delta_unit=False)
    assert len(list(fc.rollout(a, 2))) == 2
    list(fc.rollout(b, 2))
    # the unit of b's own context window, not the one a's rollout fixed
    expected = RMSNormalizer().fit(b.input_fields).delta_scale
    torch.testing.assert_close(fc.normalizer.first.delta_scale, expected)
    assert not torch.equal(expected, RMSNormalizer().fit(a.input_fields).delta_scale)


def test_benchmark_files_stay_small():
    for path in Path(h.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 520, path.name


def test_benchmarks_is_a_package_on_the_test_path():
    import benchmarks

    # a folder without __init__.py imports as a namespace package, whose __file__ is None
    assert benchmarks.__file__ is not None and benchmarks.__file__.endswith("__init__.py")
