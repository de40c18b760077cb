"""experiment=pretrain, the model card, fine-tune vs scratch with one recipe, and the transfer
benchmark (tiny sizes, in-process)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import transfer, transfer_runs, transfer_table
from tests.conftest import REPO, tiny_train_overrides
from walrus.checkpoint import load_checkpoint_file
from walrus.data.synthetic import SYSTEMS, generate
from walrus.training.model_card import (
    COST_KEY,
    main,
    model_preset,
    verdict,
    verdict_lines,
    verdicts,
    write_model_card,
)
from walrus.training.resume import resume_overrides
from walrus.training.train import train

TWO = "data.datasets=[{name:navier_stokes_2d,weight:1.0},{name:gray_scott_2d,weight:1.0}]"


def _tiny_pretrain(data_root, out, *extra):
    """experiment=pretrain on the two tiny datasets, tiny model; ``extra`` overrides win."""
    keep = [o for o in tiny_train_overrides(data_root, out, "pretrain") if "max_epochs" not in o]
    return [*keep, TWO, *extra]


def test_pretrain_config_balances_all_nine_systems_under_a_time_budget(compose_cfg):
    cfg = compose_cfg("train", ["experiment=pretrain"])
    specs = list(cfg.data.datasets)
    assert sorted(s.name for s in specs) == sorted(SYSTEMS) and len(SYSTEMS) == 9
    assert len({s.weight for s in specs}) == 1  # equal draws per system
    assert {SYSTEMS[s.name].n_spatial for s in specs} == {1, 2, 3}
    assert cfg.data.generate_if_missing is True
    assert cfg.trainer.max_time == "00:00:25:00"
    assert cfg.trainer.max_steps == -1 and cfg.trainer.max_epochs == -1  # time alone ends it
    small = yaml.safe_load((REPO / "configs" / "model" / "small.yaml").read_text())
    assert {k: cfg.model[k] for k in small} == small
    # scratch and fine-tune share the preset of pretraining
    scratch = compose_cfg("train", ["experiment=finetune", "finetune.enabled=false"])
    assert scratch.model == cfg.model


def test_time_budget_schedule_ends_at_the_floor(compose_cfg, tiny_data_root, tmp_path):
    overrides = _tiny_pretrain(
        tiny_data_root, tmp_path, "trainer.max_time=2", "trainer.limit_train_batches=null"
    )
    _, objects = train(compose_cfg("train", overrides))
    module, trainer = objects["module"], objects["trainer"]
    assert trainer.global_step >= 1
    peak = float(compose_cfg("train", overrides).optimizer.lr)
    floor = peak * float(compose_cfg("train", overrides).lr_scheduler.min_ratio)
    assert module.lr_schedulers().get_last_lr()[0] == pytest.approx(floor)


def test_pretrain_small_config_is_a_short_pretrain_on_three_small_systems(compose_cfg):
    full = compose_cfg("train", ["experiment=pretrain"])
    small = compose_cfg("train", ["experiment=pretrain_small"])
    names = [s.name for s in small.data.datasets]
    assert names == ["navier_stokes_2d", "gray_scott_2d", "burgers_1d"]
    assert {SYSTEMS[n].n_spatial for n in names} == {1, 2}
    assert len({s.weight for s in small.data.datasets}) == 1
    assert small.task_name == "pretrain_small" and small.trainer.max_time == "00:00:03:00"
    assert small.trainer.max_steps == -1 and small.trainer.max_epochs == -1
    # the recipe of experiment=pretrain: model, optimiser, noise, cost callback
    assert small.model == full.model and small.optimizer == full.optimizer
    assert small.module == full.module and "training_cost" in small.callbacks
    kwargs = dict(small.data.generate_kwargs)
    assert kwargs == {"progress": False, "n_traj": [8, 2, 2], "steps": 40}
    inspect.signature(generate).bind("navier_stokes_2d", "root", **kwargs)
    assert kwargs["steps"] < min(SYSTEMS[n].steps for n in names)
    # quiet: no generator bars, a progress line every 15 s (every 2 minutes in the full run)
    assert full.data.generate_kwargs == {"progress": False}
    assert small.callbacks.progress_line.every_seconds == 15
    assert full.callbacks.progress_line.every_seconds == 120


def test_verdict_against_persistence_has_a_tie_band():
    assert verdict(0.5, 1.0) == "beat" and verdict(2.0, 1.0) == "lose"
    assert verdict(0.96, 1.0) == verdict(1.04, 1.0) == verdict(1.0, 1.0) == "tie"
    assert verdict(0.94, 1.0) == "beat" and verdict(1.06, 1.0) == "lose"
    assert verdict(0.94, 1.0, tolerance=0.1) == "tie"
    assert verdict(0.999, 1.0, tolerance=0.0) == "beat"
    assert verdict(0.0, 0.0) == "tie" and verdict(0.1, 0.0) == "lose"
    assert verdict(float("nan"), 1.0) is None and verdict(0.5, None) is None


def test_verdicts_per_window_and_the_lines_naming_what_is_not_beaten():
    validation = {
        "a": {
            "one_step_vrmse": {"model": 0.1, "persistence": 0.5},
            "rollout_vrmse": {
                "model": {"1": 0.2, "2-10": 0.98, "11-30": 1.3},
                "persistence": {"1": 0.4, "2-10": 1.0, "11-30": 1.1},
            },
        },
        "b": {
            "one_step_vrmse": {"model": 0.1, "persistence": 0.5},
            "rollout_vrmse": {"model": {"1": float("inf")}, "persistence": {"1": 0.4}},
        },
    }
    says = verdicts(validation)
    assert says["a"] == {
        "one_step": "beat",
        "rollout": {"1": "beat", "2-10": "tie", "11-30": "lose"},
    }
    assert says["b"]["rollout"] == {"1": None}
    lines = verdict_lines({"verdicts": says})
    assert lines == [
        "a: 2 beat, 1 tie, 1 lose of 4 against persistence "
        "(not beaten: rollout 2-10 tie, rollout 11-30 lose)",
        "b: 1 beat, 0 tie, 0 lose of 2 against persistence (not beaten: rollout 1 n/a)",
    ]
    assert verdicts(validation, tolerance=0.0)["a"]["rollout"]["2-10"] == "beat"


@pytest.fixture(scope="module")
def pretrained_run(tiny_data_root, tmp_path_factory):
    """A 2-step tiny ``experiment=pretrain`` run on Navier–Stokes and Gray–Scott."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    run = tmp_path_factory.mktemp("pretrain")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", _tiny_pretrain(tiny_data_root, run, "trainer.max_steps=2"))
    GlobalHydra.instance().clear()
    _, objects = train(cfg)
    return run, sum(p.numel() for p in objects["module"].model.parameters())


