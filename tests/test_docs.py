"""The docs site builds offline and documents the API (tools/build_docs.py)."""
import re, subprocess, sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
