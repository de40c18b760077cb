"""The researcher's daily loop: resume any run, know where it went, logs that keep history and
settings, a budget that fits multi-dataset validation, and `make demo` that deletes only its own."""

from __future__ import annotations

import csv
import io
import logging
import re
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import yaml

from tests.conftest import REPO, tiny_train_overrides
from walrus.checkpoint import load_checkpoint_file
from walrus.training.budget import TimeBudget
from walrus.training.loggers import wandb_run_name
from walrus.training.progress import ProgressBar
from walrus.training.resume import config_changes, override_keys, resume_overrides
from walrus.training.summary import job_prefix
from walrus.training.train import train

# ---------------------------------------------------------------------- helpers


def _overrides(data_root, out_dir, experiment="quickstart", *extra):
    """Tiny-run overrides without the epoch limit and without the output folder (a CLI run
    gets that from hydra.run.dir; a resume from the checkpoint's location)."""
    keep = [
        o
        for o in tiny_train_overrides(data_root, out_dir, experiment)
        if not o.startswith(("trainer.max_epochs=", "paths.output_dir="))
    ]
    return [*keep, *extra]


def _run(compose_cfg, overrides, out_dir=None):
    """``train`` as ``train.py`` calls it: composed from ``overrides``, which it records."""
    composed = [*overrides, f"paths.output_dir={out_dir}"] if out_dir else overrides
    return train(compose_cfg("train", composed), overrides=overrides)


