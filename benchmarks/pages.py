"""Where rendered result tables go, and how a table replaces the text between its markers.

A table lives between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` on a Markdown page; the
renderers (``quality_table``, ``transfer``, ``demo_table``, ``studies.demo_sweep``) replace that
text from the JSON in ``benchmarks/results/``, so no number on a page is typed by hand.
"""

from __future__ import annotations

from pathlib import Path

from walrus.atomic import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
RESULTS_PAGE = DOCS / "results.md"  # benchmark tables users rerun
STUDIES_PAGE = DOCS / "studies.md"  # finished one-off studies


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of table ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_between(text: str, name: str, body: str, source: str = "page") -> str:
    """``text`` with what lies between the markers of table ``name`` replaced by ``body``.

    Raises:
        ValueError: naming ``source`` when the markers are not there exactly once, in order.
    """
    start, end = markers(name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i or text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{source}: needs exactly one {start} followed by one {end}")
    return f"{text[: i + len(start)]}\n{body}\n{text[j:]}"


def between(text: str, name: str) -> str:
    """What lies between the markers of table ``name`` (stripped); ``""`` when they are absent."""
    start, end = markers(name)
    if start not in text or end not in text:
        return ""
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def write_between(page: Path, name: str, body: str) -> Path:
    """Replace table ``name`` on ``page`` with ``body``, atomically; returns ``page``."""
    return write_text_atomic(page, replace_between(page.read_text(), name, body, page.name))
