"""The quality protocol: versions, the pass rule, the rendered headline, run records that read
the CPU when a run starts, and the spatial-mean reference of the windowed tables."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import harness as h
from benchmarks import quality_protocol as qp
from benchmarks import quality_table as qt
from benchmarks import record
from benchmarks.external_data import write_well_hdf5
from benchmarks.studies import finetune_probe
from tests.conftest import REPO
from walrus.data.normalization import RMSNormalizer
from walrus.data.well_dataset import WellDataset

WINDOWS = list(qp.WINDOWS)


def model(per_seed: dict[int, float | list[float]]) -> dict:
    """A ``benchmarks.quality`` model entry: per seed one value for every window (or a list)."""
    seeds = []
    for seed, v in per_seed.items():
        values = v if isinstance(v, list) else [v] * len(WINDOWS)
        seeds.append({"seed": seed, "rollout": {"mean": dict(zip(WINDOWS, values))}})

    def stat(w: str) -> dict:
        vals = [s["rollout"]["mean"][w] for s in seeds]
        return record.spread(vals)

    stats = {"one_step": stat("1"), "rollout": {w: stat(w) for w in WINDOWS}}
    return {"per_seed": seeds, "stats": stats}


def cell(dataset: str, budget: int, ours: dict, fno: dict, unet: dict) -> dict:
    """One cell's JSON with ``ours+jitter``, two baselines and persistence."""
    run = {
        "system": dataset,
        "dataset": dataset,
        "budget": {"kind": "cpu_seconds", "value": budget, "label": f"{budget} cpu-s"},
        "selection": {"fno": {"chosen": "lr1e-3_d4"}, "unet_convnext": {"chosen": "lr3e-3"}},
        "spatial_mean": {"mean": {w: 0.9998 for w in WINDOWS}},
        "models": {
            "ours+jitter": model(ours),
            "fno": model(fno),
            "unet_convnext": model(unet),
            "persistence": model({0: 2.0}),
        },
    }
    return {"format": "quality/2", "record": {"cpu_model": "Test CPU"}, "runs": [run]}


def write_version(root: Path, n: int, commit: str, cells: dict[str, dict]) -> Path:
    path = root / f"quality_v{n}"
    path.mkdir(parents=True)
    rec = {"commit": commit, "dirty": False, "started": "2026-12-05T00:00:00+00:00"}
    rec["cpu_model"] = "Test CPU"
    (path / qp.MANIFEST).write_text(json.dumps({"version": n, "record": rec}))
    for name, data in cells.items():
        (path / f"{name}.json").write_text(json.dumps(data))
    return path


def test_verdict_takes_the_better_baseline_per_window_and_every_seed():
    # ours 0.8 of fno on the mean, but seed 2 at 0.96: fails on that seed alone
    run = cell(
        "gs",
        150,
        {0: 0.8, 1: 0.8, 2: 0.96},
        {0: 1.0, 1: 1.0, 2: 1.0},
        {0: 5.0, 1: 5.0, 2: 5.0},
    )["runs"][0]
    v = qp.verdict(run)
    assert v["windows"]["1"]["baseline"] == "fno"
    assert v["windows"]["1"]["ratio"] == pytest.approx(statistics.fmean([0.8, 0.8, 0.96]))
    assert v["windows"]["1"]["seed_ratios"] == pytest.approx([0.8, 0.8, 0.96])
    assert v["windows"]["1"]["ratio"] <= qp.MEAN_MAX and not v["pass"]
    # the better baseline changes by window: UNetConvNext early, the FNO late
    unet = {s: [0.5, 0.5, 9.0, 9.0, 9.0] for s in (0, 1, 2)}
    run = cell("gs", 150, {s: 0.4 for s in (0, 1, 2)}, {s: 1.0 for s in (0, 1, 2)}, unet)
    v = qp.verdict(run["runs"][0])
    assert [v["windows"][w]["baseline"] for w in WINDOWS] == ["unet_convnext"] * 2 + ["fno"] * 3
    assert v["windows"]["1"]["ratio"] == pytest.approx(0.8) and v["pass"]
    # 0.91 on the mean fails even with every seed under 0.95
    run = cell("gs", 150, {s: 0.91 for s in (0, 1, 2)}, {s: 1.0 for s in (0, 1, 2)}, unet)
    assert not qp.verdict(run["runs"][0])["windows"]["61+"]["pass"]
    # ours diverged in a window: that window fails
    bad = cell("gs", 150, {0: [0.1, 0.1, 0.1, 0.1, None]}, {0: 1.0}, {0: 1.0})["runs"][0]
    assert not qp.verdict(bad)["windows"]["61+"]["pass"]
    # a window the rollout does not reach is left out, not failed
    bad["windows"] = WINDOWS[:4]
    assert qp.verdict(bad)["pass"] and set(qp.verdict(bad)["windows"]) == set(WINDOWS[:4])


