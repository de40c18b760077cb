"""The quality benchmark's candidates: every model's, from one file, the same number each.

``benchmarks/quality_candidates.yaml`` is the default file; see its header for the layout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.baselines import KINDS, BaselineOptions
from benchmarks.harness import BenchmarkError
from walrus.safe_yaml import load_yaml

# the default candidate file (the JSON records it relative to the repository)
CANDIDATES = str(Path(__file__).with_name("quality_candidates.yaml"))
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class Candidates:
    """Every model's candidates: ours as Hydra overrides, each baseline as options."""

    ours: dict[str, list[str]]
    baselines: dict[str, dict[str, BaselineOptions]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """Candidates per model."""
        return {"ours": len(self.ours), **{k: len(v) for k, v in self.baselines.items()}}


def _section(data: Mapping[str, Any], model: str, where: str) -> tuple[Any, Mapping[str, Any]]:
    """A model's ``common`` settings and ``candidates`` mapping from the candidate file."""
    section = data.get(model)
    if not isinstance(section, Mapping) or set(section) - {"common", "candidates"}:
        raise BenchmarkError(f"{where}: {model!r} must be a mapping with common and candidates")
    cands = section.get("candidates")
    if not isinstance(cands, Mapping) or not cands:
        raise BenchmarkError(f"{where}: {model}.candidates must map names to settings")
    return section.get("common"), cands


def load_candidates(path: str | os.PathLike, baselines: Sequence[str]) -> Candidates:
    """The candidate file (see ``benchmarks/quality_candidates.yaml``) for ours and ``baselines``.

    Raises:
        BenchmarkError: one line naming the file and what is wrong: an unreadable file, an
            unknown model, a bad override or option, or unequal numbers of candidates.
    """
    where = f"--candidates {path}"
    try:
        data = load_yaml(path)
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"{where}: {e}") from None
    if not isinstance(data, Mapping):
        raise BenchmarkError(f"{where}: expected a mapping model -> candidates")
    unknown = sorted(set(map(str, data)) - {"ours", *KINDS})
    if unknown:
        raise BenchmarkError(f"{where}: unknown model(s) {unknown}; known: ours, {KINDS}")
    common, cands = _section(data, "ours", where)
    common = check_overrides(f"ours.common in {path}", common if common is not None else [])
    ours = {
        str(n): [*common, *check_overrides(f"ours.{n} in {path}", o if o is not None else [])]
        for n, o in cands.items()
    }
    out: dict[str, dict[str, BaselineOptions]] = {}
    for kind in baselines:
        common, cands = _section(data, kind, where)
        common = {} if common is None else common
        if not isinstance(common, Mapping):
            raise BenchmarkError(f"{where}: {kind}.common must be a mapping of options")
        out[kind] = {
            str(n): BaselineOptions.from_mapping(
                kind, {**common, **(o or {})}, f"{where}: {kind}.{n}"
            )
            for n, o in cands.items()
        }
    result = Candidates(ours, out)
    counts = result.counts()
    if len(set(counts.values())) > 1 or max(counts.values()) > MAX_CANDIDATES:
        raise BenchmarkError(
            f"{where}: every model needs the same number of candidates, at most "
            f"{MAX_CANDIDATES}; got {counts}"
        )
    return result


def check_overrides(name: str, overrides: Any) -> list[str]:
    """``overrides`` as a list of plain Hydra ``key=value`` strings, or a one-line error.

    Candidates may come from a file, so no interpolation (``${...}``) and no ``_target_`` key.
    """
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise BenchmarkError(f"candidate {name!r}: overrides must be a list of strings")
    for o in overrides:
        key, sep, _ = o.partition("=")
        if not sep or not key.strip("+~") or "${" in o or "_target_" in key:
            raise BenchmarkError(
                f"candidate {name!r}: {o!r} is not a plain key=value override "
                "(no ${...} interpolation, no _target_)"
            )
    return overrides
