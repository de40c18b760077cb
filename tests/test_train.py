"""Training end to end on tiny data: experiments, resume, fine-tune, logging, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import REPO, tiny_train_overrides
from walrus.checkpoint import load_checkpoint_file, load_model, model_state_dict
from walrus.training.train import train


class PoisonWeightsInSecondEpoch(pl.Callback):
    """Makes the weights NaN before the second epoch's first step, as a divergence would."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == 1:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


class StopAfterFirstEpoch(pl.Callback):
    """Interrupts a run after its first epoch, as a crash or a pre-emption would."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def _train(compose_cfg, data_root, out_dir, *extra, experiment="quickstart"):
    cfg = compose_cfg("train", [*tiny_train_overrides(data_root, out_dir, experiment), *extra])
    return train(cfg)


def _cli(*args, cwd=REPO, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("WALRUS_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("experiment", ["quickstart", "multi"])
def test_fast_dev_run_of_each_experiment(compose_cfg, tiny_data_root, tmp_path, experiment):
    extra = ["debug=fast_dev_run"]
    if experiment == "multi":
        extra.append("data.datasets=[navier_stokes_2d,gray_scott_2d]")
    metrics, objects = _train(compose_cfg, tiny_data_root, tmp_path, *extra, experiment=experiment)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert "val/vrmse" in metrics
    assert objects["trainer"].global_step == 1


def test_run_writes_config_checkpoints_and_logs(compose_cfg, tiny_data_root, tmp_path):
    metrics, _ = _train(compose_cfg, tiny_data_root, tmp_path)
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert (tmp_path / "logs" / "metrics.csv").is_file()
    assert json.loads((tmp_path / "metrics.json").read_text())["val/vrmse"] == pytest.approx(
        metrics["val/vrmse"]
    )
    # The checkpoint alone rebuilds the model, weights-only.
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    meta = ckpt["walrus"]
    assert meta["vocab"]["names"][:3] == ["vorticity", "velocity_x", "velocity_y"]
    assert meta["data_config"]["datasets"] == ["navier_stokes_2d"]
    assert meta["normalizer"] == {
        "_target_": "walrus.data.normalization.RMSNormalizer",
        "eps": 1e-4,
        "delta": "window",
    }
    model, vocab = load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert "vorticity" in vocab
    for k, v in model.state_dict().items():
        assert torch.equal(v, model_state_dict(ckpt)[k])


def test_logged_metrics_cover_loss_lr_gradnorm_and_val(compose_cfg, tiny_data_root, tmp_path):
    metrics, _ = _train(compose_cfg, tiny_data_root, tmp_path, "trainer.log_every_n_steps=1")
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "val/vrmse",
        "val/vrmse_persistence",
        "val/rollout_vrmse",
        "val/vrmse/navier_stokes_2d/vorticity",
    ):
        assert key in metrics, key


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return model_state_dict(load_checkpoint_file(path))


def test_resume_matches_uninterrupted_run(compose_cfg, tiny_data_root, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["trainer.limit_train_batches=3", "model.jitter=true", "trainer.max_epochs=3"]
    _train(compose_cfg, tiny_data_root, full, *common)
    stop = "+callbacks.stop._target_=tests.test_train.StopAfterFirstEpoch"
    _train(compose_cfg, tiny_data_root, part, *common, stop)
    first = _weights(part / "checkpoints" / "last.ckpt")
    _train(
        compose_cfg,
        tiny_data_root,
        part,
        *common,
        f"ckpt_path={part / 'checkpoints' / 'last.ckpt'}",
    )
    a, b = (
        _weights(full / "checkpoints" / "last.ckpt"),
        _weights(part / "checkpoints" / "last.ckpt"),
    )
    assert any(not torch.equal(first[k], b[k]) for k in b), "resumed run did not train"
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sched_a = load_checkpoint_file(full / "checkpoints" / "last.ckpt")["lr_schedulers"][0]
    sched_b = load_checkpoint_file(part / "checkpoints" / "last.ckpt")["lr_schedulers"][0]
    assert sched_a["last_epoch"] == sched_b["last_epoch"] == 9


def test_finetune_adds_new_fields_and_keeps_old_ones(compose_cfg, tiny_data_root, tmp_path):
    _train(compose_cfg, tiny_data_root, tmp_path / "pre", "model.n_fields=3")
    src = tmp_path / "pre" / "checkpoints" / "last.ckpt"
    old = _weights(src)
    _train(
        compose_cfg,
        tiny_data_root,
        tmp_path / "ft",
        f"init_from={src}",
        "finetune.freeze=processor",
        experiment="finetune",
    )
    ckpt = load_checkpoint_file(tmp_path / "ft" / "checkpoints" / "last.ckpt")
    names = ckpt["walrus"]["vocab"]["names"]
    assert names == ["vorticity", "velocity_x", "velocity_y", "A", "B"]
    assert ckpt["walrus"]["model_config"]["n_fields"] == 5
    new = model_state_dict(ckpt)
    frozen = [k for k in old if k.startswith("blocks.")]
    assert frozen and all(torch.equal(old[k], new[k]) for k in frozen)
    grown = [k for k in new if k in old and new[k].shape != old[k].shape]
    assert grown, "no embedding/decoder tensor grew with the vocabulary"


def test_wandb_offline_run_leaves_local_directory(
    compose_cfg, tiny_data_root, tmp_path, monkeypatch
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _train(compose_cfg, tiny_data_root, tmp_path, "logger=wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline run under {tmp_path / 'wandb'}"


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(compose_cfg, tiny_data_root, tmp_path):
    from walrus.errors import NonFiniteLossError

    poison = "+callbacks.poison._target_=tests.test_train.PoisonWeightsInSecondEpoch"
    with pytest.raises(
        NonFiniteLossError, match=r"global step 2 \(batch 0, dataset 'navier_stokes_2d'"
    ):
        _train(compose_cfg, tiny_data_root, tmp_path, "trainer.max_epochs=2", poison)
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in model_state_dict(ckpt).values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["experiment=nope"], "nope"),
        (["experiment=quickstart", "no_such_key=1"], "no_such_key"),
        (["experiment=finetune"], "init_from"),
    ],
)
def test_bad_config_gets_clear_message(args, message, tmp_path):
    r = _cli(
        *args,
        f"paths.output_dir={tmp_path}",
        f"paths.data_dir={tmp_path}/data",
        "data.generate_if_missing=false",
    )
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_data_root_is_reported(tmp_path):
    r = _cli(
        "experiment=quickstart",
        f"paths.output_dir={tmp_path}",
        f"paths.data_dir={tmp_path}/nowhere",
        "data.generate_if_missing=false",
    )
    assert r.returncode == 2
    assert "nowhere" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["missing", "corrupt", "incompatible"])
def test_bad_checkpoint_is_reported(compose_cfg, tiny_data_root, tmp_path, kind):
    path = tmp_path / "bad.ckpt"
    if kind == "corrupt":
        path.write_bytes(b"not a checkpoint at all")
    elif kind == "incompatible":
        torch.save({"state_dict": {"model.x": torch.zeros(1)}}, path)
    with pytest.raises((ValueError, FileNotFoundError), match="bad.ckpt"):
        _train(compose_cfg, tiny_data_root, tmp_path / "run", f"ckpt_path={path}")


def test_incompatible_weights_are_listed(compose_cfg, tiny_data_root, tmp_path):
    _train(compose_cfg, tiny_data_root, tmp_path / "pre")
    src = tmp_path / "pre" / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint_file(src)
    ckpt["state_dict"].pop(next(iter(ckpt["state_dict"])))
    ckpt["state_dict"]["model.extra.weight"] = torch.zeros(2)
    torch.save(ckpt, tmp_path / "edited.ckpt")
    with pytest.raises(
        ValueError, match=r"missing keys \(1\).*\n.*unexpected keys \(1\): extra.weight"
    ):
        _train(
            compose_cfg,
            tiny_data_root,
            tmp_path / "ft",
            f"init_from={tmp_path / 'edited.ckpt'}",
            experiment="finetune",
        )


def test_finetune_with_conflicting_fields_is_reported(compose_cfg, tiny_data_root, tmp_path):
    with pytest.raises(ValueError, match="velocity_x"):
        _train(
            compose_cfg,
            tiny_data_root,
            tmp_path,
            "data.datasets=[{name: navier_stokes_2d, fields: [velocity_x, velocity_x]}]",
        )


def test_ddp_two_cpu_processes_shard_data_and_stay_in_sync(tiny_data_root, tmp_path):
    overrides = [
        o for o in tiny_train_overrides(tiny_data_root, tmp_path) if not o.startswith("trainer=")
    ]
    r = _cli(
        *overrides,
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.limit_train_batches=null",
        "trainer.max_epochs=1",
        "data.batch_size=1",
        "callbacks=audit",
        "callbacks.progress_bar=null",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    audits = [json.loads((tmp_path / f"audit_rank{i}.json").read_text()) for i in (0, 1)]
    seen = [{tuple(s) for s in a["samples"]} for a in audits]
    assert seen[0] and seen[1]
    assert not seen[0] & seen[1], "ranks trained on the same windows"
    assert audits[0]["weights_sha256"] == audits[1]["weights_sha256"]


@pytest.mark.parametrize(
    "options",
    [
        ["module.predict_delta=false", "module.loss=mse"],
        ["trainer.precision=bf16-mixed", "model.grad_checkpointing=true"],
    ],
    ids=["full-state-mse", "bf16-checkpointing"],
)
def test_training_options_run(compose_cfg, tiny_data_root, tmp_path, options):
    metrics, objects = _train(compose_cfg, tiny_data_root, tmp_path, "debug=fast_dev_run", *options)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    module = objects["module"]
    assert module.predict_delta == ("module.predict_delta=false" not in options)


def test_torch_compile_option_trains(compose_cfg, tiny_data_root, tmp_path):
    metrics, objects = _train(
        compose_cfg, tiny_data_root, tmp_path, "debug=fast_dev_run", "module.compile=true"
    )
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    blocks = objects["module"].model.blocks
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert not any("_orig_mod" in k for k in objects["module"].state_dict())


def test_zscore_data_option_trains_with_stats_yaml(compose_cfg, tiny_data_root, tmp_path):
    from walrus.data.normalization import ZScoreNormalizer

    _, objects = _train(compose_cfg, tiny_data_root, tmp_path, "data.normalization=zscore")
    normalizer = objects["module"].normalizer
    assert isinstance(normalizer, ZScoreNormalizer)
    assert set(normalizer.stats["mean"]) >= {"vorticity", "velocity_x", "velocity_y"}
    meta = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")["walrus"]
    assert meta["normalizer"]["_target_"].endswith("ZScoreNormalizer")


def test_model_config_from_a_file_is_data_not_instantiated():
    from walrus.checkpoint import build_model

    base = {"_target_": "walrus.model.walrus.Walrus", "n_fields": 4, "dim": 16, "depth": 1,
            "heads": 2, "projection_dim": 8, "intermediate_dim": 16, "groups": 4}  # fmt: skip
    assert build_model(base).dim == 16
    with pytest.raises(ValueError, match="entry 'groups' must be a plain value"):
        build_model({**base, "groups": {"_target_": "os.getcwd"}})
    with pytest.raises(ValueError, match="not an attention kernel"):
        build_model({**base, "temporal_kernel": "${oc.env:HOME}"})  # never resolved
    with pytest.raises(ValueError, match="cannot build the model from its config"):
        build_model({**base, "no_such_option": 1})
