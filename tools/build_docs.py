"""Build the documentation site offline into docs/ (a page per notebook, with show_doc API tables).

Quarto is not installable everywhere, so this does nbdev's part of `nbdev_docs` by hand and hands the
rendering to MkDocs (mkdocs-material + mkdocs-jupyter):

1. nbdev's own preprocessing (`proc_nbs`) writes the notebooks to `_proc/` with `show_doc` cells
   executed into markdown API tables and directives applied; (we call it directly because
   `nbdev_proc_nbs` first tries to download Quarto and `pip install` the project);
2. `mkdocs build` renders `_proc/` to `docs/` without re-executing anything (`mkdocs.yml`).

Where Quarto exists, `nbdev_docs` still works with the nbdev config in `nbs/_quarto.yml`.
"""
import shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def process_notebooks(n_workers: int = 2) -> Path:
    "Run nbdev's docs preprocessing of `nbs/` into `_proc/`."
    import nbdev.doclinks
    from nbdev.quarto import refresh_quarto_yml, nbdev_sidebar
    from nbdev.serve import proc_nbs
    refresh_quarto_yml()
    nbdev.doclinks._build_modidx()
    nbdev_sidebar.__wrapped__(path=ROOT / 'nbs')
    return proc_nbs(ROOT / 'nbs', n_workers=n_workers, force=True)

def notebook_title(nb_path: Path) -> str:
    "The notebook's `# Title` (its first markdown heading), else its file name."
    import nbformat
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type == 'markdown' and cell.source.startswith('# '):
            return cell.source.splitlines()[0][2:].strip().strip('`')
    return nb_path.stem

def site_config() -> Path:
    "`mkdocs.yml` plus a navigation in reading order with each notebook's title; written to `_mkdocs.yml`."
    import yaml
    cfg = yaml.safe_load((ROOT / 'mkdocs.yml').read_text())
    nbs = sorted((ROOT / 'nbs').glob('*.ipynb'), key=lambda p: (p.stem != 'index', p.stem))
    cfg['nav'] = [{('Home' if p.stem == 'index' else notebook_title(p)): p.name} for p in nbs]
    out = ROOT / '_mkdocs.yml'
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out

def render_site() -> Path:
    "Render `_proc/` to `docs/` with MkDocs."
    site = ROOT / 'docs'
    if site.exists(): shutil.rmtree(site)
    subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--quiet', '--config-file', str(site_config())],
                   cwd=ROOT, check=True)
    return site

def main() -> int:
    import os
    os.chdir(ROOT)
    proc = process_notebooks()
    missing = sorted(p.name for p in (ROOT / 'nbs').glob('*.ipynb') if not (proc / p.name).exists())
    if missing:
        print(f"nbdev could not process: {', '.join(missing)}", file=sys.stderr)
        return 1
    site = render_site()
    print(f"docs site written to {site.relative_to(ROOT)}/ ({len(list(site.rglob('*.html')))} pages)")
    return 0

if __name__ == '__main__': sys.exit(main())
