"""Errors a user can act on; ``walrus.cli`` turns them into one ``error: ...`` line."""

from __future__ import annotations

import contextlib
import errno
import shlex
import signal
from collections.abc import Iterator, Sequence


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss is NaN or Inf; the message names the step and batch."""


class NonFiniteWeightsError(RuntimeError):
    """Raised when a model parameter, or its one-step validation prediction, is NaN or Inf;
    nothing is saved after it, so the last finite checkpoint is kept. The message names the
    step and, where one is, the first non-finite parameter."""


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


class CommandInterrupted(RuntimeError):
    """An inference command stopped on SIGTERM or SIGINT (see ``walrus.signals``);
    ``walrus.cli`` exits with ``exit_status``, 128 + the signal number (143, 130).

    Attributes:
        signum: the signal received.
        exit_status: what a shell reports for a process the signal ended.
    """

    def __init__(self, signum: int, what: str = "") -> None:
        self.signum = int(signum)
        self.exit_status = 128 + self.signum
        name = signal.Signals(self.signum).name
        super().__init__(f"stopped by {name}" + (f": {what}" if what else ""))


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
    :data:`RESOURCE_ERRORS` or allocator ``RuntimeError`` raised inside, as its
    ``walrus_input`` attribute; the innermost name wins. ``walrus.cli.run_cli`` reports it."""
    from walrus.memory import is_allocator_error

    try:
        yield
    except (*RESOURCE_ERRORS, RuntimeError) as e:
        if not isinstance(e, RESOURCE_ERRORS) and not is_allocator_error(e):
            raise
        if getattr(e, "walrus_input", None) is None:
            with contextlib.suppress(AttributeError):
                e.walrus_input = what  # type: ignore[attr-defined]
        raise
