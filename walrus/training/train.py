"""``train(cfg)``: build data, model and trainer from a composed config and fit."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from walrus.atomic import remove_stale_temp_files, write_text_atomic
from walrus.checkpoint import (
    AtomicCheckpointIO,
    build_model,
    check_config_fits,
    load_checkpoint_file,
    load_weights_strict,
    model_state_dict,
    walrus_meta,
)
from walrus.cli import quiet_lightning
from walrus.data.datamodule import resolve_data_root
from walrus.data.normalization import ZScoreNormalizer, build_normalizer
from walrus.data.vocab import FieldVocabulary
from walrus.errors import TrainingInterrupted
from walrus.hub import open_checkpoint
from walrus.memory import check_forward_fits, check_model_fits, model_bytes, runs_on_cpu
from walrus.model.config import WalrusConfig
from walrus.options import check_option_types
from walrus.run_files import is_first_process, write_run_files
from walrus.training.budget import TimeBudget
from walrus.training.callbacks import DataPositionCallback, RNGStateCallback
from walrus.training.checkpointing import (
    BestCheckpoint,
    CtrlCStop,
    LastCheckpoint,
    check_resume_state,
)
from walrus.training.loggers import (
    finish_wandb_runs,
    is_wandb_config,
    quiet_logger_noise,
    wandb_run_name,
)
from walrus.training.resume import (
    RunRecord,
    check_resume_config,
    new_wandb_id,
    override_keys,
    read_record,
    resume_overrides,
)
from walrus.training.run_dir import claim_run_dir, run_dir_for
from walrus.training.summary import job_prefix, print_summary, sweep_job

FREEZE_OPTIONS = (None, "processor")


def _source_checkpoint(cfg: DictConfig) -> tuple[dict | None, dict | None, str | None]:
    """The checkpoint that seeds this run, validated up front: ``ckpt_path`` (resume, any
    experiment; a fine-tune's ``init_from`` is then its record) or ``init_from`` (fine-tune)."""
    resuming = bool(cfg.get("ckpt_path"))
    enabled = cfg.get("finetune", {}).get("enabled")
    if enabled is False and cfg.get("init_from") and not resuming:
        raise ValueError(
            f"finetune.enabled=false trains from scratch, but init_from={cfg.init_from} was given: "
            "drop init_from, or drop finetune.enabled=false to fine-tune"
        )
    if enabled and not cfg.get("init_from") and not resuming:
        raise ValueError(
            f"experiment {cfg.task_name!r} fine-tunes a checkpoint: pass init_from=PATH/TO/last.ckpt "
            "(or ckpt_path=RUN/checkpoints/last.ckpt to resume a run)"
        )
    path = cfg.get("ckpt_path") or cfg.get("init_from")
    if not path:
        return None, None, None
    if not resuming:  # init_from: a walrus checkpoint, an official walrus.pt or hf://ORG/NAME...
        ckpt, file = open_checkpoint(path)
        return ckpt, walrus_meta(ckpt, file), str(path)
    ckpt = load_checkpoint_file(path)
    return ckpt, walrus_meta(ckpt, path), str(path)


def _model_config(cfg: DictConfig, meta: dict | None) -> dict[str, Any]:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if meta is None:
        return model_cfg
    saved = dict(meta["model_config"])
    # Architecture comes from the checkpoint; run-time knobs may follow the current config.
    for knob in WalrusConfig.RUNTIME_OPTIONS:
        if knob in model_cfg:
            saved[knob] = model_cfg[knob]
    return saved


def _record_model(cfg: DictConfig, out_dir: Path, actual: WalrusConfig, source: str) -> None:
    """With a source checkpoint, the architecture is the checkpoint's: rewrite ``config.yaml``
    with the model that actually runs, and say which requested ``model`` options are ignored."""
    requested = OmegaConf.to_container(cfg.model, resolve=True)
    given = set(requested)  # options the model config sets, not WalrusConfig's defaults
    runs = actual.to_dict()
    with contextlib.suppress(ValueError):  # else compared as given; ignored either way
        requested = WalrusConfig.from_dict({**requested, "n_fields": actual.n_fields}).to_dict()
    ignored = [
        f"{k}={requested[k]!r} (checkpoint: {runs[k]!r})"
        for k in sorted(given & set(requested) & set(runs))
        if k not in (*WalrusConfig.RUNTIME_OPTIONS, "n_fields") and requested[k] != runs[k]
    ]
    if ignored:
        rank_zero_info(
            f"note: the architecture comes from {source}; these model options were ignored: "
            f"{', '.join(ignored)} (config.yaml records the model that runs)"
        )
    recorded = OmegaConf.to_container(cfg, resolve=True)
    recorded["model"] = runs
    write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(recorded)))


