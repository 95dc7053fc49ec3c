"""The interactive-views chapter reads as a chapter: before any of its machinery or checks, the page
shows views being displayed (the widgets first, their checks after)."""

from __future__ import annotations

import nbformat

from conftest import ROOT

CHAPTER = ROOT / "nbs" / "observe" / "06_widgets.ipynb"
CHECKS = ("test_eq(", "test_fail(", "assert ", "show_doc(")


def _directives(source: str) -> set[str]:
    "The cell's `#| name` directives (`#| hide`, `#| export`, ...), by name."
    return {
        line.strip()[2:].strip().split()[0]
        for line in source.splitlines()
        if line.strip().replace(" ", "").startswith("#|") and line.strip()[2:].strip()
    }


def test_the_widgets_chapter_opens_with_the_views():
    """The first code cell the page shows that is not the module's own (`default_exp`, `export`)
    displays a view, and every code cell before the first check is an import or a view."""
    nb = nbformat.read(CHAPTER, as_version=4)
    shown = [
        c.source
        for c in nb.cells
        if c.cell_type == "code"
        and not _directives(c.source) & {"hide", "export", "exporti", "default_exp"}
    ]
    first_check = next(i for i, s in enumerate(shown) if any(k in s for k in CHECKS))
    opening = shown[:first_check]
    views = [s for s in opening if "_explorer(" in s or "_view(" in s]
    assert views, opening  # a view is displayed before any check or API table
    assert all(s.startswith(("from ", "import ")) or s in views for s in opening), opening
    headings = [c.source.splitlines()[0] for c in nb.cells if c.source.startswith("## ")]
    assert headings[0] == "## The views", headings
