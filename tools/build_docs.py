"""Build the documentation site offline into docs/ (a page per notebook, with show_doc API tables).

Quarto is not installable everywhere, so this does nbdev's part of `nbdev_docs` by hand and hands
the rendering to MkDocs (mkdocs-material + mkdocs-jupyter):

1. nbdev's own preprocessing (`proc_nbs`) writes the notebooks to `_proc/` with `show_doc` cells
   executed into markdown API tables and directives applied (we call it directly because
   `nbdev_proc_nbs` first tries to download Quarto and `pip install` the project);
2. what Quarto would do with nbdev's output is done here: each page is named as nbdev names it
   (`output-file`, e.g. `config.html`, so nbdev's cross-links work), gets its title back as a
   heading,
   `#|` directives are applied and removed (`hide` and `include: false` drop the cell, `echo: false`
   hides the input, `output: false` the outputs), and Quarto-only markdown is turned into plain
   markdown (link attributes such as `{target="_blank" ...}` and `[text]{.class}` spans dropped,
   `::: {.callout-note}` blocks made quotes, shortcodes removed), so no page shows Quarto syntax as
   text;
   links between notebooks (`../train/06_trainer.ipynb`, which JupyterLab follows) become links to
   their
   pages (`../train/trainer.html`), and cells that only check (no output, only `test_*` calls and
   asserts) are left
   out: the notebook keeps its tests, the page keeps what a reader reads;
3. an API index page (`api.html`) lists every public name of every module (its `__all__`, and the
   public methods of its classes) with a link to where it is documented;
4. `mkdocs build` renders the result to `docs/` without re-executing anything (`mkdocs.yml`; no web
   fonts, no widget scripts from a CDN: a page read offline asks nothing of the internet). The
   navigation (`NAV`) is a user guide, a reference (the API index and a page per public module) and
   the internals; a notebook `NAV` does not name goes to the guide when it exports no module, else
   to
   the reference.

`NAV` is the one source of the grouping: Quarto's sidebar (`nbs/sidebar.yml`, which `nbdev_docs`
reads; settings.ini has `custom_sidebar = True` so nbdev leaves it alone) is written from it too
(`python tools/build_docs.py --sidebar` writes only that file, `--check-sidebar` exits 1 when it is
stale), so where Quarto exists `nbdev_docs` renders the same user guide, reference and internals.
"""

import html as html_lib
import os, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE_SRC = ROOT / "_site_src"
# [text](url){target="_blank" ...}
_LINK_ATTRS = re.compile(r'(\]\([^)\s]*(?:\s+"[^"]*")?\))\{[^}\n]*\}')
_SPAN = re.compile(r"\[([^\]\n]*)\]\{[.#][^}\n]*\}")  # [text]{.class}
_SHORTCODE = re.compile(r"\{\{<[^>]*>\}\}")  # {{< include x.qmd >}}
_DIV_OPEN = re.compile(r"^\s*:{3,}\s*\{?\s*(?:\.callout-(\w+))?[^}]*\}?\s*$")
_DIV_CLOSE = re.compile(r"^\s*:{3,}\s*$")
# [text](../train/06_trainer.ipynb#x)
_NB_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s#]*?)([\w.-]+)\.ipynb(#[^)\s]*)?\)")
_CHECK = re.compile(r"^\s*(test_\w*\(|test\(|assert\b)")  # a line that checks
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# The site's navigation by notebook, each named by its path under nbs/ without `.ipynb` (its area
# folder and file: `train/06_trainer`): (section, [entry, ...]); an entry is a notebook or
# (subsection, [notebooks]).
API_INDEX = "api"
NAV = [
    (
        "User guide",
        [
            "guide/01_tutorial",
            ("Training", ["app/01_runtime", "app/02_cli"]),
            "core/01_config",
            ("DiLoCo", ["diloco/01_distributed", "diloco/07_distributed_norms"]),
            ("torchrun", ["torchrun/01_parallel"]),
            (
                "After training",
                ["guide/02_after_training", "train/04_checkpoint", "observe/01_metrics"],
            ),
            "guide/03_coming_from_2",
        ],
    ),
    (
        "Reference",
        [
            API_INDEX,
            "train/06_trainer",
            "core/06_registry",
            "models/01_model",
            "data/01_tokens",
            "data/02_data",
            "train/01_precision",
            "train/02_optimizers",
            "train/03_schedules",
            "observe/02_hooks",
            "observe/03_progress",
            "observe/04_integrations",
            "train/05_ooo",
            "diloco/06_distributed_diloco",
            "diloco/04_distributed_hub",
            "observe/06_widgets",
            "core/07_package",
        ],
    ),
    (
        "Internals",
        [
            "core/04_files",
            "core/05_optional",
            "core/02_paths",
            "models/02_module_utils",
            "models/03_shapes",
            "diloco/02_distributed_tensors",
            "diloco/03_distributed_transport",
            "diloco/05_distributed_outer",
            "diloco/09_distributed_compression",
            "app/03_main",
            "core/08_showdoc",
        ],
    ),
]

