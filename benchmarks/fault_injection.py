"""Fault injection: kill -9, SIGTERM, a full disk and a flipped byte; what survived.

    python -m benchmarks.fault_injection --out benchmarks/results/fault_injection.json

Every case runs ``train.py`` (``model=tiny``, synthetic 32x32 data, 3 epochs of 8 steps,
``last.ckpt`` every step) in a subprocess, hits it at a step drawn from ``--seed``, resumes
with ``ckpt_path=`` and compares the final weights with an uninterrupted run's, bit for bit.
A case passes only if every one of its checks (listed in the JSON) holds. The script prints one
table row per case, writes the rows to ``--out`` and exits 1 if any case failed. About a
minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EPOCHS, STEPS_PER_EPOCH = 3, 8
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH

# train.py with its n-th torch.save going to a disk that fills after 4 KiB: torch's real
# serializer writes into the file until the write raises ENOSPC (argv: n, then overrides)
DISK_FULL_AT_SAVE = """
import errno, runpy, sys, torch
n, real_save, calls = int(sys.argv[1]), torch.save, []
class FillingDisk:
    def __init__(self, f):
        self.f, self.room = f, 4096
    def write(self, data):
        data = bytes(data)
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)
    def flush(self):
        self.f.flush()
def save(obj, f, *args, **kwargs):
    calls.append(1)
    return real_save(obj, FillingDisk(f) if len(calls) == n else f, *args, **kwargs)
torch.save = save
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""

