"""The wheel ships the package, the exported modules, and the example configs (2.0 shipped them only in the sdist)."""
import subprocess, sys, zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def test_wheel_contents(tmp_path):
    res = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    wheel, = tmp_path.glob('speedtronic-*.whl')
    names = set(zipfile.ZipFile(wheel).namelist())
    for cfg in ['smoke.yaml', 'v2_smoke.yaml', 'diloco.yaml']:
        assert f'speedtronic/configs/{cfg}' in names
    assert 'speedtronic/examples/diloco_master.yaml' in names
    assert 'speedtronic/config.py' in names and 'speedtronic/cli.py' in names
    entry = next(n for n in names if n.endswith('entry_points.txt'))
    assert 'speedtronic = speedtronic.cli:main' in zipfile.ZipFile(wheel).read(entry).decode()
    # one version everywhere: the wheel's metadata, settings.ini and speedtronic.__version__ (2.1.0: improves on 2.0, compatible)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith('.dist-info/METADATA'))).decode()
    import speedtronic
    assert f'Version: {speedtronic.__version__}' in metadata.splitlines(), metadata[:300]
    assert wheel.name.startswith(f'speedtronic-{speedtronic.__version__}-') and speedtronic.__version__ == '2.1.0'

def test_installed_configs_are_readable():
    from importlib.resources import files
    text = files('speedtronic.configs').joinpath('smoke.yaml').read_text()
    assert 'smoke' in text

def test_readme_is_generated_from_index():
    res = subprocess.run([sys.executable, 'tools/make_readme.py', '--check'], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr

def test_ci_runs_the_readme_test_command():
    readme = (ROOT / 'README.md').read_text()
    lines = readme.splitlines()
    first_two = [l for l in lines if l.startswith('bash tools/setup.sh')][:2]
    assert first_two[0].endswith('speedtronic train --config configs/demo.yaml')
    assert first_two[1] == 'bash tools/setup.sh dev && bash tools/test_all.sh'
    assert first_two[1] in (ROOT / '.ci' / 'run').read_text()

SKIPPING = '''
import pytest
@pytest.fixture
def browser(): pytest.skip("needs Debian chromium and the playwright package")
def test_page(browser): pass
def test_widget(browser): pass
@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu(): pass
def test_runs(): pass
'''

def test_the_suite_ends_with_what_it_skipped_and_how_to_run_it(tmp_path):
    "`tools/test_all.sh` reads pytest's own skip reasons (its junit file) and names each with its count and the fix."
    (tmp_path / 'test_skipping.py').write_text(SKIPPING)
    junit = tmp_path / 'junit.xml'
    res = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', f'--junitxml={junit}', 'test_skipping.py'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and '1 passed, 3 skipped' in res.stdout, res.stdout
    res = subprocess.run(['bash', str(ROOT / 'tools' / 'test_all.sh'), '--skipped', str(junit)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "pytest: 2 tests skipped: needs Debian chromium and the playwright package -> to run: install Debian's chromium "
        "(bash tools/setup.sh dev does, as root or with sudo; .ci/run requires it)",
        "pytest: 1 test skipped: needs CUDA -> to run: run on a machine with a CUDA GPU"]