SIDEBAR = ROOT / "nbs" / "sidebar.yml"


def notebook_keys(folder: Path = ROOT / "nbs") -> list[str]:
    """Every notebook under `folder` (its area folders too) by its path there without `.ipynb`:
    `train/06_trainer`."""
    return sorted(
        p.relative_to(folder).with_suffix("").as_posix()
        for p in folder.rglob("*.ipynb")
        if not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts)
    )


def sections(stems) -> list[tuple[str, list]]:
    """`NAV` over the pages there are (`stems`): (section, [stem or (subsection, [stems])]); a stem
    `NAV` does not name joins the guide or the reference."""
    stems = set(stems)
    named = {
        s for _, entries in NAV for e in entries for s in ([e] if isinstance(e, str) else e[1])
    }
    extra = sorted(stem for stem in stems if stem not in named and stem != "index")
    out = []
    for section, entries in NAV:
        items = [
            e if isinstance(e, str) else (e[0], [s for s in e[1] if s in stems])
            for e in entries
            if (e in stems if isinstance(e, str) else any(s in stems for s in e[1]))
        ]
        wanted = (
            (lambda stem: is_guide(ROOT / "nbs" / f"{stem}.ipynb"))
            if section == "User guide"
            else (
                lambda stem: section == "Reference" and not is_guide(ROOT / "nbs" / f"{stem}.ipynb")
            )
        )
        out.append((section, items + [stem for stem in extra if wanted(stem)]))
    return out


def quarto_sidebar() -> str:
    """The text of `nbs/sidebar.yml`: Quarto's sidebar with `NAV`'s sections, over the notebooks in
    `nbs/` (no API index: only this builder writes one)."""
    import yaml

    stems = notebook_keys()
    contents = [f"{s}.ipynb" for s in stems if s == "index"]
    for section, items in sections(stems):
        contents.append(
            {
                "section": section,
                "contents": [
                    f"{e}.ipynb"
                    if isinstance(e, str)
                    else {"section": e[0], "contents": [f"{s}.ipynb" for s in e[1]]}
                    for e in items
                ],
            }
        )
    head = (
        "# Written by tools/build_docs.py from its NAV (the docs site's grouping); edit NAV, "
        "not this file.\n"
    )
    return head + yaml.safe_dump({"website": {"sidebar": {"contents": contents}}}, sort_keys=False)


def process_notebooks(n_workers: int = 2) -> Path:
    """Run nbdev's docs preprocessing of `nbs/` into `_proc/` (the sidebar written from `NAV`, not
    nbdev's flat list)."""
    import nbdev.doclinks
    from nbdev.quarto import refresh_quarto_yml
    from nbdev.serve import proc_nbs

    refresh_quarto_yml()
    nbdev.doclinks._build_modidx()
    SIDEBAR.write_text(quarto_sidebar(), encoding="utf-8")
    return proc_nbs(ROOT / "nbs", n_workers=n_workers, force=True)


def _front_matter(nb) -> dict:
    import yaml

    if nb.cells and nb.cells[0].cell_type == "raw" and nb.cells[0].source.startswith("---"):
        return yaml.safe_load(nb.cells[0].source.strip().strip("-")) or {}
    return {}


def _directives(source: str) -> tuple[dict, str]:
    "`#| key: value` lines at the top of a cell, and the source without them."
    lines, found = source.splitlines(), {}
    while lines and lines[0].startswith("#|"):
        key, _, value = lines.pop(0)[2:].partition(":")
        found[key.strip()] = value.strip()
    return found, "\n".join(lines)


