"""Training end to end on tiny data: experiments, resume, fine-tune, logging, bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import REPO, tiny_train_overrides
from walrus.checkpoint import atomic_torch_save, load_checkpoint_file, load_model, model_state_dict
from walrus.training.budget import TimeBudget
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
        if trainer.current_epoch == 0:
            trainer.should_stop = True


class StopAfterStep4(pl.Callback):
    """Interrupts a run in the middle of its second epoch (3 batches per epoch)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 4:
            trainer.should_stop = True


def _train(compose_cfg, data_root, out_dir, *extra, experiment="quickstart"):
    cfg = compose_cfg("train", [*tiny_train_overrides(data_root, out_dir, experiment), *extra])
    return train(cfg)


def _cli(*args, cwd=REPO, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("WALRUS_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
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


_UNINTERRUPTED: list[Path] = []


@pytest.mark.parametrize("stop", ["StopAfterFirstEpoch", "StopAfterStep4"])
@pytest.mark.parametrize("max_steps", [-1, 9])
def test_resume_matches_uninterrupted_run(
    compose_cfg, tiny_data_root, tmp_path, tmp_path_factory, stop, max_steps
):
    # stopped at an epoch's end or inside an epoch, with and without a step cap (Lightning
    # resumes the two differently)
    part = tmp_path / "part"
    common = ["trainer.limit_train_batches=3", "model.jitter=true", "trainer.max_epochs=3"]
    if not _UNINTERRUPTED:  # 9 steps either way: one reference run serves every case
        _UNINTERRUPTED.append(tmp_path_factory.mktemp("full"))
        _train(compose_cfg, tiny_data_root, _UNINTERRUPTED[0], *common)
    full = _UNINTERRUPTED[0]
    common.append(f"trainer.max_steps={max_steps}")
    stop = f"+callbacks.stop._target_=tests.test_train.{stop}"
    _, objects = _train(compose_cfg, tiny_data_root, part, *common, stop)
    stopped_at = objects["trainer"].global_step
    first = _weights(part / "checkpoints" / "last.ckpt")
    _, objects = _train(
        compose_cfg,
        tiny_data_root,
        part,
        *common,
        stop,  # a resume keeps the run's options (the callback stops once only)
        f"ckpt_path={part / 'checkpoints' / 'last.ckpt'}",
    )
    assert stopped_at < 9
    assert (objects["trainer"].global_step, objects["trainer"].current_epoch) == (9, 3)
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


def test_resume_with_more_epochs_under_a_step_cap(compose_cfg, tiny_data_root, tmp_path):
    # stopped by max_epochs with max_steps set and not reached: a larger max_epochs trains on
    common = ["trainer.limit_train_batches=3", "trainer.max_steps=600"]
    _train(compose_cfg, tiny_data_root, tmp_path, *common, "trainer.max_epochs=1")
    last = tmp_path / "checkpoints" / "last.ckpt"
    _, objects = _train(
        compose_cfg, tiny_data_root, tmp_path, *common, "trainer.max_epochs=2", f"ckpt_path={last}"
    )
    assert (objects["trainer"].global_step, objects["trainer"].current_epoch) == (6, 2)
    assert load_checkpoint_file(last)["global_step"] == 6


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
    atomic_torch_save(ckpt, tmp_path / "edited.ckpt")  # an edited file gets fresh checksums
    with pytest.raises(
        ValueError, match=r"missing keys \(1\).*unexpected keys \(1\): extra.weight"
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


@pytest.mark.slow  # .ci/run runs it after make test
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


@pytest.mark.slow  # .ci/run runs it after make test
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tick(pl.Callback):
    """Gives the time budget a fake clock: ``train_s`` per training step, ``val_s`` per
    validation batch (the sanity check's included)."""

    def __init__(self, train_s: float = 10.0, val_s: float = 0.0) -> None:
        self.clock = FakeClock()
        self.train_s, self.val_s = train_s, val_s

    def setup(self, trainer, pl_module, stage) -> None:
        next(c for c in trainer.callbacks if isinstance(c, TimeBudget)).clock = self.clock

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.now += self.train_s

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.clock.now += self.val_s


def _time_capped(compose_cfg, tiny_data_root, tmp_path, *extra):
    metrics, objects = _train(
        compose_cfg,
        tiny_data_root,
        tmp_path,
        "trainer.max_time=00:00:01:40",  # 100 s of fake time
        "trainer.max_epochs=100",  # 200 steps: the step budget is far away
        "+callbacks.tick._target_=tests.test_train.Tick",
        *extra,
    )
    trainer = objects["trainer"]
    tick = next(c for c in trainer.callbacks if type(c).__name__ == "Tick")  # Hydra imported it
    return metrics, trainer, tick


def test_time_budget_ends_the_run_with_the_lr_at_its_floor(compose_cfg, tiny_data_root, tmp_path):
    metrics, trainer, tick = _time_capped(compose_cfg, tiny_data_root, tmp_path)
    # 10 s steps, validation free: the 9th step ends at 90 s and a 10th would end at 100 s
    assert trainer.global_step == 9 and tick.clock.now == pytest.approx(90.0)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert lr == pytest.approx(scheduler.base_lrs[0] * scheduler.min_ratio, rel=1e-6)
    assert "val/vrmse" in metrics
    # the budget's clock is saved with the run and carries over a resume
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    saved = [v for k, v in ckpt["callbacks"].items() if "TimeBudget" in k]
    assert saved and saved[0]["elapsed"] == pytest.approx(90.0)


def test_time_budget_keeps_room_for_the_final_validation(compose_cfg, tiny_data_root, tmp_path):
    metrics, trainer, tick = _time_capped(
        compose_cfg,
        tiny_data_root,
        tmp_path,
        "+callbacks.tick.val_s=5.0",
        "trainer.num_sanity_val_steps=1",  # measures 5 s per validation batch
        "data.max_val_windows=4",
        "trainer.limit_val_batches=2",  # a full validation: 10 s
    )
    # sanity 5 s; per epoch 2 steps (20 s) + validation (10 s). Training stops after the step
    # where one more step and the final validation would pass 100 s.
    assert trainer.global_step == 6
    assert 90.0 <= tick.clock.now <= 100.0
    assert "val/vrmse" in metrics  # the final validation ran, inside the budget
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert lr == pytest.approx(scheduler.base_lrs[0] * scheduler.min_ratio, rel=1e-6)


def test_time_budget_resumed_after_ctrl_c_keeps_room_for_the_final_validation(
    compose_cfg, tiny_data_root, tmp_path
):
    from walrus.errors import TrainingInterrupted

    common = [
        "+callbacks.tick.val_s=5.0",
        "data.max_val_windows=4",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=1",
        "trainer.limit_train_batches=null",
        "+callbacks.int._target_=tests.test_reliability.SigintAt",
        "+callbacks.int.step=2",
    ]  # fmt: skip  (one long epoch: no validation between the sanity check and the stop)
    with pytest.raises(TrainingInterrupted):
        _time_capped(compose_cfg, tiny_data_root, tmp_path, *common)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert load_checkpoint_file(last)["global_step"] == 2
    # the resume skips the sanity check (mid-epoch): the validation time measured before the
    # interruption is kept with the budget's clock
    metrics, trainer, tick = _time_capped(
        compose_cfg, tiny_data_root, tmp_path, *common, f"ckpt_path={last}"
    )
    budget = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
    assert "val/vrmse" in metrics and budget.reserve() == pytest.approx(10.0)
    assert 90.0 <= budget.elapsed() <= 100.0  # the final validation (10 s) fit in


def test_time_budget_state_keeps_timings_and_drops_malformed_rows():
    budget = TimeBudget(100.0)
    budget._val_s, budget._train_s = {"a": [10.0, 2]}, {None: [30.0, 3]}
    budget._full_val_batches = {"a": 4.0}
    again = TimeBudget(100.0)
    again.load_state_dict(budget.state_dict())
    assert again.reserve() == pytest.approx(20.0) and again.next_step_seconds() == 10.0
    bad = TimeBudget(100.0)
    bad.load_state_dict(
        {"elapsed": 5.0, "val_s": [["a", float("nan"), 1], [3, 1.0, 1], "x"], "val_batches": {}}
    )
    assert bad._val_s == {} and bad._full_val_batches == {} and bad.elapsed() == 5.0


def test_bad_time_budget_is_reported(compose_cfg, tiny_data_root, tmp_path):
    with pytest.raises(ValueError, match=r"trainer.max_time must be DD:HH:MM:SS.*'5min'"):
        _train(compose_cfg, tiny_data_root, tmp_path, "trainer.max_time=5min")


def test_progress_lines_when_stdout_is_not_a_terminal(
    compose_cfg, tiny_data_root, tmp_path, capsys
):
    _train(compose_cfg, tiny_data_root, tmp_path, "callbacks.progress_line.every_n_steps=1")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if re.match(r"step \d", ln)]
    pattern = r"step (\d)/2  loss [-+.\de]+  [.\d]+ samples/s  ETA \d+:\d\d:\d\d"
    assert [re.fullmatch(pattern, ln).group(1) for ln in lines] == ["1", "2"], lines


def test_progress_line_shows_the_time_budget_when_it_binds(
    compose_cfg, tiny_data_root, tmp_path, capsys
):
    # 100 s of fake time at 10 s a step ends the run long before its 200 steps
    _time_capped(compose_cfg, tiny_data_root, tmp_path, "callbacks.progress_line.every_n_steps=1")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if re.match(r"step \d", ln)]
    lines = lines[1:]  # at the first line the budget has timed no step on its (fake) clock
    assert lines and all("/200" not in ln for ln in lines), lines
    steps = [re.match(r"step (\d+)  time 0:0[01]:\d\d/0:01:40  loss ", ln) for ln in lines]
    assert all(steps) and steps[-1].group(1) == "9", lines


def test_progress_line_is_silent_on_a_terminal(compose_cfg, tiny_data_root, tmp_path, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    from walrus.training.progress import ProgressLine

    tty, pipe = ProgressLine(every_n_steps=1, stream=Terminal()), ProgressLine(stream=io.StringIO())
    assert not tty.enabled() and pipe.enabled()
    with pytest.raises(ValueError, match="every_n_steps or every_seconds"):
        ProgressLine(every_n_steps=None, every_seconds=None)


def test_cli_run_dir_from_hydra_progress_and_no_noise(tiny_data_root, tmp_path):
    run = tmp_path / "moved"
    overrides = [o for o in tiny_train_overrides(tiny_data_root, tmp_path) if "output_dir" not in o]
    r = _cli(
        *overrides,
        f"hydra.run.dir={run}",
        "trainer.max_steps=1",
        "trainer.check_val_every_n_epoch=2",  # so it ends without validating
        "callbacks.progress_line.every_n_steps=1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("config.yaml", "metrics.json", "checkpoints/last.ckpt", "train.log", ".hydra"):
        assert (run / name).exists(), name
    out = r.stdout + r.stderr
    assert re.search(r"^step 1/1  loss ", r.stdout, re.M), out[-3000:]
    assert "litlogger" not in out and "could not find the monitored key" not in out
    assert "no best-*.ckpt was written; checkpoints/last.ckpt holds the final weights" in out


def test_cli_multirun_gives_each_job_its_own_directory(tiny_data_root, tmp_path):
    overrides = [o for o in tiny_train_overrides(tiny_data_root, tmp_path) if "output_dir" not in o]
    r = _cli(
        "-m", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}", "debug=fast_dev_run", "seed=0,1"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):  # each job's console lines say which job they come from
        pattern = rf"^\[job {job}\] (INFO: )?Run finished: stopped by debug=fast_dev_run"
        assert re.search(pattern, r.stdout + r.stderr, re.M), (r.stdout + r.stderr)[-3000:]
        cfg = (tmp_path / "sweep" / job / "config.yaml").read_text()
        assert f"seed: {job}" in cfg
        assert f"output_dir: {tmp_path / 'sweep' / job}" in cfg


def test_config_composed_outside_a_hydra_run_needs_an_output_dir(compose_cfg, tiny_data_root):
    overrides = [
        o for o in tiny_train_overrides(tiny_data_root, Path(".")) if "output_dir" not in o
    ]
    with pytest.raises(ValueError, match="pass paths.output_dir=DIR"):
        train(compose_cfg("train", overrides))


def test_cli_resume_continues_in_the_checkpoints_folder(tiny_data_root, tmp_path):
    run = tmp_path / "run"
    overrides = [
        o
        for o in tiny_train_overrides(tiny_data_root, tmp_path)
        if not o.startswith(("paths.output_dir=", "trainer.max_epochs="))
    ]
    r = _cli(*overrides, f"hydra.run.dir={run}", "trainer.max_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    # no hydra.run.dir and no other option: the run's own folder and config
    r = _cli(f"ckpt_path={last}", "trainer.max_steps=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()  # no new dated folder
    assert load_checkpoint_file(last)["global_step"] == 2
    assert f"resume:     python train.py ckpt_path={last}" in r.stdout + r.stderr
    assert "model: tiny" not in (run / "config.yaml").read_text()  # the run's resolved config
    assert "dim: 32" in (run / "config.yaml").read_text()


def _epoch_end_state(completed: int, batches_done: int, last: bool) -> dict:
    epoch = {"ready": 2, "started": 2, "processed": 2, "completed": completed}
    batch = dict.fromkeys(("ready", "started", "processed", "completed"), batches_done)
    return {
        "loops": {
            "fit_loop": {
                "epoch_progress": {"total": dict(epoch), "current": dict(epoch)},
                "epoch_loop.batch_progress": {
                    "total": dict(batch),
                    "current": dict(batch),
                    "is_last_batch": last,
                },
            }
        }
    }


def test_settle_epoch_progress_on_constructed_loop_states():
    from walrus.training.checkpointing import settle_epoch_progress

    def epochs(ckpt):
        return ckpt["loops"]["fit_loop"]["epoch_progress"]["total"]

    def batches(ckpt):
        return ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]

    finished = _epoch_end_state(completed=1, batches_done=3, last=True)
    settle_epoch_progress(finished)  # the second epoch ran to its end: it is completed
    assert epochs(finished) == {"ready": 2, "started": 2, "processed": 2, "completed": 2}
    assert batches(finished)["current"] == dict.fromkeys(batches(finished)["current"], 0)
    assert batches(finished)["total"]["ready"] == 3 and not batches(finished)["is_last_batch"]

    cut = _epoch_end_state(completed=1, batches_done=1, last=False)
    settle_epoch_progress(cut)  # stopped after one batch of it: still in progress
    assert epochs(cut) == {"ready": 2, "started": 2, "processed": 1, "completed": 1}
    assert batches(cut)["current"]["ready"] == 1

    mid = _epoch_end_state(completed=1, batches_done=1, last=False)
    mid["loops"]["fit_loop"]["epoch_progress"]["total"]["processed"] = 1  # saved mid-epoch
    before = json.dumps(mid, sort_keys=True)
    settle_epoch_progress(mid)
    assert json.dumps(mid, sort_keys=True) == before
    for odd in ({}, {"loops": 3}, {"loops": {"fit_loop": {"epoch_progress": 1}}}):
        settle_epoch_progress(odd)  # not a resumable state: left alone, no error


def test_run_ending_inside_an_epoch_at_max_steps_validates_its_final_weights(
    compose_cfg, tiny_data_root, tmp_path
):
    # 3 batches per epoch, max_steps=4: the run ends after the first batch of epoch 1
    _, objects = _train(
        compose_cfg,
        tiny_data_root,
        tmp_path,
        "trainer.limit_train_batches=3",
        "trainer.max_epochs=2",
        "trainer.max_steps=4",
    )
    assert objects["trainer"].global_step == 4
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    validated = [int(r["step"]) + 1 for r in rows if r.get("val/vrmse")]
    assert validated == [3, 4]  # the end of epoch 0, and the last step
