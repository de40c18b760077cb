"""The README and the docs: every rendered table matches its JSON, links resolve, and the README
stays a short page for users."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from benchmarks import demo_table, quality_table, transfer_table
from benchmarks.common import RESULTS_DIR
from benchmarks.pages import README, RESULTS_PAGE, STUDIES_PAGE, between, markers
from benchmarks.studies import demo_sweep
from tests.conftest import REPO

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def _load_config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", DOCS / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_table_is_rendered_from_its_json():
    table = demo_table.render(json.loads(demo_table.DEMO_METRICS.read_text()))
    for page in (README, RESULTS_PAGE):
        assert between(page.read_text(), demo_table.MARKER) == table, page


def test_the_quality_table_is_rendered_from_the_json():
    files = sorted(RESULTS_DIR.glob("quality*.json"))
    assert between(RESULTS_PAGE.read_text(), "quality-table") == quality_table.markdown(files)


def test_the_quality_protocol_tables_are_rendered_from_the_newest_version():
    # README's headline and the results page's table: the newest quality_v<N>/ (or, before the
    # first version, the line that says none has run), rendered from the committed JSON
    headline = quality_table.headline_markdown(RESULTS_DIR, "docs/quality_protocol.md")
    assert between(README.read_text(), "quality-headline") == headline
    assert (
        between(RESULTS_PAGE.read_text(), "quality-protocol") == quality_table.protocol_markdown()
    )


def test_the_study_tables_are_rendered_from_the_json():
    text = STUDIES_PAGE.read_text()
    sweeps = sorted(RESULTS_DIR.glob("model_sweep*.json"))
    body = "\n\n".join(quality_table.sweep_markdown(json.loads(p.read_text())) for p in sweeps)
    assert between(text, "sweep-table") == body
    sweep = json.loads((RESULTS_DIR / "demo_sweep.json").read_text())
    assert between(text, "demo-sweep") == demo_sweep.markdown(sweep)


def test_every_transfer_table_on_the_results_page_is_rendered_from_its_json():
    text = RESULTS_PAGE.read_text()
    found = 0
    for path in sorted(RESULTS_DIR.glob("transfer*.json")):
        start, end = transfer_table.markers(path.stem)
        if start in text:
            block = text.split(start, 1)[1].split(end, 1)[0]
            assert block == f"\n{transfer_table.render_table(json.loads(path.read_text()))}\n"
            found += 1
    assert found >= 3


def test_the_configuration_reference_matches_the_config_files():
    reference = _load_config_reference()
    page = reference.PAGE.read_text()
    assert between(page, "config-reference") == reference.render().strip()
    for path in (REPO / "configs").rglob("*.yaml"):
        name = path.relative_to(REPO / "configs").with_suffix("")
        if path.parent != REPO / "configs":
            assert f"### `{name}`" in page, f"{name} is missing from the reference"


def test_the_config_reader_dots_nested_keys_and_keeps_comments():
    reference = _load_config_reference()
    text = (
        "# @package _global_\ndefaults:\n  - override /model: small\n  - _self_\n"
        "# the rate\nlr: 1.0e-3  # trailing\nmodule:\n  # noise level\n  input_noise: 0.1\n"
        "  normalizer:\n    eps: 1.0e-4\nlist_option:\n  - a\n  - b\nafter: 2\n"
    )
    rows = reference.options(text)
    assert rows == [
        ("lr", "1.0e-3", "the rate"),
        ("module", "", ""),
        ("module.input_noise", "0.1", "noise level"),
        ("module.normalizer", "", ""),
        ("module.normalizer.eps", "1.0e-4", ""),
        ("list_option", "", ""),
        ("after", "2", ""),
    ]
    assert reference.defaults_list(text) == ["override /model: small", "_self_"]


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\((?!https?://)([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    for link in links:
        assert (REPO / link).exists(), f"README links to a missing {link}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_cite_files_and_commits_not_work_items(page: Path):
    text = page.read_text()
    assert not re.search(r"\b(issue|session)s? \d", text, re.I), page
    assert "README" not in text or page.name == "development.md", page


def test_every_page_is_in_the_site_navigation():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in PAGES:
        assert str(page.relative_to(DOCS)) in nav, f"{page} is not in mkdocs.yml's nav"


def test_a_missing_marker_is_a_one_line_error(tmp_path):
    from benchmarks.pages import write_between

    page = tmp_path / "page.md"
    page.write_text("no table here\n")
    start, end = markers("demo-table")
    with pytest.raises(ValueError, match=f"page.md: needs exactly one {start} followed by one"):
        write_between(page, "demo-table", "body")
    page.write_text(f"a\n{start}\nold\n{end}\nb\n")
    write_between(page, "demo-table", "new")
    assert page.read_text() == f"a\n{start}\nnew\n{end}\nb\n"
