"""Build the documentation site offline into docs/ (a page per notebook, with show_doc API tables).

Quarto is not installable everywhere, so this does nbdev's part of `nbdev_docs` by hand and hands the
rendering to MkDocs (mkdocs-material + mkdocs-jupyter):

1. nbdev's own preprocessing (`proc_nbs`) writes the notebooks to `_proc/` with `show_doc` cells
   executed into markdown API tables and directives applied (we call it directly because
   `nbdev_proc_nbs` first tries to download Quarto and `pip install` the project);
2. what Quarto would do with nbdev's output is done here: each page is named as nbdev names it
   (`output-file`, e.g. `config.html`, so nbdev's cross-links work), gets its title back as a heading,
   `#|` directives are applied and removed (`hide` and `include: false` drop the cell, `echo: false`
   hides the input, `output: false` the outputs), and Quarto-only markdown is turned into plain
   markdown (link attributes such as `{target="_blank" ...}` and `[text]{.class}` spans dropped,
   `::: {.callout-note}` blocks made quotes, shortcodes removed), so no page shows Quarto syntax as text;
3. `mkdocs build` renders the result to `docs/` without re-executing anything (`mkdocs.yml`). The
   navigation is Home, then the guides (notebooks that export no module, such as "Coming from
   Speedtronic 2.0"), then the chapters in reading order.

Where Quarto exists, `nbdev_docs` still works with the nbdev config in `nbs/_quarto.yml`.
"""
import os, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE_SRC = ROOT / '_site_src'
_LINK_ATTRS = re.compile(r'(\]\([^)\s]*(?:\s+"[^"]*")?\))\{[^}\n]*\}')     # [text](url){target="_blank" ...}
_SPAN = re.compile(r'\[([^\]\n]*)\]\{[.#][^}\n]*\}')                         # [text]{.class}
_SHORTCODE = re.compile(r'\{\{<[^>]*>\}\}')                                  # {{< include x.qmd >}}
_DIV_OPEN = re.compile(r'^\s*:{3,}\s*\{?\s*(?:\.callout-(\w+))?[^}]*\}?\s*$')
_DIV_CLOSE = re.compile(r'^\s*:{3,}\s*$')

def process_notebooks(n_workers: int = 2) -> Path:
    "Run nbdev's docs preprocessing of `nbs/` into `_proc/`."
    import nbdev.doclinks
    from nbdev.quarto import refresh_quarto_yml, nbdev_sidebar
    from nbdev.serve import proc_nbs
    refresh_quarto_yml()
    nbdev.doclinks._build_modidx()
    nbdev_sidebar.__wrapped__(path=ROOT / 'nbs')
    return proc_nbs(ROOT / 'nbs', n_workers=n_workers, force=True)

def _front_matter(nb) -> dict:
    import yaml
    if nb.cells and nb.cells[0].cell_type == 'raw' and nb.cells[0].source.startswith('---'):
        return yaml.safe_load(nb.cells[0].source.strip().strip('-')) or {}
    return {}

def _directives(source: str) -> tuple[dict, str]:
    "`#| key: value` lines at the top of a cell, and the source without them."
    lines, found = source.splitlines(), {}
    while lines and lines[0].startswith('#|'):
        key, _, value = lines.pop(0)[2:].partition(':')
        found[key.strip()] = value.strip()
    return found, '\n'.join(lines)

def _fenced_divs(text: str) -> str:
    "Quarto's `::: {.callout-note}` ... `:::` as a quote headed by the callout's kind; other `:::` fences dropped."
    out, divs = [], []  # one entry per open div: True for a callout, whose lines become a quote
    for line in text.split('\n'):
        if _DIV_CLOSE.match(line):
            if divs and divs.pop(): out.append('')  # a blank line ends the quote
        elif m := _DIV_OPEN.match(line):
            divs.append(bool(m.group(1)))
            if m.group(1): out.append(f'> **{m.group(1).capitalize()}**\n>')
        else:
            out.append('> ' + line if any(divs) else line)
    return '\n'.join(out)

def plain_markdown(text: str) -> str:
    "Markdown with the Quarto-only syntax nbdev writes (link attributes, spans, callouts, shortcodes) made plain."
    return _fenced_divs(_SHORTCODE.sub('', _SPAN.sub(r'\1', _LINK_ATTRS.sub(r'\1', text))))