# infer.py under a file size limit (RLIMIT_FSIZE, ``ulimit -f``): h5py's write of
# predictions.hdf5 fails part-way as on a full disk (argv: limit in bytes, then infer.py's args)
FILE_SIZE_LIMIT = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, no kill
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.argv = ["infer.py", *sys.argv[2:]]
runpy.run_path("infer.py", run_name="__main__")
"""


def _overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "experiment=quickstart", "model=tiny", "trainer=cpu", f"paths.data_dir={data}",
        f"paths.output_dir={out}", "data.batch_size=2", "data.max_val_windows=2",
        "data.batches_per_epoch=null", "data.generate_if_missing=false",
        "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "logger=csv",
        "callbacks.progress_bar=null", f"trainer.limit_train_batches={STEPS_PER_EPOCH}",
        f"trainer.max_epochs={EPOCHS}", "callbacks.last_checkpoint.every_n_steps=1", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("WALRUS_TRACEBACK", None)
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )


def _train(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run(["train.py", *_overrides(data, out, *extra)])


def _start(data: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *_overrides(data, out)],
        cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _load(path: Path) -> dict | None:
    """The checkpoint if it loads (checksums verified), else None."""
    from walrus.checkpoint import load_checkpoint_file

    try:
        return load_checkpoint_file(path)
    except (OSError, ValueError):
        return None


def _step(path: Path) -> int | None:
    ckpt = _load(path) if path.is_file() else None
    return None if ckpt is None else int(ckpt["global_step"])


def _wait_for_step(path: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> int:
    """Poll ``path`` until it holds ``step`` or later; the step it holds (-1 if never saved)."""
    end, seen, mtime = time.monotonic() + timeout, -1, None
    while time.monotonic() < end and proc.poll() is None and seen < step:
        if path.is_file() and path.stat().st_mtime_ns != mtime:
            mtime = path.stat().st_mtime_ns
            seen = _step(path) or seen
        time.sleep(0.02)
    return seen


def _tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*walrus-tmp*")) if folder.is_dir() else []


def _error_line(stderr: str) -> str:
    return next((ln for ln in stderr.splitlines() if ln.startswith("error:")), "")


def _same_weights(a: Path, b: Path) -> bool:
    from walrus.checkpoint import model_state_dict

    wa, wb = (model_state_dict(_load(p) or {}) for p in (a, b))
    return bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _row(case: str, exit_: int | None, survived: str, checks: dict[str, bool]) -> dict:
    return {"case": case, "exit": exit_, "survived": survived, "ok": all(checks.values()),
            "checks": checks}  # fmt: skip


def _resume_checks(data: Path, out: Path, reference: Path) -> tuple[dict[str, bool], int | None]:
    """Resume ``out`` from its last.ckpt to the end; checks that it finishes like ``reference``."""
    last = out / "checkpoints" / "last.ckpt"
    r = _train(data, out, f"ckpt_path={last}")
    final = _step(last)
    return {
        "resume exits 0": r.returncode == 0,
        f"resume reaches step {TOTAL_STEPS}": final == TOTAL_STEPS,
        "final weights bitwise equal to an uninterrupted run": _same_weights(last, reference),
        "no temporary files left after the resume": not _tmp_files(last.parent),
    }, final


def case_kill9(data: Path, work: Path, reference: Path, at: int) -> dict:
    out = work / "kill9"
    last = out / "checkpoints" / "last.ckpt"
    proc = _start(data, out)
    seen = _wait_for_step(last, proc, at)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = _step(last)
    shutil.copy(last, work / "killed.ckpt")  # for case_corrupt
    checks = {f"last.ckpt saved by step {at}": seen >= at, "last.ckpt loads": saved is not None}
    resumed, final = _resume_checks(data, out, reference)
    return _row(
        f"kill -9 after step {at}, resume",
        proc.returncode,
        f"last.ckpt at step {saved}; resumed to step {final}",
        {**checks, **resumed},
    )


def case_sigterm(data: Path, work: Path, reference: Path, at: int) -> dict:
    out = work / "sigterm"
    last = out / "checkpoints" / "last.ckpt"
    proc = _start(data, out)
    seen = _wait_for_step(last, proc, at)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    saved, message = _step(last), _error_line(err)
    checks = {
        f"still running at step {at}": seen >= at,
        "exit status 143": proc.returncode == 143,
        "one error line naming SIGTERM and the checkpoint": "SIGTERM" in message
        and f"ckpt_path={last}" in message,
        "last.ckpt saved at or after the signal's step": saved is not None and saved >= seen,
        "no temporary files left": not _tmp_files(last.parent),
    }
    resumed, final = _resume_checks(data, out, reference)
    return _row(
        f"SIGTERM after step {at}, resume",
        proc.returncode,
        f"last.ckpt at step {saved}; resumed to step {final}",
        {**checks, **resumed},
    )


def case_disk_full(data: Path, work: Path, reference: Path, at: int) -> dict:
    out = work / "disk_full"
    last = out / "checkpoints" / "last.ckpt"
    r = _run(["-c", DISK_FULL_AT_SAVE, str(at), *_overrides(data, out)])
    saved, message = _step(last), _error_line(r.stderr)
    checks = {
        "exit status 2": r.returncode == 2,
        "one error line: no space left on device, naming last.ckpt": message
        == f"error: no space left on device: could not write {last} (any previous file is kept)",
        "no traceback": "Traceback" not in r.stderr,
        "previous last.ckpt intact (checksums verified)": saved is not None and saved < at,
        "no temporary files left": not _tmp_files(last.parent),
    }
    resumed, final = _resume_checks(data, out, reference)
    return _row(
        f"disk full at save {at}, resume",
        r.returncode,
        f"last.ckpt at step {saved}; resumed to step {final}",
        {**checks, **resumed},
    )


def case_predictions_disk_full(data: Path, work: Path, reference: Path, *extra: str) -> dict:
    """A rollout whose predictions.hdf5 does not fit: one line, no partial or temporary file,
    an earlier rollout's predictions untouched (``extra``: more infer.py options; one dataset)."""
    args = [f"ckpt_path={reference}", f"paths.data_dir={data}", "plots=false", "progress=false"]
    args += extra
    earlier = work / "rollout_ok"
    first = _run(["infer.py", "rollout", *args, f"out={earlier}"])
    old = earlier / "predictions.hdf5"
    before = old.read_bytes() if old.is_file() else b""
    # a file size limit between the largest other file the rollout writes and predictions.hdf5
    others = max(
        (p.stat().st_size for p in earlier.rglob("*") if p.is_file() and p != old), default=0
    )
    limit = (others + len(before)) // 2
    full = work / "rollout_full"
    r = _run(["-c", FILE_SIZE_LIMIT, str(limit), "rollout", *args, f"out={full}"])
    message = _error_line(r.stderr)
    checks = {
        "an unlimited rollout writes predictions.hdf5": first.returncode == 0 and bool(before),
        f"only predictions.hdf5 is larger than the {limit} B limit": len(before) > limit > others,
        "exit status 2": r.returncode == 2,
        "one error line naming predictions.hdf5": message.startswith("error: ")
        and str(full / "predictions.hdf5") in message
        and r.stderr.count("error:") == 1,
        "no traceback": "Traceback" not in r.stderr,
        "no partial predictions.hdf5": not (full / "predictions.hdf5").exists(),
        "no temporary files left": not _tmp_files(full),
        "the earlier rollout's predictions.hdf5 intact": old.is_file()
        and old.read_bytes() == before,
    }
    return _row("predictions.hdf5 past the disk's room", r.returncode, message, checks)


