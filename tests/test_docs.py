"""The docs site builds offline and documents the API (tools/build_docs.py)."""
import re, subprocess, sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
import build_docs  # noqa: E402

class _Text(HTMLParser):
    "Visible text of an HTML page, without scripts and styles."
    def __init__(self):
        super().__init__(); self.parts, self._skip = [], 0
    def handle_starttag(self, tag, attrs):
        if tag in ('script', 'style'): self._skip += 1
    def handle_endtag(self, tag):
        if tag in ('script', 'style'): self._skip -= 1
    def handle_data(self, data):
        if not self._skip: self.parts.append(data)

def page_text(path: Path) -> str:
    p = _Text(); p.feed(path.read_text(encoding='utf-8'))
    return re.sub(r'\s+', ' ', ' '.join(p.parts))

@pytest.fixture(scope='module')
def site(docs_site):
    return docs_site

def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.glob('*.html') if p.name != '404.html')

def test_a_page_per_notebook(site):
    pages = {p.name for p in site.glob('*.html')} - {'404.html'}
    assert len(pages) == len(list((ROOT / 'nbs').glob('*.ipynb'))), pages
    for name in ['index.html', 'config.html', 'trainer.html', 'runtime.html', 'cli.html', 'data.html']:
        assert name in pages

def test_cross_links_resolve(site):
    "nbdev links every API name to its page; on this site those links are relative and all resolve."
    hrefs = [(page.name, href) for page in site.glob('*.html') if page.name != '404.html'
             for href in re.findall(r'href="([^"#:]+\.html)(?:#[^"]*)?"', page.read_text(encoding='utf-8'))]
    assert len(hrefs) > 100
    assert [h for h in hrefs if not (site / h[1]).exists()] == []

def test_directives_and_quarto_attributes_do_not_leak(site):
    text = page_text(site / 'precision.html')
    assert '#| echo' not in text and 'target="_blank"' not in text and '{target=' not in text
    assert 'Device and precision' in text          # the title nbdev moved to front matter is back as a heading

def test_config_page_documents_the_config_api(site):
    text = page_text(site / 'config.html')
    for name in ['SpeedtronicConfig', 'RunConfig', 'ModelConfig', 'DataConfig', 'OptimizerConfig', 'SchedulerConfig',
                 'PrecisionConfig', 'CheckpointConfig', 'LoggingConfig', 'DistributedConfig', 'ConfigError']:
        assert name in text, f'{name} is not documented on the config page'
    # show_doc tables were rendered into the page (parameter tables, not only the source code)
    html = (site / 'config.html').read_text(encoding='utf-8')
    assert '<table' in html

def test_index_is_the_readme(site):
    text = page_text(site / 'index.html')
    assert 'bash tools/setup.sh dev && bash tools/test_all.sh' in text

# What a reader must never see: the test-only imports cell, and syntax only Quarto understands.
TEST_IMPORTS = ('from fastcore.test import', 'from hypothesis import', 'import hypothesis', 'from nbdev.showdoc import')
QUARTO_TEXT = ('{target=', 'target="_blank"', '{.callout', '{.', ':::', '{{<', '#|')

def test_no_page_shows_the_test_imports(site):
    "The test-imports cell is `#| hide` in every notebook, and the build drops hidden cells."
    shown = {page.name: [line for line in TEST_IMPORTS if line in page_text(page)] for page in pages(site)}
    assert {name: lines for name, lines in shown.items() if lines} == {}

def test_no_page_shows_quarto_syntax(site):
    "show_doc's `[source](...){target=...}` links, callouts, spans and directives never appear as text."
    shown = {page.name: [bit for bit in QUARTO_TEXT if bit in page_text(page)] for page in pages(site)}
    assert {name: bits for name, bits in shown.items() if bits} == {}

def test_plain_markdown():
    "The build's Quarto pass, on the forms nbdev and Quarto write."
    md = build_docs.plain_markdown
    assert md('[source](https://x/a.py#L3){target="_blank" style="float:right; font-size:smaller"}') == '[source](https://x/a.py#L3)'
    assert md('a [marked]{.mark} word{{< include x.qmd >}}') == 'a marked word'
    assert md('x\n::: {.callout-note}\nread this\n:::\ny') == 'x\n> **Note**\n>\n> read this\n\ny'
    assert md('::: {.column-margin}\naside\n:::') == 'aside'
    assert md('`a[::2]`, {1: 2} and [a](b) stay') == '`a[::2]`, {1: 2} and [a](b) stay'

def test_directives_applied_to_cells():
    "`hide` and `include: false` drop a cell, `echo: false` hides its input, `output: false` its outputs."
    code = lambda src, out='shown': nbformat.v4.new_code_cell(src, outputs=[nbformat.v4.new_output('stream', text=out)])
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_raw_cell('---\ntitle: T\ndescription: D\n---'),
        code('#| hide\nfrom fastcore.test import *'), code('#|hide\nsecret()'), code('#| include: false\nx = 1'),
        code('#| echo: false\nshow_doc(f)'), code('#| output: false\nprint(1)'), code('plain()'),
        nbformat.v4.new_markdown_cell('[source](u){target="_blank"}')])
    nb, fm = build_docs.quarto_pass(nb, 'https://example.org/')
    assert fm['title'] == 'T'
    assert [c.source for c in nb.cells] == ['# T\n\n> D', 'show_doc(f)', 'print(1)', 'plain()', '[source](u)']
    assert nb.cells[1].metadata.tags == ['remove_input'] and nb.cells[2].outputs == []

def test_guides_follow_home_in_the_navigation(site):
    "The navigation: Home, the guides (notebooks that export no module), then the chapters."
    nav = [next(iter(item)) for item in __import__('yaml').safe_load((ROOT / '_mkdocs.yml').read_text())['nav']]
    assert nav[:2] == ['Home', 'Coming from Speedtronic 2.0'], nav
    assert nav.index('Configuration') < nav.index('Interactive views'), nav

def test_coming_from_2_page(site):
    "The page that gathers the differences from 2.0 links to the chapters it summarises."
    text, html = page_text(site / 'coming_from_2.html'), (site / 'coming_from_2.html').read_text(encoding='utf-8')
    for topic in ['every trainable parameter', 'matrices only', 'rate that produced that update', 'Exact resume',
                  'fsync', 'No pickle loading', 'redacted', 'speedtronic: error:', 'Node ids']:
        assert topic in text, topic
    for chapter in ['optimizers.html', 'schedules.html', 'checkpoint.html', 'config.html', 'cli.html', 'widgets.html']:
        assert f'href="{chapter}' in html, chapter
