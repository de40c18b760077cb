"""A registry of physical field names with stable integer ids.

One model trains on many datasets by naming its input channels through this vocabulary:
``velocity_x`` gets the same id whichever dataset it comes from. Adding names never
changes the ids of names already present, so a checkpoint's vocabulary can be extended
for fine-tuning on a system with new fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor


class FieldVocabulary:
    """Field name -> stable id, in order of first insertion.

    Args:
        names: initial names; duplicates are kept once.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._ids: dict[str, int] = {}
        self.add(names)

    def add(self, names: Iterable[str]) -> list[int]:
        """Add names in place (existing ones are kept) and return the ids of all given names."""
        if isinstance(names, str):
            raise TypeError(f"expected a list of field names, got the string {names!r}")
        out = []
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"field names must be non-empty strings, got {name!r}")
            if name not in self._ids:
                self._ids[name] = len(self._ids)
            out.append(self._ids[name])
        return out

    def extend(self, names: Iterable[str]) -> FieldVocabulary:
        """A new vocabulary with ``names`` appended; this one is left unchanged."""
        new = FieldVocabulary(self.names)
        new.add(names)
        return new

    def ids(self, names: Iterable[str]) -> Tensor:
        """Ids of ``names`` as a ``(C,)`` long tensor; an unknown name is a ValueError."""
        if isinstance(names, str):
            names = [names]
        return torch.tensor([self[n] for n in names], dtype=torch.long)

    def __getitem__(self, name: str) -> int:
        try:
            return self._ids[name]
        except KeyError:
            raise ValueError(
                f"unknown field {name!r}: not in the field vocabulary ({len(self)} names: "
                f"{', '.join(self.names[:20])}{', ...' if len(self) > 20 else ''}); "
                "extend the vocabulary with the new field"
            ) from None

    @property
    def names(self) -> list[str]:
        """All names, ordered by id."""
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, name: object) -> bool:
        return name in self._ids

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldVocabulary) and self.names == other.names

    def __repr__(self) -> str:
        return f"FieldVocabulary({self.names!r})"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, safe for ``weights_only`` checkpoints."""
        return {"names": self.names}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FieldVocabulary:
        """Inverse of ``to_dict``."""
        if "names" not in data:
            raise ValueError("a field vocabulary dict needs a 'names' list")
        names = list(data["names"])
        if len(set(names)) != len(names):
            raise ValueError("a field vocabulary dict has duplicate names")
        return cls(names)
