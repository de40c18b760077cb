"""No lost work, no silent corruption: checksums, final/interval/SIGTERM saves, atomic writes."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import REPO, tiny_train_overrides
from walrus.atomic import remove_stale_temp_files, write_text_atomic
from walrus.checkpoint import (
    CHECKPOINT_FORMAT,
    atomic_torch_save,
    load_checkpoint_file,
    model_state_dict,
)
from walrus.training.train import train


def _train(compose_cfg, data_root, out_dir, *extra):
    return train(compose_cfg("train", [*tiny_train_overrides(data_root, out_dir), *extra]))


def _step(path: Path) -> int:
    return load_checkpoint_file(path)["global_step"]


def _tiny_ckpt() -> dict:
    return {
        "state_dict": {
            "model.a": torch.arange(1000.0),
            "model.b": torch.ones(3, dtype=torch.bfloat16),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4)}}}],
        "walrus": {"format": CHECKPOINT_FORMAT, "model_config": {}, "vocab": {"names": []}},
    }


def flip_byte(path: Path, member_suffix: str, at: int = 100) -> None:
    """Flip one byte inside a stored (uncompressed) zip member of a torch checkpoint."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        pos = info.header_offset + 30 + name_len + extra_len + at
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))


# ---------------------------------------------------------------------- checksums


def test_flipped_byte_in_a_tensor_is_a_clear_error(tmp_path):
    path = tmp_path / "model.ckpt"
    atomic_torch_save(_tiny_ckpt(), path)
    assert set(load_checkpoint_file(path)["walrus"]["checksums"]) == {
        "state_dict/model.a",
        "state_dict/model.b",
        "optimizer_states/0/state/0/exp_avg",
    }
    flip_byte(path, "data/0")  # model.a's storage
    with pytest.raises(ValueError, match=r"model\.ckpt is corrupt: tensor state_dict/model\.a"):
        load_checkpoint_file(path)


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save(_tiny_ckpt(), path)
    with pytest.warns(UserWarning, match="old.ckpt has no tensor checksums"):
        ckpt = load_checkpoint_file(path)
    assert torch.equal(ckpt["state_dict"]["model.a"], torch.arange(1000.0))


def test_flipped_byte_in_a_trained_checkpoint_stops_resume(compose_cfg, tiny_data_root, tmp_path):
    _train(compose_cfg, tiny_data_root, tmp_path / "a")
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    flip_byte(last, "data/0", at=8)
    with pytest.raises(ValueError, match="last.ckpt is corrupt: tensor state_dict/model"):
        _train(compose_cfg, tiny_data_root, tmp_path / "b", f"ckpt_path={last}")


# ---------------------------------------------------------------------- no lost steps


def test_max_steps_mid_epoch_saves_the_final_state(compose_cfg, tiny_data_root, tmp_path):
    _train(
        compose_cfg, tiny_data_root, tmp_path, "trainer.limit_train_batches=3",
        "trainer.max_epochs=3", "trainer.max_steps=5",
    )  # fmt: skip
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == 5


