"""benchmarks.studies.demo_quick_sweep: candidate parsing, what it reads from a rollout's
metrics.json, the every-window verdict, and the `make demo-quick` target it chose."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.studies.demo_quick_sweep import (
    beats_persistence,
    choose,
    parse_candidate,
    table,
    windows,
)
from tests.conftest import REPO


def test_parse_candidate_splits_generator_flags_from_train_overrides() -> None:
    name, data, train = parse_candidate(
        "r32 = --resolution 32 --n-traj 12,4,4 | trainer.max_steps=3"
    )
    assert name == "r32" and data == ["--resolution", "32", "--n-traj", "12,4,4"]
    assert train == ["trainer.max_steps=3"]
    assert parse_candidate("base=") == ("base", [], [])
    with pytest.raises(argparse.ArgumentTypeError, match="NAME="):
        parse_candidate("no name here")


def test_windows_and_every_window_verdict(tmp_path: Path) -> None:
    def source(values: list[float]) -> dict:
        return {"vrmse": {"mean_over_fields": {"windows": dict(zip(["1", "2-10"], values))}}}

    metrics = {"model": source([0.1, 0.9]), "persistence": source([0.2, 0.8])}
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"datasets": {"navier_stokes_2d": {"metrics": metrics}}}))
    vrmse = windows(path)
    assert vrmse == {"model": {"1": 0.1, "2-10": 0.9}, "persistence": {"1": 0.2, "2-10": 0.8}}
    assert not beats_persistence(vrmse)  # loses the second window
    vrmse["model"]["2-10"] = 0.7
    assert beats_persistence(vrmse)
    vrmse["model"]["2-10"] = 0.8
    assert not beats_persistence(vrmse)  # a tie is not a win
    rows = table({"candidates": {"a": {"cpu_s": {"total": 9.0}, "vrmse": vrmse,
                                        "beats_persistence_every_window": False}}})  # fmt: skip
    assert rows == [{"candidate": "a", "cpu_s": 9.0, "1": "0.1/0.2", "2-10": "0.8/0.8",
                     "wins all": False}]  # fmt: skip


def test_demo_quick_runs_the_chosen_candidate_through_make_demo() -> None:
    result = json.loads((REPO / "benchmarks/results/demo_quick_sweep.json").read_text())
    chosen = result["candidates"][result["chosen"]]
    assert result["split"] == "valid" and len(result["candidates"]) >= 2
    assert chosen["beats_persistence_every_window"] and chosen["cpu_s"]["total"] <= 180
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "demo-quick", "STAMP=Makefile"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    flat = " ".join(dry.replace("\\\n", " ").split())
    assert f"navier_stokes_2d --out data/demo-quick {' '.join(chosen['generator_args'])}" in flat
    assert "experiment=quickstart paths.data_dir=data/demo-quick" in flat
    assert f"hydra.run.dir=outputs/demo-quick {' '.join(chosen['train_overrides'])}" in flat


def test_choose_the_best_ratio_within_budget_among_every_window_winners() -> None:
    def cand(cpu: float, model: list[float], wins: bool = True) -> dict:
        vrmse = {"model": dict(zip("ab", model)), "persistence": {"a": 1.0, "b": 2.0}}
        return {"cpu_s": {"total": cpu}, "vrmse": vrmse, "beats_persistence_every_window": wins}

    candidates = {
        "cheap": cand(50, [0.5, 1.8]),  # mean ratio 0.7
        "good": cand(170, [0.2, 1.0]),  # 0.35
        "slow": cand(200, [0.1, 0.2]),  # over budget
        "loses": cand(60, [0.1, 2.5], wins=False),
    }
    assert choose(candidates) == "good"
    assert choose(candidates, budget_cpu_s=100) == "cheap"
    assert choose({"loses": candidates["loses"]}) is None


def test_getting_started_table_is_rendered_from_the_json() -> None:
    from benchmarks.pages import between
    from benchmarks.studies.demo_quick_sweep import PAGE, markdown

    result = json.loads((REPO / "benchmarks/results/demo_quick_sweep.json").read_text())
    table_md = between(PAGE.read_text(), "demo-quick-sweep")
    assert table_md == markdown(result)
    assert f"| **{result['chosen']}** |" in table_md
