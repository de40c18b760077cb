"""`python infer.py rollout|evaluate`: files written, round trips, errors, capping, NaN stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch import Tensor, nn

from walrus.checkpoint import atomic_torch_save, build_model
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_file import read_trajectory
from walrus.data.writer import write_well_file
from walrus.inference import command_override, run
from walrus.metrics import ALL_METRICS

REPO = Path(__file__).resolve().parents[1]
N_TIME, RES = 10, 16
TINY = {
    "_target_": "walrus.model.walrus.Walrus",
    "n_fields": 4,
    "dim": 16,
    "depth": 1,
    "heads": 2,
    "projection_dim": 8,
    "intermediate_dim": 16,
    "groups": 4,
    "causal": True,
    "jitter": True,
    "drop_path": 0.0,
}


def _fields(n_traj: int, seed: int) -> dict[str, np.ndarray]:
    """Smooth travelling waves, ``(n_traj, N_TIME, RES, RES)`` per scalar."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 2 * np.pi, RES, endpoint=False)
    t = np.arange(N_TIME)[:, None, None] * 0.2
    out = {}
    for name in ("u", "vx", "vy"):
        phase = rng.uniform(0, 2 * np.pi, (n_traj, 1, 1, 1))
        out[name] = (
            np.sin(x[None, None, :, None] + t[None] + phase) * np.cos(x[None, None, None, :]) + 1.5
        ).astype(np.float32)
    return out


def write_toy(root: Path, name: str = "toy", n_traj: int = 3, extra_field: bool = False) -> None:
    """A Well dataset with a scalar ``u`` and a vector ``velocity`` in train/valid/test."""
    for k, split in enumerate(("train", "valid", "test")):
        f = _fields(n_traj, seed=k)
        scalars = {"u": f["u"]}
        if extra_field:
            scalars["tracer"] = f["u"] * 0.5
        write_well_file(
            root / name / "data" / split / f"{name}.hdf5",
            name,
            coords={"x": np.arange(RES, dtype=np.float32), "y": np.arange(RES, dtype=np.float32)},
            time=np.arange(N_TIME, dtype=np.float32) * 0.1,
            n_trajectories=n_traj,
            fields=scalars,
            vector_fields={"velocity": np.stack([f["vx"], f["vy"]], axis=-1)},
        )


def write_checkpoint(
    path: Path, data_root: Path | None, seed: int = 0, config: dict | None = None
) -> Path:
    """A walrus checkpoint of a tiny untrained model (``TINY`` by default) over the toy fields."""
    torch.manual_seed(seed)
    config = TINY if config is None else config
    vocab = FieldVocabulary(["u", "velocity_x", "velocity_y", "pressure"])
    model = build_model(config)
    meta = {
        "format": 1,
        "model_config": config,
        "vocab": vocab.to_dict(),
        "predict_delta": True,
    }
    if data_root is not None:
        meta["data_config"] = {
            "root": str(data_root),
            "datasets": ["toy"],
            "n_steps_input": 3,
            "time_stride": 1,
            "batch_size": 8,
        }
    state = {"model." + k: v for k, v in model.state_dict().items()}
    atomic_torch_save({"state_dict": state, "walrus": meta}, path)
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("infer")
    write_toy(base / "data")
    write_toy(base / "other", name="tracer_set", extra_field=True)
    return {
        "base": base,
        "data": base / "data",
        "other": base / "other",
        "ckpt": write_checkpoint(base / "tiny.ckpt", base / "data"),
        "bare_ckpt": write_checkpoint(base / "bare.ckpt", None),
    }


