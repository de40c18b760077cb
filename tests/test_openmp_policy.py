"""The OpenMP wait policy `import walrus` chooses before torch loads, and when it stands back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import os, {first}; import torch; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(first: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_walrus_first_makes_idle_threads_sleep() -> None:
    assert _policy("walrus") == "PASSIVE"


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"OMP_WAIT_POLICY": "active"}, "active"), ({"GOMP_SPINCOUNT": "1000"}, "None")],
)
def test_a_policy_the_user_set_wins(env: dict[str, str], expected: str) -> None:
    assert _policy("walrus", **env) == expected


def test_torch_loaded_first_is_left_alone() -> None:
    # libgomp has read its settings by then; setting the variable would only mislead
    assert _policy("torch, walrus") == "None"
