"""The documentation as tests read it: README.md and the topic pages under docs/ (what a test checks
in the docs may move from page to page without the test changing), and the pages' relative links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](image)
FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1\s*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def docs_text() -> str:
    """Every page's text, README first."""
    return "\n\n".join(p.read_text() for p in pages())


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercased, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2, ...), headings inside code blocks left out."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        seen[f"{slug}-{seen[slug]}" if seen[slug] else slug] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """`page`'s relative links whose file, or whose #anchor in that file, does not exist."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            broken.append(f"{page.name}: {target} (no file {path})")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            broken.append(f"{page.name}: {target} (no heading #{anchor} in {file.name})")
    return broken
