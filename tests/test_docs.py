"""The README and docs/ as a reader follows them: every relative link leads to a file of the
repository (and an #anchor to a heading of it)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """A heading's anchor as code hosts make it: lower case, spaces to '-', punctuation out."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_lead_somewhere(page):
    broken = []
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # code spans hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or REPO not in dest.parents and dest != REPO:
            broken.append(target)
            continue
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def test_the_readme_links_every_docs_page():
    readme = REPO / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(readme.read_text())}
    pages = {p.resolve() for p in PAGES[1:]}
    assert pages <= linked, f"docs pages no README link reaches: {sorted(pages - linked)}"
