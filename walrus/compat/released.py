"""Facts about the released Walrus checkpoint (``walrus.pt``, current official layout).

The converter uses these when a checkpoint in the current layout comes without a config or
field names: the released model's settings and its 67-field vocabulary, as published with the
checkpoint (its ``extended_config.yaml`` and ``field_to_index_map``). Nothing is downloaded.
``config_beside`` finds the ``extended_config.yaml`` published next to a ``walrus.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Field name of every vocabulary id (``field_to_index_map``, ordered by id). Ids 0-2 are
# reserved: the model appends a wall flag, an open flag and a ones channel to its input and
# projects them with these columns.
RELEASED_FIELDS = (
    "closed_boundary", "open_boundary", "bias_correction", "pressure", "velocity_x", "velocity_y",
    "velocity_z", "zeros_like_density", "speed_of_sound", "concentration", "D_xx", "D_xy", "D_xz",
    "D_yx", "D_yy", "D_yz", "D_zx", "D_zy", "D_zz", "E_xx", "E_xy", "E_xz", "E_yx", "E_yy",
    "E_yz", "E_zx", "E_zy", "E_zz", "density", "energy", "velocity_r", "velocity_theta",
    "velocity_phi", "momentum_x", "momentum_y", "momentum_z", "pressure_re", "pressure_im",
    "mask", "magnetic_field_x", "magnetic_field_y", "magnetic_field_z", "A", "B", "height",
    "internal_energy", "temperature", "electron_fraction", "entropy", "magnetic_field_log_r",
    "magnetic_field_theta", "magnetic_field_phi", "velocity_log_r", "buoyancy", "tracer",
    "log10_density", "log10_temperature", "c_zz", "C_xx", "C_xy", "C_xz", "C_yx", "C_yy", "C_yz",
    "C_zx", "C_zy", "C_zz",
)  # fmt: skip

# Reserved ids of the current layout, in the order its code appends the channels:
# ones (bias correction), wall flag, open flag.
FLAG_FIELDS = (2, 0, 1)
RESERVED_NAMES = {0: "closed_boundary", 1: "open_boundary", 2: "bias_correction"}

# The released model config (official names). ``groups`` is the model-level value, which
# overrides the encoder/decoder configs' 12.
RELEASED_MODEL: dict[str, Any] = {
    "hidden_dim": 1408,
    "projection_dim": 48,
    "intermediate_dim": 352,
    "processor_blocks": 40,
    "num_heads": 16,
    "n_states": 67,
    "groups": 16,
    "drop_path": 0.05,
    "causal_in_time": True,
    "jitter_patches": True,
    "use_periodic_fixed_jitter": True,
    "include_d": [2, 3],
    "input_field_drop": 0.0,
    "override_dimensionality": 0,
}
# Input frames the released model was trained with (``n_steps_input``).
RELEASED_N_STEPS_INPUT = 6
# Parameters of the released model (its state dict minus the per-block RoPE frequencies).
RELEASED_N_PARAMS = 1_286_199_047

# The config published beside the released weights; picked up from the same folder (or the same
# Hub snapshot) when no config is given.
CONFIG_FILE = "extended_config.yaml"


def config_beside(weights: str | os.PathLike) -> Path | None:
    """``extended_config.yaml`` in the folder of ``weights``, or ``None`` when there is none."""
    path = Path(weights).parent / CONFIG_FILE
    return path if path.is_file() else None
