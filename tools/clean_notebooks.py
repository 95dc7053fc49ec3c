"""Clean the notebooks in nbs/ with `nbdev_clean`, and check they hold the kernel metadata
JupyterLab writes.

JupyterLab needs a kernelspec in a notebook's metadata to start a kernel without asking ("Select
Kernel"), and when the kernel starts it writes the kernel's `kernelspec` and `language_info` into
the metadata: if they differ from what the file holds, the notebook opens already marked modified.
`nbdev_clean` keeps both keys (`language_info` is in settings.ini's `allowed_metadata_keys`) and
sets `kernelspec.display_name` to the kernel's name, `python3`; `tools/setup.sh` gives the
environment's python3 kernel that display name, so what nbdev_clean keeps and what JupyterLab writes
agree. This adds `KERNELSPEC`/`LANGUAGE_INFO` to a notebook that lacks them (a new one), so a plain
`nbdev_clean` afterwards changes nothing. On another Python version JupyterLab still updates
`language_info.version` on open; nothing stored in a file can avoid that.

    python tools/clean_notebooks.py          # clean every notebook (nbdev_clean, then the metadata)
    python tools/clean_notebooks.py --check  # exit 1 naming the notebooks whose metadata differs
"""

import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what nbdev_clean keeps
KERNELSPEC = {
    "display_name": "python3",
    "language": "python",
    "name": "python3",
}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.7",
}


def notebooks() -> list[Path]:
    nbs = ROOT / "nbs"
    return sorted(
        p
        for p in nbs.rglob("*.ipynb")
        if not any(part.startswith((".", "_")) for part in p.relative_to(nbs).parts)
    )


def metadata_problem(path: Path) -> str | None:
    "Why `path`'s kernel metadata is not what JupyterLab writes, or None."
    meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    if meta.get("kernelspec") != KERNELSPEC:
        return f"kernelspec is {meta.get('kernelspec')!r}"
    if meta.get("language_info") != LANGUAGE_INFO:
        return f"language_info is {meta.get('language_info')!r}"
    return None


def set_metadata(path: Path) -> bool:
    "Give `path` the kernel metadata JupyterLab writes; True if the file changed."
    from execnb.nbio import nb2str

    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    nb.setdefault("metadata", {}).update(kernelspec=KERNELSPEC, language_info=LANGUAGE_INFO)
    new = nb2str(nb)
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = [
            (p.relative_to(ROOT / "nbs").as_posix(), why)
            for p in notebooks()
            if (why := metadata_problem(p))
        ]
        for name, why in bad:
            print(f"{name}: {why}; run python tools/clean_notebooks.py", file=sys.stderr)
        return 1 if bad else 0
    # the nbdev of this interpreter, else the one on PATH
    beside = Path(sys.executable).parent / "nbdev_clean"
    subprocess.run([str(beside) if beside.exists() else "nbdev_clean"], cwd=ROOT, check=True)
    for p in notebooks():
        set_metadata(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
