"""walrus: a fast Walrus-style space-time transformer for PDE dynamics.

``walrus.rollout`` is the generator function (it shadows the ``walrus/rollout.py`` module of the
same name as an attribute); import that module's other names with ``from walrus.rollout import``.

The Python loader (``load``, ``from_pretrained``, ``open_dataset``, ``trajectory_batch``, ``infer`` and the
``InferenceCheckpoint`` they return, see :mod:`walrus.pretrained`) is imported on first use, so
``import walrus`` stays light.
"""

import os
import sys
from typing import Any

# Idle OpenMP threads sleep instead of spinning. libgomp's default spin (GOMP_SPINCOUNT 300000)
# made training 4x slower beside any other busy process on 2 cores (docs/performance.md,
# benchmarks/contention.py). It only takes effect before torch loads libgomp, so it is set here,
# which train.py, infer.py and the module CLIs import first; a policy the user set wins.
if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from walrus.rollout import ensemble_rollout, predict_next, rollout  # noqa: E402

_LOADER = (
    "InferenceCheckpoint",
    "from_pretrained",
    "infer",
    "load",
    "open_dataset",
    "trajectory_batch",
)

__all__ = ["ensemble_rollout", "predict_next", "rollout", *_LOADER]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LOADER:
        from walrus import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'walrus' has no attribute {name!r}")