def _fenced_divs(text: str) -> str:
    """Quarto's `::: {.callout-note}` ... `:::` as a quote headed by the callout's kind; other `:::`
    fences dropped."""
    out, divs = [], []  # one entry per open div: True for a callout, whose lines become a quote
    for line in text.split("\n"):
        if _DIV_CLOSE.match(line):
            if divs and divs.pop():
                out.append("")  # a blank line ends the quote
        elif m := _DIV_OPEN.match(line):
            divs.append(bool(m.group(1)))
            if m.group(1):
                out.append(f"> **{m.group(1).capitalize()}**\n>")
        else:
            out.append("> " + line if any(divs) else line)
    return "\n".join(out)


def plain_markdown(text: str) -> str:
    """Markdown with the Quarto-only syntax nbdev writes (link attributes, spans, callouts,
    shortcodes) made plain."""
    return _fenced_divs(_SHORTCODE.sub("", _SPAN.sub(r"\1", _LINK_ATTRS.sub(r"\1", text))))


def page_links(text: str, pages: dict[str, str]) -> str:
    """Links to notebooks (`../train/06_trainer.ipynb#x`, as JupyterLab follows them) made links to
    their pages (`../train/trainer.html#x`)."""

    def page(m):  # the folder part stays: a page links to another area's page as its notebook does
        name = pages.get(m.group(2)) or m.group(2) + ".html"
        return "](" + m.group(1) + name + (m.group(3) or "") + ")"

    return _NB_LINK.sub(page, text)


def only_checks(cell) -> bool:
    """A code cell that shows nothing and checks: no output, a line starting `test_*(`/`assert`, and
    no public `def`/`class`."""
    if cell.cell_type != "code" or cell.get("outputs"):
        return False
    lines = cell.source.splitlines()
    return any(_CHECK.match(l) for l in lines) and not any(
        re.match(r"(async\s+)?(def|class)\s+[^_\s]|@patch", l) for l in lines
    )


def _clean_text(
    text: str, site_url: str, pages: dict[str, str] | None = None, to_root: str = ""
) -> str:
    """Plain markdown with page links; the site's own address made relative (`to_root`: `../` from
    an area folder)."""
    return page_links(plain_markdown(text), pages or {}).replace(site_url, to_root)


def quarto_pass(nb, site_url: str, pages: dict[str, str] | None = None, to_root: str = ""):
    """Apply what Quarto would to one nbdev-processed notebook: title heading, directives, link
    attributes, page links."""
    fm = _front_matter(nb)
    cells = nb.cells[1:] if fm else nb.cells
    import nbformat

    head = (
        [
            nbformat.v4.new_markdown_cell(
                f"# {fm['title']}" + (f"\n\n> {fm['description']}" if fm.get("description") else "")
            )
        ]
        if fm.get("title")
        else []
    )
    out = []
    for cell in cells:
        if cell.cell_type == "markdown":
            if cell.source.startswith("<!-- WARNING"):
                continue
            cell.source = _clean_text(cell.source, site_url, pages, to_root)
        elif cell.cell_type == "code":
            d, cell.source = _directives(cell.source)
            if "hide" in d or d.get("include") == "false" or only_checks(cell):
                continue
            if d.get("output") == "false":
                cell.outputs = []
            if not cell.source.strip() and not cell.get("outputs"):
                continue
            if d.get("echo") == "false":
                cell.metadata.setdefault("tags", []).append("remove_input")
            for o in cell.get("outputs", []):
                data = o.get("data", {})
                if WIDGET_VIEW in data and len(data) > 1:
                    del data[WIDGET_VIEW]  # a static page shows the view's picture
                for mime in ("text/markdown", "text/html"):
                    if mime in data:
                        data[mime] = _clean_text("".join(data[mime]), site_url, pages, to_root)
        out.append(cell)
    nb.cells = head + out
    nb.metadata.pop("widgets", None)  # no widget state: the page loads no widget scripts
    return nb, fm


