"""walrus: a fast Walrus-style space-time transformer for PDE dynamics.

``walrus.rollout`` is the generator function (it shadows the ``walrus/rollout.py`` module of the
same name as an attribute); import that module's other names with ``from walrus.rollout import``.
"""

from walrus.rollout import ensemble_rollout, predict_next, rollout

__all__ = ["ensemble_rollout", "predict_next", "rollout"]
__version__ = "0.1.0"
