"""House rules for notebooks that tools can check.

- A non-exported code cell that imports something must do nothing else: nbdev's docs processing
  executes every cell containing an import, so a test cell with an import in it would run (and fail)
  during the docs build.
- The first cell holds only the `# Title` and an optional `> description`: nbdev turns that cell
into
  the page's front matter and drops anything else in it from the docs.
- The notebook's metadata holds the kernel JupyterLab would write (tools/clean_notebooks.py), so it
opens
  without a "Select Kernel" dialog and without being marked modified.
"""

import ast, sys
from pathlib import Path
import nbformat

from clean_notebooks import metadata_problem

ROOT = Path(__file__).resolve().parent.parent


def _directives(src: str) -> set[str]:
    return {
        l.strip()[3:].split()[0].rstrip(":")
        for l in src.splitlines()
        if l.strip().startswith("#|") and len(l.strip()) > 3
    }


def mixed_import_cells(nb_path: Path) -> list[int]:
    "Indices of code cells that mix imports with other statements (outside export cells)."
    nb = nbformat.read(nb_path, as_version=4)
    bad = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or _directives(cell.source) & {
            "export",
            "exports",
            "exporti",
            "exec_doc",
        }:
            continue
        src = "\n".join(
            l for l in cell.source.splitlines() if not l.lstrip().startswith(("%", "!"))
        )
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        nodes = list(ast.walk(tree))
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in nodes) and any(
            isinstance(n, (ast.Expr, ast.Assign)) for n in nodes
        ):
            bad.append(i)
    return bad


def title_cell_problem(nb_path: Path) -> str | None:
    "Why the first cell is not a bare title cell, or None."
    cells = nbformat.read(nb_path, as_version=4).cells
    if not cells or cells[0].cell_type != "markdown" or not cells[0].source.startswith("# "):
        return "the first cell must be a markdown `# Title` cell"
    extra = [l for l in cells[0].source.splitlines()[1:] if l.strip() and not l.startswith(">")]
    if extra:
        return (
            "the title cell holds more than `# Title` and `> description` (nbdev drops it "
            "from the docs)"
        )
    return None


def main() -> int:
    failed = False
    for p in sorted((ROOT / "nbs").rglob("*.ipynb")):
        if any(part.startswith((".", "_")) for part in p.relative_to(ROOT / "nbs").parts):
            continue
        if cells := mixed_import_cells(p):
            print(
                f"{p.relative_to(ROOT / 'nbs')}: cells {cells} mix imports with other code (put "
                "imports in a cell of their own)"
            )
            failed = True
        if why := title_cell_problem(p):
            print(f"{p.relative_to(ROOT / 'nbs')}: {why}")
            failed = True
        if why := metadata_problem(p):
            print(f"{p.relative_to(ROOT / 'nbs')}: {why}: run python tools/clean_notebooks.py")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
