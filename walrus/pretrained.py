"""The Python path to a trained model: load it, open data, build a batch, roll out.

``load(ckpt)`` and ``from_pretrained(repo_id)`` return the same
:class:`~walrus.inference.loading.InferenceCheckpoint` that ``infer.py`` uses: the model (eval
mode), its normaliser, field vocabulary, ``predict_delta``, data config and inference defaults.
``walrus.rollout(loaded, batch, steps)`` then runs exactly as ``infer.py rollout`` does.
``open_dataset`` and ``trajectory_batch`` give the batch of one trajectory, as infer reads it.
``infer("rollout", "ckpt_path=...", ...)`` runs an ``infer.py`` command in this process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from walrus.data.batch import Batch
from walrus.data.well_dataset import WellDataset
from walrus.hub import DEFAULT_FILE, DEFAULT_REVISION, hub_file
from walrus.inference.loading import (
    InferenceCheckpoint,
    load_inference_checkpoint,
    open_datasets,
    resolve_data_config,
)
from walrus.inference.rollout import load_rollout_sample

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def load(ckpt: str | os.PathLike) -> InferenceCheckpoint:
    """Load a checkpoint for inference.

    Args:
        ckpt: a walrus checkpoint (e.g. ``RUN/checkpoints/last.ckpt``), an official Walrus file
            such as the released ``walrus.pt`` (converted in memory, with the
            ``extended_config.yaml`` beside it when present) or ``hf://ORG/NAME[/FILE][@REVISION]``.

    Raises:
        FileNotFoundError, ValueError: a missing, unreadable or invalid checkpoint.
    """
    return load_inference_checkpoint(ckpt)


def from_pretrained(
    repo_id: str, *, revision: str = DEFAULT_REVISION, filename: str = DEFAULT_FILE
) -> InferenceCheckpoint:
    """Load a checkpoint from the Hugging Face Hub, e.g. ``from_pretrained("polymathic-ai/walrus")``.

    The file goes to the user's Hub cache; an official file is converted once and the result
    kept in the same cache (see :mod:`walrus.hub`). With ``HF_HUB_OFFLINE=1`` only the cache
    is read.

    Raises:
        FileNotFoundError: no such repo or file, or offline and not cached.
        ValueError: a malformed name, no such revision, or an invalid checkpoint.
    """
    return load_inference_checkpoint(hub_file(repo_id, filename, revision).url)


def open_dataset(
    ckpt: InferenceCheckpoint,
    data_dir: str | os.PathLike | None = None,
    dataset: str | None = None,
    *,
    split: str = "test",
    n_steps_input: int | None = None,
    time_stride: int | None = None,
) -> WellDataset:
    """One dataset split, read with the checkpoint's vocabulary, as ``infer.py`` opens it.

    Args:
        ckpt: the loaded checkpoint.
        data_dir: the folder holding ``<dataset>/data/<split>/*.hdf5`` (``paths.data_dir``);
            default: the checkpoint's training data root.
        dataset: the dataset's name; default: the first of the checkpoint's training datasets.
        split: ``train``, ``valid`` or ``test``.
        n_steps_input: context frames; default: the checkpoint's training value (4 if it
            stores none).
        time_stride: frames between steps; default: the checkpoint's training value (1 if it
            stores none).

    Raises:
        FileNotFoundError, ValueError: no data to read, or fields the checkpoint does not know.
    """
    override: dict[str, Any] = {"n_steps_input": n_steps_input, "time_stride": time_stride}
    if dataset is not None:
        override["datasets"] = [dataset]
    data = resolve_data_config(override, ckpt, data_dir=data_dir)
    if dataset is None:
        data["datasets"] = list(data["datasets"])[:1]
    return open_datasets(data, split, ckpt)[0]


def trajectory_batch(
    ds: WellDataset, index: int = 0, *, steps: int | None = None, start: int = 0
) -> Batch:
    """Trajectory ``index`` of ``ds`` as ``infer.py rollout`` reads it (B = 1).

    Args:
        ds: from :func:`open_dataset`.
        index: trajectory index within the split.
        steps: target frames after the context; default: as many as the trajectory holds.
        start: first context frame, counted at the dataset's time stride.

    Returns:
        ``Batch`` with ``input_fields (1, n_steps_input, C, *sp)`` and ``output_fields
        (1, steps, C, *sp)`` (the ground truth to compare a rollout with).

    Raises:
        ValueError, IndexError: not enough frames, or no such trajectory.
    """
    stride = ds.stride_lo
    if steps is None:
        steps = ds.frames_available(index, stride) - start - ds.n_steps_input
    return load_rollout_sample(
        ds, index, start=start, n_steps_input=ds.n_steps_input, steps=steps, stride=stride
    )


def infer(command: str, *overrides: str) -> dict[str, Any]:
    """Run ``python infer.py COMMAND OVERRIDES...`` in this process (no Hydra run folder).

    ``infer("rollout", f"ckpt_path={ckpt}", "steps=20", f"out={out}")`` composes
    ``configs/infer.yaml`` with the same overrides as the command line and returns what
    :func:`walrus.inference.run_rollout` / ``run_evaluate`` return (metrics, files, notes).

    Raises:
        FileNotFoundError: the repository's ``configs/`` folder is missing (not a source checkout).
        ValueError: an unknown command or a bad option.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from walrus.inference import COMMANDS, run

    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; use one of {COMMANDS}")
    if not (CONFIG_DIR / "infer.yaml").is_file():
        raise FileNotFoundError(
            f"{CONFIG_DIR / 'infer.yaml'} not found; run from a source checkout"
        )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="infer", overrides=[*overrides, f"command={command}"])
    except (HydraException, OmegaConfBaseException) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = " ".join(ln for ln in lines if not ln.startswith(("See https", "^")))
        raise ValueError(f"bad override in {list(overrides)!r}: {detail}"[:500]) from None
    finally:
        GlobalHydra.instance().clear()
    return run(cfg)
