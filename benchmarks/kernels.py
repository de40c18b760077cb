"""A training step's kernels, recorded under a dispatch mode and replayed alone.

:class:`KernelRecorder` keeps every aten call that moves data (forward and backward) with its
operands' sizes, strides and dtype, sorted by kind (:func:`kernel_kind`); :class:`KernelReplay`
replays calls on random tensors of the same layouts. Over a step's GEMM calls that replay is its
GEMM floor (:mod:`benchmarks.gemm_rate`). :func:`op_breakdown` splits one profiled step's CPU
time by kind of op instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


def mean_seconds(fn: Callable[[], Any], iters: int) -> float:
    """Mean wall seconds of ``iters`` calls of ``fn`` (after one untimed call)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "aten::bmm",
    "aten::baddbmm",
    "aten::baddbmm_",
)
COPY_OPS = ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::stack", "aten::clone")


def op_kind(name: str) -> str:
    """``gemm``, ``attention``, ``copy`` or ``other`` for a profiled aten op name."""
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "attention" in name.lower():
        return "attention"
    return "copy" if name in COPY_OPS else "other"


def gemm_flops(name: str, shapes: list[list[int]]) -> int:
    """FLOPs of one GEMM op from its recorded input shapes (0 when they are not recorded).

    ``mm (m,k)(k,n)``, ``addmm[_] (c)(m,k)(k,n)`` and the batched ``bmm``/``baddbmm[_]`` forms:
    ``2 m k n`` per matrix product.
    """
    mats = [s for s in shapes if len(s) >= 2]
    if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_"):
        mats = mats[-2:] if len(mats) >= 2 else []
    if len(mats) < 2:
        return 0
    a, b = mats[0], mats[1]
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


_GEMM_PACKETS = {getattr(torch.ops.aten, n.removeprefix("aten::")) for n in GEMM_OPS}
NORM_OPS = ("layer_norm", "vector_norm", "group_norm", "rms_norm")
ACTIVATION_OPS = ("silu", "gelu", "sigmoid", "tanh", "relu")
KERNEL_KINDS = ("gemm", "attention", "norm", "activation", "copy", "other")


def kernel_kind(name: str) -> str:
    """The kind of a dispatched aten op (``aten::silu_backward``) for the kernel replay:
    ``op_kind``'s ``gemm``, ``attention`` and ``copy``, with ``norm`` and ``activation`` (and
    their backwards) split out of ``other``."""
    kind = op_kind(name)
    if kind != "other":
        return kind
    base = name.removeprefix("aten::")
    if any(n in base for n in NORM_OPS):
        return "norm"
    if base.rstrip("_").removesuffix("_backward") in ACTIVATION_OPS:
        return "activation"
    return "other"


@dataclass(frozen=True)
class TensorSpec:
    """Size, stride and dtype of a recorded operand."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def fresh(self) -> torch.Tensor:
        """A tensor of this layout (its own storage, just large enough): random floats, zero
        integers and booleans (safe as indices)."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        if 0 in self.size:
            extent = 0
        if self.dtype.is_floating_point or self.dtype.is_complex:
            flat = torch.randn(extent, dtype=self.dtype)
        else:
            flat = torch.zeros(extent, dtype=self.dtype)
        return flat.as_strided(self.size, self.stride)


Call = tuple[Any, tuple, dict]  # (overload, args, kwargs), tensors as TensorSpec


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), value.stride(), value.dtype)
    return value


class KernelRecorder(TorchDispatchMode):
    """Records the aten calls that run under it, forward and backward alike, by kind.

    ``calls[kind]`` holds ``(overload, args, kwargs)`` with every tensor replaced by its
    :class:`TensorSpec`: enough to replay the call on fresh tensors of the same layout. Views
    (no data moved) are not recorded; ``kinds`` limits the recording to those kinds.
    """

    def __init__(self, kinds: tuple[str, ...] = KERNEL_KINDS) -> None:
        super().__init__()
        self.kinds = kinds
        self.calls: dict[str, list[Call]] = {k: [] for k in kinds}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if not func.is_view:
            if func.overloadpacket in _GEMM_PACKETS:
                kind = "gemm"
            else:
                kind = kernel_kind(f"aten::{func.overloadpacket.__name__}")
            if kind in self.kinds:
                self.calls[kind].append((func, *tree_map(_spec, (args, kwargs))))
        return func(*args, **kwargs)


def step_kernels(
    step: Callable[[], Any], kinds: tuple[str, ...] = KERNEL_KINDS
) -> dict[str, list[Call]]:
    """The aten calls of one run of ``step`` by kind (after one unrecorded run), in order."""
    step()
    with KernelRecorder(kinds) as rec:
        step()
    return rec.calls


def step_gemms(step: Callable[[], Any]) -> list[Call]:
    """The GEMM calls of one run of ``step`` (after one unrecorded run), in order: ``mm``,
    ``addmm``, ``bmm``, ``baddbmm`` and their in-place and ``out=`` forms."""
    return step_kernels(step, ("gemm",))["gemm"]


def call_flops(func: Any, args: tuple) -> int:
    """FLOPs of one recorded GEMM call (see :func:`gemm_flops`); 0 for other ops."""
    if func.overloadpacket not in _GEMM_PACKETS:
        return 0
    shapes = [list(a.size) for a in args if isinstance(a, TensorSpec)]
    return gemm_flops(f"aten::{func.overloadpacket.__name__}", shapes)


def _fresh(value: Any) -> Any:
    return value.fresh() if isinstance(value, TensorSpec) else value


class KernelReplay:
    """Recorded calls alone: each replayed on random tensors of its layout.

    Each call gets its own inputs (same sizes, strides and dtype as in the step), so caches see
    about what the step's kernels see; in-place calls write into their own buffer each time.
    Over a step's GEMM calls this is its GEMM floor.
    """

    def __init__(self, calls: list[Call]):
        self.calls = [
            (func, tree_map(_fresh, args), tree_map(_fresh, kw)) for func, args, kw in calls
        ]
        self.flops = sum(call_flops(func, args) for func, args, _ in calls)

    def __call__(self) -> None:
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)

    def seconds(self, iters: int) -> float:
        """Mean wall seconds of ``iters`` replays (after one untimed replay)."""
        return mean_seconds(self, iters)


def op_breakdown(step: Callable[[], Any]) -> dict[str, Any]:
    """One profiled forward+backward of ``step``: CPU seconds per op kind and GEMM FLOPs.

    Returns:
        ``{"seconds": {kind: s}, "total_s", "gemm_flops"}`` over the ops' self CPU time.
    """
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds = dict.fromkeys(("gemm", "attention", "copy", "other"), 0.0)
    flops = 0
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        kind = op_kind(ev.name)
        seconds[kind] += ev.self_cpu_time_total * 1e-6
        if kind == "gemm":
            flops += gemm_flops(ev.name, [list(s) for s in ev.input_shapes])
    return {"seconds": seconds, "total_s": sum(seconds.values()), "gemm_flops": flops}


def floor_summary(calls: list[Call]) -> list[dict[str, Any]]:
    """The distinct GEMM calls of a step: op, operand sizes, count and FLOPs per call."""
    seen: dict[tuple, dict[str, Any]] = {}
    for func, args, _ in calls:
        sizes = [list(a.size) for a in args if isinstance(a, TensorSpec)]
        key = (str(func), str(sizes))
        entry = seen.setdefault(
            key, {"op": str(func), "sizes": sizes, "count": 0, "flops": call_flops(func, args)}
        )
        entry["count"] += 1
    return sorted(seen.values(), key=lambda e: -e["count"] * e["flops"])
