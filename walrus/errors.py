"""Errors a user can act on; ``walrus.cli`` turns them into one ``error: ...`` line."""

from __future__ import annotations

from collections.abc import Sequence


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