def _summary(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Run finished")]
    assert len(lines) == 1, lines
    return lines[0]


def _csv_steps(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.fixture(scope="module")
def pretrained(tiny_data_root, tmp_path_factory):
    """A 2-step quickstart checkpoint to fine-tune from."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    out = tmp_path_factory.mktemp("pre")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", [*tiny_train_overrides(tiny_data_root, out), "model.n_fields=3"])
    GlobalHydra.instance().clear()
    train(cfg)
    return out / "checkpoints" / "last.ckpt"


# ---------------------------------------------------------------------- 1. resume


def test_finetune_resumes_with_ckpt_path_alone_in_its_own_folder(
    compose_cfg, tiny_data_root, tmp_path, pretrained, caplog
):
    caplog.set_level(logging.INFO)
    run = tmp_path / "ft"
    first = _overrides(
        tiny_data_root,
        run,
        "finetune",
        f"init_from={pretrained}",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "module.lr_scales={blocks:0.5}",  # its own optimiser groups must resume too
    )
    _run(compose_cfg, first, out_dir=run)
    added = [r.getMessage() for r in caplog.records if "fine-tune: added" in r.getMessage()]
    assert added == [
        f"fine-tune: added 2 field(s) to the vocabulary of {pretrained} (3 -> 5): A, B"
    ]
    assert not [r for r in caplog.records if "were ignored" in r.getMessage()]
    last = run / "checkpoints" / "last.ckpt"
    assert _csv_steps(run / "logs" / "metrics.csv") == [0, 1, 2]

    caplog.clear()
    merged = resume_overrides([f"ckpt_path={last}", "trainer.max_steps=5"])
    assert "experiment=finetune" in merged and f"init_from={pretrained}" in merged
    _, objects = _run(compose_cfg, merged)  # no output folder given: the checkpoint's
    assert objects["output_dir"] == run
    assert objects["trainer"].global_step == 5
    rates = {g["lr_scale"]: g["lr"] for g in objects["trainer"].optimizers[0].param_groups}
    assert set(rates) == {1.0, 0.5} and rates[0.5] == pytest.approx(0.5 * rates[1.0])
    assert load_checkpoint_file(last)["global_step"] == 5
    # the CSV history is continued, not replaced ("Previous log files will be deleted")
    assert _csv_steps(run / "logs" / "metrics.csv") == [0, 1, 2, 3, 4]
    assert not [r for r in caplog.records if "were ignored" in r.getMessage()]
    assert "stopped by trainer.max_steps=5 at step 5" in _summary(caplog)

    # the documented spelling with the experiment and init_from given again works too
    again = resume_overrides(
        [
            "experiment=finetune",
            f"init_from={pretrained}",
            f"ckpt_path={last}",
            "trainer.max_steps=6",
        ]
    )
    _, objects = _run(compose_cfg, again)
    assert objects["trainer"].global_step == 6


def test_resume_refuses_changed_options_in_one_line(compose_cfg, tiny_data_root, tmp_path):
    run = tmp_path / "run"
    first = _overrides(
        tiny_data_root, run, "quickstart", "trainer.max_steps=1", "optimizer.lr=0.002"
    )
    _run(compose_cfg, first, run)
    before = (run / "config.yaml").read_text()
    merged = resume_overrides(
        [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "optimizer.lr=0.5", "model.dim=64"]
    )
    with pytest.raises(ValueError) as err:
        _run(compose_cfg, merged)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "only trainer.max_steps, trainer.max_epochs, trainer.max_time, logging and the" in message
    )
    assert "model.dim (run: 32, now: 64)" in message and "optimizer.lr (run: 0.002, now: 0.5)" in (
        message
    )
    assert (run / "config.yaml").read_text() == before  # the run's record is untouched


def test_recorded_overrides_never_name_code(compose_cfg, tiny_data_root, tmp_path):
    run = tmp_path / "run"
    extra = ["trainer.max_steps=1", "+callbacks.stop._target_=tests.test_train.StopAfterFirstEpoch"]
    _run(compose_cfg, _overrides(tiny_data_root, run, "quickstart", *extra), run)
    merged = resume_overrides([f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"])
    assert not [o for o in merged if "_target_" in o]  # a file's word is not code to build
    with pytest.raises(ValueError, match=r"callbacks.stop._target_ \(run: 'tests.test_train"):
        _run(compose_cfg, merged)


@pytest.mark.parametrize("scratch", [False, True])
def test_finetune_max_steps_runs_exactly_that_many_steps(
    compose_cfg, tiny_data_root, tmp_path, pretrained, caplog, scratch
):
    caplog.set_level(logging.INFO)
    how = "finetune.enabled=false" if scratch else f"init_from={pretrained}"
    # 2 batches per epoch: an epoch limit would cut 5 steps short
    overrides = _overrides(tiny_data_root, tmp_path, "finetune", how, "trainer.max_steps=5")
    _, objects = _run(compose_cfg, overrides, out_dir=tmp_path)
    assert objects["trainer"].global_step == 5
    summary = _summary(caplog)
    assert "stopped by trainer.max_steps=5 at step 5" in summary and "max_epochs" not in summary
    assert not [r for r in caplog.records if "`Trainer.fit` stopped" in r.getMessage()]


# ---------------------------------------------------------------------- 2. summary, sweeps


def test_run_ends_with_one_summary_block(compose_cfg, tiny_data_root, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _run(
        compose_cfg,
        _overrides(tiny_data_root, tmp_path, "quickstart", "trainer.max_epochs=1"),
        tmp_path,
    )
    text = _summary(caplog)
    last = tmp_path / "checkpoints" / "last.ckpt"
    best = next((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert "stopped by trainer.max_epochs=1 at step 2" in text
    assert f"folder:     {tmp_path}\n" in text
    assert f"last.ckpt:  {last}\n" in text
    assert f"best:       {best} (val/rollout_vrmse = " in text
    assert f"resume:     python train.py ckpt_path={last}\n" in text
    # the final weights, as `make demo` rolls out (checkpoints/last.ckpt)
    assert text.endswith(f"roll out:   python infer.py rollout ckpt_path={last}")
    makefile = (REPO / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:") :]
    assert re.search(r"infer\.py rollout ckpt_path=\S*/checkpoints/last\.ckpt", demo)


def test_fast_dev_run_claims_no_checkpoint(compose_cfg, tiny_data_root, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _run(
        compose_cfg,
        _overrides(tiny_data_root, tmp_path, "quickstart", "debug=fast_dev_run"),
        tmp_path,
    )
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    text = _summary(caplog)
    assert "debug=fast_dev_run" in text and "last.ckpt:  none written" in text
    assert "resume:" not in text
    assert "holds the final weights" not in caplog.text


def test_sweep_job_lines_carry_the_job_number(capsys):
    handler = logging.StreamHandler(sys.stdout)
    log = logging.getLogger("test_daily_loop.sweep")
    log.addHandler(handler)
    try:
        with job_prefix(3):
            print("first\nsecond")
            log.warning("from a logger")
        print("after")
    finally:
        log.removeHandler(handler)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[job 3] first", "[job 3] second", "[job 3] from a logger", "after"]


# ---------------------------------------------------------------------- 3-4. loggers


def test_tensorboard_records_the_config_and_continues_on_resume(
    compose_cfg, tiny_data_root, tmp_path
):
    run = tmp_path / "run"
    first = _overrides(
        tiny_data_root,
        run,
        "quickstart",
        "logger=tensorboard",
        "trainer.max_steps=2",
        "optimizer.lr=0.002",
    )
    _run(compose_cfg, first, run)
    _run(
        compose_cfg,
        resume_overrides([f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=3"]),
    )
    board = run / "tensorboard"
    hparams = yaml.safe_load((board / "hparams.yaml").read_text())
    assert hparams["optimizer"]["lr"] == 0.002 and hparams["model"]["dim"] == 32
    assert len(list(board.glob("events.out.tfevents.*"))) >= 2  # one folder, both sessions


def test_wandb_offline_run_has_config_name_and_resumes_by_id(
    compose_cfg, tiny_data_root, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = tmp_path / "run"
    first = [
        *_overrides(tiny_data_root, run, "quickstart", "logger=wandb"),
        "trainer.max_steps=2",
        "optimizer.lr=0.002",
    ]
    _, objects = _run(compose_cfg, first, run)
    logger = objects["trainer"].logger
    experiment = logger.experiment  # the run train() started, and finished
    name, config, run_id = experiment.name, dict(experiment.config), experiment.id
    shown = ProgressBar().get_metrics(objects["trainer"], objects["module"])
    assert name == wandb_run_name("quickstart", first) and name.startswith("quickstart model=tiny ")
    assert "paths." not in name and "logger=" not in name and "experiment=" not in name
    assert config["optimizer"]["lr"] == 0.002  # the resolved config
    assert "anonymous" not in logger._wandb_init  # W&B warns "has no effect" whenever it is set
    assert "v_num" not in shown

    last = run / "checkpoints" / "last.ckpt"
    _, objects = _run(compose_cfg, resume_overrides([f"ckpt_path={last}", "trainer.max_steps=3"]))
    resumed_id = objects["trainer"].logger.experiment.id
    assert resumed_id == run_id
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)


def test_wandb_run_name_says_what_differs_from_the_experiment():
    name = wandb_run_name(
        "finetune",
        ["experiment=finetune", "init_from=a/last.ckpt", "paths.data_dir=D", "optimizer.lr=1e-4"],
    )
    assert name == "finetune optimizer.lr=1e-4"
    assert wandb_run_name("train", None) == "train"


# ---------------------------------------------------------------------- 5. budget per dataset


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class DatasetTick(pl.Callback):
    """A fake clock: Gray–Scott steps and validation batches cost 4x Navier–Stokes ones."""

    COST = {"navier_stokes_2d": (10.0, 1.0), "gray_scott_2d": (40.0, 4.0)}  # (train, val) s

    def __init__(self) -> None:
        self.clock = _Clock()
        self.dataset = ""
        self.reserve_at_stop: float | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        next(c for c in trainer.callbacks if isinstance(c, TimeBudget)).clock = self.clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.dataset = batch.metadata["dataset"]

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # inside the timed step
        self.clock.now += self.COST[self.dataset][0]

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.clock.now += self.COST[batch.metadata["dataset"]][1]

    def on_validation_start(self, trainer, pl_module) -> None:
        budget = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
        if budget.stopped and self.reserve_at_stop is None:
            self.reserve_at_stop = budget.reserve()


def test_budget_reserves_each_datasets_own_validation_time(compose_cfg, tiny_data_root, tmp_path):
    overrides = _overrides(
        tiny_data_root,
        tmp_path,
        "multi",
        "data.datasets=[navier_stokes_2d,gray_scott_2d]",
        "data.batches_per_epoch=40",
        "trainer.limit_train_batches=null",
        "trainer.limit_val_batches=null",
        "trainer.num_sanity_val_steps=1",  # measures one Navier–Stokes batch only
        "trainer.max_time=200",
        "+callbacks.tick._target_=tests.test_daily_loop.DatasetTick",
    )
    metrics, objects = _run(compose_cfg, overrides, tmp_path)
    trainer = objects["trainer"]
    tick = next(c for c in trainer.callbacks if type(c).__name__ == "DatasetTick")
    budget = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
    assert budget.stopped and trainer.global_step < 40  # the budget ended it in the first epoch
    assert "val/vrmse" in metrics  # the final validation ran ...
    assert tick.clock.now <= 200.0  # ... inside the budget
    # one validation batch of each dataset: 1 s + 4 s. Before it only a Navier–Stokes batch was
    # validated; Gray–Scott's was estimated from the two datasets' training steps (4x).
    assert tick.reserve_at_stop == pytest.approx(5.0)
    assert budget.reserve() == pytest.approx(5.0)  # measured, each dataset on its own


# ---------------------------------------------------------------------- 8. progress


def test_progress_bar_stays_off_when_stdout_is_a_file(monkeypatch):
    bar = ProgressBar()
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    bar.setup(pl.Trainer(logger=False, enable_checkpointing=False, callbacks=[bar]), None, "fit")
    assert not bar.is_enabled


class AlternatingSteps(pl.Callback):
    """The module's clock: training steps alternately take 1 s and 9 s (as 2D and 3D batches of
    a multi-dataset run do)."""

    def __init__(self) -> None:
        self.clock = _Clock()
        self.steps = 0

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.clock = self.clock

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.now += 1.0 if self.steps % 2 == 0 else 9.0
        self.steps += 1


def test_samples_per_second_is_measured_over_the_logging_interval(
    compose_cfg, tiny_data_root, tmp_path
):
    overrides = _overrides(
        tiny_data_root,
        tmp_path,
        "quickstart",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=2",
        "+callbacks.steps._target_=tests.test_daily_loop.AlternatingSteps",
    )
    _run(compose_cfg, overrides, tmp_path)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        rates = [
            float(r["train/samples_per_s"]) for r in csv.DictReader(f) if r["train/samples_per_s"]
        ]
    # the steps completed since the last logging step: step 0 (2 samples in 1 s), then steps
    # 1-2 (4 samples in 9 s + 1 s), not 2 and 0.22 samples/s alternating step by step
    assert rates == [pytest.approx(2.0), pytest.approx(0.4)]


# ---------------------------------------------------------------------- 10. make demo


def _demo_dir(target) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "demo-dir", f"DEMO_DIR={target}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_make_demo_deletes_only_folders_it_created(tmp_path):
    target = tmp_path / "demo"
    assert _demo_dir(target).returncode == 0
    assert (target / ".made-by-make-demo").is_file()
    (target / "old_run.txt").write_text("x")
    assert _demo_dir(target).returncode == 0  # its own folder: emptied
    assert sorted(p.name for p in target.iterdir()) == [".made-by-make-demo"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "last.ckpt").write_text("precious")
    r = _demo_dir(mine)
    assert r.returncode != 0
    assert f"{mine} exists and was not created by make demo; not deleting it" in r.stdout
    assert (mine / "last.ckpt").read_text() == "precious"


def test_resume_accepts_options_newer_than_the_run_at_their_default():
    recorded = {"module": {"lr": 1.0}, "paths": {"output_dir": "/r"}}
    current = {"module": {"lr": 1.0, "field_dropout": 0.0}, "paths": {"output_dir": "/r"}}
    assert config_changes(recorded, current) == []
    # set on this command line: a change the resume must refuse
    given = override_keys(["module.field_dropout=0.0", "+x=1"])
    assert given == ["module.field_dropout", "x"]
    assert config_changes(recorded, current, given) == [
        "module.field_dropout (run: '<unset>', now: 0.0)"
    ]
    # a changed recorded option is refused whatever the command line says
    assert config_changes(recorded, {**current, "module": {"lr": 2.0}}) == [
        "module.lr (run: 1.0, now: 2.0)"
    ]
