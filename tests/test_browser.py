"""What a person sees: the docs site and the notebook widgets in headless Chromium (JupyterLab for the widgets)."""
import json, subprocess, sys, time, urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, free_port

def _wait_http(url: str, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2): return
        except Exception: time.sleep(0.5)
    raise TimeoutError(f'{url} did not answer within {timeout}s')

@pytest.fixture(scope='module')
def served_docs(docs_site):
    port = free_port()
    proc = subprocess.Popen([sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1', '--directory', str(docs_site)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f'http://127.0.0.1:{port}/index.html', 30)
        yield f'http://127.0.0.1:{port}'
    finally:
        proc.terminate(); proc.wait(10)

def test_config_page_renders_the_api(browser, served_docs, tmp_path):
    page = browser.new_page()
    page.goto(f'{served_docs}/config.html')
    text = page.inner_text('article')
    assert 'SpeedtronicConfig' in text and 'RunConfig' in text
    assert page.locator('article table').count() > 0          # show_doc parameter tables
    page.screenshot(path=str(tmp_path / 'config.png'), full_page=False)
    # the navigation links every chapter
    links = page.eval_on_selector_all('nav.md-nav--primary a.md-nav__link', 'els => els.map(e => e.textContent.trim())')
    for chapter in ['Trainer', 'Checkpoints', 'Data', 'Runtime', 'Command line']:
        assert chapter in links, links
    page.close()

def test_schedule_page_shows_the_static_plot(browser, served_docs):
    page = browser.new_page()
    page.goto(f'{served_docs}/schedules.html')
    imgs = page.locator('article img')
    assert imgs.count() >= 1
    assert imgs.first.evaluate('img => img.naturalWidth') > 100   # a real, decoded plot
    page.close()

NOTEBOOK = {
    'cells': [
        {'cell_type': 'code', 'metadata': {}, 'execution_count': None, 'outputs': [],
         'source': 'from speedtronic.widgets import precision_explorer\nview = precision_explorer()\nview'},
        {'cell_type': 'code', 'metadata': {}, 'execution_count': None, 'outputs': [],
         'source': 'from speedtronic.widgets import schedule_explorer\nschedule_explorer()'},
        {'cell_type': 'code', 'metadata': {}, 'execution_count': None, 'outputs': [],
         'source': 'from speedtronic.runtime import train_from_config\n'
                   'cfg = {"run": {"max_steps": 6, "output_dir": "tiny-run"}, "checkpoint": {"enabled": False},\n'
                   '       "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16},\n'
                   '       "data": {"num_tokens": 64, "micro_batch_size": 2, "target_batch_size": 2},\n'
                   '       "logging": {"level": "WARNING", "progress": "auto", "loss_plot": False}}\n'
                   'result = train_from_config(cfg, device="cpu")\n'
                   'print("finished at", result.steps)'},
    ],
    'metadata': {'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}},
    'nbformat': 4, 'nbformat_minor': 5,
}

@pytest.fixture(scope='module')
def jupyterlab(tmp_path_factory):
    root = tmp_path_factory.mktemp('lab')
    (root / 'widgets.ipynb').write_text(json.dumps(NOTEBOOK))
    port = free_port()
    cmd = [sys.executable, '-m', 'jupyterlab', '--no-browser', '--allow-root', '--ip=127.0.0.1', f'--port={port}',
           f'--ServerApp.root_dir={root}', "--IdentityProvider.token=", '--ServerApp.password=',
           '--LabApp.expose_app_in_browser=True', '--ServerApp.disable_check_xsrf=True']
    env = {**__import__('os').environ, 'JUPYTER_CONFIG_DIR': str(root / '.jupyter'), 'PYTHONPATH': str(ROOT)}
    log = open(root / 'lab.log', 'w')
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    try:
        _wait_http(f'http://127.0.0.1:{port}/api/status', 120)
        yield f'http://127.0.0.1:{port}'
    finally:
        proc.terminate()
        try: proc.wait(20)
        except subprocess.TimeoutExpired: proc.kill()
        log.close()

def test_widgets_work_in_jupyterlab(browser, jupyterlab, tmp_path):
    page = browser.new_page(viewport={'width': 1400, 'height': 1000})
    page.goto(f'{jupyterlab}/lab/tree/widgets.ipynb')
    page.wait_for_function('window.jupyterapp && document.querySelector(".jp-Notebook")', timeout=120_000)
    page.wait_for_function('window.jupyterapp.shell.currentWidget && window.jupyterapp.shell.currentWidget.sessionContext '
                           '&& window.jupyterapp.shell.currentWidget.sessionContext.session '
                           '&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel', timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # the precision explorer: device dropdown + the resolved plan (CUDA with bf16 → bf16)
    plan = page.locator('.widget-html-content code').first
    plan.wait_for(timeout=120_000)
    assert 'bf16' in plan.inner_text()
    # pick a CPU and ask for fp16: the plan falls back to fp32 and says why
    selects = page.locator('.widget-dropdown select')
    selects.nth(0).select_option('cpu')
    selects.nth(1).select_option('fp16')
    page.wait_for_function("document.querySelector('.widget-html-content code').innerText.includes('fp32')", timeout=30_000)
    assert 'fp32' in plan.inner_text()
    # the schedule explorer: sliders and a rendered plot image that changes with the sliders
    img = page.locator('.widget-image').first
    img.wait_for(timeout=60_000)
    before = img.get_attribute('src')
    assert page.locator('.widget-slider, .widget-hslider').count() >= 4
    kind = page.locator('.widget-dropdown select').nth(3)
    kind.select_option('constant')
    page.wait_for_function(f"document.querySelector('.widget-image').getAttribute('src') !== {json.dumps(before)}", timeout=30_000)
    # a training run in the notebook shows one progress line, updated in place, ending at the target
    page.wait_for_function("[...document.querySelectorAll('.jp-OutputArea-output')].some(e => e.innerText.includes('finished at 6'))",
                           timeout=120_000)
    bars = [t for t in page.locator('.jp-OutputArea-output').all_inner_texts() if 'step ' in t and 'tok/s' in t]
    assert len(bars) == 1 and 'step 6/6' in bars[0] and '100%' in bars[0], bars
    page.screenshot(path=str(tmp_path / 'lab.png'), full_page=True)
    page.close()
