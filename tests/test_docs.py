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
    for nb in (ROOT / 'nbs').glob('*.ipynb'):
        assert (site / f'{nb.stem}.html').exists(), f'no page for {nb.name}'

def test_config_page_documents_the_config_api(site):
    text = page_text(site / '00_config.html')
    for name in ['SpeedtronicConfig', 'RunConfig', 'ModelConfig', 'DataConfig', 'OptimizerConfig', 'SchedulerConfig',
                 'PrecisionConfig', 'CheckpointConfig', 'LoggingConfig', 'DistributedConfig', 'ConfigError']:
        assert name in text, f'{name} is not documented on the config page'
    # show_doc tables were rendered into the page (parameter tables, not only the source code)
    html = (site / '00_config.html').read_text(encoding='utf-8')
    assert '<table' in html

def test_index_is_the_readme(site):
    text = page_text(site / 'index.html')
    assert 'bash tools/setup.sh dev && bash tools/test_all.sh' in text
