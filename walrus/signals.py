"""Stop an inference command on SIGTERM or SIGINT within one model call.

Inside :func:`stop_on_signals` the two signals only note themselves; :func:`check_stop`, which
the rollout calls after every model call (each step, each ensemble member, each jitter draw),
then raises :class:`~walrus.errors.CommandInterrupted`, and ``walrus.cli`` exits with
128 + the signal number (143 for SIGTERM, 130 for SIGINT). Outside the block (the Python API,
training) the check does nothing and the signals keep their usual handlers.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from walrus.errors import CommandInterrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RECEIVED: list[int] = []  # the first stop signal received inside the block


def _note(signum: int, frame: object) -> None:
    if not _RECEIVED:
        _RECEIVED.append(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT set a flag that :func:`check_stop` turns into
    ``CommandInterrupted``; the previous handlers come back on leaving. Only in the main
    thread (elsewhere signals cannot be handled; the block then changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _RECEIVED.clear()
    for s in STOP_SIGNALS:
        signal.signal(s, _note)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _RECEIVED.clear()


def check_stop(what: str = "") -> None:
    """Raise ``CommandInterrupted`` if a stop signal was received (``what``: where, for the
    message)."""
    if _RECEIVED:
        raise CommandInterrupted(_RECEIVED[0], what)
