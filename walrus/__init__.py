"""walrus: a fast Walrus-style space-time transformer for PDE dynamics."""

from walrus.forecast import ensemble_rollout, predict_next, rollout

__all__ = ["ensemble_rollout", "predict_next", "rollout"]
__version__ = "0.1.0"
