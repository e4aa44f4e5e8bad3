"""The docs agree with the tree: every relative link in README.md, CHANGELOG.md and docs/*.md reaches a file that
exists and, with an #anchor, a heading of that file (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), images too
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)  # [label]: target
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but hyphens and underscores removed, each
    space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page; repeated headings get GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of a page's links that point into the repository (no scheme, outside code blocks)."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def broken(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, does not resolve (None: it does)."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{page.relative_to(REPO)}: {target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{page.relative_to(REPO)}: {target}: no heading #{anchor} in {file.relative_to(REPO)}"
    return None


def test_every_relative_link_in_the_docs_resolves():
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    links = [(page, target) for page in pages for target in relative_links(page)]
    assert len(links) > 30  # the pages do link each other: a parser that finds none proves nothing
    problems = [problem for page, target in links if (problem := broken(page, target))]
    assert problems == [], "\n".join(problems)


def test_the_slug_rule_is_githubs():
    assert slug("Outputs, resume and what is exact") == "outputs-resume-and-what-is-exact"
    assert slug("`train.py --find-lr`: the LR range test") == "trainpy---find-lr-the-lr-range-test"
    assert slug("9. The suite at 2bba924 (fast_tier)") == "9-the-suite-at-2bba924-fast_tier"


MODULE = re.compile(r"\b((?:assembly|core|data|engine|models)(?:/checkpoint)?/[a-z_]+)(?:\.py)?(?:\.([A-Za-z_]+))?")


def test_every_module_docs_architecture_names_exists():
    """docs/architecture.md drawn from the tree: each `folder/module` it names is a file, and each
    `folder/module.name` a definition in it (a function, class or constant)."""
    missing = []
    for module, name in MODULE.findall((REPO / "docs" / "architecture.md").read_text()):
        path = REPO / f"{module}.py"
        if not path.is_file() and not (REPO / module).is_dir():
            missing.append(module)
        elif name and name not in ("py",) and path.is_file() and not re.search(
                rf"^(?:def|class) {name}\b|^{name}\s*[:=]|^\s+def {name}\b", path.read_text(), re.M):
            missing.append(f"{module}.{name}")
    assert not missing
