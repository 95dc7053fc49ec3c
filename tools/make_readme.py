"""Write README.md from nbs/index.ipynb (Quarto, which `nbdev_readme` needs, is not available
everywhere).

Markdown cells are copied as they are; code cells are shown as Python blocks with their text output,
except cells marked `#| hide`. `--check` exits 1 when README.md is not what the notebook says.
"""

import sys
from pathlib import Path
import nbformat

ROOT = Path(__file__).resolve().parent.parent
HEADER = (
    "<!-- Generated from nbs/index.ipynb by tools/make_readme.py; edit the notebook, not "
    "this file. -->\n\n"
)


def _hidden(cell) -> bool:
    return any(
        line.strip().replace(" ", "") in ("#|hide", "#|exporti", "#|export")
        for line in cell.source.splitlines()[:3]
    )


def _text_output(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts).rstrip()


def render(nb_path: Path) -> str:
    "The README text for the notebook at `nb_path`."
    nb = nbformat.read(nb_path, as_version=4)
    blocks = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            blocks.append(cell.source.strip())
        elif cell.cell_type == "code" and not _hidden(cell):
            blocks.append(f"```python\n{cell.source.strip()}\n```")
            out = _text_output(cell)
            if out:
                blocks.append(f"    {out}".replace("\n", "\n    "))
    return HEADER + "\n\n".join(b for b in blocks if b) + "\n"


def main() -> int:
    text = render(ROOT / "nbs" / "index.ipynb")
    readme = ROOT / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text(encoding="utf-8") != text:
            print("README.md is out of date: run python tools/make_readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
