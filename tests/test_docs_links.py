"""README.md and docs/: every relative link resolves to a file of the repository (and its
#anchor to a heading of that file), nothing points outside the repository, every docs page is
listed in docs/index.md, and the README stays a front door (at most 300 lines).

docs/index.md may list pages that are not written yet: its links are checked when the file
exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings in code
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [u for u in LINK.findall(text) if not re.match(r"[a-z]+:", u)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for url in links(page):
        target, _, anchor = url.partition("#")
        dest = (page.parent / target).resolve() if target else page
        assert dest.is_relative_to(ROOT), f"{url}: outside the repository"
        if not dest.exists():
            assert page.name == "index.md" and page.parent == DOCS, f"{url}: no such file"
            continue
        if anchor:
            assert anchor in anchors(dest), f"{url}: no heading #{anchor} in {dest.name}"


def test_nothing_points_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "/work/" not in text, page
        for url in links(page):
            assert not url.startswith("/"), (page, url)


def test_index_lists_every_page():
    listed = {u.partition("#")[0] for u in links(DOCS / "index.md")}
    assert {p.name for p in DOCS.glob("*.md")} - {"index.md"} <= listed


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    assert all(len(x) <= 300 for x in lines if not x.startswith("|"))
    for page in PAGES:  # prose is wrapped: only table rows and console output run long
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        long = [x for x in text.splitlines() if len(x) > 300 and not x.startswith("|")]
        assert not long, (page.name, long[0][:80])


def test_readme_install_table_names_the_base_dependencies():
    """The README's `pip install .` row lists what pyproject.toml's base install pulls in."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    row = next(x for x in (ROOT / "README.md").read_text().splitlines()
               if x.startswith("| `pip install .` |"))
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0)
        assert re.search(rf"\b{re.escape(name)}\b", row), f"README's install row lacks {name}"
