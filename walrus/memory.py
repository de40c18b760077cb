"""How much memory this process may still use, and requests checked against it up front.

:func:`available_memory` is the smallest of the machine's ``MemAvailable``, the cgroup's room
(``memory.max`` minus ``memory.current``, v1's ``limit_in_bytes`` minus ``usage_in_bytes``) and
the address-space limit (``ulimit -v``) minus what the process has mapped. The default bound on
one data read (``data.max_sample_bytes``) is a share of it, and a model whose weights (with
gradients and optimizer state, when training) cannot fit is refused before it is built.
"""

from __future__ import annotations

import functools
import os
import re
import resource
from pathlib import Path
from typing import Any

# share of the available memory one data read may take by default (data.max_sample_bytes)
SAMPLE_SHARE = 0.25
MIN_SAMPLE_BYTES = 256 << 20
# bytes per parameter: fp32 weights; training adds the gradient and AdamW's two moments
BYTES_PER_PARAM = {"train": 16, "infer": 4}
# RuntimeError texts of PyTorch's allocators (CPU, CUDA, MPS) running out of memory
ALLOCATOR_ERROR = re.compile(
    r"can't allocate memory|DefaultCPUAllocator|out of memory|failed to allocate|"
    r"not enough memory",
    re.I,
)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit = _read_int(limit_file)
        if limit is not None and limit < 1 << 60:  # "max" or v1's huge number: no limit
            return max(limit - (_read_int(usage_file) or 0), 0)
    return None


def _address_space_room() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - mapped, 0)


def available_memory() -> int:
    """Bytes this process may still allocate: the smallest of the known limits (the physical
    memory when none can be read)."""
    known = [
        v
        for v in (_meminfo("MemAvailable"), _cgroup_room(), _address_space_room())
        if v is not None
    ]
    if not known:
        try:
            known = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
        except (ValueError, OSError, AttributeError):
            known = [8 << 30]
    return min(known)


@functools.lru_cache(maxsize=1)
def default_max_sample_bytes() -> int:
    """The default ``data.max_sample_bytes``: a quarter of :func:`available_memory` when first
    asked (at least 256 MiB), then fixed for the process."""
    return max(int(available_memory() * SAMPLE_SHARE), MIN_SAMPLE_BYTES)


def gib(n: float) -> str:
    """``n`` bytes in GiB, three significant digits."""
    return f"{n / 2**30:.3g} GiB"


def check_model_fits(model_config: dict[str, Any], purpose: str, source: str = "model") -> None:
    """Refuse a model whose parameters cannot fit in :func:`available_memory`, before it is
    built: the parameters are counted on PyTorch's ``meta`` device (no memory).

    Args:
        model_config: a :class:`~walrus.model.config.WalrusConfig` as a dict (validated by the
            caller's build step; an invalid one is left to it).
        purpose: ``"train"`` (weights, gradients and AdamW state: 16 bytes per parameter) or
            ``"infer"`` (weights: 4 bytes per parameter).
        source: what the sizes come from, for the message (``"model"`` names the options).

    Raises:
        ValueError: one line naming the size options (or ``source``) and both amounts.
    """
    import torch

    from walrus.model.config import WalrusConfig
    from walrus.model.walrus import Walrus

    try:
        config = WalrusConfig.from_dict(model_config)
    except ValueError:
        return  # the caller's build reports it
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Walrus(config).parameters())
    need = n_params * BYTES_PER_PARAM[purpose]
    room = available_memory()
    if need <= room:
        return
    sizes = ", ".join(
        f"model.{k}={getattr(config, k)}"
        for k in ("dim", "depth", "heads", "intermediate_dim", "projection_dim", "n_fields")
    )
    what = "weights, gradients and optimizer state" if purpose == "train" else "weights"
    raise ValueError(
        f"{source if source != 'model' else sizes}: {n_params:,} parameters need {gib(need)} for "
        f"their {what}, more than the {gib(room)} this machine has available; choose smaller "
        "model sizes"
    )


def is_allocator_error(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch's (or NumPy's) allocator running out of memory."""
    import torch

    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and bool(ALLOCATOR_ERROR.search(str(error)))
