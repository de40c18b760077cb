"""The CPU thread tuner: it keeps the faster of all cores and one thread, stands back when the
user fixed the count, restores the count it found, and train.py's OpenMP default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from walrus.training.threads import ThreadTuner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _fit(tuner: ThreadTuner, device: str = "cpu", world_size: int = 1) -> None:
    trainer = SimpleNamespace(world_size=world_size)
    module = SimpleNamespace(device=torch.device(device))
    tuner.on_fit_start(trainer, module)


def _run(tuner: ThreadTuner, steps: int, seconds: dict[int, float]) -> list[int]:
    """Feed ``steps`` steps whose time depends on the thread count; the counts they ran at."""
    seen = []
    for _ in range(steps):
        n = torch.get_num_threads()
        seen.append(n)
        tuner.record(seconds[n])
    return seen


def test_one_thread_is_kept_when_it_is_faster_and_rechecked(two_threads):
    tuner = ThreadTuner(every_n_steps=20, window=4, start_step=3)
    _fit(tuner)
    assert tuner.active
    seen = _run(tuner, 12, {2: 0.5, 1: 0.3})  # a neighbour took a core
    # 3 steps, then 4 timed at 2 threads, then 5 at 1 (the first absorbs the switch)
    assert seen == [2] * 7 + [1] * 5
    assert torch.get_num_threads() == 1
    assert tuner.history == [{"step": 12, "median_s": {"2": 0.5, "1": 0.3}, "threads": 1}]
    seen = _run(tuner, 29, {2: 0.2, 1: 0.3})  # the neighbour left: the next probe goes back
    assert seen[:20] == [1] * 20 and torch.get_num_threads() == 2
    assert tuner.history[-1]["threads"] == 2 and tuner.history[-1]["step"] == 41
    tuner.teardown(None, None, "fit")
    assert torch.get_num_threads() == 2 and not tuner.active


def test_all_cores_stay_unless_one_thread_wins_by_the_margin(two_threads):
    tuner = ThreadTuner(every_n_steps=5, window=2, start_step=0, margin=0.1)
    _fit(tuner)
    _run(tuner, 6, {2: 1.0, 1: 0.95})  # 5 % faster is not enough
    assert torch.get_num_threads() == 2
    assert tuner.history[0]["threads"] == 2


def test_the_count_found_is_restored_when_training_ends(two_threads):
    tuner = ThreadTuner(every_n_steps=50, window=1, start_step=0)
    _fit(tuner)
    _run(tuner, 4, {2: 1.0, 1: 0.1})
    assert torch.get_num_threads() == 1
    tuner.teardown(None, None, "fit")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    ("kwargs", "fit", "env"),
    [
        ({"every_n_steps": None}, {}, {}),
        ({}, {"device": "meta"}, {}),
        ({}, {"world_size": 2}, {}),
        ({}, {}, {"OMP_NUM_THREADS": "2"}),  # the user fixed the count
    ],
)
def test_it_stands_back(two_threads, monkeypatch, kwargs, fit, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    tuner = ThreadTuner(window=1, start_step=0, **kwargs)
    _fit(tuner, **fit)
    assert not tuner.active
    trainer = SimpleNamespace()
    for _ in range(5):
        tuner.on_train_batch_start(trainer)
        tuner.on_train_batch_end(trainer)
    assert torch.get_num_threads() == 2 and tuner.history == []


def test_one_core_leaves_nothing_to_tune(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tuner = ThreadTuner()
        _fit(tuner)
        assert not tuner.active
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "callbacks.thread_tuner.every_n_steps must be an int >= 1 or null"),
        ({"window": "8"}, "callbacks.thread_tuner.window must be an int >= 1, got '8'"),
        ({"start_step": -1}, "callbacks.thread_tuner.start_step must be an int >= 0"),
        ({"margin": 1.5}, r"callbacks.thread_tuner.margin must be a number in \[0, 1\)"),
        ({"margin": True}, r"callbacks.thread_tuner.margin must be a number in \[0, 1\)"),
    ],
)
def test_bad_options_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ThreadTuner(**kwargs)


def _train_py_policy(**env: str) -> str:
    """``GOMP_SPINCOUNT`` / ``OMP_WAIT_POLICY`` as train.py leaves them (its top only)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    source = (REPO / "train.py").read_text().split("import hydra")[0]
    probe = source + "\nprint(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_train_py_spins_briefly_unless_the_user_chose():
    assert _train_py_policy() == "10000 None"
    assert _train_py_policy(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"
    assert _train_py_policy(GOMP_SPINCOUNT="0") == "0 None"