def is_guide(nb_path: Path) -> bool:
    """A notebook that exports no module (a guide such as "Coming from Speedtronic 2.0"), rather
    than a chapter."""
    import nbformat

    if not nb_path.exists() or nb_path.stem == "index":
        return False
    cells = nbformat.read(nb_path, as_version=4).cells
    return not any(c.cell_type == "code" and "#| default_exp" in c.source for c in cells)


def page_names(proc: Path) -> dict[str, str]:
    """Each processed notebook's page in its folder by file stem (`06_trainer` -> `trainer.html`),
    as nbdev names it (`output-file`)."""
    import nbformat

    return {
        src.stem: _front_matter(nbformat.read(src, as_version=4)).get(
            "output-file", src.stem + ".html"
        )
        for src in proc.rglob("*.ipynb")
    }


def site_sources(proc: Path) -> dict[str, tuple[str, str]]:
    "Write `_site_src/` from `_proc/`; returns (title, page file) by notebook stem."
    import nbformat, yaml

    site_url = (
        "https://"
        + yaml.safe_load((ROOT / "nbs" / "nbdev.yml").read_text())["website"]["site-url"]
        .split("://", 1)[1]
        .rstrip("/")
        + "/"
    )
    if SITE_SRC.exists():
        shutil.rmtree(SITE_SRC)
    SITE_SRC.mkdir()
    names, pages = page_names(proc), {}
    for key in notebook_keys(proc):
        src = proc / f"{key}.ipynb"
        folder = Path(key).parent  # the page stays in its area folder, where nbdev's links point
        to_root = "../" * len(folder.parts)
        nb, fm = quarto_pass(nbformat.read(src, as_version=4), site_url, names, to_root)
        name = (folder / (Path(names[src.stem]).stem + ".ipynb")).as_posix()
        (SITE_SRC / name).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, SITE_SRC / name)
        pages[key] = ("Home" if key == "index" else fm.get("title", src.stem), name)
    return pages


def navigation(pages: dict[str, tuple[str, str]]) -> list:
    """MkDocs' `nav`: Home, then each of `sections` (the API index is a page here, unlike in
    Quarto's sidebar)."""
    entry = lambda stem: {pages[stem][0]: pages[stem][1]}
    nav = [entry("index")] if "index" in pages else []
    for section, items in sections(pages):
        nav.append(
            {
                section: [
                    entry(e) if isinstance(e, str) else {e[0]: [entry(s) for s in e[1]]}
                    for e in items
                ]
            }
        )
    return nav


STYLESHEET = """\
/* Written by tools/build_docs.py. A command in the prose (a markdown cell's code block) wraps at
   the page's edge instead of hiding its end behind a horizontal scroll bar: the first command a
   reader copies is seen whole at any width. Code cells keep their lines. */
.jupyter-wrapper .jp-RenderedMarkdown .highlight pre,
.jupyter-wrapper .jp-RenderedMarkdown .highlight pre code {
  white-space: pre-wrap;
  overflow-wrap: anywhere;
}
"""


def write_stylesheet() -> str:
    "Write the site's own stylesheet into the pages' sources; returns its path there."
    path = SITE_SRC / "stylesheets" / "speedtronic.css"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STYLESHEET, encoding="utf-8")
    return path.relative_to(SITE_SRC).as_posix()


