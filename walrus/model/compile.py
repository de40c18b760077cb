"""``torch.compile`` of a Walrus model in place: per processor block, or the whole model.

Both keep the state dict's keys (``nn.Module.compile`` wraps the call, not the module). The
whole-model compile traces the host-side preparation too (input checks, stride and padding
plans, jitter draws): Dynamo runs what reads tensor values eagerly (graph breaks there) and
compiles the rest; new jitter offsets cost a recompile until Dynamo marks them dynamic.
Inside a compiled region :func:`~walrus.model.fast_blocks.run_processor` takes the
out-of-place fused path (inductor plans its own buffers) and derived weights are not cached.
"""

from __future__ import annotations

from torch import nn

COMPILE_MODES = ("false", "blocks", "model")


def compile_mode(value: bool | str | None, option: str = "compile") -> str:
    """The compile mode ``value`` names: ``"false"``, ``"blocks"`` or ``"model"``.

    ``True`` means ``"blocks"`` and ``False`` / ``None`` mean ``"false"``.

    Raises:
        ValueError: any other value, naming ``option``.
    """
    if value is None or value is False:
        return "false"
    if value is True:
        return "blocks"
    if isinstance(value, str) and value.lower() in COMPILE_MODES:
        return value.lower()
    raise ValueError(
        f"option {option} must be false, blocks or model (true means blocks), got {value!r}"
    )


def compile_model(model: nn.Module, mode: bool | str | None, option: str = "compile") -> str:
    """Compile ``model`` in place as ``mode`` says (see :func:`compile_mode`); returns the mode.

    ``"blocks"`` compiles each of ``model.blocks`` (where the compute is); ``"model"`` compiles
    the whole forward, encoder and decoder included.
    """
    mode = compile_mode(mode, option)
    if mode == "blocks":
        for block in model.blocks:
            block.compile()
    elif mode == "model":
        model.compile()
    return mode
