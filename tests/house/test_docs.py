"""The docs site builds offline and documents the API (tools/build_docs.py)."""

import re, subprocess, sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_docs  # noqa: E402
from conftest import spawn


class _Text(HTMLParser):
    "Visible text of an HTML page, without scripts and styles."

    def __init__(self):
        super().__init__()
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def page_text(path: Path) -> str:
    p = _Text()
    p.feed(path.read_text(encoding="utf-8"))
    return re.sub(r"\s+", " ", " ".join(p.parts))


@pytest.fixture(scope="module")
def site(docs_site):
    return docs_site


def pages(site: Path) -> list[Path]:
    "Every page of the site, its area folders' too."
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def notebooks() -> list[Path]:
    "Every notebook of nbs/ (the index and one folder per area)."
    return [ROOT / "nbs" / f"{k}.ipynb" for k in build_docs.notebook_keys()]


def test_a_page_per_notebook(site):
    "A page per notebook, and the API index."
    pages = {p.relative_to(site).as_posix() for p in site.rglob("*.html")} - {
        "404.html",
        "api.html",
    }
    assert len(pages) == len(notebooks()), pages
    assert (site / "api.html").exists()
    for name in [
        "index.html",
        "core/config.html",
        "train/trainer.html",
        "app/runtime.html",
        "app/cli.html",
        "data/data.html",
    ]:
        assert name in pages


def test_cross_links_resolve(site):
    "nbdev links every API name to its page; on this site those links are relative and all resolve."
    hrefs = [
        (page, href)
        for page in pages(site)
        for href in re.findall(
            r'href="([^"#:]+\.html)(?:#[^"]*)?"', page.read_text(encoding="utf-8")
        )
    ]
    assert len(hrefs) > 100
    assert any(h.startswith("../") for _, h in hrefs)  # an area's page links to another area's
    assert [(p.name, h) for p, h in hrefs if not (p.parent / h).exists()] == []


def test_directives_and_quarto_attributes_do_not_leak(site):
    text = page_text(site / "train/precision.html")
    assert "#| echo" not in text and 'target="_blank"' not in text and "{target=" not in text
    # the title nbdev moved to front matter is back as a heading
    assert "Device and precision" in text


def test_config_page_documents_the_config_api(site):
    text = page_text(site / "core/config.html")
    for name in [
        "SpeedtronicConfig",
        "RunConfig",
        "ModelConfig",
        "DataConfig",
        "OptimizerConfig",
        "SchedulerConfig",
        "PrecisionConfig",
        "CheckpointConfig",
        "LoggingConfig",
        "DistributedConfig",
        "ConfigError",
    ]:
        assert name in text, f"{name} is not documented on the config page"
    # show_doc tables were rendered into the page (parameter tables, not only the source code)
    html = (site / "core/config.html").read_text(encoding="utf-8")
    assert "<table" in html


def test_index_is_the_readme(site):
    text = page_text(site / "index.html")
    assert "bash tools/setup.sh dev && bash tools/test_all.sh" in text


# What a reader must never see: the test-only imports cell, and syntax only Quarto understands.
TEST_IMPORTS = (
    "from fastcore.test import",
    "from hypothesis import",
    "import hypothesis",
    "from nbdev.showdoc import",
)
QUARTO_TEXT = ("{target=", 'target="_blank"', "{.callout", "{.", ":::", "{{<", "#|")


def test_no_page_shows_the_test_imports(site):
    "The test-imports cell is `#| hide` in every notebook, and the build drops hidden cells."
    shown = {
        page.name: [line for line in TEST_IMPORTS if line in page_text(page)]
        for page in pages(site)
    }
    assert {name: lines for name, lines in shown.items() if lines} == {}


def test_no_page_shows_quarto_syntax(site):
    """show_doc's `[source](...){target=...}` links, callouts, spans and directives never appear as
    text."""
    shown = {
        page.name: [bit for bit in QUARTO_TEXT if bit in page_text(page)] for page in pages(site)
    }
    assert {name: bits for name, bits in shown.items() if bits} == {}


