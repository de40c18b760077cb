"""``train(cfg)``: build data, model and trainer from a composed config and fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from walrus.atomic import write_text_atomic
from walrus.checkpoint import (
    AtomicCheckpointIO,
    build_model,
    load_checkpoint_file,
    load_weights_strict,
    model_state_dict,
    walrus_meta,
)
from walrus.data.normalization import ZScoreNormalizer, build_normalizer
from walrus.data.vocab import FieldVocabulary
from walrus.training.callbacks import RNGStateCallback

FREEZE_OPTIONS = (None, "processor")


def _source_checkpoint(cfg: DictConfig) -> tuple[dict | None, dict | None, str | None]:
    """The checkpoint that seeds this run (fine-tune or resume), validated up front."""
    if cfg.get("finetune", {}).get("enabled") and not cfg.get("init_from"):
        raise ValueError(
            f"experiment {cfg.task_name!r} fine-tunes a checkpoint: pass init_from=PATH/TO/last.ckpt"
        )
    if cfg.get("init_from") and cfg.get("ckpt_path"):
        raise ValueError(
            "give either init_from (fine-tune, weights only) or ckpt_path (resume), not both"
        )
    path = cfg.get("init_from") or cfg.get("ckpt_path")
    if not path:
        return None, None, None
    ckpt = load_checkpoint_file(path)
    return ckpt, walrus_meta(ckpt, path), str(path)


def _model_config(cfg: DictConfig, meta: dict | None) -> dict[str, Any]:
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if meta is None:
        return model_cfg
    saved = dict(meta["model_config"])
    # Architecture comes from the checkpoint; run-time knobs may follow the current config.
    for knob in ("grad_checkpointing", "drop_path", "temporal_kernel", "spatial_kernel", "jitter"):
        if knob in model_cfg:
            saved[knob] = model_cfg[knob]
    return saved


def _merged_stats(datamodule: Any) -> dict[str, dict[str, float]]:
    """Per-field z-score statistics of every served dataset (``stats.yaml``), merged by name."""
    merged: dict[str, dict[str, float]] = {}
    for name in datamodule.dataset_names:
        for section, table in datamodule.stats(name).items():
            if isinstance(table, dict):
                merged.setdefault(section, {}).update(table)
    return merged


def _freeze(model: torch.nn.Module, what: str | None) -> None:
    if what not in FREEZE_OPTIONS:
        raise ValueError(f"finetune.freeze must be one of {FREEZE_OPTIONS}, got {what!r}")
    if what == "processor":
        for p in model.blocks.parameters():
            p.requires_grad_(False)


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train (or fine-tune, or resume) a model as ``cfg`` describes.

    Returns:
        ``(metrics, objects)``: the final logged metrics as floats, and the ``trainer``,
        ``module``, ``datamodule`` and ``output_dir`` used.
    """
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    ckpt, meta, source = _source_checkpoint(cfg)
    base_vocab = FieldVocabulary.from_dict(meta["vocab"]) if meta else None
    datamodule = instantiate(cfg.data, base_vocab=base_vocab)
    datamodule.prepare_data()
    vocab = datamodule.vocab

    model_cfg = _model_config(cfg, meta)
    if meta is None:
        model_cfg["n_fields"] = max(int(model_cfg.get("n_fields", 0)), len(vocab))
    model = build_model(model_cfg)
    if cfg.get("init_from"):
        load_weights_strict(model, model_state_dict(ckpt), source)
        if len(vocab) > model_cfg["n_fields"]:
            model.resize_vocab(len(vocab))
            model_cfg["n_fields"] = len(vocab)
    elif cfg.get("ckpt_path") and meta["vocab"] != vocab.to_dict():
        raise ValueError(
            f"cannot resume from {source}: its field vocabulary differs from this run's data; "
            "resume with the same data config, or fine-tune with init_from="
        )
    _freeze(model, cfg.finetune.get("freeze") if cfg.get("finetune") else None)

    extra = {}
    if cfg.get("init_from") and meta.get("normalizer"):
        # A fine-tuned model keeps the normalisation its weights were trained with.
        extra["normalizer"] = build_normalizer(meta["normalizer"])
    elif getattr(datamodule, "normalization", "rms") == "zscore":
        extra["normalizer"] = ZScoreNormalizer(_merged_stats(datamodule))
    module = instantiate(cfg.module)(
        **extra,
        model=model,
        optimizer=instantiate(cfg.optimizer),
        lr_scheduler=instantiate(cfg.lr_scheduler) if cfg.get("lr_scheduler") else None,
        model_config=model_cfg,
        vocab=vocab.to_dict(),
        data_config=OmegaConf.to_container(cfg.data, resolve=True),
    )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not any(isinstance(c, RNGStateCallback) for c in callbacks):
        callbacks.append(RNGStateCallback())
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer: pl.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if trainer.is_global_zero:
        write_text_atomic(out_dir / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True))
    objects = {
        "trainer": trainer,
        "module": module,
        "datamodule": datamodule,
        "output_dir": out_dir,
    }
    return metrics, objects