def site_config(pages: dict[str, tuple[str, str]]) -> Path:
    "`mkdocs.yml` plus the navigation (`navigation`); written to `_mkdocs.yml`."
    import yaml

    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    cfg["docs_dir"] = SITE_SRC.name
    cfg["nav"] = navigation(pages)
    cfg["hooks"] = [str(Path(__file__).resolve())]  # `on_page_content`: headings and contents agree
    cfg["extra_css"] = [write_stylesheet()]
    out = ROOT / "_mkdocs.yml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def slug(heading: str) -> str:
    "The id a page gives a heading (`### Trainer.fit` -> `trainerfit`)."
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def _headings(nb_file: Path) -> set[str]:
    "The ids of the headings of one site page (markdown cells and `show_doc` outputs)."
    import nbformat

    texts = []
    for cell in nbformat.read(nb_file, as_version=4).cells:
        texts.append(cell.source if cell.cell_type == "markdown" else "")
        texts += [
            "".join(o.get("data", {}).get("text/markdown", "")) for o in cell.get("outputs", [])
        ]
    return {slug(h) for t in texts for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", t, flags=re.M)}


def public_names() -> dict[str, list[str]]:
    """Every public name by module: its `__all__` (read from the source, nothing imported) and the
    public methods of its classes."""
    import ast
    from speedtronic._modidx import d

    out = {}
    for src in sorted((ROOT / "speedtronic").rglob("*.py")):
        if src.name.startswith("_") and src.name != "__init__.py":
            continue
        module = ".".join(
            ("speedtronic",) + src.relative_to(ROOT / "speedtronic").with_suffix("").parts
        ).removesuffix(".__init__")
        names = next(
            (
                ast.literal_eval(n.value)
                for n in ast.parse(src.read_text(encoding="utf-8")).body
                if isinstance(n, ast.Assign)
                and any(getattr(t, "id", "") == "__all__" for t in n.targets)
            ),
            [],
        )
        methods = [
            q[len(module) + 1 :]
            for q in d["syms"].get(module, {})
            if q.count(".") == module.count(".") + 2
            and q[len(module) + 1 :].split(".")[0] in names
            and not q.rsplit(".", 1)[1].startswith("_")
        ]
        if names:
            out[module] = sorted(names, key=str.lower) + sorted(methods, key=str.lower)
    return out


def summary(module: str, name: str) -> str:
    """What `name` (`Class.method` too) of `module` is, in one line: its docstring's first paragraph
    (a docstring wrapped to fit 100 columns is joined); for a constant, the comment on its line,
    else its value."""
    import importlib, inspect

    obj, owner = importlib.import_module(module), None
    try:
        for part in name.split("."):
            owner, obj = obj, getattr(obj, part)
    except AttributeError:
        return ""
    if inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, part, None), property):
        obj = inspect.getattr_static(owner, part)
    if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, property):
        doc = (inspect.getdoc(obj) or "").strip()
        return " ".join(doc.split("\n\n")[0].split())
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (OSError, TypeError):
        source = ""
    m = re.search(rf"^{re.escape(name)}\b[^\n=]*=[^\n]*#\s*(.+)$", source, flags=re.M)
    if m:
        return m.group(1).strip()
    value = repr(obj)
    return f"`{value if len(value) <= 60 else value[:59] + '…'}`" if "`" not in value else ""


