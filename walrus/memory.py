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
from collections.abc import Mapping, Sequence
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


def _param_count(model_config: Mapping[str, Any]) -> tuple[Any, int] | None:
    """The validated config and its parameter count (counted on the ``meta`` device: no
    memory); ``None`` for an invalid config (the caller's build reports it)."""
    import torch

    from walrus.model.config import WalrusConfig
    from walrus.model.walrus import Walrus

    try:
        config = WalrusConfig.from_dict(model_config)
    except ValueError:
        return None
    with torch.device("meta"):
        return config, sum(p.numel() for p in Walrus(config).parameters())


def model_bytes(model_config: Mapping[str, Any], purpose: str) -> int:
    """Bytes the model of ``model_config`` takes for ``purpose`` (see :func:`check_model_fits`);
    0 for an invalid config."""
    counted = _param_count(model_config)
    return 0 if counted is None else counted[1] * BYTES_PER_PARAM[purpose]


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
    counted = _param_count(model_config)
    if counted is None:
        return
    config, n_params = counted
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


def runs_on_cpu(accelerator: Any) -> bool:
    """Whether a Lightning ``accelerator`` option puts the run on the CPU (``"auto"``: when no
    GPU is visible)."""
    import torch

    name = str(accelerator or "auto").lower()
    if name == "auto":
        return not torch.cuda.is_available() and not torch.backends.mps.is_available()
    return name == "cpu"


def check_forward_fits(
    model: Any,
    inputs: Sequence[tuple[str, int, Sequence[int], Any]],
    batch: int,
    frames: int,
    *,
    training: bool,
    batch_option: str,
    to_allocate: int = 0,
    grad_steps: int = 1,
) -> None:
    """Refuse, before the first batch, a forward (or training step) whose activations cannot
    fit in :func:`available_memory` (CPU runs: callers skip this on a GPU).

    The peak comes from :func:`walrus.model.peak.activation_bytes` (conservative, analytic).

    Args:
        model: the model, or its config as a dict (then built on the ``meta`` device; an
            invalid one is left to the caller's build). Modules other than
            :class:`~walrus.model.walrus.Walrus` are not checked.
        inputs: per dataset ``(file, channels, spatial grid, bcs)``: the file named in the
            message, the fields per frame, the grid and the boundary codes (``None``: walls).
        batch, frames: samples per batch and input frames per sample.
        training: a training step (activations kept for backward) rather than a no-grad forward.
        batch_option: the option that sets ``batch``, with its value, for the message
            (``"data.batch_size=8"``).
        to_allocate: bytes still to be allocated besides the activations (the weights, their
            gradients and optimizer state of a model not yet built).
        grad_steps: forwards whose activations are kept together (an unrolled training step).

    Raises:
        ValueError: one line naming the file, the batch option and the model sizes.
    """
    import torch

    from walrus.model.config import WalrusConfig
    from walrus.model.peak import activation_bytes
    from walrus.model.walrus import Walrus

    if isinstance(model, Mapping):
        try:
            config = WalrusConfig.from_dict(model)
        except ValueError:
            return  # the caller's build reports it
        with torch.device("meta"):
            model = Walrus(config)
    if not isinstance(model, Walrus):
        return  # another kind of module (a wrapper): nothing to estimate from
    room = available_memory()
    for source, channels, spatial, bcs in inputs:
        try:
            act = activation_bytes(
                model, batch, frames, channels, spatial, training=training, bcs=bcs,
                grad_steps=grad_steps,
            )  # fmt: skip
        except ValueError:
            continue  # a grid the model cannot tile: the forward's own check names it
        if act + to_allocate <= room:
            continue
        cfg = model.config
        sizes = ", ".join(f"model.{k}={getattr(cfg, k)}" for k in ("dim", "depth", "heads"))
        what = "one training step" if training else "one forward pass"
        extra = f" plus {gib(to_allocate)} for the model" if to_allocate else ""
        hints = [batch_option, f"the model size ({sizes})"]
        if training and not cfg.grad_checkpointing:
            hints.append("set model.grad_checkpointing=true")
        grid = "x".join(str(int(n)) for n in spatial)
        raise ValueError(
            f"{source}: {what} on {batch} sample(s) of {frames} frame(s), {channels} field(s) and "
            f"a {grid} grid needs about {gib(act)} of activations{extra}, more than the "
            f"{gib(room)} this machine has available; lower {', '.join(hints)}, or use data "
            "with a smaller grid"
        )
