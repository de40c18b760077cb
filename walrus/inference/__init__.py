"""Inference commands: ``python infer.py rollout|evaluate ckpt_path=... [options]``.

``run(cfg)`` dispatches on ``cfg.command`` to the module named after the command:
``inference/rollout.py:run_rollout`` (autoregressive rollouts with metrics, predictions and
plots) or ``inference/evaluate.py:run_evaluate`` (one-step errors over a split); both run
through a Lightning ``Trainer`` built from ``cfg.trainer``. See ``configs/infer.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from walrus.cli import quiet_lightning
from walrus.inference.evaluate import run_evaluate
from walrus.inference.rollout import run_rollout

COMMANDS = ("rollout", "evaluate")
# Hydra flags that take the next word as their value
_HYDRA_VALUE_FLAGS = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}


def command_override(argv: Sequence[str]) -> list[str]:
    """Turn the first positional word of ``argv[1:]`` into the override ``command=<word>``.

    ``["infer.py", "rollout", "steps=5"]`` becomes ``["infer.py", "steps=5", "command=rollout"]``.

    Raises:
        ValueError: the word is not one of ``COMMANDS``, or there are two of them.
    """
    out, command, skip = [argv[0]], None, False
    for arg in argv[1:]:
        if skip or arg.startswith("-") or "=" in arg:
            skip = arg in _HYDRA_VALUE_FLAGS
            out.append(arg)
            continue
        if command is not None or arg not in COMMANDS:
            raise ValueError(
                f"unknown command {arg!r}; use: python infer.py {{{'|'.join(COMMANDS)}}} "
                "ckpt_path=PATH [options]"
            )
        command = arg
    if command is not None:
        out.append(f"command={command}")
    return out


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the command ``cfg.command`` names."""
    quiet_lightning()
    command = None if OmegaConf.is_missing(cfg, "command") else cfg.get("command")
    if command not in COMMANDS:
        raise ValueError(
            f"give a command: python infer.py {{{'|'.join(COMMANDS)}}} ckpt_path=PATH [options]"
            + ("" if command is None else f" (got command={command!r})")
        )
    return run_rollout(cfg) if command == "rollout" else run_evaluate(cfg)


__all__ = ["COMMANDS", "command_override", "run", "run_evaluate", "run_rollout"]
