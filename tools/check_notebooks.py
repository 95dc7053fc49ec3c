"""House rules for notebooks that tools can check.

- A non-exported code cell that imports something must do nothing else: nbdev's docs processing
  executes every cell containing an import, so a test cell with an import in it would run (and fail)
  during the docs build.
"""
import ast, sys
from pathlib import Path
import nbformat

ROOT = Path(__file__).resolve().parent.parent

def _directives(src: str) -> set[str]:
    return {l.strip()[3:].split()[0].rstrip(':') for l in src.splitlines() if l.strip().startswith('#|') and len(l.strip()) > 3}

def mixed_import_cells(nb_path: Path) -> list[int]:
    "Indices of code cells that mix imports with other statements (outside export cells)."
    nb = nbformat.read(nb_path, as_version=4)
    bad = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != 'code' or _directives(cell.source) & {'export', 'exports', 'exporti', 'exec_doc'}: continue
        src = '\n'.join(l for l in cell.source.splitlines() if not l.lstrip().startswith(('%', '!')))
        try: tree = ast.parse(src)
        except SyntaxError: continue
        nodes = list(ast.walk(tree))
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in nodes) and any(isinstance(n, (ast.Expr, ast.Assign)) for n in nodes):
            bad.append(i)
    return bad

def main() -> int:
    problems = {p.name: mixed_import_cells(p) for p in sorted((ROOT / 'nbs').glob('*.ipynb'))}
    problems = {k: v for k, v in problems.items() if v}
    for name, cells in problems.items():
        print(f'{name}: cells {cells} mix imports with other code (put imports in a cell of their own)')
    return 1 if problems else 0

if __name__ == '__main__': sys.exit(main())