def compose_infer(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="infer", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


def base_overrides(toy: dict[str, Path], out: Path, command: str = "rollout") -> list[str]:
    return [
        f"command={command}",
        f"ckpt_path={toy['ckpt']}",
        f"out={out}",
        "trainer.accelerator=cpu",
        "progress=false",
    ]


def test_cli_rollout_writes_every_file(toy: dict[str, Path]) -> None:
    out = toy["base"] / "cli_out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "infer.py", "rollout", f"ckpt_path={toy['ckpt']}", f"out={out}",
         "steps=4", "trajectories=[0,2]", "trainer.accelerator=cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "litlogger" not in proc.stdout + proc.stderr  # Lightning's tip is silenced
    for name in ("metrics.json", "predictions.hdf5", "vrmse.png", "spectral.png", "fidelity.png",
                 "snapshots.png"):  # fmt: skip
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "rollout.gif").is_file() or (out / "rollout.mp4").is_file()
    assert not list(out.glob(".*.tmp*")), "temporary files left behind"
    report = json.loads((out / "metrics.json").read_text())
    entry = report["datasets"]["toy"]
    assert entry["trajectories"] == [0, 2] and entry["steps"] == 4
    metrics = entry["metrics"]
    assert metrics["fields"] == ["u", "velocity_x", "velocity_y"]
    assert metrics["count"] == [2] * 4
    for source in ("model", "persistence"):
        for metric in ALL_METRICS:
            block = metrics[source][metric]
            assert len(block["per_step"]["u"]) == 4
            assert list(block["windows"]["u"]) == ["1", "2-4"]  # the steps that ran
    # the table names the windows that ran and both sources
    assert "VRMSE model" in proc.stdout and "2-4" in proc.stdout and "2-10" not in proc.stdout
    assert "high k persist." in proc.stdout  # the binned spectral MSE table
    assert "amplitude model" in proc.stdout and "change corr model" in proc.stdout
    # the toy's waves are all in the low band: the others are flagged, not scored
    assert metrics["negligible_true_power"]["u"]["high"] == [1, 2, 3, 4]
    assert metrics["model"]["spectral_high"]["per_step"]["u"] == [None] * 4
    assert "u: mid k, high k" in proc.stdout
    assert metrics["persistence"]["change_correlation"]["per_step"]["u"] == [None] * 4
    assert metrics["spectral_bins"]["grid"] == [RES, RES]


def test_predictions_round_trip_through_reader(toy: dict[str, Path], tmp_path: Path) -> None:
    result = run(compose_infer([*base_overrides(toy, tmp_path), "steps=3", "plots=false"]))
    frames, names, bcs = read_trajectory(tmp_path / "predictions.hdf5", 1)
    assert names == ["u", "velocity_x", "velocity_y"]
    assert frames.shape == (3, 3, RES, RES)
    assert bcs.tolist() == [[2, 2], [2, 2]]
    # the stored frames are the rolled-out predictions, not the truth
    truth, _, _ = read_trajectory(toy["data"] / "toy" / "data" / "test" / "toy.hdf5", 1)
    assert not np.allclose(frames, truth[3:6])
    assert result["metrics"]["datasets"]["toy"]["predictions"]["trajectories"] == [0, 1, 2]
    # the model's step-1 VRMSE in metrics.json is that of the stored frame
    from walrus.metrics import vrmse

    all_pred = [read_trajectory(tmp_path / "predictions.hdf5", i)[0] for i in range(3)]
    all_truth = [
        read_trajectory(toy["data"] / "toy" / "data" / "test" / "toy.hdf5", i)[0] for i in range(3)
    ]
    step1 = torch.stack(
        [
            vrmse(torch.from_numpy(p[0:1]), torch.from_numpy(t[3:4]))[0]
            for p, t in zip(all_pred, all_truth)
        ]
    ).mean(0)
    per_step = result["metrics"]["datasets"]["toy"]["metrics"]["model"]["vrmse"]["per_step"]
    assert per_step["u"][0] == pytest.approx(float(step1[0]), rel=1e-4)


def test_steps_beyond_truth_are_capped(toy: dict[str, Path], tmp_path: Path, capsys) -> None:
    result = run(compose_infer([*base_overrides(toy, tmp_path), "steps=50", "trajectories=0",
                                "start=2", "save_predictions=false", "plots=false"]))  # fmt: skip
    # 10 frames, start 2, 3 context frames -> 5 frames of truth left
    entry = result["metrics"]["datasets"]["toy"]
    assert entry["steps"] == 5 and entry["metrics"]["steps"] == 5
    assert "asked for 50 steps" in capsys.readouterr().out
    assert any("rolled out 5 steps" in n for n in result["notes"])


