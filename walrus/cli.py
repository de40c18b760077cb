"""Shared command-line plumbing: user errors become one clear message and a non-zero exit."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from walrus.errors import NonFiniteLossError

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)
# Deprecation chatter from third-party internals that a user can do nothing about.
QUIET_WARNINGS = (r".*isinstance\(treespec, LeafSpec\).*", r".*litlogger.*")


def run_cli(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on a user error print ``error: ...`` and exit with status 2.

    Set ``WALRUS_TRACEBACK=1`` to see the full traceback instead.
    """
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    try:
        return fn()
    except (*USER_ERRORS, NonFiniteLossError) as e:
        if os.environ.get("WALRUS_TRACEBACK"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