def test_plain_markdown():
    "The build's Quarto pass, on the forms nbdev and Quarto write."
    md = build_docs.plain_markdown
    assert (
        md('[source](https://x/a.py#L3){target="_blank" style="float:right; font-size:smaller"}')
        == "[source](https://x/a.py#L3)"
    )
    assert md("a [marked]{.mark} word{{< include x.qmd >}}") == "a marked word"
    assert md("x\n::: {.callout-note}\nread this\n:::\ny") == "x\n> **Note**\n>\n> read this\n\ny"
    assert md("::: {.column-margin}\naside\n:::") == "aside"
    assert md("`a[::2]`, {1: 2} and [a](b) stay") == "`a[::2]`, {1: 2} and [a](b) stay"


def test_directives_applied_to_cells():
    """`hide` and `include: false` drop a cell, `echo: false` hides its input, `output: false` its
    outputs."""
    code = lambda src, out="shown": nbformat.v4.new_code_cell(
        src, outputs=[nbformat.v4.new_output("stream", text=out)]
    )
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_raw_cell("---\ntitle: T\ndescription: D\n---"),
            code("#| hide\nfrom fastcore.test import *"),
            code("#|hide\nsecret()"),
            code("#| include: false\nx = 1"),
            code("#| echo: false\nshow_doc(f)"),
            code("#| output: false\nprint(1)"),
            code("plain()"),
            nbformat.v4.new_markdown_cell('[source](u){target="_blank"}'),
        ]
    )
    nb, fm = build_docs.quarto_pass(nb, "https://example.org/")
    assert fm["title"] == "T"
    assert [c.source for c in nb.cells] == [
        "# T\n\n> D",
        "show_doc(f)",
        "print(1)",
        "plain()",
        "[source](u)",
    ]
    assert nb.cells[1].metadata.tags == ["remove_input"] and nb.cells[2].outputs == []


def _nav() -> list:
    return __import__("yaml").safe_load((ROOT / "_mkdocs.yml").read_text())["nav"]


def _titles(items) -> list[str]:
    "Every page title under `items` (a nav list), depth first."
    out = []
    for item in items:
        ((title, value),) = item.items()
        out += _titles(value) if isinstance(value, list) else [title]
    return out


def test_navigation_is_a_guide_a_reference_and_the_internals(site):
    """Home, a user guide starting with the tutorial, a reference starting with the API index, and
    the internals last."""
    nav = _nav()
    sections = [next(iter(item)) for item in nav]
    assert sections == ["Home", "User guide", "Reference", "Internals"], sections
    guide, reference, internals = (_titles(item[name]) for item, name in zip(nav[1:], sections[1:]))
    assert guide[0] == "Tutorial: train in JupyterLab" and reference[0] == "API index", (
        guide,
        reference,
    )
    assert [next(iter(i)) for i in nav[1]["User guide"]][:6] == [
        "Tutorial: train in JupyterLab",
        "Training",
        "Configuration",
        "DiLoCo",
        "torchrun",
        "After training",
    ], nav[1]
    for page in [
        "Coming from Speedtronic 2.0",
        "Command line",
        "Training across machines",
        "Parallel",
    ]:
        assert page in guide, page
    for page in ["Trainer", "Data", "Optimizers", "Interactive views"]:
        assert page in reference, page
    for page in ["Files", "Run paths", "Module utilities", "DiLoCo wire format", "API tables"]:
        assert page in internals, page
    every = _titles(nav)
    assert len(every) == len(set(every)) == len(notebooks()) + 1, every  # each page once


def _sidebar_tree(items, page) -> list:
    """Quarto's sidebar contents as nested (section, [page, ...]) lists, each notebook as the site
    page `page` names."""
    return [
        page(Path(i).stem)
        if isinstance(i, str)
        else (i["section"], _sidebar_tree(i["contents"], page))
        for i in items
    ]


