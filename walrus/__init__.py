"""walrus: a fast Walrus-style space-time transformer for PDE dynamics.

``walrus.rollout`` is the generator function (it shadows the ``walrus/rollout.py`` module of the
same name as an attribute); import that module's other names with ``from walrus.rollout import``.

The Python loader (``load``, ``from_pretrained``, ``open_dataset``, ``trajectory_batch``, ``infer`` and the
``InferenceCheckpoint`` they return, see :mod:`walrus.pretrained`) is imported on first use, so
``import walrus`` stays light.
"""

from typing import Any

from walrus.rollout import ensemble_rollout, predict_next, rollout

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