def _merged_stats(datamodule: Any) -> dict[str, dict[str, float]]:
    """Per-field z-score statistics of every served dataset (``stats.yaml``), merged by name."""
    merged: dict[str, dict[str, float]] = {}
    for name in datamodule.dataset_names:
        for section, table in datamodule.stats(name).items():
            if isinstance(table, dict):
                merged.setdefault(section, {}).update(table)
    return merged


ZSCORE = f"{ZScoreNormalizer.__module__}.{ZScoreNormalizer.__name__}"


def _run_normalizer(
    cfg: DictConfig, datamodule: Any, meta: dict | None, resuming: bool, source: str | None
) -> dict[str, Any]:
    """The ``normalizer`` argument of the module (empty: ``module.normalizer``).

    ``data.normalization=zscore`` switches the dataset-level z-score on, with the statistics of
    this run's data (``stats.yaml``); otherwise the per-sample ``module.normalizer`` runs. A
    fine-tune (``meta``: the source checkpoint's) keeps the kind its weights were trained with:
    asking for the other kind is refused, a per-sample normaliser is the checkpoint's own, and a
    z-score one takes this data's statistics. A resumed run reuses the stored normaliser.

    Raises:
        ValueError: the fine-tune asks for another kind of normalisation than its checkpoint's.
    """
    zscore = getattr(datamodule, "normalization", "rms") == "zscore"
    stored = (meta or {}).get("normalizer")
    if not stored:
        return {"normalizer": ZScoreNormalizer(_merged_stats(datamodule))} if zscore else {}
    if resuming:
        return {"normalizer": build_normalizer(stored)}
    kind = stored.get("_target_", "").rsplit(".", 1)[-1]
    if zscore and stored.get("_target_") != ZSCORE:
        raise ValueError(
            f"data.normalization=zscore: {source} was trained with per-sample normalisation "
            f"({kind}) and a fine-tune keeps it; drop data.normalization=zscore"
        )
    if stored.get("_target_") == ZSCORE:
        if not zscore:
            raise ValueError(
                f"data.normalization={datamodule.normalization}: {source} was trained with the "
                "dataset-level z-score and a fine-tune keeps it; set data.normalization=zscore "
                "(this data's stats.yaml)"
            )
        eps = build_normalizer(stored).eps  # the stored options, checked
        return {"normalizer": ZScoreNormalizer(_merged_stats(datamodule), eps=eps)}
    requested = OmegaConf.select(cfg, "module.normalizer")
    requested = OmegaConf.to_container(requested, resolve=True) if requested else None
    if requested != stored:
        rank_zero_info(
            f"note: the per-sample normaliser comes from {source} ({stored}); "
            f"module.normalizer ({requested}) is not used"
        )
    return {"normalizer": build_normalizer(stored)}


def _freeze(model: torch.nn.Module, what: str | None) -> None:
    if what not in FREEZE_OPTIONS:
        raise ValueError(f"finetune.freeze must be one of {FREEZE_OPTIONS}, got {what!r}")
    if what == "processor":
        for p in model.blocks.parameters():
            p.requires_grad_(False)


