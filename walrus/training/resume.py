"""One resume rule for every experiment: ``ckpt_path=RUN/checkpoints/last.ckpt`` continues RUN.

A run records, in every checkpoint it writes (:class:`RunRecord`), its resolved config, the
command-line overrides it was started with and its W&B run id. Resuming:

* the run folder is the checkpoint's (``RUN``) unless ``hydra.run.dir`` says otherwise
  (:func:`~walrus.training.run_dir.run_dir_for`, in ``configs/hydra/default.yaml``);
* ``train.py`` composes the config again from the recorded overrides plus the new ones
  (:func:`resume_overrides`), so ``ckpt_path=...`` alone resumes any experiment. The recorded
  overrides are data: each is parsed and checked, and one that would name code to build
  (``_target_``) or an interpolation (``${...}``) is not taken from the file;
* :func:`check_resume_config` refuses, in one line naming them, changes to any option other
  than the stopping options, logging and where the run executes (``FREE_OPTIONS``).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from walrus.checkpoint import load_checkpoint_file

RECORD_KEY = "RunRecord"
# Options a resume may change: when to stop, how to log, where things are and where it runs
# (a sharded run resumes under DDP and back, on another machine).
STOP_OPTIONS = ("trainer.max_steps", "trainer.max_epochs", "trainer.max_time")
FREE_OPTIONS = (
    *STOP_OPTIONS,
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "logger",
    "callbacks.progress_bar",
    "callbacks.progress_line",
    "callbacks.thread_tuner",  # how many threads, not what is computed
    "trainer.accelerator",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.strategy",
    "trainer.use_distributed_sampler",
    "data.num_workers",
    "data.pin_memory",
    "ckpt_path",
    "callbacks.model_checkpoint.filename",  # names only the best files written from now on
    "paths.output_dir",
    "paths.log_dir",
    "task_name",
    "finetune.enabled",
)
_RUN = "<run folder>"


def new_wandb_id() -> str:
    """A fresh W&B run id (lower-case hex)."""
    return secrets.token_hex(4)


class RunRecord(pl.Callback):
    """Stores the run's resolved config, overrides and W&B id in every checkpoint it writes.

    Args:
        config: the resolved config (plain data).
        overrides: the command-line overrides the run was started with (``None``: unknown).
        wandb_id: the W&B run id, kept across resumes.
    """

    def __init__(
        self, config: dict[str, Any], overrides: Sequence[str] | None, wandb_id: str
    ) -> None:
        self.config = config
        self.overrides = list(overrides) if overrides is not None else None
        self.wandb_id = wandb_id

    @property
    def state_key(self) -> str:
        return RECORD_KEY

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config, "overrides": self.overrides, "wandb_id": self.wandb_id}


def read_record(ckpt: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The validated run record of a loaded checkpoint (``{}`` for one written without it)."""
    record = (ckpt.get("callbacks") or {}).get(RECORD_KEY)
    if record is None:
        return {}
    if not isinstance(record, dict):
        raise ValueError(f"checkpoint {path}: its run record is not a mapping")
    out: dict[str, Any] = {}
    config = record.get("config")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"checkpoint {path}: run record field 'config' is not a mapping")
    out["config"] = config
    overrides = record.get("overrides")
    if overrides is not None and (
        not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides)
    ):
        raise ValueError(f"checkpoint {path}: run record field 'overrides' is not a list of text")
    out["overrides"] = overrides
    wandb_id = record.get("wandb_id")
    if wandb_id is not None and (
        not isinstance(wandb_id, str) or not wandb_id.isalnum() or len(wandb_id) > 64
    ):
        raise ValueError(f"checkpoint {path}: run record field 'wandb_id' is not a W&B run id")
    out["wandb_id"] = wandb_id
    return out


def override_keys(overrides: Iterable[str]) -> list[str]:
    """The dotted keys a list of Hydra overrides sets (``+``/``++``/``~`` prefixes dropped)."""
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides]


def _parse(overrides: Iterable[str], where: str) -> list[Any]:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ValueError(f"{where}: cannot read override: {e}") from None


def _from_file_ok(line: str, key: str) -> bool:
    """Whether a recorded override may be applied again: plain data only."""
    parts = key.split(".")
    return "${" not in line and not any(p.startswith("_") and p.endswith("_") for p in parts)


def resume_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides to compose a run with: for a resume (``ckpt_path=``), the ones the run was
    started with, then ``overrides`` (which win, option by option); else ``overrides``."""
    current = _parse(overrides, "command line")
    ckpt_path = next(
        (o.value() for o in current if o.key_or_group == "ckpt_path" and not o.is_delete()), None
    )
    if not ckpt_path:
        return list(overrides)
    record = read_record(load_checkpoint_file(ckpt_path), ckpt_path)
    recorded = record.get("overrides") or []
    given = {o.key_or_group for o in current}
    kept = [
        o.input_line
        for o in _parse(recorded, f"checkpoint {ckpt_path}")
        if o.key_or_group not in given and _from_file_ok(o.input_line, o.key_or_group)
    ]
    return [*kept, *overrides]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _free(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_OPTIONS)


def _relocated(value: Any, run_dir: str) -> Any:
    if isinstance(value, str) and run_dir and (value == run_dir or value.startswith(run_dir + "/")):
        return _RUN + value[len(run_dir) :]
    return value


def config_changes(
    recorded: dict[str, Any], current: dict[str, Any], given: Iterable[str] = ()
) -> list[str]:
    """Options (dotted) whose value differs between the recorded and current resolved configs,
    leaving out those a resume may change; paths inside each run's folder compare alike.

    An option the recorded config lacks (added by a later version of this package) keeps its
    default and is no change, unless this command line sets it (``given``: override keys)."""
    given = set(given)
    old_dir = str((recorded.get("paths") or {}).get("output_dir") or "")
    new_dir = str((current.get("paths") or {}).get("output_dir") or "")
    old = {k: _relocated(v, old_dir) for k, v in _flatten(recorded).items()}
    new = {k: _relocated(v, new_dir) for k, v in _flatten(current).items()}
    changed = []
    for key in sorted(set(old) | set(new)):
        if _free(key) or old.get(key, "<unset>") == new.get(key, "<unset>"):
            continue
        if key not in old and not any(key == g or key.startswith(g + ".") for g in given):
            continue  # an option newer than the run, at its default
        if key == "init_from" and new.get(key) is None:
            continue  # a fine-tune's recorded init_from: resuming does not need it again
        changed.append(
            f"{key} (run: {old.get(key, '<unset>')!r}, now: {new.get(key, '<unset>')!r})"
        )
    return changed


def check_resume_config(
    recorded: dict[str, Any] | None,
    current: dict[str, Any],
    path: str,
    given: Iterable[str] = (),
) -> None:
    """Raise ``ValueError`` naming every option a resume changed that it may not change
    (``given``: the keys this command line overrides, see :func:`config_changes`)."""
    if not recorded:
        return
    changed = config_changes(recorded, current, given)
    if changed:
        raise ValueError(
            f"resuming {path}: only {', '.join(STOP_OPTIONS)}, logging and the hardware options "
            "may change on resume, "
            f"but these options differ from the run's: {'; '.join(changed)}"
        )