class NaNAfter(nn.Module):
    """Wraps a model; from call ``k`` (1-based) on, its output is NaN."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.model, self.k, self.calls = model, k, 0

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed=None) -> Tensor:
        self.calls += 1
        out = self.model(x, fields, bcs, jitter_seed=jitter_seed)
        return out * float("nan") if self.calls >= self.k else out


def test_nan_stops_rollout_and_keeps_files(
    toy: dict[str, Path], tmp_path: Path, monkeypatch, capsys
) -> None:
    from walrus.inference import loading

    real = loading.load_inference_checkpoint

    def patched(path):
        ck = real(path)
        ck.model = NaNAfter(ck.model, k=3)
        return ck

    monkeypatch.setattr(loading, "load_inference_checkpoint", patched)
    result = run(compose_infer([*base_overrides(toy, tmp_path), "steps=5", "trajectories=1"]))
    out = capsys.readouterr().out
    assert "diverged at step 3" in out
    entry = result["metrics"]["datasets"]["toy"]
    assert entry["diverged"][0]["step"] == 3 and entry["diverged"][0]["trajectories"] == [1]
    assert entry["metrics"]["steps"] == 2  # the steps before the NaN are scored
    frames, _, _ = read_trajectory(tmp_path / "predictions.hdf5", 0)
    assert frames.shape[0] == 2 and np.isfinite(frames).all()
    assert json.loads((tmp_path / "metrics.json").read_text())["datasets"]["toy"]["diverged"]
    assert (tmp_path / "vrmse.png").is_file() and (tmp_path / "snapshots.png").is_file()


def test_evaluate_one_step_over_split(toy: dict[str, Path], tmp_path: Path, capsys) -> None:
    result = run(compose_infer([*base_overrides(toy, tmp_path, "evaluate"), "batch_size=5"]))
    entry = result["metrics"]["datasets"]["toy"]
    # 3 trajectories x (10 - 3 context - 1 target + 1) windows
    assert entry["windows"] == 21 and entry["metrics"]["count"] == [21]
    model_v = entry["metrics"]["model"]["vrmse"]["per_step"]["u"][0]
    persist_v = entry["metrics"]["persistence"]["vrmse"]["per_step"]["u"][0]
    assert np.isfinite(model_v) and persist_v > 0
    assert json.loads((tmp_path / "metrics.json").read_text())["command"] == "evaluate"
    assert "one-step errors over 21 windows" in capsys.readouterr().out


def test_data_override_and_unknown_field_message(toy: dict[str, Path], tmp_path: Path) -> None:
    overrides = [*base_overrides(toy, tmp_path), f"paths.data_dir={toy['other']}",
                 "data.datasets=[tracer_set]"]  # fmt: skip
    with pytest.raises(ValueError) as err:
        run(compose_infer(overrides))
    msg = str(err.value)
    assert "tracer" in msg and "fine-tune" in msg.lower()
    assert f"experiment=finetune init_from={toy['ckpt']}" in msg
    assert "data.datasets=[tracer_set]" in msg


def test_checkpoint_without_data_config_needs_data(toy: dict[str, Path], tmp_path: Path) -> None:
    overrides = [*base_overrides(toy, tmp_path), f"ckpt_path={toy['bare_ckpt']}"]
    with pytest.raises(ValueError, match=r"pass paths\.data_dir=DIR and data\.datasets=\[\.\.\.\]"):
        run(compose_infer(overrides))
    # given on the command line it works
    result = run(compose_infer([*overrides, f"paths.data_dir={toy['data']}", "data.datasets=[toy]",
                                "steps=1", "plots=false", "save_predictions=false"]))  # fmt: skip
    assert result["metrics"]["n_steps_input"] == 4  # default without a stored data config


def test_missing_and_corrupt_checkpoint(toy: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match="nope.ckpt does not exist"):
        run(compose_infer([*base_overrides(toy, tmp_path), f"ckpt_path={missing}"]))
    corrupt = tmp_path / "bad.ckpt"
    corrupt.write_bytes(toy["ckpt"].read_bytes()[:200])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        run(compose_infer([*base_overrides(toy, tmp_path), f"ckpt_path={corrupt}"]))
    with pytest.raises(ValueError, match="ckpt_path"):
        run(compose_infer([f"out={tmp_path}", "command=rollout"]))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trajectories=[0,7]", r"trajectories \[7\] out of range"),
        ("steps=0", "option steps must be an integer >= 1"),
        ("start=8", "leaves nothing to predict"),
        ("split=bogus", "split must be one of"),
        ("command=predict", "give a command"),
    ],
)
def test_bad_options(toy: dict[str, Path], tmp_path: Path, override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(compose_infer([*base_overrides(toy, tmp_path), override]))


def test_command_word_becomes_override() -> None:
    assert command_override(["infer.py", "rollout", "steps=3"]) == [
        "infer.py",
        "steps=3",
        "command=rollout",
    ]
    assert command_override(["infer.py", "--cfg", "job", "evaluate"])[-1] == "command=evaluate"
    assert command_override(["infer.py", "steps=3"]) == ["infer.py", "steps=3"]
    with pytest.raises(ValueError, match="unknown command 'predict'"):
        command_override(["infer.py", "predict"])


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_commands_and_options(flag: str, capsys) -> None:
    from walrus.inference import config_options

    with pytest.raises(SystemExit) as exit_info:
        command_override([str(REPO / "infer.py"), flag])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python infer.py {rollout|evaluate} ckpt_path=PATH")
    assert "\n  rollout " in text and "\n  evaluate " in text and "Hydra" in text
    options = config_options(REPO / "configs" / "infer.yaml")
    keys = [key for key, _, _ in options]
    for key in ("ckpt_path", "steps", "trajectories", "max_windows", "batch_size", "ensemble",
                "data.datasets", "paths.data_dir", "out"):  # fmt: skip
        assert key in keys and f"\n  {key}\n" in text, key
    assert "command" not in keys and "hydra" not in keys and "task_name" not in keys
    # grouped by command, with the default as written in the file
    rollout_part = text.split("options of rollout:")[1].split("options of evaluate:")[0]
    assert "  steps\n" in rollout_part and "max_windows" not in rollout_part
    assert "(default: 4)" in text.split("  batch_size\n")[1].split("\n  ")[0]
    assert "(required)" in text.split("  ckpt_path\n")[1].split("\n  ")[0]
    # after a command word too; Hydra's own help flag is left to Hydra
    with pytest.raises(SystemExit):
        command_override([str(REPO / "infer.py"), "rollout", "--help"])
    assert command_override(["infer.py", "--hydra-help"]) == ["infer.py", "--hydra-help"]


def test_cli_user_error_exits_nonzero(tmp_path: Path, capsys) -> None:
    from walrus.cli import run_cli

    cfg = compose_infer(
        ["command=rollout", f"ckpt_path={tmp_path / 'missing.ckpt'}", f"out={tmp_path}"]
    )
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: run(cfg))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "does not exist" in err


def test_jitter_seeded_and_bf16(toy: dict[str, Path], tmp_path: Path) -> None:
    def vrmse_u(*extra: str) -> list[float]:
        result = run(compose_infer([*base_overrides(toy, tmp_path), "steps=2", "trajectories=0",
                                    "plots=false", "save_predictions=false", "overwrite=true", *extra]))  # fmt: skip
        return result["metrics"]["datasets"]["toy"]["metrics"]["model"]["vrmse"]["per_step"]["u"]

    plain = vrmse_u("jitter=false")
    jittered = vrmse_u("jitter=true", "seed=3")
    assert vrmse_u("jitter=true", "seed=3") == jittered  # seeded: reproducible
    assert jittered != plain
    # jitter=null (default): the checkpoint's default, on for a model built with jitter
    assert vrmse_u() == vrmse_u("jitter=true", "seed=0")
    bf16 = vrmse_u("bf16=true", "jitter=false")
    assert np.all(np.isfinite(bf16)) and bf16 != plain
    np.testing.assert_allclose(bf16, plain, rtol=0.2)


@pytest.mark.slow  # .ci/run runs it after make test
def test_ddp_two_processes_match_single_process(toy: dict[str, Path], tmp_path: Path) -> None:
    single = run(compose_infer([*base_overrides(toy, tmp_path / "one"), "steps=4", "batch_size=1",
                                "plots=false"]))  # fmt: skip
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "infer.py", "rollout", f"ckpt_path={toy['ckpt']}", f"out={out}",
         "steps=4", "batch_size=1", "plots=false", "progress=false", "trainer=ddp",
         "trainer.devices=2", "trainer.accelerator=cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads((out / "metrics.json").read_text())["datasets"]["toy"]["metrics"]
    alone = single["metrics"]["datasets"]["toy"]["metrics"]
    assert merged["count"] == alone["count"] == [3] * 4  # every trajectory once, none twice
    for source in ("model", "persistence"):
        for metric in ALL_METRICS:
            for field in alone["fields"]:
                np.testing.assert_allclose(  # null (undefined) as NaN: equal where both are
                    np.array(merged[source][metric]["per_step"][field], dtype=float),
                    np.array(alone[source][metric]["per_step"][field], dtype=float),
                    rtol=1e-4,
                )
    for i in range(3):  # rank 0 gathered every trajectory's predictions, in order
        np.testing.assert_allclose(
            read_trajectory(out / "predictions.hdf5", i)[0],
            read_trajectory(tmp_path / "one" / "predictions.hdf5", i)[0],
            rtol=1e-4,
            atol=1e-5,
        )


def test_ensemble_rollout_scores_the_mean_and_saves_the_spread(toy, tmp_path: Path) -> None:
    from walrus.metrics import SPREAD

    common = [*base_overrides(toy, tmp_path), "steps=3", "trajectories=0", "jitter=true"]
    result = run(compose_infer([*common, "ensemble=3"]))
    metrics = result["metrics"]["datasets"]["toy"]["metrics"]
    assert result["metrics"]["ensemble"] == 3
    spread = metrics[SPREAD]["vrmse"]["per_step"]["u"]
    assert len(spread) == 3 and all(v > 0 for v in spread)
    # each spread is stored in its field's group: velocity_spread is a vector like velocity
    frames, names, _ = read_trajectory(
        tmp_path / "predictions.hdf5", 0, fields=["u", "velocity", "u_spread", "velocity_spread"]
    )
    assert names == ["u", "velocity_x", "velocity_y", "u_spread", "velocity_spread_x",
                     "velocity_spread_y"]  # fmt: skip
    assert frames.shape == (3, 6, RES, RES) and (frames[:, 3:] >= 0).all()
    assert frames[:, 3:].max() > 0
    # the stored mean is scored: its step-1 VRMSE is the one in metrics.json
    truth, _, _ = read_trajectory(toy["data"] / "toy" / "data" / "test" / "toy.hdf5", 0)
    from walrus.metrics import vrmse

    v = vrmse(torch.from_numpy(frames[:1, :3]), torch.from_numpy(truth[3:4]))[0, 0].item()
    assert metrics["model"]["vrmse"]["per_step"]["u"][0] == pytest.approx(v, rel=1e-5)
    assert (tmp_path / "snapshots.png").is_file() and (tmp_path / "vrmse.png").is_file()
    # one member is the plain seeded rollout
    one = run(compose_infer([*common, "ensemble=1", "plots=false", f"out={tmp_path / 'one'}"]))
    assert SPREAD not in one["metrics"]["datasets"]["toy"]["metrics"]
    with pytest.raises(ValueError, match="ensemble=2 needs jitter=true"):
        run(compose_infer([*base_overrides(toy, tmp_path), "ensemble=2", "jitter=false"]))
    with pytest.raises(ValueError, match="option ensemble"):
        run(compose_infer([*base_overrides(toy, tmp_path), "ensemble=0"]))


def test_each_command_runs_from_the_module_named_after_it():
    import importlib

    import walrus
    from walrus.inference import COMMANDS
    from walrus.rollout import rollout as generator

    for command in COMMANDS:
        module = importlib.import_module(f"walrus.inference.{command}")
        assert callable(getattr(module, f"run_{command}"))
    assert walrus.rollout is generator


def test_jitter_average_option(toy, tmp_path: Path) -> None:
    """``jitter_average``: by default a jittered rollout of a patch model averages
    DEFAULT_JITTER_AVERAGE draws per step, other models and unjittered rollouts one;
    metrics.json records it; more than one needs jitter."""
    from walrus.inference.loading import DEFAULT_JITTER_AVERAGE

    patch = {**TINY, "encoder": "patch", "kernel_sizes": [4, 2]}
    patch_ckpt = write_checkpoint(tmp_path / "patch.ckpt", toy["data"], config=patch)
    common = [*base_overrides(toy, tmp_path), "steps=2", "trajectories=0", "plots=false"]
    on_patch = [*common, f"ckpt_path={patch_ckpt}", "jitter=true"]
    got = {
        name: run(compose_infer([*args, f"out={tmp_path / name}"]))["metrics"]
        for name, args in (
            ("patch", on_patch),
            ("patch_two", [*on_patch, "jitter_average=2"]),
            ("patch_off", [*common, f"ckpt_path={patch_ckpt}", "jitter=false"]),
            ("conv", [*common, "jitter=true"]),
        )
    }
    assert got["patch"]["jitter_average"] == DEFAULT_JITTER_AVERAGE > 1
    assert got["patch_two"]["jitter_average"] == 2
    assert got["patch_off"]["jitter_average"] == 1 and got["conv"]["jitter_average"] == 1
    v = [
        got[name]["datasets"]["toy"]["metrics"]["model"]["vrmse"]["per_step"]["u"][0]
        for name in ("patch", "patch_two")
    ]
    assert v[0] != v[1]  # the draws changed the prediction
    with pytest.raises(ValueError, match="jitter_average=2 needs jitter=true"):
        run(compose_infer([*common, "jitter=false", "jitter_average=2", f"out={tmp_path / 'x'}"]))
    with pytest.raises(ValueError, match="option jitter_average"):
        run(compose_infer([*common, "jitter_average=0", f"out={tmp_path / 'y'}"]))