def _report_missing_best(trainer: pl.Trainer, last: LastCheckpoint) -> None:
    """Says in one line why a monitoring checkpoint callback wrote no ``best-*.ckpt``."""
    if trainer.fast_dev_run:
        return  # the summary says that a fast_dev_run writes no checkpoint
    holds = (
        "checkpoints/last.ckpt holds the final weights."
        if last.path.is_file()
        else "no checkpoint was written."
    )
    for cb in trainer.checkpoint_callbacks:
        monitor = getattr(cb, "monitor", None)
        if monitor and not getattr(cb, "best_model_path", "") and trainer.is_global_zero:
            rank_zero_info(
                f"No {monitor} was logged (no validation epoch logged it), so no best-*.ckpt "
                f"was written; {holds}"
            )


CHECKED_GROUPS = ("data", "module", "optimizer", "lr_scheduler", "trainer", "callbacks", "logger")


def _check_types(cfg: DictConfig) -> None:
    """Options of the wrong kind are a one-line error naming them, before anything is built."""
    if isinstance(cfg.get("seed"), bool) or not isinstance(cfg.get("seed"), int):
        raise ValueError(f"option seed must be an int, got {cfg.get('seed')!r}")
    for group in CHECKED_GROUPS:
        check_option_types(cfg.get(group), group)
    # torch's own errors for these name no option (lr 0 is allowed: the weights stay as loaded)
    for group, name in (("optimizer", "lr"), ("optimizer", "eps"), ("module", "weight_decay")):
        value = (cfg.get(group) or {}).get(name)  # its kind was checked above
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"option {group}.{name} must be a number >= 0, got {value!r}")


def _output_dir(cfg: DictConfig) -> Path:
    """The run directory: Hydra's run directory, or ``paths.output_dir`` when given; outside a
    Hydra run, a resume's is the checkpoint's run folder."""
    try:
        return Path(cfg.paths.output_dir)
    except InterpolationResolutionError:
        resumed = run_dir_for(cfg.get("ckpt_path"), "")
        if resumed:
            with open_dict(cfg):
                cfg.paths.output_dir = resumed
            return Path(resumed)
        raise ValueError(
            "paths.output_dir is Hydra's run directory, and this config was not composed by a "
            "Hydra run: pass paths.output_dir=DIR"
        ) from None


