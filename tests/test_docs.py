"""The README and docs/ as a reader follows them: every relative link leads to a file of the
repository (and an #anchor to a heading of it), every page is reached from the README and listed
in the site's nav (mkdocs.yml), the tutorial's snippets are the examples' code and compile (those
that need no GPU run here, the README's and the tutorial's others on a GPU), every knob is
documented, and the docs links in code comments lead somewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import requires_gpu

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"(?<!\\)\[[^\]]*(?<!\\)\]\(([^)\s]+)\)")  # \[ is no link
FENCE = re.compile(r"^(<!-- runs without a GPU -->\n)?```(\w+)\n(.*?)^```$", re.M | re.S)


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
        docs = REPO / "docs"
        if docs in page.parents and docs not in dest.parents and dest.is_file():
            broken.append(f"{target} (a file outside docs/: the site build cannot resolve it; "
                          f"name it in a code span)")
            continue
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def _linked(page: Path) -> set[Path]:
    """The markdown pages of the repository a page links to."""
    text = re.sub(r"`[^`\n]*`", "", page.read_text())
    out = set()
    for target in LINK.findall(text):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", path) and path.endswith(".md"):
            out.add((page.parent / path).resolve())
    return out


def test_the_readme_reaches_every_docs_page():
    seen, todo = set(), [(REPO / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page not in seen and page.exists():
            seen.add(page)
            todo.extend(_linked(page))
    pages = {p.resolve() for p in PAGES[1:]}
    assert pages <= seen, f"docs pages no link from the README reaches: {sorted(pages - seen)}"


def test_the_site_nav_lists_every_page():
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", (REPO / "mkdocs.yml").read_text(),
                         flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in PAGES[1:]}
    assert nav == pages, f"not in the nav: {sorted(pages - nav)}; not pages: {sorted(nav - pages)}"


# -------------------------------------------------------------------------------- snippets
def _snippets(page: Path) -> list[tuple[str, str, bool]]:
    """(language, code, runs without a GPU) of each fenced block of a page."""
    return [(lang, code, bool(mark)) for mark, lang, code in FENCE.findall(page.read_text())]


TUTORIAL = DOCS / "tutorial.md"


def test_the_tutorial_has_code_to_check():
    kinds = [(lang, run) for lang, _, run in _snippets(TUTORIAL)]
    assert kinds.count(("python", False)) >= 5
    assert ("python", True) in kinds and ("cpp", False) in kinds


@pytest.mark.parametrize("index", range(len(_snippets(TUTORIAL))))
def test_each_python_snippet_of_the_tutorial_compiles(index):
    lang, code, _ = _snippets(TUTORIAL)[index]
    if lang == "python":
        compile(code, f"docs/tutorial.md snippet {index}", "exec")


@pytest.mark.parametrize("index", [i for i, (_, _, run) in enumerate(_snippets(TUTORIAL)) if run])
def test_the_tutorials_snippets_that_need_no_gpu_run(index):
    from vitrail.jit import ToolchainError
    _, code, _ = _snippets(TUTORIAL)[index]
    try:  # VITRAIL_ARCH=90a (tests/conftest.py): what compiles, compiles for Hopper
        exec(compile(code, f"docs/tutorial.md snippet {index}", "exec"), {"__name__": "snippet"})
    except ToolchainError as e:  # a snippet that compiles a kernel needs nvcc
        pytest.skip(f"no toolchain: {e}")


def _gpu_snippets() -> list[tuple[str, int]]:
    """(page, index) of the README's and the tutorial's Python snippets that need a GPU and are
    not quotes of a file (those run in the examples' own tests)."""
    out = []
    for page in (REPO / "README.md", TUTORIAL):
        for i, (lang, code, no_gpu) in enumerate(_snippets(page)):
            quote = re.match(r"# (?:examples|vitrail|tests)/\S+\n", code)
            if lang == "python" and not no_gpu and not quote:
                out.append((str(page.relative_to(REPO)), i))
    return out


@requires_gpu
@pytest.mark.parametrize("page,index", _gpu_snippets())
def test_the_snippets_that_need_a_gpu_run_on_it(page, index, tmp_path, monkeypatch):
    """Each runs as written, with the names the README takes as the reader's own given: x (a
    bf16 matrix), y (a tensor like it), my_op (an op of x) and model (a function of x)."""
    import torch

    import vitrail.ops as ops
    monkeypatch.chdir(tmp_path)  # what a snippet writes (a trace) lands here
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    given = {"__name__": "snippet", "x": x, "y": torch.empty_like(x),
             "my_op": lambda t: ops.softmax(t, dim=-1), "model": lambda t: t * 2}
    _, code, _ = _snippets(REPO / page)[index]
    exec(compile(code, f"{page} snippet {index}", "exec"), given)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_quoted_code_is_the_files_text(page):
    """A snippet whose first line names a file (``# examples/...`` or ``// examples/...``) is a
    quote of it: its other lines stand in the file, in order and together."""
    for lang, code, _ in _snippets(page):
        first, _, body = code.partition("\n")
        named = re.fullmatch(r"(?:#|//) ((?:examples|vitrail|tests)/\S+)", first)
        if named:
            source = (REPO / named.group(1)).read_text()
            assert body in source, f"{page.name}: the quote of {named.group(1)} is not its text"


# -------------------------------------------------------------------------------- knobs, code
def test_every_knob_is_documented_and_no_other():
    from vitrail import knobs
    text = "\n".join(p.read_text() for p in PAGES)
    declared = {k.name for k in knobs.ALL}
    assert declared <= set(re.findall(r"\bVITRAIL_[A-Z_]+\b", text))
    # pages name no knob that does not exist (identifiers of code spans aside)
    assert set(re.findall(r"\bVITRAIL_[A-Z_]+\b", text)) - declared <= {"VITRAIL_TRY"}


def test_docs_links_in_code_lead_somewhere():
    """Comments and docstrings point at the docs (docs/ops/softmax.md#the-tile-path): each such
    page exists and has the heading."""
    broken = []
    code = [*sorted((REPO / "vitrail").rglob("*.py")), *sorted((REPO / "examples").rglob("*.py"))]
    for path in code:
        for page, anchor in re.findall(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?", path.read_text()):
            dest = REPO / page
            if not dest.exists() or anchor and anchor not in {
                    _anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}:
                broken.append(f"{path.relative_to(REPO)}: {page}#{anchor}")
    assert not broken


def test_no_benchmark_figures_in_the_packages_comments():
    """Measured figures (speedups against a baseline, TFLOP/s, GB/s) live in docs pages, the
    performance notes or generated from `vitrail bench` JSON; a code comment keeps its reason
    and a link (the benchmark modules, which print figures, are not comments)."""
    figure = re.compile(r"\d(\.\d+)?x (torch|cuBLAS|cuDNN|SDPA|flash|CuPy)|\d (TFLOP/s|GB/s)\b")
    found = []
    for path in sorted((REPO / "vitrail").rglob("*")):
        if path.suffix not in (".py", ".cuh", ".cpp", ".h", ".cu"):
            continue
        mark = "#" if path.suffix == ".py" else "//"
        for n, line in enumerate(path.read_text().splitlines(), 1):
            comment = line.split(mark, 1)[1] if mark in line else ""
            if figure.search(comment):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
