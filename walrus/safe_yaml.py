"""A YAML loader for data files (``stats.yaml``, a released ``extended_config.yaml``).

Data files hold plain values, so this loader is stricter than ``yaml.safe_load``:

- anchors and aliases are refused (a 1 KB file of nested aliases expands to gigabytes);
- explicit tags are refused (``!!python/...``, ``!!binary``, any ``!tag``);
- a file over ``MAX_YAML_BYTES`` (1 MiB) or nested deeper than ``MAX_YAML_DEPTH`` is refused.

Every failure is a one-line ``ValueError`` naming the file and, where YAML knows it, the line.
Hydra's own config loading does not go through here.
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionStartEvent, NodeEvent

from walrus.data.storage import as_location, read_bytes

MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64


class _DataError(yaml.MarkedYAMLError):
    """A refused construct; carries its position like YAML's own errors."""


class _DataLoader(yaml.SafeLoader):
    """``SafeLoader`` refusing anchors, aliases, tags and deep nesting while composing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            raise _DataError(None, None, "aliases (*name) are not allowed", event.start_mark)
        if isinstance(event, NodeEvent) and event.anchor is not None:
            raise _DataError(None, None, "anchors (&name) are not allowed", event.start_mark)
        if getattr(event, "tag", None) is not None:  # only an explicit tag sets it
            raise _DataError(None, None, f"tags ({event.tag}) are not allowed", event.start_mark)
        if isinstance(event, CollectionStartEvent):
            self._depth += 1
            if self._depth > MAX_YAML_DEPTH:
                raise _DataError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark
                )
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


def _message(e: BaseException) -> str:
    """YAML's error as one line: ``line N: problem``."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or type(e).__name__
        text = f"line {mark.line + 1}: {problem}" if mark is not None else problem
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def parse_yaml(text: str | bytes, source: str) -> Any:
    """Parse YAML ``text`` under this module's rules; errors name ``source``.

    Raises:
        ValueError: too large, not UTF-8, a syntax error, an alias, anchor or tag, too deep.
    """
    if len(text) > MAX_YAML_BYTES:
        raise ValueError(f"{source}: larger than {MAX_YAML_BYTES} bytes, the most read as YAML")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: not UTF-8 text (byte {e.start})") from None
    loader = _DataLoader(text)
    try:
        return loader.get_single_data()
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ValueError(f"{source}: not a valid YAML data file: {_message(e)}") from None
    finally:
        loader.dispose()


def load_yaml(path: str | os.PathLike) -> Any:
    """Read a YAML data file (local path or fsspec URL) under this module's rules.

    Raises:
        FileNotFoundError: no such file. ValueError: not a regular file, or see ``parse_yaml``.
    """
    loc = as_location(path)
    return parse_yaml(read_bytes(loc, MAX_YAML_BYTES), str(loc))
