"""A W&B logger that never prompts and never fails for lack of network."""

from __future__ import annotations

import netrc
import os
from typing import Any

from lightning.pytorch.loggers import WandbLogger


def wandb_key_configured() -> bool:
    """True when an API key is set in the environment or in ``~/.netrc``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class SafeWandbLogger(WandbLogger):
    """``WandbLogger`` that runs offline unless a W&B API key is configured.

    Offline runs are written under ``save_dir/wandb/offline-run-*`` and can be uploaded later with
    ``wandb sync``. ``mode`` forces ``"online"``, ``"offline"`` or ``"disabled"``.
    """

    def __init__(self, *args: Any, mode: str | None = None, **kwargs: Any) -> None:
        mode = (
            mode
            or os.environ.get("WANDB_MODE")
            or ("online" if wandb_key_configured() else "offline")
        )
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        super().__init__(*args, offline=mode == "offline", mode=mode, **kwargs)
