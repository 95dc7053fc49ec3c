"""`nbdev_export`, then each exported module's `__all__` wrapped at 100 columns.

nbdev writes a module's `__all__` wrapped at 120 columns (its own fixed width) while every other
line of the package comes from notebook cells that `ruff format` keeps within 100. This runs
`nbdev_export` with the arguments given, then rewraps each `__all__` list the same way nbdev does
(its names in order, continuation lines indented 11 spaces) at 100 columns. The names are read
with `ast.literal_eval` and written back in the same order: only the line breaks move.

    python tools/export.py                                # every notebook
    python tools/export.py --path nbs/data/02_data.ipynb  # one, as nbdev_export takes it
"""

import ast
import re
import subprocess
import sys
from pathlib import Path
from textwrap import TextWrapper

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "speedtronic"
WIDTH = 100
# `__all__ = [...]` as nbdev writes it: from its line to the first line that ends the list
ALL = re.compile(r"^__all__ = \[.*?\]$", re.MULTILINE | re.DOTALL)


def wrapped(names: list[str]) -> str:
    "The `__all__` assignment for `names`, wrapped at `WIDTH` columns as nbdev wraps it."
    wrapper = TextWrapper(
        width=WIDTH, initial_indent="", subsequent_indent=" " * 11, break_long_words=False
    )
    return "\n".join(wrapper.wrap(f"__all__ = {names!r}"))


def rewrap(text: str) -> str:
    "`text` (a module's source) with its `__all__` list rewrapped; unchanged when it has none."
    found = ALL.search(text)
    if found is None:
        return text
    names = ast.literal_eval(found.group(0).removeprefix("__all__ = "))
    return text[: found.start()] + wrapped(list(names)) + text[found.end() :]


def main(argv: list[str]) -> int:
    done = subprocess.run(["nbdev_export", *argv], cwd=ROOT)
    if done.returncode:
        return done.returncode
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if (new := rewrap(text)) != text:
            path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