def test_versions_resume_at_the_same_commit_and_refuse_a_second_read(tmp_path):
    assert qp.plan("c1", tmp_path) == (1, tmp_path / "quality_v1", False)
    one = {qp.cell_name("navier_stokes_2d", 150): {}}
    write_version(tmp_path, 1, "c1", one)
    assert qp.plan("c1", tmp_path) == (1, tmp_path / "quality_v1", True)  # resume, same commit
    assert qp.plan("c2", tmp_path) == (2, tmp_path / "quality_v2", False)  # a code change
    every = {qp.cell_name(d, b): {} for d, b in qp.cells()}
    write_version(tmp_path, 2, "c2", every)
    with pytest.raises(h.BenchmarkError, match="quality_v2 already holds every cell at commit c2"):
        qp.plan("c2", tmp_path)
    assert [n for n, _ in qp.versions(tmp_path)] == [1, 2]
    (tmp_path / "quality_v10").mkdir()
    (tmp_path / "quality_vx").mkdir()
    assert [n for n, _ in qp.versions(tmp_path)] == [1, 2, 10]  # numeric order, not text


def test_one_command_runs_every_cell_in_sequence(tmp_path, capsys):
    argv = ["--dry-run", "--allow-dirty", "--results-dir", str(tmp_path / "results")]
    qp.main([*argv, "--data-root", str(tmp_path / "data")])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "-m benchmarks." in ln]
    assert "benchmarks.external_data" in lines[0]  # the py-pde set first, when missing
    cells = [ln for ln in lines if "-m benchmarks.quality " in ln]
    assert len(cells) == len(qp.DATASETS) * len(qp.BUDGETS) == 8
    for ln in cells:
        assert "--seeds 0,1,2" in ln and "--threads 1" in ln and "quality_v1" in ln
    assert [ln.split("--cpu-seconds ")[1].split()[0] for ln in cells] == ["150"] * 4 + ["600"] * 4
    assert "--dataset" in cells[3] and "gray_scott_pypde" in cells[3]
    assert not (tmp_path / "results").exists()  # a dry run writes nothing
    # never part of make test: the target exists and the test recipe does not reach it
    make = (REPO / "Makefile").read_text()
    assert "benchmark-quality: baseline\n\t$(PY) -m benchmarks.quality_protocol" in make
    test_recipe = make.split("\ntest: install\n", 1)[1].split("\n\n", 1)[0]
    assert "quality_protocol" not in test_recipe and "benchmark-quality" not in test_recipe


