"""Refresh stored outputs of chosen cells without touching the others (small diffs, easy merges).

    python tools/refresh_outputs.py --show-doc [NB ...]   re-render every `show_doc(...)` cell
    (after a renderer
                                                           or docstring change); runs only exports,
                                                           imports and
                                                           show_doc cells, as nbdev's docs build
                                                           does
    python tools/refresh_outputs.py --cells ID,ID NB      re-run NB in a Jupyter kernel (as
    JupyterLab runs it) and
                                                           keep the new outputs of the cells with
                                                           those ids only
    python tools/refresh_outputs.py --empty NB            the same for every code cell that has no
    outputs yet
    python tools/refresh_outputs.py --all NB              the same for every code cell (a notebook
    run once, as
                                                           DEVELOPING.md asks, without widget state
                                                           in the file)

NB defaults to every notebook in nbs/. Run tools/clean_notebooks.py afterwards.
"""

import argparse, ast, json, os, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / "nbs"


def _source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _is_show_doc(cell) -> bool:
    return cell["cell_type"] == "code" and _source(cell).lstrip().startswith("show_doc(")


def _needed_for_docs(cell) -> bool:
    "Export cells, cells that only import, and show_doc cells: what nbdev's docs build runs."
    if cell["cell_type"] != "code":
        return False
    src = _source(cell)
    if _is_show_doc(cell) or any(
        l.startswith(("#| export", "#|export", "#| exports")) for l in src.splitlines()
    ):
        return True
    if "eval: false" in src:
        return False
    try:
        tree = ast.parse(
            "\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("%", "!")))
        )
    except SyntaxError:
        return False
    return bool(tree.body) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body)


def show_doc_outputs(path: Path) -> dict[str, list]:
    "New outputs of the show_doc cells of `path`, by cell id."
    from execnb.shell import CaptureShell

    nb = json.loads(path.read_text(encoding="utf-8"))
    shell, found = CaptureShell(), {}
    shell.run_cell("from nbdev.showdoc import show_doc")
    for cell in nb["cells"]:
        if not _needed_for_docs(cell):
            continue
        outputs = shell.run(_source(cell))
        if shell.exc:
            raise RuntimeError(f"{path.name}: cell {cell.get('id')} failed") from shell.exc
        if _is_show_doc(cell):
            found[cell["id"]] = outputs
    return found


def kernel_outputs(path: Path) -> dict[str, list]:
    "Outputs of every code cell of `path` run top to bottom in a python3 kernel, by cell id."
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=900,
        store_widget_state=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return {c["id"]: c.get("outputs", []) for c in nb.cells if c.cell_type == "code"}


def _as_stored(outputs: list) -> list:
    """Outputs in the form a notebook file keeps them (multi-line text as a list of lines, as
    nbformat writes)."""
    from nbformat import from_dict
    from nbformat.v4.rwbase import split_lines

    nb = from_dict(
        {"cells": [{"cell_type": "code", "outputs": json.loads(json.dumps(outputs, default=str))}]}
    )
    return json.loads(json.dumps(split_lines(nb)["cells"][0]["outputs"]))


def replace_outputs(path: Path, outputs: dict[str, list]) -> int:
    "Put `outputs` into the cells with those ids; returns how many cells changed."
    nb = json.loads(path.read_text(encoding="utf-8"))
    changed = 0
    for cell in nb["cells"]:
        if cell.get("id") not in outputs:
            continue
        stored = _as_stored(outputs[cell["id"]])
        if cell.get("outputs") != stored:
            cell["outputs"], changed = stored, changed + 1
    if changed:
        from execnb.nbio import nb2str

        path.write_text(nb2str(nb), encoding="utf-8")
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--show-doc", action="store_true")
    group.add_argument("--cells")
    group.add_argument("--empty", action="store_true")
    group.add_argument("--all", action="store_true")
    args = ap.parse_args(argv)
    paths = [Path(p).resolve() for p in args.notebooks] or sorted(
        p for p in NBS.rglob("*.ipynb") if not any(s.startswith((".", "_")) for s in p.parts)
    )
    for path in paths:
        os.chdir(path.parent)  # a notebook runs in its own folder, as nbdev_test runs it
        if args.show_doc:
            new = show_doc_outputs(path)
        else:
            nb = json.loads(path.read_text(encoding="utf-8"))
            wanted = (
                set(args.cells.split(","))
                if args.cells
                else {
                    c["id"]
                    for c in nb["cells"]
                    if c["cell_type"] == "code" and (args.all or not c.get("outputs"))
                }
            )
            if not wanted:
                continue
            new = {k: v for k, v in kernel_outputs(path).items() if k in wanted}
        print(f"{path.name}: {replace_outputs(path, new)} cell(s) refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