def _clean_text(text: str, site_url: str) -> str:
    return plain_markdown(text).replace(site_url, '')

def quarto_pass(nb, site_url: str):
    "Apply what Quarto would to one nbdev-processed notebook: title heading, directives, link attributes."
    fm = _front_matter(nb)
    cells = nb.cells[1:] if fm else nb.cells
    import nbformat
    head = [nbformat.v4.new_markdown_cell(f"# {fm['title']}" + (f"\n\n> {fm['description']}" if fm.get('description') else ''))] \
        if fm.get('title') else []
    out = []
    for cell in cells:
        if cell.cell_type == 'markdown':
            if cell.source.startswith('<!-- WARNING'): continue
            cell.source = _clean_text(cell.source, site_url)
        elif cell.cell_type == 'code':
            d, cell.source = _directives(cell.source)
            if 'hide' in d or d.get('include') == 'false': continue
            if d.get('output') == 'false': cell.outputs = []
            if not cell.source.strip() and not cell.get('outputs'): continue
            if d.get('echo') == 'false':
                cell.metadata.setdefault('tags', []).append('remove_input')
            for o in cell.get('outputs', []):
                for mime in ('text/markdown', 'text/html'):
                    if mime in o.get('data', {}): o['data'][mime] = _clean_text(''.join(o['data'][mime]), site_url)
        out.append(cell)
    nb.cells = head + out
    return nb, fm

def is_guide(nb_path: Path) -> bool:
    "A notebook that exports no module (a guide such as \"Coming from Speedtronic 2.0\"), rather than a chapter."
    import nbformat
    if not nb_path.exists() or nb_path.stem == 'index': return False
    cells = nbformat.read(nb_path, as_version=4).cells
    return not any(c.cell_type == 'code' and '#| default_exp' in c.source for c in cells)

def site_sources(proc: Path) -> list[tuple[str, str]]:
    "Write `_site_src/` from `_proc/`; returns (title, page file) in reading order."
    import nbformat, yaml
    site_url = 'https://' + yaml.safe_load((ROOT / 'nbs' / 'nbdev.yml').read_text())['website']['site-url'].split('://', 1)[1].rstrip('/') + '/'
    if SITE_SRC.exists(): shutil.rmtree(SITE_SRC)
    SITE_SRC.mkdir()
    pages = []
    for src in sorted(proc.glob('*.ipynb'), key=lambda p: (p.stem != 'index', not is_guide(ROOT / 'nbs' / p.name), p.stem)):
        nb, fm = quarto_pass(nbformat.read(src, as_version=4), site_url)
        name = Path(fm.get('output-file', src.stem + '.html')).stem + '.ipynb'
        nbformat.write(nb, SITE_SRC / name)
        pages.append(('Home' if src.stem == 'index' else fm.get('title', src.stem), name))
    return pages

def site_config(pages: list[tuple[str, str]]) -> Path:
    "`mkdocs.yml` plus a navigation in reading order with each notebook's title; written to `_mkdocs.yml`."
    import yaml
    cfg = yaml.safe_load((ROOT / 'mkdocs.yml').read_text())
    cfg['docs_dir'] = SITE_SRC.name
    cfg['nav'] = [{title: name} for title, name in pages]
    out = ROOT / '_mkdocs.yml'
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out

def render_site(config: Path) -> Path:
    "Render the pages to `docs/` with MkDocs."
    site = ROOT / 'docs'
    if site.exists(): shutil.rmtree(site)
    subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--quiet', '--config-file', str(config)],
                   cwd=ROOT, check=True, env={**os.environ, 'NO_MKDOCS_2_WARNING': '1'})
    return site

def main() -> int:
    os.chdir(ROOT)
    proc = process_notebooks()
    missing = sorted(p.name for p in (ROOT / 'nbs').glob('*.ipynb') if not (proc / p.name).exists())
    if missing:
        print(f"nbdev could not process: {', '.join(missing)}", file=sys.stderr)
        return 1
    site = render_site(site_config(site_sources(proc)))
    print(f"docs site written to {site.relative_to(ROOT)}/ ({len(list(site.glob('*.html')))} pages)")
    return 0

if __name__ == '__main__': sys.exit(main())
