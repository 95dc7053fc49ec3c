import os, shutil, socket, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

@pytest.fixture(scope='session')
def docs_site():
    "Build the docs site once per test session (tools/build_docs.py) and return its folder."
    res = subprocess.run([sys.executable, 'tools/build_docs.py'], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return ROOT / 'docs'

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                 '--disable-background-networking', '--disable-component-update', '--disable-sync']

@pytest.fixture(scope='session')
def browser():
    "Headless Debian Chromium driven by Playwright; skipped when either is missing unless CI requires it."
    exe = next((shutil.which(n) for n in ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable') if shutil.which(n)), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if not exe or sync_playwright is None:
        if os.environ.get('SPEEDTRONIC_REQUIRE_BROWSER'): pytest.fail('Chromium or playwright is missing (see .ci/run)')
        pytest.skip('needs Debian chromium and the playwright package')
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()