def train_from_command_line(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """``train.py``'s entry inside a Hydra run: a resume (``ckpt_path=``) is composed again from
    the overrides the run was started with plus this command line's, then :func:`train` runs."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    merged = resume_overrides(overrides)
    if merged != overrides:
        cfg = compose(config_name=hydra_cfg.job.config_name, overrides=merged)
    return train(cfg, overrides=merged)


def train(
    cfg: DictConfig, overrides: Sequence[str] | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """Train (or fine-tune, or resume) a model as ``cfg`` describes.

    Args:
        cfg: the composed config.
        overrides: the command-line overrides ``cfg`` was composed with; recorded in the
            checkpoints (so ``ckpt_path=...`` alone resumes) and named in the W&B run name.

    Returns:
        ``(metrics, objects)``: the final logged metrics as floats, and the ``trainer``,
        ``module``, ``datamodule`` and ``output_dir`` used.
    """
    with job_prefix(sweep_job()):
        return _train(cfg, overrides)


def _check_step_fits(cfg: DictConfig, model_cfg: dict[str, Any], datamodule: Any) -> None:
    """Refuse a CPU run whose training step (activations of one batch of the largest grid,
    plus the weights, gradients and AdamW state) cannot fit in the free memory, before the
    model is built. GPU runs are not checked (their allocator reports the device's limit)."""
    if not runs_on_cpu(OmegaConf.select(cfg, "trainer.accelerator")):
        return
    inputs = getattr(datamodule, "sample_inputs", None)
    batch, frames = getattr(datamodule, "batch_size", None), getattr(datamodule, "n_steps_input", 0)
    if inputs is None or not isinstance(batch, int) or not isinstance(frames, int):
        return  # a datamodule of another kind: nothing to estimate from
    unrolled = OmegaConf.select(cfg, "module.rollout_mode") == "unrolled"
    steps = OmegaConf.select(cfg, "module.rollout_steps", default=1) if unrolled else 1
    check_forward_fits(
        model_cfg,
        inputs,
        batch,
        frames,
        training=True,
        batch_option=f"data.batch_size={batch}",
        to_allocate=model_bytes(model_cfg, "train"),
        grad_steps=steps if isinstance(steps, int) and steps >= 1 else 1,
    )


def _train(
    cfg: DictConfig, overrides: Sequence[str] | None
) -> tuple[dict[str, float], dict[str, Any]]:
    started = time.monotonic()
    quiet_lightning()
    quiet_logger_noise()
    out_dir = _output_dir(cfg)
    _check_types(cfg)
    if is_first_process():  # other ranks start once the first has written into the folder
        claim_run_dir(out_dir, cfg.get("ckpt_path"))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    ckpt, meta, source = _source_checkpoint(cfg)
    resuming = bool(cfg.get("ckpt_path"))
    record = read_record(ckpt, source) if resuming else {}
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if resuming:
        given = override_keys(overrides or ())
        check_resume_config(record.get("config"), resolved, source, given)
    finetuned = bool(cfg.get("init_from") or (record.get("config") or {}).get("init_from"))

    base_vocab = FieldVocabulary.from_dict(meta["vocab"]) if meta else None
    # warns when the old option data.root overrides paths.data_dir
    resolve_data_root(OmegaConf.select(cfg, "paths.data_dir"), OmegaConf.select(cfg, "data.root"))
    datamodule = instantiate(cfg.data, base_vocab=base_vocab)
    datamodule.prepare_data()
    vocab = datamodule.vocab
    if base_vocab is not None and not resuming:
        added = [n for n in vocab.names if n not in base_vocab.names]
        rank_zero_info(
            f"fine-tune: added {len(added)} field(s) to the vocabulary of {source} "
            f"({len(base_vocab)} -> {len(vocab)}): {', '.join(added)}"
            if added
            else f"fine-tune: every field of this data is in the vocabulary of {source}"
        )

    extra = _run_normalizer(cfg, datamodule, meta if finetuned else None, resuming, source)
    model_cfg = _model_config(cfg, meta)
    if meta is None:
        model_cfg["n_fields"] = max(int(model_cfg.get("n_fields", 0)), len(vocab))
        # one encoder/decoder set per data dimensionality, unless the config fixes them
        model_cfg.setdefault("include_d", datamodule.spatial_dims)
    if source:  # sizes checked against the stored weights before anything is allocated
        check_config_fits(model_cfg, model_state_dict(ckpt, source), source)
    check_model_fits(model_cfg, "train")  # weights, gradients, AdamW state vs free memory
    _check_step_fits(cfg, model_cfg, datamodule)
    try:
        model = build_model(model_cfg)
    except ValueError as e:
        raise ValueError(f"checkpoint {source}: {e}" if source else str(e)) from None
    if not resuming and cfg.get("init_from"):
        load_weights_strict(model, model_state_dict(ckpt), source)
        if len(vocab) > model_cfg["n_fields"]:
            model.resize_vocab(len(vocab))
            model_cfg["n_fields"] = len(vocab)
        model.grow_dims(datamodule.spatial_dims)  # fresh sets for new data dimensionalities
        if model.shared_fields and added:  # new fields start among the known ones
            model.init_new_fields(vocab.ids(added).tolist(), list(range(len(base_vocab))))
    elif resuming and any(model.encoder_key(d) is None for d in datamodule.spatial_dims):
        raise ValueError(
            f"cannot resume from {source}: this run's data has {datamodule.spatial_dims}-D "
            f"datasets and the model has encoders for {list(model.include_d)}-D data only; "
            "fine-tune with init_from= to add them"
        )
    elif resuming and meta["vocab"] != vocab.to_dict():
        raise ValueError(
            f"cannot resume from {source}: its field vocabulary differs from this run's data; "
            "resume with the same data config, or fine-tune with init_from="
        )
    _freeze(model, cfg.finetune.get("freeze") if cfg.get("finetune") else None)

    module = instantiate(cfg.module)(
        **extra,
        model=model,
        optimizer=instantiate(cfg.optimizer),
        lr_scheduler=instantiate(cfg.lr_scheduler) if cfg.get("lr_scheduler") else None,
        model_config=model.config.to_dict(),  # validated plain data
        vocab=vocab.to_dict(),
        data_config=OmegaConf.to_container(cfg.data, resolve=True),
    )
    if resuming:  # before any logger writes into the run folder
        check_resume_state(ckpt, source, module)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    for required in (RNGStateCallback, DataPositionCallback):  # exact resume
        if not any(isinstance(c, required) for c in callbacks):
            callbacks.append(required())
    for best in (c for c in callbacks if isinstance(c, BestCheckpoint)):
        best.resuming = resuming
    last = next((c for c in callbacks if isinstance(c, LastCheckpoint)), None)
    if last is None:  # the final state is always saved
        last = LastCheckpoint(out_dir / "checkpoints")
        callbacks.append(last)
    max_time = cfg.trainer.get("max_time")
    if max_time is not None and not any(isinstance(c, TimeBudget) for c in callbacks):
        callbacks.append(TimeBudget(max_time))  # replaces Lightning's Timer
    wandb_id = record.get("wandb_id") or new_wandb_id()
    callbacks.append(RunRecord(resolved, overrides, wandb_id))
    loggers = []
    for logger_cfg in (cfg.get("logger") or {}).values():
        if logger_cfg is None:
            continue
        kwargs: dict[str, Any] = {}
        if is_wandb_config(logger_cfg):
            kwargs["id"] = wandb_id  # a resume continues the same W&B run
            if logger_cfg.get("name") in (None, cfg.get("task_name")):
                kwargs["name"] = wandb_run_name(cfg.get("task_name"), overrides)
        loggers.append(instantiate(logger_cfg, **kwargs))
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],
        max_time=None,
    )
    # checks passed: now write into the run dir (nothing before: a refused run leaves nothing)
    for folder in (out_dir, out_dir / "checkpoints"):  # left by a run killed mid-write
        remove_stale_temp_files(folder)
    write_run_files(cfg, out_dir, "train.log")
    for logger in loggers:  # every logger records the settings
        logger.log_hyperparams(resolved)
    write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if source:
        _record_model(cfg, out_dir, model.config, source)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except CtrlCStop:
        raise TrainingInterrupted(trainer.global_step, str(last.path), "SIGINT") from None
    except SIGTERMException:
        raise TrainingInterrupted(trainer.global_step, str(last.path)) from None
    finally:
        finish_wandb_runs(loggers)  # a later train() in this process must not reuse the run

    _report_missing_best(trainer, last)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics_path = out_dir / "metrics.json"
    if not metrics and metrics_path.is_file():
        # nothing ran (e.g. resuming a finished run): keep the last good metrics
        metrics = json.loads(metrics_path.read_text())
    elif trainer.is_global_zero:
        write_text_atomic(metrics_path, json.dumps(metrics, indent=2, sort_keys=True))
    print_summary(trainer, out_dir, last.path, time.monotonic() - started, metrics)
    objects = {
        "trainer": trainer,
        "module": module,
        "datamodule": datamodule,
        "output_dir": out_dir,
    }
    return metrics, objects