def _ddp_overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return _overrides(data, out, "trainer=ddp", "trainer.accelerator=cpu", *extra)


def _ddp_step_files(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("*.ckpt")) if out.is_dir() else []


def case_sigterm_two_ranks(data: Path, work: Path, at: int) -> dict:
    """``trainer=ddp`` with 2 gloo CPU processes (each rank sees half the data: 12 steps in all);
    SIGTERM to rank 0, which Lightning forwards to rank 1 (sending it to both at once makes
    Lightning's handlers broadcast twice on rank 1); last.ckpt saved, exit 143, the resume
    finishes all epochs."""
    out = work / "sigterm_ddp"
    last = out / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *_ddp_overrides(data, out)],
        cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = _wait_for_step(last, proc, at)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    saved, message = _step(last), _error_line(err)
    resumed = _run(["train.py", *_ddp_overrides(data, out, f"ckpt_path={last}")])
    final = _load(last) or {}
    checks = {
        f"still running at step {at}": seen >= at,
        "exit status 143": proc.returncode == 143,
        "one error line naming SIGTERM and the checkpoint": "SIGTERM" in message
        and f"ckpt_path={last}" in message,
        "last.ckpt saved at or after the signal's step": saved is not None and saved >= seen,
        "no temporary files left": not _tmp_files(last.parent),
        "2-rank resume exits 0": resumed.returncode == 0,
        f"resume runs on to the end of epoch {EPOCHS}": final.get("epoch") == EPOCHS - 1
        and final.get("global_step", 0) > (saved or 0),
    }
    return _row(
        f"SIGTERM to rank 0 of 2 DDP ranks after step {at}, resume",
        proc.returncode,
        f"last.ckpt at step {saved}; resumed to step {final.get('global_step')}",
        checks,
    )


def case_corrupt(data: Path, work: Path) -> dict:
    from tests.test_reliability import flip_byte

    bad = work / "corrupt" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    shutil.copy(work / "killed.ckpt", bad)
    intact = _load(bad) is not None
    flip_byte(bad, "data/0", at=8)
    r = _train(data, work / "corrupt_run", f"ckpt_path={bad}")
    message = _error_line(r.stderr)
    checks = {
        "the unflipped copy loads": intact,
        "exit status 2": r.returncode == 2,
        "one error line naming the file as corrupt": message.startswith(
            f"error: checkpoint {bad} is corrupt: tensor "
        ),
        "no traceback": "Traceback" not in r.stderr,
        "nothing trained from it": not (
            work / "corrupt_run" / "checkpoints" / "last.ckpt"
        ).exists(),
    }
    return _row("one flipped byte in last.ckpt, resume", r.returncode, message, checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--seed", type=int, default=0, help="draws the steps the faults hit")
    args = parser.parse_args(argv)
    from walrus.data.synthetic import generate

    rng = random.Random(args.seed)
    kill_at, term_at, full_at = (rng.randint(2, TOTAL_STEPS - 2) for _ in range(3))
    ddp_at = rng.randint(2, TOTAL_STEPS // 2 - 2)  # 2 ranks: half the steps
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        generate("navier_stokes_2d", data, n_traj=[2, 1, 1], resolution=32, steps=12, seed=0,
                 progress=False)  # fmt: skip
        ref = _train(data, work / "reference")
        reference = work / "reference" / "checkpoints" / "last.ckpt"
        if ref.returncode != 0 or _step(reference) != TOTAL_STEPS:
            print(f"the uninterrupted reference run failed:\n{ref.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows = [
            case_kill9(data, work, reference, kill_at),
            case_sigterm(data, work, reference, term_at),
            case_disk_full(data, work, reference, full_at),
            case_corrupt(data, work),
            case_predictions_disk_full(data, work, reference),
            case_sigterm_two_ranks(data, work, ddp_at),
        ]
    print(f"{'case':40s} {'exit':>4s} {'ok':3s} survived")
    for r in rows:
        print(f"{r['case']:40s} {r['exit']!s:>4s} {'yes' if r['ok'] else 'NO':3s} {r['survived']}")
        for check, held in r["checks"].items():
            if not held:
                print(f"{'':46s}failed: {check}")
    if args.out:
        from walrus.atomic import write_text_atomic

        write_text_atomic(args.out, json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