class CrashAt(pl.Callback):
    """Raises at the start of training batch ``step`` (a stand-in for a kill)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.ckpt_path is None:  # not once resumed
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize(
    ("interval", "saved"),
    [
        (["every_n_steps=2", "every_minutes=null"], 2),
        (["every_n_steps=null", "every_minutes=1e-6"], 3),  # due after every step
    ],
    ids=["steps", "minutes"],
)
def test_last_checkpoint_is_saved_before_any_validation(
    compose_cfg, tiny_data_root, tmp_path, interval, saved
):
    options = [f"callbacks.last_checkpoint.{o}" for o in interval]
    crash = ["+callbacks.crash._target_=tests.test_reliability.CrashAt", "+callbacks.crash.step=3"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        _train(
            compose_cfg, tiny_data_root, tmp_path, "trainer.limit_train_batches=5", *options, *crash
        )
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == saved


def test_sampler_resumes_mid_epoch_on_any_number_of_ranks():
    from walrus.data.sampler import MixedBatchSampler

    def make(**kw):
        return MixedBatchSampler([10, 7], 2, seed=3, **kw)

    full = list(make())
    first = make()
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    assert first.state_dict() == {"epoch": 0, "batches": 3, "world": 1}
    again = make()
    again.load_state_dict(first.state_dict())
    assert seen + list(again) == full
    assert list(again) == full  # the position applies once
    other_epoch = make()
    other_epoch.load_state_dict({"epoch": 1, "batches": 3, "world": 1})
    assert list(other_epoch) == full  # a saved position of another epoch is ignored
    two = [make(num_replicas=2, rank=r) for r in (0, 1)]
    for s in two:
        s.load_state_dict({"epoch": 0, "batches": 2, "world": 1})
    assert sorted(map(tuple, list(two[0]) + list(two[1]))) == sorted(map(tuple, full[2:]))
    with pytest.raises(ValueError, match="sampler state"):
        make().load_state_dict({"epoch": 0, "batches": -1, "world": 1})


@pytest.mark.parametrize("crash_at", [2, 7], ids=["epoch0", "epoch1"])
def test_resume_after_a_crash_mid_epoch_is_bitwise_exact(
    compose_cfg, tiny_data_root, tmp_path, crash_at
):
    # 4 batches per epoch, 3 epochs; the crash lands mid-epoch with last.ckpt saved every step
    common = [
        "trainer.limit_train_batches=4", "trainer.max_epochs=3", "model.jitter=true",
        "module.input_noise=0.1", "callbacks.last_checkpoint.every_n_steps=1",
    ]  # fmt: skip
    _train(compose_cfg, tiny_data_root, tmp_path / "full", *common)
    part = tmp_path / "part"
    crash = [
        "+callbacks.crash._target_=tests.test_reliability.CrashAt",
        f"+callbacks.crash.step={crash_at}",
    ]
    with pytest.raises(RuntimeError, match="simulated crash"):
        _train(compose_cfg, tiny_data_root, part, *common, *crash)
    last = part / "checkpoints" / "last.ckpt"
    assert _step(last) == crash_at
    position = load_checkpoint_file(last)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position == [{"epoch": crash_at // 4, "batches": crash_at % 4, "world": 1}]
    _train(compose_cfg, tiny_data_root, part, *common, *crash, f"ckpt_path={last}")
    a = model_state_dict(load_checkpoint_file(tmp_path / "full" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(load_checkpoint_file(last))
    assert _step(last) == 12
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bad_interval_option_is_named():
    from walrus.training.checkpointing import LastCheckpoint

    with pytest.raises(ValueError, match="every_n_steps"):
        LastCheckpoint("x", every_n_steps=0)
    with pytest.raises(ValueError, match="every_minutes"):
        LastCheckpoint("x", every_minutes="soon")


class SigtermAt(pl.Callback):
    """Sends this process a real SIGTERM at the end of training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_a_checkpoint_and_exits_143(tiny_data_root, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("WALRUS_TRACEBACK", None)
    r = subprocess.run(
        [
            sys.executable, "train.py", *tiny_train_overrides(tiny_data_root, tmp_path),
            "trainer.limit_train_batches=6", "trainer.max_epochs=3",
            "+callbacks.term._target_=tests.test_reliability.SigtermAt", "+callbacks.term.step=2",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert r.returncode == 143, r.stderr[-2000:]
    assert "SIGTERM at step 2" in r.stderr and f"ckpt_path={last}" in r.stderr
    assert "Traceback" not in r.stderr
    assert _step(last) == 2


class SigintAt(pl.Callback):
    """Sends this process a real SIGINT (what Ctrl-C sends) in the middle of training step
    ``step``, between its backward pass and its optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_saves_a_checkpoint_prints_the_resume_command_and_exits_130(
    tiny_data_root, tmp_path
):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("WALRUS_TRACEBACK", None)
    args = [*tiny_train_overrides(tiny_data_root, tmp_path), "trainer.limit_train_batches=6"]
    r = subprocess.run(
        [
            sys.executable, "train.py", *args, "trainer.max_epochs=3",
            "+callbacks.int._target_=tests.test_reliability.SigintAt", "+callbacks.int.step=2",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert r.returncode == 130, r.stderr[-2000:]
    assert "Ctrl-C (SIGINT) at step 2" in r.stderr
    assert f"resume with: python train.py ckpt_path={last}" in r.stderr
    assert "Traceback" not in r.stderr and "graceful shutdown" not in r.stderr
    assert _step(last) == 2


def test_ctrl_c_stop_is_noted_and_the_handler_restored(compose_cfg, tiny_data_root, tmp_path):
    from walrus.errors import TrainingInterrupted

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match="Ctrl-C") as info:
        _train(
            compose_cfg, tiny_data_root, tmp_path, "trainer.limit_train_batches=4",
            "+callbacks.int._target_=tests.test_reliability.SigintAt", "+callbacks.int.step=3",
        )  # fmt: skip
    assert info.value.exit_status == 130
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C quits a later session again
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == 3


class _SigintDisposition(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> bool:
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_data_workers_ignore_ctrl_c_so_the_step_can_finish():
    from walrus.data.datamodule import worker_init

    # a shell's background job starts with Ctrl-C ignored: give the workers a handler to inherit
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        loader = torch.utils.data.DataLoader(
            _SigintDisposition(), num_workers=1, worker_init_fn=worker_init, batch_size=None
        )
        assert list(loader) == [True]
        plain = torch.utils.data.DataLoader(_SigintDisposition(), num_workers=1, batch_size=None)
        assert list(plain) == [False]
    finally:
        signal.signal(signal.SIGINT, before)


# ---------------------------------------------------------------------- atomic writes


def test_stale_temp_files_of_dead_writers_are_removed(compose_cfg, tiny_data_root, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir(parents=True)
    stale = ckpts / f".last.ckpt.{dead}.0123abcd.walrus-tmp.ckpt"
    live = ckpts / f".last.ckpt.{os.getpid()}.0123abcd.walrus-tmp.ckpt"
    mine = ckpts / "notes.ckpt.tmp"
    for p in (stale, live, mine):
        p.write_bytes(b"x" * 10)
    assert remove_stale_temp_files(ckpts) == [stale]
    assert live.exists() and mine.exists()
    stale.write_bytes(b"x")
    live.unlink()
    _train(compose_cfg, tiny_data_root, tmp_path)
    assert not stale.exists() and mine.exists()


def test_atomic_write_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_mode), real(fd)))
    write_text_atomic(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"
    kinds = ["dir" if (m & 0o170000) == 0o040000 else "file" for m in synced]
    assert kinds == ["file", "dir"]


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save(_tiny_ckpt(), path)
    before = path.read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=f"no space left on device: could not write {path}"):
        atomic_torch_save(_tiny_ckpt(), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_resume_does_not_warn_that_its_checkpoint_folder_is_not_empty(
    compose_cfg, tiny_data_root, tmp_path
):
    import warnings

    _train(compose_cfg, tiny_data_root, tmp_path)
    last = tmp_path / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(compose_cfg, tiny_data_root, tmp_path, "trainer.max_epochs=2", f"ckpt_path={last}")
    assert _step(last) == 4  # it did resume and train
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]


def test_extending_a_finished_run_trains_at_the_floor_rate_and_names_the_new_best(
    compose_cfg, tiny_data_root, tmp_path
):
    # one epoch of 2 steps inside one longer epoch (limit_train_batches=null): the extension
    # continues the same epoch, whose best checkpoint name used to repeat (best-000-v1.ckpt)
    common = ["trainer.limit_train_batches=null", "callbacks.model_checkpoint.monitor=val/loss"]
    _train(compose_cfg, tiny_data_root, tmp_path, *common, "trainer.max_steps=2")
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in ckpts.glob("best-*.ckpt")] == ["best-epoch000-step000002.ckpt"]
    _, objects = _train(
        compose_cfg, tiny_data_root, tmp_path, *common, "trainer.max_steps=4",
        f"ckpt_path={ckpts / 'last.ckpt'}",
    )  # fmt: skip
    trainer = objects["trainer"]
    assert trainer.global_step == 4
    # the schedule was fitted to the first 2 steps and stays at its floor (docs/guide/training.md)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert scheduler.total_steps == 2
    assert lr == pytest.approx(scheduler.base_lrs[0] * scheduler.min_ratio, rel=1e-6)
    names = sorted(p.name for p in ckpts.glob("best-*.ckpt"))
    assert len(names) == 1 and "-v" not in names[0] and names[0].startswith("best-epoch000-step")


def test_resuming_a_finished_run_keeps_its_metrics(compose_cfg, tiny_data_root, tmp_path):
    metrics, _ = _train(compose_cfg, tiny_data_root, tmp_path)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved and saved == metrics
    again, _ = _train(
        compose_cfg, tiny_data_root, tmp_path, f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"
    )
    assert json.loads((tmp_path / "metrics.json").read_text()) == saved
    assert again == saved
