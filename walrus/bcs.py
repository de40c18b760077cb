"""Boundary condition codes, shared by the data reader and the model.

The numbering follows The Well's ``BoundaryCondition`` enum, so values read from a
Well file's ``bc_type`` attribute map straight onto these codes.
"""

from __future__ import annotations

from enum import IntEnum


class BoundaryType(IntEnum):
    WALL = 0
    OPEN = 1
    PERIODIC = 2

    @classmethod
    def parse(cls, value: str | int) -> BoundaryType:
        """Accept a code, or a name in any case (``"periodic"``, ``"WALL"``)."""
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"unknown boundary type {value!r}; expected one of {names}") from None
