"""Errors a user can act on; ``walrus.cli`` turns them into one ``error: ...`` line."""

from __future__ import annotations

import contextlib
import errno
import shlex
from collections.abc import Iterator, Sequence


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss is NaN or Inf; the message names the step and batch."""


class RolloutDivergedError(ValueError):
    """A rollout prediction held NaN or Inf.

    Attributes:
        step: 1-based rollout step whose prediction was not finite.
        fields: names of the fields with non-finite values.
    """

    def __init__(self, step: int, fields: Sequence[str]) -> None:
        self.step = step
        self.fields = list(fields)
        super().__init__(
            f"rollout diverged at step {step}: non-finite values (NaN/Inf) in fields {self.fields}"
        )


class TrainingInterrupted(RuntimeError):
    """Training stopped on SIGTERM or Ctrl-C (SIGINT) after saving a checkpoint; ``walrus.cli``
    exits with 143 (SIGTERM) or 130 (Ctrl-C), what a shell reports for a process those signals
    killed.

    Attributes:
        checkpoint: the checkpoint to resume from (``ckpt_path=``).
        exit_status: 143 for SIGTERM, 130 for SIGINT.
    """

    def __init__(self, step: int, checkpoint: str, signal_name: str = "SIGTERM") -> None:
        self.checkpoint = checkpoint
        self.exit_status = 130 if signal_name == "SIGINT" else 143  # 128 + signal number
        what = "Ctrl-C (SIGINT)" if signal_name == "SIGINT" else signal_name
        super().__init__(
            f"training stopped by {what} at step {step}; saved {checkpoint}; resume with: "
            f"python train.py ckpt_path={shlex.quote(checkpoint)}"
        )


class DiskFullError(OSError):
    """A write failed because the disk (or quota) is full, or the file grew past the largest
    file allowed (``EFBIG``: the filesystem's or ``ulimit -f``); the message names the file."""

    def __init__(self, path: str, errno_: int) -> None:
        what = (
            "file size limit reached (filesystem or ulimit -f)"
            if errno_ == errno.EFBIG
            else "no space left on device"
        )
        super().__init__(f"{what}: could not write {path} (any previous file is kept)")
        self.errno, self.filename = errno_, path

    def __str__(self) -> str:
        return self.args[0]


# what blows up when an input asks for too much: memory, recursion depth, number range
RESOURCE_ERRORS = (MemoryError, RecursionError, OverflowError)


@contextlib.contextmanager
def reading(what: str) -> Iterator[None]:
    """Name the input being processed (``"checkpoint PATH"``, ``"option data.x"``) on any
    :data:`RESOURCE_ERRORS` raised inside, as its ``walrus_input`` attribute; the innermost
    name wins. ``walrus.cli.run_cli`` reports it."""
    try:
        yield
    except RESOURCE_ERRORS as e:
        if getattr(e, "walrus_input", None) is None:
            with contextlib.suppress(AttributeError):
                e.walrus_input = what  # type: ignore[attr-defined]
        raise