def test_model_card_of_a_tiny_run(pretrained_run, capsys):
    run, params = pretrained_run
    ckpt = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    assert COST_KEY in ckpt["callbacks"]

    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    lightning_notes = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_notes.addHandler(handler)
    try:
        md, js = write_model_card(run, max_windows=4, steps=5, max_trajectories=3)
    finally:
        lightning_notes.removeHandler(handler)
    # neither the inference tables nor Lightning's accelerator notes are printed
    assert capsys.readouterr().out == "" and not [n for n in notes if "available" in n]
    assert lightning_notes.level == logging.NOTSET  # restored
    card = json.loads(js.read_text())
    systems = card["data"]["systems"]
    assert list(systems) == ["navier_stokes_2d", "gray_scott_2d"]
    assert systems["gray_scott_2d"]["fields"] == ["A", "B"]
    assert systems["navier_stokes_2d"]["boundaries"] == ["periodic/periodic"] * 2
    assert systems["navier_stokes_2d"]["resolution"] == [32, 32]
    assert systems["navier_stokes_2d"]["trajectories"] == {"train": 2, "valid": 1, "test": 1}
    assert card["budget"]["steps"] == 2 and card["budget"]["cpu_s"] > 0
    assert card["budget"]["threads"] == torch.get_num_threads()
    assert card["model"]["preset"] == "tiny" and card["model"]["params"] == params
    for name in systems:
        v = card["validation"][name]
        assert v["rollout_steps"] == 5 and v["rollout_trajectories"] == 1
        assert math.isfinite(v["one_step_vrmse"]["model"])
        assert set(v["rollout_vrmse"]["model"]) == {"1", "2-5"}  # windows cut at step 5
        says = card["verdicts"][name]
        assert says["one_step"] == verdict(
            v["one_step_vrmse"]["model"], v["one_step_vrmse"]["persistence"]
        )
        assert set(says["rollout"]) == {"1", "2-5"}
    assert card["tie_tolerance"] == 0.05
    assert isinstance(card["source"]["dirty"], bool)
    text = md.read_text()
    assert "| gray_scott_2d | 2D | 32x32 |" in text and "Preset `tiny`" in text
    assert "a tie when the two VRMSEs differ by at most 5%" in text
    assert verdict_lines(card)[0] in text
    assert not list(run.glob("*.tmp"))


