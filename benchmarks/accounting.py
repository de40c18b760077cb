"""Work accounting without real compute: FLOPs, materialised bytes, ATen calls, host syncs.

:func:`account` runs a function under :class:`OpAccountant` (a ``TorchDispatchMode``) and
torch's ``FlopCounterMode``, normally inside a ``FakeTensorMode`` so a 1.3B-parameter forward
at batch 8 costs seconds and no memory. Definitions (the same as the issue's reference):

- **calls**: ATen calls that return at least one tensor (views and in-place ops included;
  ``prim.device`` and other non-tensor results are not calls). Ops on real host tensors inside
  a fake run (index checks on a CPU ``fields`` tensor) are run for real and counted apart as
  ``host_calls``: they are not device work.
- **materialised bytes**: bytes of the tensors returned by non-view ops that do not alias an
  input (fresh storage). In-place and ``out=`` writes are counted apart as ``inplace_bytes``.
  Uninitialised allocations (``empty``, ``new_empty``, ...) launch no kernel and write nothing:
  they are calls without bytes.
- **host syncs**: ops that make the host wait for the device: ``.item()``
  (``_local_scalar_dense``), ops with data-dependent output shapes (``nonzero``,
  ``masked_select``, ...), and copies from an accelerator to the CPU. Under fake tensors a
  ``.item()`` cannot produce a value; it is recorded and answered with zero.
- **FLOPs**: ``FlopCounterMode`` with the CPU flash-attention kernel (and in-place GEMMs) registered
  (:func:`register_cpu_sdpa_flops`); torch only ships formulas for the CUDA SDPA kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_SDPA_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_ALIASING = {torch.ops.aten._unsafe_view.default}  # views without alias annotations
_MASK_INDEX = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default}
_INPLACE_GEMMS = {torch.ops.aten.addmm_.default, torch.ops.aten.baddbmm_.default}
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.empty_like.default,
}


def register_cpu_sdpa_flops() -> None:
    """Teach ``FlopCounterMode`` the CPU flash-attention kernels (forward and backward).

    torch ships formulas for the CUDA SDPA kernels only; without these the CPU attention would
    count zero. This is the reference's counting method ("stock"). In-place GEMMs (``addmm_``,
    ``baddbmm_``), which stock ``FlopCounterMode`` also counts as zero, are added by
    :class:`OpAccountant` to give the complete count. Idempotent.
    """
    if _SDPA_CPU in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(_SDPA_CPU)
    def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(_SDPA_CPU_BWD)
    def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kw):
        return flop_counter.sdpa_backward_flop_count(
            grad_out_shape, query_shape, key_shape, value_shape
        )


@dataclass
class OpStat:
    """Totals for one ATen overload."""

    calls: int = 0
    bytes: int = 0  # materialised (fresh storage)
    inplace_bytes: int = 0


@dataclass
class Report:
    """Result of :func:`account`.

    Attributes:
        flops: complete FLOP count: ``flops_stock`` plus in-place GEMMs.
        flops_stock: FLOPs counted by ``FlopCounterMode`` with the CPU SDPA kernel registered
            (the reference's method; in-place GEMMs count zero).
        calls: ATen calls returning tensors (device work).
        materialised_bytes: bytes of fresh tensors written by non-view ops.
        inplace_bytes: bytes written in place or into ``out=`` tensors.
        host_calls: ATen calls on real host tensors (not device work).
        syncs: one line per host sync (op name and reason).
        ops: per-overload totals.
    """

    flops: int = 0
    flops_stock: int = 0
    calls: int = 0
    materialised_bytes: int = 0
    inplace_bytes: int = 0
    host_calls: int = 0
    syncs: list[str] = field(default_factory=list)
    ops: dict[str, OpStat] = field(default_factory=dict)

    def top(self, n: int = 15) -> list[dict[str, Any]]:
        """The ``n`` ops that write the most bytes (fresh and in place), as table rows."""
        rows = sorted(self.ops.items(), key=lambda kv: -(kv[1].bytes + kv[1].inplace_bytes))[:n]
        return [
            {
                "op": k,
                "calls": v.calls,
                "GB": v.bytes / 1e9,
                "inplace_GB": v.inplace_bytes / 1e9,
                "written_GB": (v.bytes + v.inplace_bytes) / 1e9,
            }
            for k, v in rows
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable summary (ops sorted by materialised bytes)."""
        return {
            "flops": self.flops,
            "flops_stock": self.flops_stock,
            "calls": self.calls,
            "materialised_bytes": self.materialised_bytes,
            "inplace_bytes": self.inplace_bytes,
            "host_calls": self.host_calls,
            "syncs": self.syncs,
            "ops": {k: vars(v) for k, v in sorted(self.ops.items(), key=lambda kv: -kv[1].bytes)},
        }


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class OpAccountant(TorchDispatchMode):
    """Counts calls, bytes and host syncs of every ATen op (see the module docstring).

    Args:
        fake: the run uses fake tensors; real-tensor ops then count as host calls.
    """

    def __init__(self, fake: bool = True):
        super().__init__()
        self.fake = fake
        self.report = Report()
        self.inplace_gemm_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if self.fake and flat and not any(isinstance(t, FakeTensor) for t in flat):
            with _disable_current_modes():
                out = func(*args, **kwargs)
            self.report.host_calls += 1
            return out
        name = str(func)
        sync = self._sync_reason(func, flat, kwargs)
        if sync:
            self.report.syncs.append(f"{name}: {sync}")
        try:
            out = func(*args, **kwargs)
        except Exception as err:  # a fake tensor cannot answer a data-dependent query
            if func is torch.ops.aten._local_scalar_dense.default:
                return 0
            raise RuntimeError(f"{name} needs real data (host sync): {err}") from err
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if not outs:
            return out
        if func in _INPLACE_GEMMS:  # (self, a (.., n, k), b (.., k, m))
            a, b = args[1], args[2]
            self.inplace_gemm_flops += 2 * math.prod(a.shape) * b.shape[-1]
        stat = self.report.ops.setdefault(name, OpStat())
        stat.calls += 1
        self.report.calls += 1
        if func.is_view or func in _ALIASING or func in _ALLOCATIONS:
            return out
        aliased = [r.alias_info is not None for r in func._schema.returns]
        for i, t in enumerate(outs):
            n = _nbytes(t)
            if i < len(aliased) and aliased[i]:
                stat.inplace_bytes += n
                self.report.inplace_bytes += n
            else:
                stat.bytes += n
                self.report.materialised_bytes += n
        return out

    @staticmethod
    def _sync_reason(func, flat: list[Tensor], kwargs: dict) -> str | None:  # noqa: ANN001
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            return "value read on the host (.item() / data-dependent output)"
        if func in _MASK_INDEX:  # only boolean masks make the shape data-dependent
            if any(t.dtype in (torch.bool, torch.uint8) for t in flat[1:]):
                return "boolean-mask indexing (data-dependent shape)"
            return None
        if torch.Tag.dynamic_output_shape in tags:
            return "output shape depends on the data"
        if func in _COPIES and flat:
            src = flat[-1] if func is torch.ops.aten.copy_.default else flat[0]
            dst = flat[0] if func is torch.ops.aten.copy_.default else kwargs.get("device")
            dst_type = dst.device.type if isinstance(dst, Tensor) else getattr(dst, "type", None)
            if src.device.type not in ("cpu", "meta") and dst_type == "cpu":
                return f"copy from {src.device.type} to the host"
        return None


def account(fn: Callable[[], Any], fake: bool = True) -> Report:
    """Run ``fn()`` and count its work.

    Args:
        fn: the computation (no arguments). For a fake run, call this inside a
            ``FakeTensorMode(allow_non_fake_inputs=True)`` with fake inputs and module.
        fake: see :class:`OpAccountant`.

    Returns:
        The :class:`Report`.
    """
    register_cpu_sdpa_flops()
    flops = flop_counter.FlopCounterMode(display=False)
    with flops, OpAccountant(fake) as acc:
        fn()
    acc.report.flops_stock = flops.get_total_flops()
    acc.report.flops = acc.report.flops_stock + acc.inplace_gemm_flops
    return acc.report
