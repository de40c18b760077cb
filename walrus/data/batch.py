"""The typed batch that flows from the data layer into training and rollout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class Batch:
    """Windows of frames from one dataset.

    Attributes:
        input_fields: ``(B, T_in, C, *spatial)`` float input frames.
        output_fields: ``(B, T_out, C, *spatial)`` float target frames (``T_out`` may be 0).
        field_ids: ``(C,)`` long vocabulary ids of the C channels (kept on the host).
        bcs: ``(n_spatial, 2)`` long boundary codes (``walrus.bcs.BoundaryType``), lo/hi per axis
            (kept on the host).
        metadata: free-form facts, e.g. ``dataset``, ``field_names``, ``trajectory`` (B,),
            ``start`` (B,), ``dt``. Lists are per sample and are concatenated by ``collate``.
    """

    input_fields: Tensor
    output_fields: Tensor
    field_ids: Tensor
    bcs: Tensor
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        x, y = self.input_fields, self.output_fields
        if x.ndim < 4 or x.ndim > 6:
            raise ValueError(
                f"input_fields must be (B, T, C, *spatial) with 1-3 spatial axes, got shape {tuple(x.shape)}"
            )
        n_spatial = x.ndim - 3
        if y.ndim != x.ndim or y.shape[0] != x.shape[0] or y.shape[2:] != x.shape[2:]:
            raise ValueError(
                f"output_fields shape {tuple(y.shape)} does not match input_fields {tuple(x.shape)} "
                "outside the time axis"
            )
        if self.field_ids.ndim != 1 or self.field_ids.numel() != x.shape[2]:
            raise ValueError(
                f"field_ids must hold one id per channel ({x.shape[2]}), got shape {tuple(self.field_ids.shape)}"
            )
        if tuple(self.bcs.shape) != (n_spatial, 2):
            raise ValueError(
                f"bcs must be ({n_spatial}, 2) for {n_spatial} spatial axes, got {tuple(self.bcs.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return self.input_fields.shape[0]

    @property
    def n_spatial(self) -> int:
        return self.input_fields.ndim - 3

    def channel_names(self, names: Sequence[str] | None = None) -> list[str] | None:
        """The C channel names: ``names`` if given, else ``metadata['field_names']``, else ``None``.

        Raises:
            ValueError: the names are not one per channel.
        """
        n_fields = self.input_fields.shape[2]
        found: Any = names if names is not None else self.metadata.get("field_names")
        if found is None:
            return None
        found = [str(n) for n in found]
        if len(found) != n_fields:
            raise ValueError(f"got {len(found)} field names {found} for {n_fields} channels")
        return found

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Batch:
        """Move the frames; ``dtype`` applies to them only.

        ``field_ids`` and ``bcs`` stay on the host: the model reads them as Python values (stride
        and padding plans, id checks), which on a device tensor would cost a host sync per step.
        """
        return replace(
            self,
            input_fields=self.input_fields.to(device=device, dtype=dtype, non_blocking=True),
            output_fields=self.output_fields.to(device=device, dtype=dtype, non_blocking=True),
        )

    def pin_memory(self) -> Batch:
        return replace(
            self,
            input_fields=self.input_fields.pin_memory(),
            output_fields=self.output_fields.pin_memory(),
        )


def collate(samples: list[Batch]) -> Batch:
    """Concatenate samples (each with its own leading batch axis) into one batch.

    All samples must come from one dataset: same fields, boundaries and shapes.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    first = samples[0]
    for s in samples[1:]:
        if not torch.equal(s.field_ids, first.field_ids) or not torch.equal(s.bcs, first.bcs):
            raise ValueError(
                "cannot collate samples with different fields or boundary conditions "
                f"({first.metadata.get('dataset')!r} vs {s.metadata.get('dataset')!r}); "
                "use the mixing sampler so each batch comes from one dataset"
            )
    metadata: dict[str, Any] = {}
    for key, value in first.metadata.items():
        if isinstance(value, list):
            metadata[key] = [v for s in samples for v in s.metadata[key]]
        elif isinstance(value, Tensor) and value.ndim >= 1:
            metadata[key] = torch.cat([s.metadata[key] for s in samples])
        else:
            metadata[key] = value
    return Batch(
        input_fields=torch.cat([s.input_fields for s in samples]),
        output_fields=torch.cat([s.output_fields for s in samples]),
        field_ids=first.field_ids,
        bcs=first.bcs,
        metadata=metadata,
    )
