"""Every relative link of the docs and the README leads to a file, and every ``#anchor`` to a heading (or an
``id``) of its page, with GitHub's anchors, which the site uses too (mkdocs.yml)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked out."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            out.append(
                re.sub(
                    r"`[^`]*`", lambda m: "`" * len(m.group(0)) if "](" in m.group(0) else m.group(0), line
                )
            )
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in _prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'\bid="([^"]+)"', line))
        found.update(re.findall(r"^::: ([\w.]+)$", line))  # mkdocstrings: the object's path is its anchor
    return found


def test_slugs_are_githubs():
    assert slug("Residual add + RMSNorm (`fused_add_rms_norm`)") == "residual-add--rmsnorm-fused_add_rms_norm"
    assert slug("One writer per `local_dir`") == "one-writer-per-local_dir"
    assert slug("Save on request: SIGUSR1 keeps training") == "save-on-request-sigusr1-keeps-training"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in _pages():
        for line in _prose(page):
            for m in _LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert not broken, "\n".join(broken)
