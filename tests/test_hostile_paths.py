"""Hostile paths, planted symlinks, reused run folders and signals: every write stays inside its
folder, nothing is written through a link the run did not create, a refused run leaves nothing
behind, and ``infer.py`` stops within one model call on SIGTERM/SIGINT with no result file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from tests.conftest import CONFIG_DIR, REPO, tiny_train_overrides
from tests.test_infer import base_overrides, compose_infer, write_toy
from tests.test_infer import toy as toy  # fixture
from walrus.cli import run_cli
from walrus.data.synthetic import generate
from walrus.data.synthetic.__main__ import main as generator_main
from walrus.inference import run
from walrus.inference.evaluate import MAX_EVALUATE_WINDOWS, _windows
from walrus.inference.loading import (
    HYDRA_FILES,
    LOG_NAME,
    MAX_ENSEMBLE,
    MAX_ROLLOUT_TRAJECTORIES,
    RESULT_FILES,
    claim_out,
    select_trajectories,
)
from walrus.run_files import close_run_log, write_run_files
from walrus.safe_paths import make_dirs, open_append, plain_name, result_folder_names
from walrus.training.train import train

FAST = ["plots=false", "steps=2", "trajectories=0"]


def _tree(folder: Path) -> dict[str, tuple[bytes, int] | str]:
    """Every entry below ``folder``: files by bytes and mtime, folders and links by kind."""
    out: dict[str, tuple[bytes, int] | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("WALRUS_TRACEBACK", None)
    return env


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.yaml").write_text("the user's own file\n")
    return victim


# ------------------------------------------------------------------ names taken from input


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "/abs/victim", "a/b", "a\\b", "a\0b", 5])
def test_only_plain_names_become_path_components(name):
    with pytest.raises(ValueError, match="is not a plain name"):
        plain_name(name, "dataset")


def test_datasets_given_by_path_write_to_their_last_name_inside_out():
    assert result_folder_names(["toy", "/abs/victim/ns", "../data/gs/", "C:\\d\\burgers"]) == {
        "toy": "toy",
        "/abs/victim/ns": "ns",
        "../data/gs/": "gs",
        "C:\\d\\burgers": "burgers",
    }
    with pytest.raises(ValueError, match="'..' is not a plain name"):
        result_folder_names([".."])
    with pytest.raises(ValueError, match=r"'a/ns' and '/b/ns' would both write .* out/ns"):
        result_folder_names(["a/ns", "/b/ns"])


def test_a_rollout_of_a_dataset_given_by_path_never_writes_beside_the_data(toy, tmp_path):
    write_toy(tmp_path / "victim", name="ns")  # same fields as toy: a legitimate input
    data_before = _tree(tmp_path / "victim")
    out = tmp_path / "out"
    datasets = f"data.datasets=[toy,{tmp_path / 'victim' / 'ns'}]"
    result = run(compose_infer([*base_overrides(toy, out), datasets, *FAST]))
    assert _tree(tmp_path / "victim") == data_before
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "ns", "toy"]
    assert [p.name for p in (out / "ns").iterdir()] == ["predictions.hdf5"]
    assert all(Path(f).resolve().is_relative_to(out.resolve()) for f in result["files"])
    # a second dataset whose folder would be the first's is refused before anything is written
    clash = f"data.datasets=[toy,{tmp_path / 'victim' / 'toy'}]"
    write_toy(tmp_path / "victim", name="toy")
    with pytest.raises(ValueError, match=r"would both write their results to out/toy"):
        run(compose_infer([*base_overrides(toy, tmp_path / "new"), clash, *FAST]))
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ planted symlinks


@pytest.mark.parametrize("planted", [LOG_NAME, ".hydra", "metrics.json", "toy"])
def test_infer_refuses_symlinks_planted_in_out(toy, tmp_path, planted):
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / planted).symlink_to(victim if planted in (".hydra", "toy") else victim / "config.yaml")
    before = _tree(victim)
    for extra in ([], ["overwrite=true"]):
        with pytest.raises(ValueError, match=f"symbolic links this run did not create: {planted}"):
            run(compose_infer([*base_overrides(toy, out), *FAST, *extra]))
    assert _tree(victim) == before


def _with_hydra_config(out: Path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="infer",
            overrides=["command=rollout", "ckpt_path=x.ckpt", f"out={out}"],
            return_hydra_config=True,
        )
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("planted", ["train.log", ".hydra"])
def test_run_files_are_never_written_through_a_symlink(tmp_path, planted):
    """The writer itself (not only the folder check) refuses a link at the log or ``.hydra``."""
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / planted).symlink_to(victim / "config.yaml" if planted == "train.log" else victim)
    before = _tree(victim)
    cfg = _with_hydra_config(out)
    try:
        with pytest.raises(ValueError, match="is a symbolic link this run did not create"):
            write_run_files(cfg, out, "train.log")
    finally:
        close_run_log()
        HydraConfig.instance().cfg = None
    assert _tree(victim) == before


def test_no_follow_helpers(tmp_path):
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "infer.log")
    with pytest.raises(ValueError, match="is not a regular file"):
        open_append(tmp_path / "fifo" / "infer.log")  # a FIFO would block the run
    (tmp_path / "a").symlink_to(_victim(tmp_path))
    with pytest.raises(ValueError, match="a is a symbolic link"):
        make_dirs(tmp_path, "a", "b")
    assert not (tmp_path / "victim" / "b").exists()
    assert make_dirs(tmp_path, "c", "d").is_dir()


def test_train_refuses_symlinks_planted_in_its_run_folder(compose_cfg, tiny_data_root, tmp_path):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").symlink_to(victim / "config.yaml")
    (run_dir / "checkpoints").symlink_to(victim)
    before = _tree(victim)
    with pytest.raises(ValueError, match="symbolic links this run did not create: checkpoints"):
        train(compose_cfg("train", tiny_train_overrides(tiny_data_root, run_dir)))
    assert _tree(victim) == before


# ------------------------------------------------------------------ run folders


@pytest.fixture(scope="module")
def trained_run(tiny_data_root, tmp_path_factory) -> Path:
    """A small train.py run (a Hydra run: .hydra/ and train.log too), every write recorded."""
    base = tmp_path_factory.mktemp("walked")
    cwd = base / "cwd"
    cwd.mkdir()
    data_before = _tree(tiny_data_root)
    overrides = [o for o in tiny_train_overrides(tiny_data_root, base) if "output_dir" not in o]
    r = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={base / 'run'}"],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert _tree(tiny_data_root) == data_before and not any(cwd.iterdir())
    assert sorted(p.name for p in base.iterdir()) == ["cwd", "run"]
    return base / "run"


def test_every_file_a_train_run_writes_is_inside_its_folder(trained_run):
    files = {str(p.relative_to(trained_run)) for p in trained_run.rglob("*") if p.is_file()}
    assert {".hydra/config.yaml", "train.log", "config.yaml", "checkpoints/last.ckpt"} <= files
    for p in trained_run.rglob("*"):
        assert not p.is_symlink() and p.resolve().is_relative_to(trained_run.resolve()), p


def test_a_new_run_into_a_folder_holding_a_run_is_refused(compose_cfg, tiny_data_root, trained_run):
    before = _tree(trained_run)
    overrides = [*tiny_train_overrides(tiny_data_root, trained_run), "trainer.max_epochs=2"]
    with pytest.raises(ValueError, match=r"already holds a run .*resume that run with ckpt_path="):
        train(compose_cfg("train", overrides))
    elsewhere = trained_run.parent / "copy.ckpt"
    elsewhere.write_bytes((trained_run / "checkpoints" / "last.ckpt").read_bytes())
    with pytest.raises(ValueError, match=r"copy\.ckpt is not in it"):
        train(compose_cfg("train", [*overrides, f"ckpt_path={elsewhere}"]))
    assert _tree(trained_run) == before


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("train.py", ["optimizer.lr=fast"]),
        ("infer.py", ["rollout", "ckpt_path=CKPT", "ensemble=100000", "jitter=true"]),
    ],
    ids=["train", "infer"],
)
def test_a_refused_run_leaves_no_folder(toy, tmp_path, script, args):
    new = tmp_path / "a" / "b" / "run"
    args = [a.replace("CKPT", str(toy["ckpt"])) for a in args]
    place = [f"out={new}"] if script == "infer.py" else [f"hydra.run.dir={new}"]
    r = subprocess.run(
        [sys.executable, script, *args, *place],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith("error: option ")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ overwrite=true


def test_overwrite_never_deletes_a_users_folder(tmp_path):
    out = tmp_path / "out"
    (out / "mine").mkdir(parents=True)  # empty: the user's, not an earlier run's
    (out / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match="holds mine, which no infer.py command wrote"):
        claim_out(out, True)
    (out / "mine" / "predictions.hdf5").symlink_to(out / "metrics.json")
    with pytest.raises(ValueError, match="holds mine, which no infer.py command wrote"):
        claim_out(out, True)  # a link inside a folder is not a result either
    assert (out / "mine").is_dir() and (out / "metrics.json").is_file()


def test_every_file_a_rollout_writes_is_listed_and_overwrite_replaces_them(toy, tmp_path):
    """A default rollout (all plots): every file is inside out= and in RESULT_FILES, so a
    second rollout with overwrite=true into the same folder replaces them all."""
    out = tmp_path / "out"
    (out / ".hydra").mkdir(parents=True)  # as an earlier Hydra run leaves them
    for name in HYDRA_FILES:
        (out / ".hydra" / name).write_text("earlier")
    (out / LOG_NAME).write_text("earlier\n")
    with pytest.raises(ValueError, match="already holds .hydra, infer.log"):
        run(compose_infer([*base_overrides(toy, out), "steps=2", "trajectories=0"]))
    first = run(
        compose_infer([*base_overrides(toy, out), "steps=2", "trajectories=0", "overwrite=true"])
    )
    written = {p for p in out.rglob("*") if p.is_file()}
    assert written == {Path(f) for f in first["files"]}
    assert {p.name for p in written} <= RESULT_FILES and "fidelity.png" in {p.name for p in written}
    second = run(
        compose_infer([*base_overrides(toy, out), "steps=2", "trajectories=0", "overwrite=true"])
    )
    assert {p for p in out.rglob("*") if p.is_file()} == {Path(f) for f in second["files"]}


# ------------------------------------------------------------------ signals and bounds


LONG = ["ensemble=1024", "jitter_average=1024", "jitter=true"]  # ~10^6 model calls a step


@pytest.mark.parametrize(
    ("sig", "status"),
    [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_stops_infer_within_a_step_with_no_result_file(toy, tmp_path, sig, status):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "infer.py", "rollout", f"ckpt_path={toy['ckpt']}", f"out={out}",
         *LONG, "trainer.accelerator=cpu", "progress=false"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / LOG_NAME).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the log appears once the checks passed, just before the rollout
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-2000:]
    assert time.monotonic() - sent < 20  # one model call, not 1024 members x 7 steps
    name = signal.Signals(sig).name
    assert err.endswith(f"error: stopped by {name}: rollout wrote no result file to {out}\n")
    assert "Traceback" not in err
    assert not [p.name for p in out.iterdir() if p.name in RESULT_FILES]
    assert not list(out.glob(".*walrus-tmp*"))


def test_sigint_stops_an_in_process_rollout_with_status_130(toy, tmp_path, capsys):
    """The same stop in-process (the default suite's SIGINT case): the signal is sent from
    another thread while the rollout runs; the handlers are restored afterwards."""
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "out"
    cfg = compose_infer([*base_overrides(toy, out), *LONG])
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(SystemExit) as exit_:
            run_cli(lambda: run(cfg))
    finally:
        timer.cancel()
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: stopped by SIGINT: (rollout|infer\.py) wrote no.*\n", err), err
    assert not (out.exists() and [p.name for p in out.iterdir() if p.name in RESULT_FILES])
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ensemble=100000", f"option ensemble must be at most {MAX_ENSEMBLE} (each runs"),
        ("jitter_average=1000000", "option jitter_average must be at most 1024"),
        ("data.time_stride=fast", "option data.time_stride must be an integer >= 1"),
        ("data.n_steps_input=x", "option data.n_steps_input must be an integer >= 1, got 'x'"),
    ],
)
def test_large_counts_and_bad_strides_are_one_line(toy, tmp_path, override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        run(compose_infer([*base_overrides(toy, tmp_path / "out"), "jitter=true", override]))
    assert not (tmp_path / "out").exists()


def test_trajectory_and_window_counts_are_bounded():
    with pytest.raises(
        ValueError, match=f"trajectories=all takes at most {MAX_ROLLOUT_TRAJECTORIES}"
    ):
        select_trajectories("all", 10**7, "big")
    assert select_trajectories([3], 10**7, "big") == [3]  # picked by index: fine
    big = type("Big", (), {"dataset": "big", "__len__": lambda self: 10**8})()
    with pytest.raises(ValueError, match="pass max_windows=N"):
        _windows(None, {}, [big])
    assert len(_windows(5, {}, [big])["big"]) == 5
    assert MAX_EVALUATE_WINDOWS < 10**8


# ------------------------------------------------------------------ the generator


def test_the_generator_refuses_to_replace_a_dataset_unless_overwrite(tmp_path, capsys):
    kw = {"n_traj": (1, 1, 1), "resolution": 8, "steps": 2, "progress": False}
    root = generate("gray_scott_2d", tmp_path, seed=0, **kw)
    (root / "notes.txt").write_text("mine")
    before = _tree(root)
    with pytest.raises(ValueError, match=r"already holds a dataset \(data/test/.*--overwrite"):
        generate("gray_scott_2d", tmp_path, seed=1, **kw)
    args = ["gray_scott_2d", "--out", str(tmp_path), "--n-traj", "1,1,1", "--resolution", "8"]
    with pytest.raises(SystemExit) as exit_:
        generator_main([*args, "--steps", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --overwrite" in err
    assert _tree(root) == before
    generate("gray_scott_2d", tmp_path, seed=1, regimes=["maze"], overwrite=True, **kw)
    after = _tree(root)
    assert after["notes.txt"] == before["notes.txt"]  # other files are kept
    assert after["stats.yaml"] != before["stats.yaml"]
    assert sorted(p.name for p in (root / "data" / "train").iterdir()) == [
        "gray_scott_2d_maze.hdf5"
    ]  # the earlier run's other regime is gone, not mixed in


def test_run_cli_exits_143_on_an_interrupted_command(capsys):
    from walrus.errors import CommandInterrupted

    def stopped():
        raise CommandInterrupted(signal.SIGTERM, "rollout wrote no result file to out")

    with pytest.raises(SystemExit) as exit_:
        run_cli(stopped)
    assert exit_.value.code == 143
    assert capsys.readouterr().err == (
        "error: stopped by SIGTERM: rollout wrote no result file to out\n"
    )