def test_a_dirty_tree_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(record, "_git", lambda *a: {"rev-parse": "c1\n"}.get(a[0], " M x.py\n"))
    with pytest.raises(SystemExit) as e:
        qp.main(["--dry-run", "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("benchmarks.quality_protocol: the working tree differs from its commit")


def test_renderer_shows_the_newest_version_its_commit_and_how_many_came_before(tmp_path):
    old = cell("navier_stokes_2d", 150, {0: 9.0}, {0: 1.0}, {0: 1.0})
    write_version(tmp_path, 1, "0" * 40, {"navier_stokes_2d_cpu150": old})
    seeds = (0, 1, 2)
    ns = cell(
        "navier_stokes_2d",
        150,
        {0: 0.5, 1: 0.6, 2: 0.7},
        {s: 1.0 for s in seeds},
        {s: 2.0 for s in seeds},
    )
    gs = cell(
        "gray_scott_2d",
        150,
        {s: 0.99 for s in seeds},
        {s: 1.0 for s in seeds},
        {s: 1.0 for s in seeds},
    )
    commit = "abcdef1234567890" + "0" * 24
    write_version(tmp_path, 2, commit, {"navier_stokes_2d_cpu150": ns, "gray_scott_2d_cpu150": gs})
    line = qt.version_line(tmp_path)
    assert line.startswith("Version 2 of the [quality protocol](quality_protocol.md)")
    assert "commit `abcdef1`" in line and "Test CPU" in line
    assert "2 of 8 cells run; 1 earlier version." in line
    head = qt.headline_markdown(tmp_path, "docs/quality_protocol.md")
    assert "(docs/quality_protocol.md)" in head and "9.00" not in head  # version 1 is not shown
    rows = [ln for ln in head.splitlines() if ln.startswith("| 150 cpu-s")]
    assert rows == [
        "| 150 cpu-s | navier_stokes_2d | 0.60 (0.50–0.70, fno) | 0.60 (0.50–0.70, fno) | "
        "0.60 (0.50–0.70, fno) | 0.60 (0.50–0.70, fno) | 0.60 (0.50–0.70, fno) | yes |",
        "| 150 cpu-s | gray_scott_2d | 0.99 (0.99–0.99, fno) | 0.99 (0.99–0.99, fno) | "
        "0.99 (0.99–0.99, fno) | 0.99 (0.99–0.99, fno) | 0.99 (0.99–0.99, fno) | **no** |",
    ]
    assert head.endswith("1 of 2 cells pass.")
    # the headline goes into the readme, the full table onto the results page
    readme, results = tmp_path / "R.md", tmp_path / "results.md"
    readme.write_text("a\n<!-- quality-headline:start -->\n<!-- quality-headline:end -->\n")
    results.write_text("<!-- quality-protocol:start -->\n<!-- quality-protocol:end -->\n")
    qt.write_protocol(results, readme, tmp_path)
    assert (
        f"<!-- quality-headline:start -->\n{head}\n<!-- quality-headline:end -->"
        in readme.read_text()
    )
    page = results.read_text()
    assert "| 150 cpu-s | gray_scott_2d | spatial mean |  | – | 0.9998 |" in page
    assert "| 150 cpu-s | navier_stokes_2d | fno (lr1e-3_d4) |" in page
    assert "**ours+jitter / unet_convnext**" in page
    # no version at all: the tables say so and name the command
    empty = tmp_path / "none"
    empty.mkdir()
    assert "has run yet: `make benchmark-quality`" in qt.headline_markdown(empty)


def test_run_record_reads_the_cpu_when_the_run_starts(monkeypatch):
    monkeypatch.setattr(record, "cpu_model", lambda: "CPU at start")
    calls = []
    monkeypatch.setattr(record, "_git", lambda *a: calls.append(a) or "")
    rec = record.run_record(["x"])
    monkeypatch.setattr(record, "cpu_model", lambda: "CPU at the end")
    done = record.finish_record(rec)
    assert done["cpu_model"] == "CPU at start" and done["cpu_capability"]
    # result files the runs write do not make the tree dirty
    assert ("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results") in calls
    assert qt.machine({"record": done, "environment": {"cpu_model": "CPU at the end"}}).startswith(
        "CPU at start"
    )


def test_probe_scripts_write_the_same_record(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "cpu_model", lambda: "Probe CPU")
    rec = finetune_probe.start_probe()
    args = argparse.Namespace(out=tmp_path / "probe.json", dataset=tmp_path / "data" / "gs")
    finetune_probe.save_probe(args, [{"seed": 0}], rec)
    data = json.loads((tmp_path / "probe.json").read_text())
    got = data["record"]
    assert got["cpu_model"] == "Probe CPU" and got["started"] == rec["started"]
    assert {"commit", "dirty", "wall_s", "args"} <= set(got) and data["rows"] == [{"seed": 0}]
    assert str(tmp_path) not in json.dumps(data)


class ZeroDelta(nn.Module):
    def forward(self, x, fields, bcs, *, jitter_seed=None):  # noqa: ANN001
        return torch.zeros_like(x[:, -1:])  # (B, 1, C, *S)


def test_spatial_mean_reference_is_computed_per_window(tmp_path):
    rng = np.random.default_rng(0)
    out = tmp_path / "offsets"
    for split in ("train", "valid", "test"):
        fields = {
            "A": 100 + rng.standard_normal((1, 12, 16, 16)),  # a large offset
            "B": 1 + 1e-3 * rng.standard_normal((1, 12, 16, 16)),  # variance near the eps
        }
        fields = {k: v.astype(np.float32) for k, v in fields.items()}
        write_well_hdf5(out / "data" / split / "f.hdf5", fields, np.arange(12.0), {"F": 0.02})
    res = h.evaluate(
        h.external_dataset(out),
        {"zero": h.Forecaster(ZeroDelta(), RMSNormalizer())},
        n_steps_input=4,
    )
    truth = WellDataset(tmp_path, "offsets", "test", 4, 0).trajectory(0).output_fields[0]
    t = truth.double().flatten(2)  # (8 steps, C, N)
    n = t.shape[-1]
    expected = (t.var(-1, correction=0) / (t.var(-1, correction=1) + 1e-7)).sqrt()  # (8, C)
    flat = res["spatial_mean"]
    assert flat["per_field"]["A"]["1"] == pytest.approx(math.sqrt((n - 1) / n), rel=1e-3)
    for c, name in enumerate(res["fields"]):
        assert flat["per_field"][name]["2-10"] == pytest.approx(
            float(expected[1:, c].mean()), rel=1e-3
        )
    assert flat["mean"]["1"] == pytest.approx(float(expected[0].mean()), rel=1e-3)
    assert flat["mean"]["1"] < math.sqrt((n - 1) / n)  # B's variance is near the eps