def _nav_tree(items) -> list:
    "MkDocs' nav in the same shape: a page as its file's stem, a section as (title, [...])."
    return [
        Path(v).stem if isinstance(v, str) else (k, _nav_tree(v))
        for i in items
        for k, v in i.items()
    ]


def test_quarto_sidebar_is_written_from_the_same_grouping(site):
    """nbs/sidebar.yml (what `nbdev_docs` renders with Quarto) has the site's sections and pages in
    the site's order."""
    import yaml

    names = build_docs.page_names(ROOT / "_proc")  # notebook stem -> page, as the site names it
    sidebar = _sidebar_tree(
        yaml.safe_load((ROOT / "nbs" / "sidebar.yml").read_text())["website"]["sidebar"][
            "contents"
        ],
        lambda stem: Path(names[stem]).stem,
    )
    drop_api = lambda tree: [
        (e[0], drop_api(e[1])) if isinstance(e, tuple) else e
        for e in tree
        if e != build_docs.API_INDEX
    ]
    # the API index is a page only this builder writes
    assert sidebar == drop_api(_nav_tree(_nav()))
    assert [e[0] for e in sidebar[1:]] == ["User guide", "Reference", "Internals"]


def test_nbdev_leaves_the_grouped_sidebar_alone():
    """The sidebar in the repository is the one `NAV` gives, and nbdev's own sidebar step (part of
    `nbdev_docs`) keeps it."""
    from nbdev.quarto import nbdev_sidebar

    before = (ROOT / "nbs" / "sidebar.yml").read_text(encoding="utf-8")
    res = subprocess.run(
        [sys.executable, "tools/build_docs.py", "--check-sidebar"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    nbdev_sidebar.__wrapped__(path=ROOT / "nbs")
    assert (ROOT / "nbs" / "sidebar.yml").read_text(encoding="utf-8") == before


def _public_names(module_file: Path) -> list[str]:
    import ast

    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    return next(
        (
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "__all__" for t in n.targets)
        ),
        [],
    )


def test_api_index_links_every_public_name(site):
    """The API index lists each module's `__all__`, each name linked to a page of the site, and to
    its heading where it has one."""
    html = (site / "api.html").read_text(encoding="utf-8")
    named = {
        name: href for href, name in re.findall(r'<a href="([^"]+)"><code>([^<]+)</code></a>', html)
    }
    for module in [
        "config",
        "trainer",
        "runtime",
        "data",
        "checkpoint",
        "widgets",
        "distributed/norms",
    ]:
        for name in _public_names(ROOT / "speedtronic" / f"{module}.py"):
            assert name in named, f"speedtronic.{module}.{name} is not in the API index"
    assert "Trainer.fit" in named and "SpeedtronicConfig.load" in named
    ids = {}
    for href in named.values():
        page, _, anchor = href.partition("#")
        assert (site / page).exists(), href
        if anchor:
            if page not in ids:
                ids[page] = set(
                    re.findall(r'id="([^"]+)"', (site / page).read_text(encoding="utf-8"))
                )
            assert anchor in ids[page], href
    assert named["Trainer.fit"] == "train/trainer.html#trainerfit", named["Trainer.fit"]
    assert named["SpeedtronicConfig"] == "core/config.html#speedtronicconfig"


def test_notebook_links_become_page_links(site):
    """A chapter links to another as `../train/06_trainer.ipynb` (JupyterLab follows that); on the
    site the link is the page."""
    html = (site / "guide/tutorial.html").read_text(encoding="utf-8")
    assert (
        'href="../train/trainer.html"' in html
        and 'href="../app/runtime.html"' in html
        and 'href="coming_from_2.html"' in html
    )
    leftover = {
        p.name: re.findall(r'href="((?:[^"/]*/)*\d\w*\.ipynb[^"]*)"', p.read_text(encoding="utf-8"))
        for p in pages(site)
    }
    assert {k: v for k, v in leftover.items() if v} == {}
    assert (
        build_docs.page_links(
            "[T](../train/06_trainer.ipynb#fit) [x](https://a/b.ipynb) [C](01_config.ipynb)",
            {"06_trainer": "trainer.html", "01_config": "config.html"},
        )
        == "[T](../train/trainer.html#fit) [x](https://a/b.ipynb) [C](config.html)"
    )


def test_pages_show_no_check_only_cells(site):
    """Cells that only check (no output, `test_*` calls, asserts) stay in the notebooks and out of
    the pages."""
    import nbformat as nbf

    left = {
        src.name: [
            c.source[:60] for c in nbf.read(src, as_version=4).cells if build_docs.only_checks(c)
        ]
        for src in (ROOT / "_site_src").rglob("*.ipynb")
    }
    assert {k: v for k, v in left.items() if v} == {}
    # about 120 before: test blocks between the design notes
    assert page_text(site / "train/trainer.html").count("test_eq(") <= 30
    cell = lambda src, outputs=(): nbformat.v4.new_code_cell(src, outputs=list(outputs))
    assert build_docs.only_checks(cell("t = _trainer()\ntest_eq(t.fit().steps, 3)"))
    assert build_docs.only_checks(cell("class _Spy:\n    pass\nassert _Spy()"))
    assert not build_docs.only_checks(
        cell("test_eq(1, 1)", [nbformat.v4.new_output("stream", text="shown")])
    )
    assert not build_docs.only_checks(cell("def helper(): pass\ntest_eq(helper(), None)"))
    assert not build_docs.only_checks(cell("x = 1"))


def test_pages_ask_nothing_of_the_internet(site):
    """No web fonts, no widget or MathJax scripts from a CDN: every stylesheet, script, font and
    image a page loads is local."""
    for page in pages(site):
        html = page.read_text(encoding="utf-8")
        remote = re.findall(
            r'<(?:script|link|img)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"', html
        )
        # the widget manager a page with widget state loads
        remote += re.findall(r'widgetRendererSrc\s*=\s*[\'"](https?://[^\'"]+)', html)
        remote += re.findall(r'url\((?:[\'"])?(https?://[^)\'"]+)', html)
        assert remote == [], (page.name, remote)


def test_coming_from_2_page(site):
    "The page that gathers the differences from 2.0 links to the chapters it summarises."
    text, html = (
        page_text(site / "guide/coming_from_2.html"),
        (site / "guide/coming_from_2.html").read_text(encoding="utf-8"),
    )
    for topic in [
        "every trainable parameter",
        "matrices only",
        "rate that produced that update",
        "Exact resume",
        "fsync",
        "No pickle loading",
        "redacted",
        "speedtronic: error:",
        "Node ids",
    ]:
        assert topic in text, topic
    for chapter in [
        "../train/optimizers.html",
        "../train/schedules.html",
        "../train/checkpoint.html",
        "../core/config.html",
        "../app/cli.html",
        "../observe/widgets.html",
    ]:
        assert f'href="{chapter}' in html, chapter


def test_tutorial_page(site):
    """The tutorial renders with its pictures: the live view's last state, the results' loss curves,
    the schedule."""
    html = (site / "guide/tutorial.html").read_text(encoding="utf-8")
    text = page_text(site / "guide/tutorial.html")
    for words in [
        "Train, watch, and press",
        "resume=True",
        "Training stopped after step",
        "step 150/150 100%",
        "Carry on where it stopped",
    ]:
        assert words in text, words
    assert html.count("data:image/png;base64") + html.count("<img") >= 4
    # its checks are hidden cells
    assert "from fastcore.test import" not in text and "test_eq" not in text


def test_show_doc_tables_are_plain_markdown(site):
    "API entries link to their source with a real line number and no Quarto attribute."
    html = (site / "train/trainer.html").read_text(encoding="utf-8")
    links = re.findall(
        r'href="(https://github.com/speedtronic/speedtronic/blob/main/speedtronic/trainer.py[^"]*)"',
        html,
    )
    assert links and all(re.search(r"#L\d+$", l) for l in links), links[:5]


def test_readme_says_what_the_package_does(tmp_path):
    """The README's claims that are easy to get stale: Muon trains (it is not 'the next chapter'),
    and the docs it describes exist."""
    from conftest import ok, run_cli

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "next chapter" not in readme and "optimizer.name: muon" in readme
    config = (ROOT / "configs" / "smoke.yaml").read_text().replace("name: adamw", "name: muon")
    assert "name: muon" in config
    (tmp_path / "muon.yaml").write_text(config)
    proc = ok(  # --verbose: the optimizer event's line is printed
        run_cli("train", "--config", "muon.yaml", "--device", "cpu", "--verbose", cwd=tmp_path)
    )
    assert (
        "optimizer name=muon" in proc.stderr + proc.stdout
        and "muon_tensors=0 " not in proc.stderr + proc.stdout
    )
    assert "API index" in readme and (ROOT / "tools" / "build_docs.py").exists()


def test_readme_diloco_example_runs_as_written(tmp_path):
    """The README's two-process DiLoCo example, in a copy: both finish, the master's last checkpoint
    holds the final global, a rerun is refused."""
    import shutil, torch
    from conftest import cli_env, ok, one_error_line, run_cli
    from speedtronic.checkpoint import load_checkpoint
    from speedtronic.distributed.tensors import load_safetensors

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [
        "speedtronic train --config examples/diloco_local_master.yaml &",
        "speedtronic train --config examples/diloco_local_worker.yaml",
    ]
    assert all(c in readme for c in commands) and "export OMP_NUM_THREADS=1" in readme
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    master = spawn(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "examples/diloco_local_master.yaml",
        ],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        worker = run_cli(
            "train", "--config", "examples/diloco_local_worker.yaml", cwd=tmp_path, timeout=300
        )
    finally:
        out, err = master.communicate(timeout=300)
    ok(worker)
    assert master.returncode == 0, err[-3000:]
    run = tmp_path / "runs" / "diloco-local"
    final = load_safetensors(run / "repo" / "global" / "latest.safetensors")
    saved = load_checkpoint(sorted((run / "master" / "checkpoints").glob("step_*.pt"))[-1])
    assert saved["step"] == 200 and all(torch.equal(saved["model"][k], v) for k, v in final.items())
    one_error_line(
        run_cli("train", "--config", "examples/diloco_local_worker.yaml", cwd=tmp_path),
        "--resume",
        "--overwrite",
    )


_HEADING = re.compile(r'<h([1-6])\b[^>]*\bid="([^"]*)"[^>]*>(.*?)</h\1>', re.S)
_TOC_LINK = re.compile(r'<a href="#([^"]*)" class="md-nav__link">(.*?)</a>', re.S)


def _words(fragment: str) -> str:
    "The text an HTML fragment shows, its `¶` link left out."
    from html import unescape

    fragment = re.sub(r'<a class="anchor-link".*?</a>', "", fragment, flags=re.S)
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", fragment))).strip()


def contents_problems(page: Path) -> list[str]:
    """Where the table of contents of `page` and its headings disagree: a link to no heading, a
    blank or wrong entry, an id used twice, a heading left out."""
    html = page.read_text(encoding="utf-8")
    article = html[html.find("<article") : html.find("</article>")]
    headings = [(int(m[0]), m[1], _words(m[2])) for m in _HEADING.findall(article)]
    ids = re.findall(r'\bid="([^"]*)"', html)
    by_id = {ident: text for _, ident, text in headings}
    problems = [f"id {i!r} used {ids.count(i)} times" for i in sorted(set(ids)) if ids.count(i) > 1]
    listed = set()
    for target, inner in _TOC_LINK.findall(html):
        listed.add(target)
        if target not in by_id:
            problems.append(f"contents link #{target} ({_words(inner)!r}) has no heading")
        elif _words(inner) != by_id[target] or not by_id[target]:
            problems.append(f"contents entry {_words(inner)!r} for heading {by_id[target]!r}")
    if listed:  # a page with a table of contents lists every heading below its title
        problems += [
            f"heading #{i} is not in the contents"
            for lv, i, _ in headings
            if lv > 1 and i not in listed
        ]
    return problems


def test_headings_and_contents_agree_on_every_page(site):
    """Every page's table of contents links to its headings by their ids, with their words (code
    too), and no id is used twice."""
    found = {p.relative_to(site).as_posix(): contents_problems(p) for p in pages(site)}
    assert {k: v[:5] for k, v in found.items() if v} == {}
    assert len(_TOC_LINK.findall((site / "core/config.html").read_text(encoding="utf-8"))) > 20


def test_the_site_makes_headings_and_contents_agree():
    """The build's own step: a heading of code keeps its words in the contents, a repeated heading
    gets an id of its own."""
    page = (
        '<h1 id="t">T<a class="anchor-link" href="#t">¶</a></h1>'
        '<h2 id="run-what"><code>run</code> — what'
        '<a class="anchor-link" href="#run-what">¶</a></h2>'
        '<h3 id="main">main</h3><h3 id="main">main</h3><h2 id="main_1">main_1</h2>'
    )
    body, tokens = build_docs.unique_heading_ids(page)
    assert re.findall(r'<h\d id="([^"]*)"', body) == ["t", "run-what", "main", "main_1", "main_1_1"]
    assert 'href="#run-what">' in body
    flat = lambda ts: [
        t2 for t in ts for t2 in [(t["level"], t["id"], t["name"])] + flat(t["children"])
    ]
    assert flat(tokens) == [
        (1, "t", "T"),
        (2, "run-what", "run — what"),
        (3, "main", "main"),
        (3, "main_1", "main"),
        (2, "main_1_1", "main_1"),
    ]


def _api_rows(site: Path) -> dict[str, tuple[str, str]]:
    "The API index's rows: name -> (link, summary text)."
    html = (site / "api.html").read_text(encoding="utf-8")
    rows = re.findall(
        r'<td><a href="([^"]+)"><code>([^<]+)</code></a></td>\s*<td>(.*?)</td>', html, re.S
    )
    return {name: (href, _words(text)) for href, name, text in rows}


def test_api_index_says_what_each_name_is_and_lists_only_the_public_api(site):
    """Each row has the first paragraph of the name's docstring (wrapped lines joined); the
    internals' modules (wire format, files) are not listed."""
    import inspect

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.runtime import train_from_config
    from speedtronic.trainer import Trainer

    rows = _api_rows(site)
    for name, obj in [
        ("SpeedtronicConfig", SpeedtronicConfig),
        ("train_from_config", train_from_config),
        ("Trainer.fit", Trainer.fit),
        ("SpeedtronicConfig.load", SpeedtronicConfig.load),
    ]:
        first = " ".join(inspect.getdoc(obj).split("\n\n")[0].split())
        assert rows[name][1] == _words(__import__("markdown").markdown(first)), (name, rows[name])
    for internal in ["INT8_SCALE", "parse_step_count", "atomic_write", "encode_delta"]:
        assert internal not in rows, internal
    html = (site / "api.html").read_text(encoding="utf-8")
    assert "speedtronic.distributed.tensors" not in html and "speedtronic.files" not in html
    described = [n for n, (_, text) in rows.items() if text]
    assert len(described) >= 0.85 * len(rows), sorted(set(rows) - set(described))


def test_first_command_fits_the_page(browser, site):
    """The index page's first command is seen whole, with no horizontal scroll, at 800 and 1280
    pixels wide."""
    for width in (800, 1280):
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto((site / "index.html").as_uri())
        block = page.locator("article pre").first
        text = block.inner_text()
        assert "speedtronic train --config configs/demo.yaml" in text, text
        scroll, client = block.evaluate("e => [e.scrollWidth, e.clientWidth]")
        assert scroll <= client, (width, scroll, client)
        page.close()
