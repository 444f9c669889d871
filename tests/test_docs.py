"""The docs agree with the code: the settings page is the code's, every setting name they use
exists, every relative link resolves, and the committed figures say what the script draws."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from npuw_kv.config.reference import MEANINGS, PAGE, setting_names, settings_markdown
from npuw_kv.config.settings import ALIASES, PASSTHROUGH, PASSTHROUGH_PREFIXES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDERS = {"KEY", "NAME"}  # -p KEY=VALUE in usage lines


def test_the_settings_page_is_written_from_the_code():
    assert set(MEANINGS) == set(setting_names()), "a setting without a meaning, or a stale one"
    assert PAGE.read_text() == settings_markdown(), (
        "docs/settings.md is stale: run python -m npuw_kv.config.reference"
    )


def known(name: str) -> bool:
    """A name ``LLMPipeline`` takes as a setting (ours, an alias, or an OpenVINO property)."""
    upper = name.upper()
    return (
        name.lower() in setting_names()
        or upper in ALIASES
        or upper in PASSTHROUGH
        or upper.startswith(PASSTHROUGH_PREFIXES)
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_setting_the_docs_pass_exists(doc):
    text = doc.read_text()
    passed = set(re.findall(r"-p\s+([A-Za-z_][A-Za-z0-9_]*)=", text)) - PLACEHOLDERS
    unknown = sorted(name for name in passed if not known(name))
    assert not unknown, f"{doc.name} passes settings that do not exist: {unknown}"


def test_the_readme_settings_table_names_settings():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    assert names and all(name in setting_names() for name in names), names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        missing_anchor = anchor and file.suffix == ".md" and anchor not in anchors(file)
        if not file.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", doc.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


FIGURES = {"static": "kv_buffer.svg", "pyramid": "kv_buffer_pyramid.svg",
           "ring": "kv_buffer_ring.svg"}  # fmt: skip


def labels(svg: str) -> list[str]:
    """The text a matplotlib SVG draws (its glyphs are paths; each text keeps a comment)."""
    return re.findall(r"<!-- (.*?) -->", svg)


@pytest.mark.parametrize("scenario", list(FIGURES))
def test_committed_figures_are_what_the_script_draws(scenario, tmp_path):
    out = tmp_path / "figure.svg"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "draw_kv_buffer.py"), "--scenario", scenario,
         "--out", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    committed = (ROOT / "docs" / FIGURES[scenario]).read_text()
    assert labels(out.read_text()) == labels(committed), (
        f"docs/{FIGURES[scenario]} is stale: run python scripts/draw_kv_buffer.py"
    )


def test_the_readme_is_a_user_guide():
    """At most 200 lines, and current facts only: no dates or commit hashes (run history goes
    to docs/measurements.md)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "a date in the README"
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w)
              and re.search(r"[a-f]", w)]  # fmt: skip
    assert not hashes, f"commit hashes in the README: {hashes}"


@pytest.mark.unit
def test_ci_runs_the_readmes_test_command_verbatim():
    """CI must run exactly the README's second set-up command, so a stage added to one is in
    the other (the NPU rules pass was once in the README only)."""
    readme = (ROOT / "README.md").read_text()
    command = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[1].strip()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in lines