def test_model_card_command_prints_a_verdict_line_per_system(pretrained_run, capsys):
    run, _ = pretrained_run
    main([str(run), "--max-windows", "2", "--steps", "2", "--max-trajectories", "1",
          "--tie-tolerance", "0.5"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    card = json.loads((run / "model_card.json").read_text())
    assert card["tie_tolerance"] == 0.5
    assert lines[:2] == verdict_lines(card) and len(lines) == 3
    assert lines[2].startswith("wrote ") and lines[2].endswith(" s")
    with pytest.raises(SystemExit) as e:
        main([str(run), "--tie-tolerance", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: tie tolerance must be a number >= 0, got -1.0\n"


def test_model_card_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="last.ckpt: no checkpoint"):
        write_model_card(tmp_path)


def test_model_preset_reports_custom_for_an_unknown_architecture():
    small = yaml.safe_load((REPO / "configs" / "model" / "small.yaml").read_text())
    assert model_preset(small) == "small"
    assert model_preset({**small, "dim": small["dim"] + 1}) == "custom"


def test_finetune_onto_unseen_datasets_with_new_fields(compose_cfg, pretrained_run, tmp_path):

    data = tmp_path / "d"
    for system in ("cahn_hilliard_2d", "burgers_1d"):
        generate(system, data, n_traj=(2, 1, 1), resolution=32, steps=12, progress=False)
    run, _ = pretrained_run
    keep = [o for o in tiny_train_overrides(data, tmp_path / "ft", "finetune") if "epochs" not in o]
    overrides = [*keep, f"init_from={run / 'checkpoints' / 'last.ckpt'}"]
    overrides += ["data.datasets=[cahn_hilliard_2d,burgers_1d]", "trainer.max_steps=3"]
    _, objects = train(compose_cfg("train", overrides))
    assert objects["trainer"].global_step == 3
    ckpt = load_checkpoint_file(tmp_path / "ft" / "checkpoints" / "last.ckpt")
    names = ckpt["walrus"]["vocab"]["names"]
    assert names == ["vorticity", "velocity_x", "velocity_y", "A", "B", "concentration"]
    # the checkpoint's 2D encoder/decoder serve the 1D data too (no fresh set needed)
    assert ckpt["walrus"]["model_config"]["include_d"] == [2]
    assert objects["module"].model.encoder_key(1) == 2


def test_scratch_refuses_init_from_in_one_line(compose_cfg, tiny_data_root, tmp_path):
    overrides = tiny_train_overrides(tiny_data_root, tmp_path, "finetune")
    overrides += ["finetune.enabled=false", f"init_from={tmp_path / 'x.ckpt'}"]
    with pytest.raises(ValueError, match="finetune.enabled=false trains from scratch") as e:
        train(compose_cfg("train", overrides))
    assert "\n" not in str(e.value) and "init_from=" in str(e.value)
    assert not (tmp_path / "config.yaml").exists()


def test_scratch_run_resumes_with_ckpt_path_alone(compose_cfg, tiny_data_root, tmp_path):
    keep = [
        o
        for o in tiny_train_overrides(tiny_data_root, tmp_path, "finetune")
        if not o.startswith(("trainer.max_epochs=", "paths.output_dir="))
    ]
    first = [*keep, "finetune.enabled=false", "trainer.max_steps=3"]
    train(compose_cfg("train", [*first, f"paths.output_dir={tmp_path}"]), overrides=first)
    last = tmp_path / "checkpoints" / "last.ckpt"
    merged = resume_overrides([f"ckpt_path={last}", "trainer.max_steps=4"])
    assert "finetune.enabled=false" in merged
    _, objects = train(compose_cfg("train", merged), overrides=merged)
    assert objects["trainer"].global_step == 4
    assert objects["output_dir"] == tmp_path


def test_make_pretrain_trains_then_writes_the_card():
    r = subprocess.run(
        ["make", "-n", "pretrain", "PRETRAIN_DIR=out/pt", "PRETRAIN_DATA=d", "PY=py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = r.stdout.replace("\\\n", " ").splitlines()
    train_at = next(i for i, s in enumerate(lines) if "train.py experiment=pretrain" in s)
    assert "paths.data_dir=d" in lines[train_at] and "hydra.run.dir=out/pt" in lines[train_at]
    card_at = next(i for i, s in enumerate(lines) if "-m walrus.training.model_card out/pt" in s)
    assert card_at > train_at
    assert any("out/pt/.made-by-make-demo" in s for s in lines[:train_at])  # the marker rule
    assert "--max-windows 8 --steps 10 --max-trajectories 2" in lines[card_at]


def test_make_pretrain_small_has_its_own_experiment_data_and_folder():
    def dry(size: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["make", "-n", "pretrain", f"PRETRAIN_SIZE={size}", "PY=py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    flat = " ".join(dry("small").stdout.replace("\\\n", " ").split())
    assert "py train.py experiment=pretrain_small paths.data_dir=data/pretrain_small" in flat
    assert "hydra.run.dir=outputs/pretrain_small" in flat
    assert "-m walrus.training.model_card outputs/pretrain_small --max-windows 8" in flat
    bad = dry("tiny")
    assert bad.returncode != 0
    assert "PRETRAIN_SIZE must be full or small, got 'tiny'" in bad.stderr


# ---------------------------------------------------------------------- transfer benchmark


def _result(held, seed, ft, scratch):
    """One run record of benchmarks.transfer with VRMSE ``ft`` / ``scratch`` in every window."""

    def test(v):
        windows = {"1": v, "2-10": 2 * v}
        return {"model": {k: dict(windows) for k in transfer_table.MEASURES}}

    return {
        "held_out": held,
        "seed": seed,
        "models": {"finetune 3": {"test": test(ft)}, "scratch 3": {"test": test(scratch)}},
    }


def test_transfer_summary_table_and_page(tmp_path):
    runs = [_result("burgers_1d", 0, 0.2, 0.4), _result("burgers_1d", 1, 0.4, 0.6)]
    summary = transfer_table.summarize(runs)["burgers_1d"]
    ft = summary["models"]["finetune 3"]["vrmse"]
    assert ft["1"]["mean"] == pytest.approx(0.3) and ft["2-10"]["mean"] == pytest.approx(0.6)
    assert ft["1"]["std"] == pytest.approx(0.1414, abs=1e-4) and ft["1"]["n"] == 2
    assert summary["ft_over_scratch"]["3"]["1"] == pytest.approx(0.3 / 0.5)
    data = {"summary": transfer_table.summarize(runs), "record": {"commit": "abc", "dirty": True}}
    table = transfer_table.render_table(data)
    assert "| burgers_1d | finetune 3 | 0.3 ± 0.14 | 0.6 ± 0.28 |" in table
    assert "| burgers_1d | fine-tuned / scratch, 3 steps | 0.60 | 0.60 |" in table
    assert "commit abc (dirty)" in table

    page = tmp_path / "results.md"
    page.write_text(f"intro\n{transfer_table.START}\nold\n{transfer_table.END}\noutro\n")
    transfer_table.render_page(page, data)
    text = page.read_text()
    assert text.startswith(f"intro\n{transfer_table.START}\n| held out |") and "old" not in text
    assert text.endswith(f"{transfer_table.END}\noutro\n")
    page.write_text("no markers\n")
    with pytest.raises(transfer.BenchmarkError, match="results.md: no <!-- transfer-table:start"):
        transfer_table.render_page(page, data)


def test_transfer_table_names_the_pretraining_and_fills_its_own_markers(tmp_path):
    runs = [_result("burgers_1d", s, 0.2, 0.4) for s in (0, 1)]
    for run, steps in zip(runs, (120, 95)):
        run["pretrain"] = {"systems": ["gray_scott_2d"], "steps": steps}
    data = {"summary": transfer_table.summarize(runs), "runs": runs}
    data["args"] = {"systems": "gray_scott_2d,burgers_1d", "seeds": [0, 1]}
    table = transfer_table.render_table(data)
    assert "on gray_scott_2d, burgers_1d (less the held-out system), 95-120 steps;" in table
    start, end = transfer_table.markers("transfer_2d")
    assert start == "<!-- transfer-table:start:transfer_2d -->"
    page = tmp_path / "results.md"
    plain = f"{transfer_table.START}\nA\n{transfer_table.END}"
    page.write_text(f"{plain}\n{start}\nB\n{end}\n")
    transfer_table.render_page(page, data, "transfer_2d")
    assert page.read_text() == f"{plain}\n{start}\n{table}\n{end}\n"


def test_zero_shot_scores_known_fields_and_skips_unknown_ones(
    pretrained_run, tiny_data_root, tmp_path
):

    ckpt, logged = pretrained_run[0] / "checkpoints" / "last.ckpt", []
    gray_scott = transfer_runs.external_set(tiny_data_root / "gray_scott_2d")
    scored = transfer_runs.score_zero_shot(ckpt, gray_scott, tmp_path / "gs", logged.append)
    assert scored["test"]["trajectories"] == 1 and not logged
    assert set(scored["test"]["model"]) == set(transfer_table.MEASURES)
    assert scored["test"]["model"]["vrmse"]["1"] > 0
    # Cahn-Hilliard's concentration field is not in the pretrained vocabulary
    generate(
        "cahn_hilliard_2d", tmp_path, n_traj=(1, 1, 1), resolution=32, steps=12, progress=False
    )
    unknown = transfer_runs.external_set(tmp_path / "cahn_hilliard_2d")
    skipped = transfer_runs.score_zero_shot(ckpt, unknown, tmp_path / "ch", logged.append)
    assert skipped == {"skipped": "the held-out set has fields the pretrained checkpoint never saw"}
    assert "['concentration']" in logged[0]


def test_transfer_refuses_too_few_test_trajectories(tiny_data_root, tmp_path, capsys):
    args = ["--systems", "navier_stokes_2d,gray_scott_2d", "--held-out", "gray_scott_2d"]
    args += ["--data-root", str(tiny_data_root), "--results-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        transfer.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "gray_scott_2d: 1 test trajectories, fewer than --min-test-trajectories 8" in err
    assert "\n" not in err and not list(tmp_path.iterdir())


def test_transfer_refuses_a_rate_that_is_not_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        transfer.main(["--finetune-lrs", "0", "--results-dir", str(tmp_path)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip().endswith("--finetune-lrs needs at least one rate, each > 0")
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_transfer_smoke(tmp_path):

    root = tmp_path / "data"
    for system in ("navier_stokes_2d", "gray_scott_2d"):
        generate(system, root, n_traj=(2, 1, 8), resolution=32, steps=12, progress=False)
    tiny = [*tiny_train_overrides(root, tmp_path, "finetune")[1:]]
    tiny = [o for o in tiny if not o.startswith(("paths.", "trainer.max_epochs", "data.gen"))]
    args = ["--systems", "navier_stokes_2d,gray_scott_2d", "--held-out", "gray_scott_2d"]
    args += ["--data-root", str(root), "--results-dir", str(tmp_path / "res")]
    args += ["--work-dir", str(tmp_path / "work"), "--pretrain-time", "3", "--seeds", "0"]
    args += ["--finetune-steps", "2", "--scratch-lrs", "1e-3,3e-4"]
    args += [f"--override={o}" for o in tiny]
    data = transfer.main(args)
    saved = json.loads((tmp_path / "res" / "transfer.json").read_text())
    assert saved["summary"] == data["summary"]
    (run,) = saved["runs"]
    assert run["pretrain"]["systems"] == ["navier_stokes_2d"] and run["pretrain"]["cpu_s"] > 0
    models = run["models"]
    assert set(models) == {"finetune 2", "scratch 2", "scratch pretrain-cpu+2", "persistence"}
    # pretrained on Navier-Stokes alone: no zero-shot row for Gray-Scott's A and B
    assert run["zero_shot_skipped"].startswith("the held-out set has fields")
    assert models["finetune 2"]["steps"] == 2 and models["scratch 2"]["steps"] == 2
    assert models["scratch 2"]["lr"] in (1e-3, 3e-4) and len(models["scratch 2"]["val_by_lr"]) == 2
    # fine-tuning chooses its rate on validation too (default 3e-3 and 1e-2)
    ft = models["finetune 2"]
    assert set(ft["val_by_lr"]) == {"0.003", "0.01"} and ft["lr"] in (3e-3, 1e-2)
    scores = {lr: v["val/rollout_vrmse"] for lr, v in ft["val_by_lr"].items()}
    assert f"{ft['lr']:g}" == min(scores, key=scores.get)
    assert models["finetune 2"]["test"]["trajectories"] == 8
    assert set(models["finetune 2"]["test"]["model"]) == set(transfer_table.MEASURES)
    assert not Path(run["dataset"]).is_absolute() and saved["record"]["commit"]
    assert saved["record"]["cpu_model"]  # read when the run started
