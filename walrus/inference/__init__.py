"""Inference commands: ``python infer.py rollout|evaluate ckpt_path=... [options]``.

``run(cfg)`` dispatches on ``cfg.command`` to the module named after the command:
``inference/rollout.py:run_rollout`` (autoregressive rollouts with metrics, predictions and
plots) or ``inference/evaluate.py:run_evaluate`` (one-step errors over a split); both run
through a Lightning ``Trainer`` built from ``cfg.trainer``. See ``configs/infer.yaml``.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from walrus.cli import quiet_lightning
from walrus.inference.evaluate import run_evaluate
from walrus.inference.rollout import run_rollout
from walrus.signals import stop_on_signals

COMMANDS = ("rollout", "evaluate")
COMMAND_HELP = {
    "rollout": "roll trajectories out autoregressively and score every step against the truth, "
    "persistence and the spatial mean; writes metrics.json, predictions.hdf5, vrmse.png, "
    "spectral.png, fidelity.png, fidelity_fields.png, snapshots.png and rollout.gif (mp4 with "
    "ffmpeg), with ensemble=N also rank_histogram.png (and members.hdf5 with "
    "save_members=true), to out/, prints tables",
    "evaluate": "one-step errors over every window of a split; writes metrics.json, prints a table",
}
HELP_FLAGS = ("-h", "--help")
# keys of configs/infer.yaml that are not options of the commands (command is the first word)
_NOT_OPTIONS = {"defaults", "task_name", "hydra", "command"}
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


def config_options(config_file: Path) -> list[tuple[str, str, str]]:
    """The commented options of ``configs/infer.yaml``: ``(key, default, comment)`` each.

    Reads the file as text (nothing is resolved): a ``key: value`` line at the top level or one
    level down (``data.datasets``) with ``#`` comment lines right above it is an option; the
    default is the value as written.
    """
    options: list[tuple[str, str, str]] = []
    comment: list[str] = []
    parent = None
    for line in config_file.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^( {2})?([A-Za-z_][\w]*):\s*(.*)$", line)
        if match is None:
            comment = []
            continue
        nested, key, value = match.groups()
        if not nested:
            parent = key
        if (parent or key) not in _NOT_OPTIONS and comment and (nested or value):
            options.append((f"{parent}.{key}" if nested else key, value, " ".join(comment)))
        comment = []
    return options


def help_text(config_file: Path) -> str:
    """``infer.py --help``: usage, the commands, and each option of ``config_file``
    (``configs/infer.yaml``) with its default and comment, grouped by command."""
    width = 100
    lines = [
        f"usage: python infer.py {{{'|'.join(COMMANDS)}}} ckpt_path=PATH [option=value ...]",
        "",
        "commands:",
    ]
    for name, text in COMMAND_HELP.items():
        lines += textwrap.wrap(
            text, width, initial_indent=f"  {name:<9} ", subsequent_indent=" " * 12
        )
    try:
        options = config_options(config_file)
    except OSError as e:
        options = []
        lines += ["", f"(options: cannot read {config_file}: {e.strerror})"]
    groups: dict[str, list[str]] = {c: [] for c in (*COMMANDS, "")}
    for key, default, comment in options:
        head, _, rest = comment.partition(":")
        command, text = (head, rest.strip()) if head in COMMANDS else ("", comment)
        indent = " " * 6
        wrapped = textwrap.wrap(
            f"{text} ({'required' if default == '???' else f'default: {default}'})",
            width,
            initial_indent=indent,
            subsequent_indent=indent,
        )
        groups[command] += [f"  {key}", *wrapped]
    for command, body in groups.items():
        if body:
            title = f"options of {command}:" if command else "options of both commands:"
            lines += ["", title, *body]
    lines += ["", "other options:"]
    lines += textwrap.wrap(
        "any override of the composed config, as for train.py: trainer=ddp trainer.devices=2, "
        "trainer.accelerator=cpu, data=NAME; python infer.py --hydra-help shows Hydra's flags",
        width,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return "\n".join(lines)


def command_override(argv: Sequence[str]) -> list[str]:
    """Turn the first positional word of ``argv[1:]`` into the override ``command=<word>``.

    ``["infer.py", "rollout", "steps=5"]`` becomes ``["infer.py", "steps=5", "command=rollout"]``.
    With ``-h`` or ``--help`` it prints ``help_text`` (options from ``configs/infer.yaml``
    beside ``argv[0]``, where Hydra reads the config) and exits with status 0.

    Raises:
        ValueError: the word is not one of ``COMMANDS``, or there are two of them.
        SystemExit: after printing the help.
    """
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        print(help_text(Path(argv[0]).resolve().parent / "configs" / "infer.yaml"))
        sys.exit(0)
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
    with stop_on_signals():  # SIGTERM/SIGINT stop it within one model call (exit 143/130)
        return run_rollout(cfg) if command == "rollout" else run_evaluate(cfg)


__all__ = [
    "COMMANDS",
    "command_override",
    "config_options",
    "help_text",
    "run",
    "run_evaluate",
    "run_rollout",
]
