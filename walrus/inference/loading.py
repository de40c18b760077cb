"""Set-up shared by the inference commands: options, checkpoint, data selection, trainer.

Everything here validates its input and raises ``ValueError`` / ``FileNotFoundError`` with the
option, file or field at fault before any model compute starts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from walrus.checkpoint import model_from_checkpoint, walrus_meta
from walrus.data.datamodule import parse_dataset_specs, resolve_data_root
from walrus.data.normalization import build_normalizer
from walrus.data.storage import data_root_exists
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import SPLITS, WellFile, list_split_files
from walrus.errors import reading
from walrus.hub import open_checkpoint
from walrus.memory import check_forward_fits, default_max_sample_bytes, runs_on_cpu
from walrus.model.compile import compile_mode, compile_model
from walrus.model.config import MAX_SIZE
from walrus.perturbation import DEFAULT_PERTURBATION, Perturbation
from walrus.rollout import check_spectral_limit
from walrus.run_files import is_first_process, write_run_files
from walrus.safe_paths import refuse_symlinks, result_folder_names
from walrus.signals import check_stop

# data config keys inference reads; the rest of a training data config is ignored
DATA_KEYS = ("root", "datasets", "n_steps_input", "time_stride", "max_sample_bytes")
# infer.py's default `seed`: the jitter seed of rollouts that jitter without a seed given
DEFAULT_SEED = 0
# Jitter draws averaged per rollout step by default when a patch model's rollout jitters
# (infer.py jitter_average=null); chosen on validation rollouts (README "Rollout fidelity").
DEFAULT_JITTER_AVERAGE = 4
# Spectral limit of a patch model's rollout steps by default (infer.py spectral_limit=null;
# walrus.rollout): chosen on validation rollouts (docs/studies.md, "Patch seams").
DEFAULT_SPECTRAL_LIMIT = 1.0
# Bounds of the counts that multiply the work of every rollout step (docs/guide/inference.md).
MAX_ENSEMBLE = 1024
MAX_JITTER_AVERAGE = 1024
_RUNS_PER_STEP = " (each runs the model once more at every step)"
# Trajectories of one dataset a rollout takes with trajectories=all; pick more by index.
MAX_ROLLOUT_TRAJECTORIES = 100_000


@dataclass
class InferenceCheckpoint:
    """A model rebuilt from a checkpoint with what inference needs from its metadata.

    ``walrus.load`` and ``walrus.from_pretrained`` return this; ``walrus.rollout`` takes it in
    place of a model and then uses its normaliser, ``predict_delta`` and jitter default, as
    ``infer.py rollout`` does.

    Attributes:
        path: the walrus checkpoint file read (for a Hub URL, the converted file in the cache;
            for a local official file, that file).
        model: the model, in eval mode, on the CPU.
        vocab: the field vocabulary the model was trained with.
        predict_delta: whether the model predicts normalised frame deltas.
        data_config: the training run's resolved data config (empty when not stored).
        normalizer: the normaliser the model was trained with (``RMSNormalizer`` if not stored).
        inference_jitter: whether rollouts jitter by default (``infer.py jitter=null``); they
            are then seeded with ``DEFAULT_SEED`` unless a seed is given.
        cap_delta_unit: the delta-unit cap default of rollouts (see ``walrus.rollout``).
        source: what the checkpoint was loaded from, as given (a path or an ``hf://`` URL).
    """

    path: Path
    model: nn.Module
    vocab: FieldVocabulary
    predict_delta: bool
    data_config: dict[str, Any] = field(default_factory=dict)
    normalizer: Any = None
    inference_jitter: bool = False
    cap_delta_unit: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        self.source = self.source or str(self.path)

    @property
    def field_names(self) -> list[str]:
        """The vocabulary's field names, by id."""
        return list(self.vocab.names)

    @property
    def n_steps_input(self) -> int | None:
        """Input frames of the training data config (``None`` when not stored)."""
        value = self.data_config.get("n_steps_input")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    def default_jitter_seed(self) -> int | None:
        """The jitter seed of a default rollout: ``DEFAULT_SEED`` when it jitters, else ``None``."""
        return DEFAULT_SEED if self.inference_jitter else None

    def default_jitter_average(self, jitter_seed: int | None) -> int:
        """Jitter draws averaged per step by default (:func:`default_jitter_average`)."""
        return default_jitter_average(self.model, jitter_seed)

    def default_spectral_limit(self) -> float:
        """The spectral limit of a default rollout (:func:`default_spectral_limit`)."""
        return default_spectral_limit(self.model)


def default_jitter_average(model: nn.Module, jitter_seed: int | None) -> int:
    """Jitter draws averaged per rollout step by default: ``DEFAULT_JITTER_AVERAGE`` when a
    patch model (``encoder="patch"``, whose output patches meet at seams) rolls out with jitter
    (``jitter_seed`` given), else 1 (conv decoders overlap already; released Walrus checkpoints
    run as the official code runs them)."""
    patch = getattr(model, "patch", False) is True
    return DEFAULT_JITTER_AVERAGE if jitter_seed is not None and patch else 1


def default_spectral_limit(model: nn.Module) -> float:
    """The per-shell limit on each rollout step's change by default (``walrus.rollout``):
    ``DEFAULT_SPECTRAL_LIMIT`` for a patch model (``encoder="patch"``, whose seams put
    grid-scale noise into smooth fields), else 0 (off: released Walrus checkpoints run as the
    official code runs them)."""
    return DEFAULT_SPECTRAL_LIMIT if getattr(model, "patch", False) is True else 0.0


def ensemble_perturbation(cfg: DictConfig, members: int) -> Perturbation | None:
    """The perturbation of ensemble members from options ``perturbation`` (the amplitude;
    null: ``DEFAULT_PERTURBATION`` for an ensemble, none for one rollout; 0: off),
    ``perturbation_length`` and ``perturbation_memory`` (null: the default's)."""
    amp = cfg.get("perturbation")
    if amp is None:
        amp = DEFAULT_PERTURBATION.amplitude if members > 1 else 0.0
    length = cfg.get("perturbation_length")
    memory = cfg.get("perturbation_memory")
    for key, value in (("perturbation", amp), ("perturbation_length", length),
                       ("perturbation_memory", memory)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"option {key} must be a number, got {value!r}")
    if amp == 0:
        return None
    if members < 2:
        raise ValueError(
            f"option perturbation={amp} perturbs ensemble members: set ensemble=N (N >= 2), "
            "or perturbation=0"
        )
    try:
        return Perturbation(
            float(amp),
            DEFAULT_PERTURBATION.length if length is None else float(length),
            DEFAULT_PERTURBATION.memory if memory is None else float(memory),
        )
    except ValueError as err:
        msg = str(err)
        for name, option in (("amplitude", "perturbation"), ("length", "perturbation_length"),
                             ("memory", "perturbation_memory")):  # fmt: skip
            msg = msg.replace(f"perturbation {name} ", f"option {option} ")
        raise ValueError(msg) from None


def require(cfg: DictConfig, key: str, hint: str) -> Any:
    """``cfg[key]``; a missing (``???``) or null value is a ValueError with ``hint``."""
    if OmegaConf.is_missing(cfg, key) or cfg.get(key) is None:
        raise ValueError(f"option {key} is required: {hint}")
    return cfg[key]


def load_inference_checkpoint(path: str | os.PathLike) -> InferenceCheckpoint:
    """Rebuild the model, its vocabulary and its training facts from a checkpoint alone.

    Args:
        path: a walrus checkpoint, an official Walrus file (converted in memory, see
            :func:`walrus.hub.open_checkpoint`) or ``hf://ORG/NAME[/FILE][@REVISION]``.

    Raises:
        FileNotFoundError, ValueError: a missing, unreadable or invalid checkpoint (one line).
    """
    with reading(f"checkpoint {path}"):
        ckpt, file = open_checkpoint(path)
        meta = walrus_meta(ckpt, file)
        model = model_from_checkpoint(ckpt, meta, file)
    del ckpt
    data_config = meta.get("data_config") or {}
    if not isinstance(data_config, Mapping):
        raise ValueError(f"checkpoint {file}: its data_config is a {type(data_config).__name__}")
    return InferenceCheckpoint(
        path=file,
        model=model.eval(),
        vocab=FieldVocabulary.from_dict(meta["vocab"]),
        predict_delta=bool(meta.get("predict_delta", True)),
        data_config=dict(data_config),
        normalizer=build_normalizer(meta.get("normalizer")),
        inference_jitter=_inference_jitter(meta, model, file),
        source=str(path),
    )


def _inference_jitter(meta: Mapping[str, Any], model: nn.Module, path: Path) -> bool:
    """Whether rollouts of this checkpoint jitter by default (``walrus.inference.jitter``).

    Checkpoints that do not say follow the model: jitter at inference when it was built with
    ``jitter=True``.
    """
    inference = meta.get("inference") or {}
    if not isinstance(inference, Mapping):
        raise ValueError(f"checkpoint {path}: walrus.inference is a {type(inference).__name__}")
    value = inference.get("jitter", bool(getattr(model, "jitter", False)))
    if not isinstance(value, bool):
        raise ValueError(f"checkpoint {path}: walrus.inference.jitter must be true or false")
    return value


def resolve_data_config(
    override: Mapping[str, Any] | None, ckpt: InferenceCheckpoint, data_dir: Any = None
) -> dict:
    """The checkpoint's training data config, with every non-null key of ``override`` on top.

    Args:
        override: the ``data`` options (``datasets``, ``n_steps_input``, ``time_stride``, and
            the deprecated ``root``).
        ckpt: the loaded checkpoint.
        data_dir: ``paths.data_dir``; ``None`` keeps the checkpoint's data root.

    Raises:
        ValueError: neither names a data root and datasets.
        FileNotFoundError: the data root does not exist.
    """
    override = dict(override or {})
    root = resolve_data_root(data_dir, override.pop("root", None))
    data = {k: v for k, v in ckpt.data_config.items() if k in DATA_KEYS}
    data.update({k: v for k, v in override.items() if k in DATA_KEYS and v is not None})
    inherited = data.get("max_sample_bytes") if override.get("max_sample_bytes") is None else None
    if isinstance(inherited, int) and not isinstance(inherited, bool):
        # the training machine's bound: never above what this machine has
        data["max_sample_bytes"] = min(inherited, default_max_sample_bytes())
    if root is not None:
        data["root"] = root
    if not data.get("root") or not data.get("datasets"):
        raise ValueError(
            f"checkpoint {ckpt.source} stores no data config to read from; pass "
            "paths.data_dir=DIR and data.datasets=[...] (or data=<config name>, e.g. "
            "data=navier_stokes_2d)"
        )
    if not data_root_exists(data["root"]):
        origin = "checkpoint's training data root" if root is None else "paths.data_dir"
        raise FileNotFoundError(
            f"data root {data['root']} ({origin}) does not exist; pass paths.data_dir=DIR, the "
            "folder holding <dataset>/data/<split>/*.hdf5"
        )
    data.setdefault("n_steps_input", 4)
    data.setdefault("time_stride", 1)
    stride = data["time_stride"]
    if isinstance(stride, Sequence) and not isinstance(stride, str) and len(stride) == 2:
        stride = stride[0]  # a training (lo, hi) range: inference uses lo
    for key, value in (("n_steps_input", data["n_steps_input"]), ("time_stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            pair = " (or a [lo, hi] pair of them)" if key == "time_stride" else ""
            raise ValueError(
                f"option data.{key} must be an integer >= 1{pair}, got {str(value)[:50]!r}"
            )
    data["time_stride"] = stride
    return data


def open_datasets(
    data: Mapping[str, Any],
    split: str,
    ckpt: InferenceCheckpoint,
    n_steps_output: int = 0,
) -> list[WellDataset]:
    """Open each dataset's split, checking that the checkpoint knows every one of its fields.

    Args:
        data: resolved data config (``root``, ``datasets``, ``n_steps_input``, ``time_stride``).
        split: ``train``, ``valid`` or ``test``.
        ckpt: the loaded checkpoint (its vocabulary gives the field ids).
        n_steps_output: target frames per window (0 for whole-trajectory rollouts).

    Raises:
        ValueError: unknown split, or fields the checkpoint has never seen (with how to fine-tune).
        FileNotFoundError: missing data folders or files.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = str(data["root"])  # a local path or an fsspec URL
    specs = parse_dataset_specs(_plain(data["datasets"]))
    out = []
    for spec in specs:
        wf = WellFile(list_split_files(root, spec.name, split)[0])
        names = wf.channel_names(spec.fields)
        unknown = [n for n in names if n not in ckpt.vocab]
        if unknown:
            raise ValueError(
                f"dataset {spec.name!r} has fields {unknown} that checkpoint {ckpt.source} was "
                f"never trained on (it knows {ckpt.vocab.names}). Fine-tune it on this data "
                f"first, which adds the new fields: python train.py experiment=finetune "
                f"init_from={ckpt.source} paths.data_dir={root} data.datasets=[{spec.name}] ; then "
                "run inference with the fine-tuned checkpoint"
            )
        out.append(
            WellDataset(
                root,
                spec.name,
                split,
                n_steps_input=data["n_steps_input"],
                n_steps_output=n_steps_output,
                time_stride=data["time_stride"],
                vocab=ckpt.vocab,
                fields=spec.fields,
                max_sample_bytes=data.get("max_sample_bytes"),
            )
        )
    return out


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def positive_int(
    cfg: DictConfig,
    key: str,
    *,
    allow_null: bool = False,
    minimum: int = 1,
    maximum: int = MAX_SIZE,
    why: str = "",
) -> int:
    """``cfg[key]`` as an int in ``[minimum, maximum]`` (``None`` passes when ``allow_null``);
    ``why`` explains the maximum in the message."""
    value = cfg.get(key)
    if value is None and allow_null:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option {key} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:  # MAX_SIZE: past what tensors can index
        shown = str(value) if len(str(value)) <= 20 else f"{str(value)[:20]}..."
        raise ValueError(f"option {key} must be at most {maximum}{why}, got {shown}")
    return value


def select_trajectories(selection: Any, n_trajectories: int, dataset: str) -> list[int]:
    """Trajectory indices from ``all``, one index or a list of them, checked against the split."""
    selection = _plain(selection)
    if selection == "all":
        if n_trajectories > MAX_ROLLOUT_TRAJECTORIES:
            raise ValueError(
                f"dataset {dataset!r} holds {n_trajectories} trajectories in this split; "
                f"trajectories=all takes at most {MAX_ROLLOUT_TRAJECTORIES}: pick some with "
                "trajectories=[i, j, ...]"
            )
        return list(range(n_trajectories))
    items = [selection] if isinstance(selection, int) else selection
    if (
        not isinstance(items, Sequence)
        or isinstance(items, str)
        or not items
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in items)
    ):
        raise ValueError(
            f"option trajectories must be 'all', an index or a list of indices, got {selection!r}"
        )
    bad = [i for i in items if not 0 <= i < n_trajectories]
    if bad:
        raise ValueError(
            f"trajectories {bad} out of range: dataset {dataset!r} has {n_trajectories} "
            f"trajectories in this split (0..{n_trajectories - 1})"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"option trajectories lists an index twice: {items}")
    return list(items)


def build_trainer(cfg: DictConfig) -> pl.Trainer:
    """A Lightning trainer from ``cfg.trainer`` for predict/test: no logger, no checkpoints.

    Samples are sharded over ranks by the inference data module itself, so Lightning's
    distributed sampler is switched off.
    """
    return instantiate(
        cfg.trainer,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        callbacks=[],
    )


@dataclass
class Prepared:
    """Validated options, the loaded checkpoint and the opened datasets of one command."""

    ckpt: InferenceCheckpoint
    data: dict[str, Any]
    datasets: list[WellDataset]
    out: Path
    batch_size: int
    jitter_seed: int | None
    autocast_dtype: torch.dtype | None
    members: int = 1
    cap_delta_unit: bool = True
    jitter_average: int = 1
    spectral_limit: float = 0.0
    perturbation: Perturbation | None = None
    # dataset name -> the folder inside `out` for its results when several are rolled out
    folders: dict[str, Path] = field(default_factory=dict)
    # what the command's `plan` returned (see `prepare`)
    plan: Any = None

    def settings(self) -> dict[str, Any]:
        """How the model was run, as both commands report it in ``metrics.json``."""
        return {
            "predict_delta": self.ckpt.predict_delta,
            "jitter_seed": self.jitter_seed,
            "ensemble": self.members,
            "jitter_average": self.jitter_average,
            "spectral_limit": self.spectral_limit,
            "perturbation": None if self.perturbation is None else asdict(self.perturbation),
            "cap_delta_unit": self.cap_delta_unit,
            "output_filter": getattr(
                getattr(self.ckpt.model, "config", None), "output_filter", None
            ),
            "bf16": self.autocast_dtype is not None,
        }


# The run's own files in `out` (walrus/run_files.py), written once the checks pass.
LOG_NAME = "infer.log"
HYDRA_FILES = frozenset({"config.yaml", "overrides.yaml", "hydra.yaml"})
# Every file the inference commands write into `out` or a dataset's folder in it; `overwrite=true`
# replaces these and nothing else.
RESULT_FILES = frozenset(
    {"metrics.json", "predictions.hdf5", "members.hdf5", "vrmse.png", "spectral.png",
     "fidelity.png", "fidelity_fields.png", "rank_histogram.png", "snapshots.png", "rollout.gif",
     "rollout.mp4"}
)  # fmt: skip
# Names a dataset's result folder may not take: they are the run's own entries.
RESERVED_NAMES = frozenset({LOG_NAME, ".hydra", *RESULT_FILES})


def _written_by_a_command(p: Path) -> bool:
    """Whether ``p``, an entry of ``out``, is one an inference command writes: a result file,
    the log, ``.hydra/`` holding only its files, or a dataset's folder holding only results
    (an empty folder is the user's). Nothing is followed through a symlink."""
    mode = os.lstat(p).st_mode
    if stat.S_ISREG(mode):
        return p.name in RESULT_FILES or p.name == LOG_NAME
    if not stat.S_ISDIR(mode):
        return False
    allowed = HYDRA_FILES if p.name == ".hydra" else RESULT_FILES
    children = list(p.iterdir())
    return bool(children) and all(
        stat.S_ISREG(os.lstat(c).st_mode) and c.name in allowed for c in children
    )


def claim_out(out: Path, overwrite: Any) -> None:
    """Make sure results written to ``out`` cannot mix with an earlier run's.

    ``out`` must not exist or be empty; with ``overwrite=true`` an earlier run's files (its
    results, per-dataset folders holding only results, ``.hydra/`` and ``infer.log``) are
    removed first. Other files and folders, empty ones included, are never deleted, and an
    entry that is a symlink is refused.

    Raises:
        ValueError: ``overwrite`` is not a boolean, ``out`` holds a symlink, or holds files
            and ``overwrite`` is false, or holds files that are not results of a command.
    """
    if not isinstance(overwrite, bool):
        raise ValueError(f"option overwrite must be true or false, got {overwrite!r}")
    if not out.is_dir():
        return
    refuse_symlinks(out, what=f"out={out}")
    found = sorted(out.iterdir())
    if not found:
        return
    names = ", ".join(p.name for p in found[:5]) + (", ..." if len(found) > 5 else "")
    if not overwrite:
        raise ValueError(
            f"out={out} already holds {names} (an earlier run?); pass a new out=DIR, or "
            "overwrite=true to replace its results"
        )
    foreign = [p.name for p in found if not _written_by_a_command(p)]
    if foreign:
        raise ValueError(
            f"out={out} holds {', '.join(foreign[:5])}, which no infer.py command wrote; "
            "overwrite=true replaces only earlier results: pass a new out=DIR"
        )
    for p in found:
        if p.is_dir():
            for child in p.iterdir():
                child.unlink()
            p.rmdir()
        else:
            p.unlink()


def prepare(
    cfg: DictConfig,
    n_steps_output: int,
    plan: Callable[[dict[str, Any], list[WellDataset]], Any] | None = None,
) -> Prepared:
    """Check the options shared by every command, load the checkpoint and open the data.

    ``plan(data, datasets)`` (the command's own checks of the opened data, e.g. the selected
    trajectories) runs before anything is written; its result is ``Prepared.plan``. A refused
    run thus writes nothing, not even ``.hydra/`` or the log.
    """
    ckpt_path = require(cfg, "ckpt_path", "pass ckpt_path=PATH/TO/checkpoints/last.ckpt")
    out = Path(str(require(cfg, "out", "pass out=DIR for the result files")))
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"option out={out} is a file, expected a directory")
    batch_size = positive_int(cfg, "batch_size")
    seed = positive_int(cfg, "seed", minimum=0)
    members = (
        positive_int(cfg, "ensemble", maximum=MAX_ENSEMBLE, why=_RUNS_PER_STEP)
        if "ensemble" in cfg
        else 1
    )
    draws = positive_int(
        cfg, "jitter_average", allow_null=True, maximum=MAX_JITTER_AVERAGE, why=_RUNS_PER_STEP
    )
    for key in ("bf16", "cap_delta_unit"):
        if not isinstance(cfg.get(key, True), bool):
            raise ValueError(f"option {key} must be true or false, got {cfg.get(key)!r}")
    if cfg.get("jitter") not in (None, True, False):
        raise ValueError(
            f"option jitter must be true, false or null (the checkpoint's default), got "
            f"{cfg.get('jitter')!r}"
        )
    cutoff = cfg.get("output_filter")
    if cutoff is not None and (
        isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)) or not 0 <= cutoff < 1
    ):
        raise ValueError(
            f"option output_filter must be null (the checkpoint's), 0 (off) or a cutoff in "
            f"(0, 1), got {cutoff!r}"
        )
    limit = cfg.get("spectral_limit")
    if limit is not None:
        try:
            limit = check_spectral_limit(limit)
        except ValueError:
            raise ValueError(
                f"option spectral_limit must be null (the checkpoint's default), 0 (off) or a "
                f"finite number > 0, got {limit!r}"
            ) from None
    perturbation = ensemble_perturbation(cfg, members)
    compile_as = compile_mode(cfg.get("compile", False))
    pl.seed_everything(seed, verbose=False)
    ckpt = load_inference_checkpoint(ckpt_path)
    if cutoff is not None:
        if not hasattr(ckpt.model, "set_output_filter"):
            raise ValueError(
                f"option output_filter: the model in {ckpt_path} "
                f"({type(ckpt.model).__name__}) has no output filter"
            )
        ckpt.model.set_output_filter(float(cutoff))
    compile_model(ckpt.model, compile_as)
    jitter = ckpt.inference_jitter if cfg.get("jitter") is None else bool(cfg.jitter)
    if members > 1 and not jitter:
        raise ValueError(
            f"option ensemble={members} needs jitter=true: the members differ only by their "
            "jitter draws"
        )
    if draws is not None and draws > 1 and not jitter:
        raise ValueError(
            f"option jitter_average={draws} needs jitter=true: the draws differ only by their "
            "jitter"
        )
    draws = draws or ckpt.default_jitter_average(seed if jitter else None)
    limit = ckpt.default_spectral_limit() if limit is None else limit
    data_dir = OmegaConf.select(cfg, "paths.data_dir", default=None)
    data = resolve_data_config(_plain(cfg.get("data")), ckpt, data_dir=data_dir)
    datasets = open_datasets(data, str(cfg.split), ckpt, n_steps_output=n_steps_output)
    folders = result_folder_names(ds.dataset for ds in datasets)
    clash = sorted(set(folders.values()) & RESERVED_NAMES) if len(datasets) > 1 else []
    if clash:
        raise ValueError(
            f"dataset folder {clash[0]!r} would clash with the run's own {clash[0]} in out=; "
            "roll that dataset out on its own"
        )
    planned = plan(data, datasets) if plan is not None else None
    # CPU runs only: on a GPU the allocator's own error becomes one line (walrus.cli)
    if runs_on_cpu(OmegaConf.select(cfg, "trainer.accelerator")):
        for ds in datasets:  # a batch holds at most the dataset's windows
            check_forward_fits(
                ckpt.model,
                [(str(ds.files[0].path), len(ds.field_names), ds.spatial_shape, ds.bcs)],
                min(batch_size, len(ds)),
                int(data["n_steps_input"]),
                training=False,
                batch_option=f"batch_size={batch_size}",
            )
    check_stop("infer.py wrote nothing")  # a signal while loading: nothing written yet
    if is_first_process():  # other ranks start once the first has written its run files
        claim_out(out, cfg.get("overwrite", False))
    write_run_files(cfg, out, LOG_NAME)  # checks passed: .hydra/ and the log into out
    return Prepared(
        ckpt=ckpt,
        data=data,
        datasets=datasets,
        out=out,
        batch_size=batch_size,
        jitter_seed=seed if jitter else None,
        autocast_dtype=torch.bfloat16 if cfg.bf16 else None,
        members=members,
        cap_delta_unit=bool(cfg.get("cap_delta_unit", True)),
        jitter_average=draws,
        spectral_limit=limit,
        perturbation=perturbation,
        folders={name: out / folder for name, folder in folders.items()},
        plan=planned,
    )