def api_modules(pages: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The public modules, each with its page's (title, file): the modules the user guide and the
    reference document; the internals' are left out."""
    import nbformat

    public = {
        s
        for section, entries in sections(pages)
        if section != "Internals"
        for e in entries
        for s in ([e] if isinstance(e, str) else e[1])
    }
    by_module = {}
    for stem, (title, name) in pages.items():
        nb = ROOT / "nbs" / f"{stem}.ipynb"
        if stem not in public or not nb.exists():
            continue
        exp = [
            l.split(None, 2)[-1]
            for c in nbformat.read(nb, as_version=4).cells
            if c.cell_type == "code"
            for l in c.source.splitlines()
            if l.startswith("#| default_exp")
        ]
        if exp:
            by_module[".".join(("speedtronic", exp[0])).removesuffix(".__init__")] = (title, name)
    return by_module


def _cell(text: str) -> str:
    "`text` safe in a markdown table cell."
    return text.replace("\\", "\\\\").replace("|", "\\|")


def write_api_index(pages: dict[str, tuple[str, str]]) -> str:
    """Write `api.md`: each public module's public names (its `__all__` and its classes' public
    methods), each linked to the page (and heading) that documents it, with the first line of its
    docstring; returns its file name. The internals' modules are not the public API: their pages
    document them, the index does not list them."""
    by_module = api_modules(pages)
    ids = {name: _headings(SITE_SRC / name) for _, name in pages.values()}
    lines = [
        "# API index",
        "",
        "> Every public name of the package by module, what it is in one line, linked to where"
        " it is documented. The internals (file writing, wire formats, path rules) are"
        " documented on their own pages.",
        "",
    ]
    html = lambda n: n.removesuffix(".ipynb") + ".html"
    for module, names in public_names().items():
        title, home = by_module.get(module, (None, None))
        if home is None:
            continue
        lines += [
            f"## `{module}`",
            "",
            f"[{title}]({html(home)})",
            "",
            "| name | what it is |",
            "|---|---|",
        ]
        for n in names:
            where = (
                home
                if slug(n) in ids[home]
                else next((p for p, i in ids.items() if slug(n) in i), home)
            )
            anchor = f"#{slug(n)}" if slug(n) in ids[where] else ""
            lines.append(f"| [`{n}`]({html(where)}{anchor}) | {_cell(summary(module, n))} |")
        lines.append("")
    (SITE_SRC / "api.md").write_text("\n".join(lines), encoding="utf-8")
    return "api.md"


_HEADING = re.compile(r'<h([1-6])\b([^>]*?)\bid="([^"]*)"([^>]*)>(.*?)</h\1>', re.S)
_ANCHOR_LINK = re.compile(r'<a class="anchor-link" href="#[^"]*">.*?</a>', re.S)


def heading_text(inner_html: str) -> str:
    "The words a heading shows (its code too), without its `¶` link and its tags."
    text = re.sub(r"<[^>]+>", "", _ANCHOR_LINK.sub("", inner_html))
    return re.sub(r"\s+", " ", html_lib.unescape(text)).strip()


def unique_heading_ids(page_html: str) -> tuple[str, list[dict]]:
    """Each heading of `page_html` with an id of its own, and the table of contents linking to them.

    The page's headings are rendered by nbconvert and its table of contents by Python-Markdown,
    which name a heading that holds code differently (`run-what-...` against `what-...`, `_1` for a
    heading of code alone), and nbconvert gives two headings of one name one id. Here the rendered
    headings are the one source: a repeated id gets `_1`, `_2`, ... (as Python-Markdown numbers
    them), the heading's `¶` link follows it, and each table-of-contents entry is the heading's id
    and its whole text."""
    seen: dict[str, int] = {}
    flat: list[dict] = []

    def one(m: re.Match) -> str:
        level, before, wanted, after, inner = m.groups()
        base = wanted or "section"
        n = seen.get(base, 0)
        ident = base if n == 0 else f"{base}_{n}"
        while ident in seen:  # a heading already called `x_1`
            n += 1
            ident = f"{base}_{n}"
        seen[base], seen[ident] = n + 1, seen.get(ident, 1)
        inner = _ANCHOR_LINK.sub(f'<a class="anchor-link" href="#{ident}">&#182;</a>', inner)
        name = html_lib.escape(heading_text(inner), quote=False)
        flat.append({"level": int(level), "id": ident, "name": name, "children": []})
        return f'<h{level}{before}id="{ident}"{after}>{inner}</h{level}>'

    body = _HEADING.sub(one, page_html)
    roots: list[dict] = []
    stack: list[dict] = []
    for token in flat:
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else roots).append(token)
        stack.append(token)
    return body, roots


def on_page_content(html: str, page, config, files) -> str:
    """MkDocs hook (this file is named in `hooks`): the page's heading ids made unique and its
    table of contents built from them."""
    from mkdocs.structure.toc import get_toc

    body, tokens = unique_heading_ids(html)
    page.toc = get_toc(tokens)
    return body


def render_site(config: Path) -> Path:
    "Render the pages to `docs/` with MkDocs."
    site = ROOT / "docs"
    if site.exists():
        shutil.rmtree(site)
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--config-file", str(config)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return site


def main() -> int:
    os.chdir(ROOT)
    if "--check-sidebar" in sys.argv:
        if SIDEBAR.exists() and SIDEBAR.read_text(encoding="utf-8") == quarto_sidebar():
            return 0
        print(
            f"{SIDEBAR.relative_to(ROOT)} is out of date: run python tools/build_docs.py --sidebar",
            file=sys.stderr,
        )
        return 1
    if "--sidebar" in sys.argv:
        SIDEBAR.write_text(quarto_sidebar(), encoding="utf-8")
        return 0
    proc = process_notebooks()
    missing = sorted(k for k in notebook_keys() if not (proc / f"{k}.ipynb").exists())
    if missing:
        print(f"nbdev could not process: {', '.join(missing)}", file=sys.stderr)
        return 1
    pages = site_sources(proc)
    pages[API_INDEX] = ("API index", write_api_index(pages))
    site = render_site(site_config(pages))
    print(
        f"docs site written to {site.relative_to(ROOT)}/ ({len(list(site.rglob('*.html')))} pages)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
