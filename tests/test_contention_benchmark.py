"""benchmarks/contention.py builds commands that run: the competitor's Python loop survives the
shell, and the training command's overrides compose."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
    cmd = train_command(tmp_path / "data", tmp_path / "run", steps=7)
    assert cmd[1] == "train.py"
    overrides = [o for o in cmd[2:] if not o.startswith("hydra.")]
    cfg = compose_cfg("train", overrides)
    assert cfg.trainer.max_steps == 7
    assert cfg.trainer.limit_val_batches == 0


def test_each_policy_is_exactly_its_own_openmp_variables(monkeypatch):
    from benchmarks.contention import POLICIES, _env

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own setting is left out
    assert {k: v for k, v in _env(POLICIES["short"]).items() if "OMP" in k} == {
        "GOMP_SPINCOUNT": "10000"
    }
    assert not any("OMP" in k for k in _env(POLICIES["passive"]))
