"""docs/strategies.md has a heading for every section the code cites, and a numbered pitfall for every
"§7 caveat N" it cites, so a citation never points at nothing.

    pytest -q tests/unit/test_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "strategies.md"
CITING_DIRS = ("src", "tests", "flows", "bench")  # their *.py, plus the recipes and the other docs
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
CAVEAT = re.compile(r"§7,? caveats? (\d+)|\(§7, (\d+)\)")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.M)


def citing_lines() -> list[tuple[str, str]]:
    """(file:line, text) of every line that cites the math notes: the old name ("spec") or the doc's."""
    out = []
    paths = [p for top in CITING_DIRS for p in sorted((ROOT / top).rglob("*.py"))]
    paths += sorted((ROOT / "params").glob("*.yaml")) + [ROOT / "README.md"]
    paths += [p for p in sorted((ROOT / "docs").glob("*.md")) if p != DOC]
    for path in paths:
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "§" in line and ("spec" in line.lower() or "strategies.md" in line):
                out.append((f"{path.relative_to(ROOT)}:{no}", line))
    return out


def headings(text: str) -> set[str]:
    return set(HEADING.findall(text))


def pitfalls(text: str) -> set[str]:
    """Numbers of the items of section 7's list."""
    section = text.split("\n## 7. ", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^(\d+)\. ", section, re.M))


def test_every_cited_section_is_a_heading():
    lines = citing_lines()
    assert len(lines) > 50, "the citation scan found almost nothing: is the pattern still right?"
    have = headings(DOC.read_text())
    missing = sorted(
        {(sec, where) for where, line in lines for sec in SECTION.findall(line) if sec not in have}
    )
    assert not missing, f"cited but not a heading of {DOC.name}: {missing}"


def test_every_cited_pitfall_is_numbered_in_section_7():
    have = pitfalls(DOC.read_text())
    cited = {(n, where) for where, line in citing_lines() for m in CAVEAT.findall(line) for n in m if n}
    assert cited, "no '§7 caveat N' citation found: is the pattern still right?"
    missing = sorted((n, where) for n, where in cited if n not in have)
    assert not missing, f"cited but not an item of {DOC.name} §7: {missing}"


def test_the_docs_own_cross_references_resolve():
    text = DOC.read_text()
    have = headings(text)
    refs = set(SECTION.findall(text))
    assert refs - have == set(), f"{DOC.name} refers to sections it does not have: {sorted(refs - have)}"
    caveats = {n for m in CAVEAT.findall(text) for n in m if n}
    assert caveats <= pitfalls(text), sorted(caveats - pitfalls(text))


def test_the_checks_see_a_missing_section():
    """The heading and pitfall parsers are what the tests above rely on: a removed heading or item shows."""
    text = DOC.read_text()
    assert {"1.3", "2.5", "3.0", "7"} <= headings(text)
    assert "2.5" not in headings(text.replace("### 2.5 ", "### 2.5x "))
    assert {str(n) for n in range(1, 9)} <= pitfalls(text)
    assert "3" not in pitfalls(text.replace("\n3. **", "\n* **"))
