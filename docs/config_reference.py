"""The configuration reference page, rendered from ``configs/``.

``python docs/config_reference.py`` replaces the ``config-reference`` block of
``docs/reference/configuration.md`` with, per config group, one table per option file: every key
as written in the YAML (nested keys dotted), its default as written (nothing is resolved) and
the comment lines right above it. A test checks that the page matches the files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
PAGE = REPO / "docs" / "reference" / "configuration.md"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w]*):(?P<value>.*)$")
_ENTRY_POINTS = ("train.yaml", "infer.yaml")


def options(text: str) -> list[tuple[str, str, str]]:
    """``(dotted key, default as written, comment)`` for every key of a YAML config's text.

    A key whose value is a nested mapping is listed too, with an empty default; list items and
    the ``defaults`` list are skipped (the file's ``defaults`` are shown apart).
    """
    rows: list[tuple[str, str, str]] = []
    comment: list[str] = []
    parents: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if not stripped.startswith("# @package"):
                comment.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(line)
        if match is None:
            if not stripped.startswith("-"):
                comment = []
            continue
        indent, key = len(match["indent"]), match["key"]
        value = match["value"].split(" #", 1)[0].strip()
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = ".".join([p for _, p in parents] + [key])
        if path != "defaults" and not path.startswith("defaults."):
            rows.append((path, value, " ".join(comment)))
        if not value:
            parents.append((indent, key))
        comment = []
    return rows


def defaults_list(text: str) -> list[str]:
    """The entries of a config's top-level ``defaults`` list, as written."""
    entries, inside = [], False
    for line in text.splitlines():
        if line.startswith("defaults:"):
            inside = True
            continue
        if inside:
            if line.startswith("  -"):
                entries.append(line.split("-", 1)[1].strip())
            elif line.strip() and not line.startswith(" "):
                break
    return entries


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def file_section(path: Path, heading: str) -> str:
    """Markdown for one config file: its defaults list and its options table."""
    text = path.read_text()
    lines = [f"### `{heading}`", ""]
    defaults = defaults_list(text)
    if defaults:
        lines += ["Composed from: " + ", ".join(f"`{d}`" for d in defaults) + ".", ""]
    rows = options(text)
    if rows:
        lines += ["| option | default | what |", "|---|---|---|"]
        for key, value, comment in rows:
            shown = f"`{_cell(value)}`" if value else ""
            lines.append(f"| `{key}` | {shown} | {_cell(comment)} |")
        lines.append("")
    return "\n".join(lines)


def render(configs: Path = CONFIGS) -> str:
    """The whole reference: the two entry configs, then every group's option files."""
    parts = ["## Entry configs", ""]
    parts += [file_section(configs / name, name) for name in _ENTRY_POINTS]
    for group in sorted(p for p in configs.iterdir() if p.is_dir()):
        parts += [f"## `{group.name}`", ""]
        for path in sorted(group.rglob("*.yaml")):
            rel = path.relative_to(configs).with_suffix("")
            parts.append(file_section(path, str(rel)))
    return "\n".join(parts)


def main() -> None:
    """Write the reference onto its page."""
    sys.path.insert(0, str(REPO))
    from benchmarks.pages import write_between

    print(f"wrote {write_between(PAGE, 'config-reference', render())}")


if __name__ == "__main__":
    main()
