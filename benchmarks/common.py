"""Small helpers shared by the benchmark scripts: timing, allocation tracking, GEMM rate, output.

Run benchmark scripts as modules from the repository root, e.g.
``python -m benchmarks.attention --quick``; they import this file as ``benchmarks.common``.

Memory: :class:`AllocationTracker` is a ``TorchDispatchMode`` that sees every ATen op's outputs.
A storage that is new (not aliasing an input of the op) counts its bytes until the storage is
freed (a finalizer on the storage object; torch keeps one Python object per live storage), so
:func:`peak_alloc_bytes` gives the peak of live tensor bytes created inside ``fn``, including
tensors saved for backward. It does not see scratch buffers that a fused C++ kernel allocates
internally without an ATen op (e.g. SDPA's per-thread blocks), nor allocator caching.
:func:`peak_rss_delta` is the cruder whole-process alternative (Linux VmHWM).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(
    fn: Callable[[], Any],
    warmup: int = 2,
    iters: int = 5,
    device: torch.device | str | None = None,
    stat: str = "median",
) -> float:
    """Wall time of ``fn()`` in milliseconds: the median (or minimum) of ``iters`` calls.

    Args:
        fn: the call to time (no arguments).
        warmup: untimed calls first.
        iters: timed calls.
        device: synchronise this device (CUDA) around each call.
        stat: ``"median"`` or ``"min"`` (more robust on a machine shared with other jobs).
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"timeit needs iters >= 1 and warmup >= 0, got {iters=}, {warmup=}")
    if stat not in ("median", "min"):
        raise ValueError(f"timeit stat must be 'median' or 'min', got {stat!r}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) if stat == "median" else min(times)


class AllocationTracker(TorchDispatchMode):
    """Track live and peak bytes of tensor storages created by ATen ops inside the context.

    Attributes:
        live: bytes of tracked storages still alive.
        peak: the largest ``live`` seen.
        max_numel: the largest output tensor (in elements) any op produced.
        calls: number of calls per op name (``"aten.bmm.default"`` etc.).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.max_numel = 0
        self.calls: dict[str, int] = {}
        self._ids: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._ids.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        self.calls[name] = self.calls.get(name, 0) + 1
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            self.max_numel = max(self.max_numel, t.numel())
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._ids:
                continue
            nbytes = st.nbytes()
            self._ids.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, nbytes)
        return out

    def count(self, *names: str) -> int:
        """Total calls of ops whose name contains any of ``names`` (e.g. ``"bmm"``)."""
        return sum(c for op, c in self.calls.items() if any(n in op for n in names))


def peak_alloc_bytes(fn: Callable[[], Any]) -> int:
    """Peak live bytes of tensors allocated while running ``fn()`` (see module docstring).

    The result of ``fn`` is dropped inside the tracker, so the peak includes it while alive.
    """
    with AllocationTracker() as tracker:
        fn()
    return tracker.peak


def peak_rss_delta(fn: Callable[[], Any]) -> int | None:
    """Rise of the process's peak resident set (VmHWM) over its current RSS while running ``fn``.

    Linux only (None elsewhere): the peak is reset through ``/proc/self/clear_refs``. Memory the
    allocator already holds from earlier work is reused without showing up, so this can
    under-count; run it in a fresh process for a cleaner figure.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_kib("VmRSS")
        fn()
        return (_proc_status_kib("VmHWM") - before) * 1024
    except OSError:
        return None


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no field {field}")


def gemm_gflops(
    dtype: torch.dtype = torch.float32, n: int = 1024, device: torch.device | str = "cpu"
) -> float:
    """Measured square-GEMM rate (GFLOP/s) of this machine: ``2 n^3`` flops per ``n x n`` matmul."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = timeit(lambda: torch.mm(a, b), warmup=2, iters=5, device=device)
    return 2 * n**3 / (ms * 1e-3) / 1e9


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment() -> dict[str, Any]:
    """Machine and library facts to store next to benchmark figures (equal-CPU-time figures
    depend on the CPU: store them with its model and vector capability)."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def save_json(name: str, data: dict[str, Any], results_dir: str | Path | None = None) -> Path:
    """Write ``data`` plus :func:`environment` to ``<results_dir>/<name>.json`` atomically.

    Args:
        name: file stem, e.g. ``"attention"``.
        data: JSON-serialisable results.
        results_dir: defaults to ``benchmarks/results`` next to this file.

    Returns:
        The path written.
    """
    out_dir = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"environment": environment(), **data}
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def print_table(rows: Sequence[dict[str, Any]], floatfmt: str = ".3g") -> None:
    """Print dict rows as an aligned text table (columns in first-seen key order)."""
    if not rows:
        return
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]

    def fmt(x: Any) -> str:
        if x is None:
            return "-"
        return format(x, floatfmt) if isinstance(x, float) else str(x)

    cells = [[fmt(row.get(c)) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in cells:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
