"""benchmarks/contention.py builds commands that run: the competitor's Python loop survives the
shell, and the training command's overrides compose."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.contention import _train_command as train_command
from benchmarks.contention import python_c


def test_the_competitor_loop_runs_multi_line_python_through_bash():
    done = subprocess.run(
        ["bash", "-c", python_c("x = 6\nprint(x * 7)  # 'quotes' too")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "42\n"


def test_the_training_command_overrides_compose(compose_cfg, tmp_path: Path):
    from benchmarks.contention import POLICIES

    cmd = train_command(tmp_path / "data", tmp_path / "run", steps=7)
    assert cmd[1] == "train.py"
    overrides = [o for o in cmd[2:] if not o.startswith("hydra.")]
    cfg = compose_cfg("train", overrides)
    assert cfg.trainer.max_steps == 7
    assert cfg.trainer.limit_val_batches == 0
    assert cfg.callbacks.thread_tuner is not None  # the default policy keeps train.py's tuner
    _, no_tuner = POLICIES["passive"]
    cmd = train_command(tmp_path / "data", tmp_path / "run", 7, no_tuner)
    cfg = compose_cfg("train", [o for o in cmd[2:] if not o.startswith("hydra.")])
    assert cfg.callbacks.thread_tuner is None


def test_each_policy_is_exactly_its_own_openmp_variables(monkeypatch):
    from benchmarks.contention import POLICIES, _env

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own setting is left out
    omp = {name: {k: v for k, v in _env(env).items() if "OMP" in k} for name, (env, _) in
           POLICIES.items()}  # fmt: skip
    assert omp == {
        "default": {},  # train.py chooses
        "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
        "spin": {"GOMP_SPINCOUNT": "300000"},
        "short": {"GOMP_SPINCOUNT": "10000"},
    }
    assert [name for name, (_, overrides) in POLICIES.items() if not overrides] == ["default"]


def test_the_table_shows_each_result_per_setting_and_condition(tmp_path, monkeypatch):
    import benchmarks.contention as contention

    def result(alone: float, loop: float) -> dict:
        return {
            "policies": ["default", "passive"],
            "summary": [
                {"policy": p, "condition": c, "wall_s": w, "x_alone": w / a}
                for p, a, lw in (("default", alone, loop), ("passive", 50.0, 50.0))
                for c, w in (("alone", a), ("torch_loop", lw))
            ],
        }

    for name, r in (("one", result(40.0, 60.0)), ("two", result(42.0, 63.0))):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    page = tmp_path / "performance.md"
    page.write_text("<!-- contention-table:start -->\nold\n<!-- contention-table:end -->\n")
    monkeypatch.setattr(contention, "PAGE", page)
    contention.render(["one", "two"], tmp_path)
    text = page.read_text()
    assert "| setting | alone | beside the torch loop |" in text
    assert "| 40.0 / 42.0 s | 60.0 / 63.0 s (1.50× / 1.50×) |" in text
    assert "old" not in text and "beside a second training run" not in text
    with pytest.raises(FileNotFoundError, match="--name three"):
        contention.render(["three"], tmp_path)
