"""The ``${walrus_run_dir:CKPT,DEFAULT}`` resolver behind ``hydra.run.dir``: a resume
(``ckpt_path=RUN/checkpoints/last.ckpt``) continues in ``RUN``; any other run uses ``DEFAULT``.

Kept free of heavy imports: ``train.py`` registers it before Hydra composes the config.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

RESOLVER = "walrus_run_dir"


def run_dir_for(ckpt_path: str | None, default: str) -> str:
    """``RUN`` for ``ckpt_path=RUN/checkpoints/<name>.ckpt``, else ``default``."""
    if not ckpt_path:
        return default
    path = Path(str(ckpt_path))
    if path.parent.name == "checkpoints":
        return str(path.parent.parent)
    return default


def register_run_dir_resolver() -> None:
    """Register ``walrus_run_dir`` with OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_dir_for)
