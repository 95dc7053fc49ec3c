"""The wheel ships the package, the exported modules, and the example configs (2.0 shipped them only
in the sdist)."""

import ast, json, subprocess, sys, zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    "The wheel of this checkout, built once."
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (out / "build.log").write_text(res.stdout + res.stderr)  # what the build printed
    (built,) = out.glob("speedtronic-*.whl")
    return built


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for cfg in ["smoke.yaml", "v2_smoke.yaml", "diloco.yaml"]:
        assert f"speedtronic/configs/{cfg}" in names
    assert "speedtronic/examples/diloco_master.yaml" in names
    assert "speedtronic/config.py" in names and "speedtronic/cli.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "speedtronic = speedtronic.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # one version everywhere: the wheel's metadata, settings.ini and speedtronic.__version__ (2.1.0:
    # improves on 2.0, compatible)
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
    )
    import speedtronic

    assert f"Version: {speedtronic.__version__}" in metadata.splitlines(), metadata[:300]
    assert (
        wheel.name.startswith(f"speedtronic-{speedtronic.__version__}-")
        and speedtronic.__version__ == "2.1.0"
    )


def test_the_license_is_an_spdx_expression_and_the_build_prints_no_warning(wheel):
    """The metadata declares `License-Expression: Apache-2.0` and no license classifier, so the
    build (and every install, which builds it) prints no setuptools deprecation warning."""
    names = zipfile.ZipFile(wheel).namelist()
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
        .splitlines()
    )
    assert "License-Expression: Apache-2.0" in metadata, metadata[:30]
    assert not [line for line in metadata if line.startswith("Classifier: License ::")], metadata
    said = (wheel.parent / "build.log").read_text()
    assert "deprecated" not in said.lower() and "Warning" not in said, said[-3000:]


def test_installed_configs_are_readable(wheel, tmp_path):
    """Installed from the wheel (not this checkout or an editable install), the package reads the
    configs it ships."""
    target = tmp_path / "site"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    shipped = ["configs/smoke.yaml", "configs/demo.yaml", "examples/diloco_master.yaml"]
    code = (
        "import json, sys, speedtronic\nfrom importlib.resources import files\n"
        "print(json.dumps([[speedtronic.__file__, str(files('speedtronic.configs')), "
        "str(files('speedtronic.examples'))], {p: files('speedtronic.' + "
        "p.split('/')[0]).joinpath(p.split('/')[1]).read_text()"
        " for p in sys.argv[1:]}]))"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(target)!r})\n" + code,
            *shipped,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    where, texts = json.loads(res.stdout)
    assert all(Path(w).is_relative_to(target) for w in where), where
    assert texts == {p: (ROOT / p).read_text() for p in shipped}


def test_readme_is_generated_from_index():
    res = subprocess.run(
        [sys.executable, "tools/make_readme.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    first_two = [l for l in lines if l.startswith("bash tools/setup.sh")][:2]
    assert first_two[0].endswith("speedtronic train --config configs/demo.yaml")
    assert first_two[1] == "bash tools/setup.sh dev && bash tools/test_all.sh"
    assert first_two[1] in (ROOT / ".ci" / "run").read_text()


SKIPPING = """
import pytest
@pytest.fixture
def browser(): pytest.skip("needs Debian chromium and the playwright package")
def test_page(browser): pass
def test_widget(browser): pass
@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu(): pass
def test_runs(): pass
"""


def test_the_suite_ends_with_what_it_skipped_and_how_to_run_it(tmp_path):
    """`tools/test_all.sh` reads pytest's own skip reasons (its junit file) and names each with its
    count and the fix."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    junit = tmp_path / "junit.xml"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "test_skipping.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "1 passed, 3 skipped" in res.stdout, res.stdout
    res = subprocess.run(
        ["bash", str(ROOT / "tools" / "test_all.sh"), "--skipped", str(junit)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "pytest: 2 tests skipped: needs Debian chromium and the playwright package -> to run: "
        "install Debian's chromium "
        "(bash tools/setup.sh dev does, as root or with sudo; .ci/run requires it)",
        "pytest: 1 test skipped: needs CUDA -> to run: run on a machine with a CUDA GPU",
    ]


def nbdev_generated_lines(path: Path) -> set[int]:
    "The lines of an exported module's `__all__` assignment, which nbdev writes (1-based)."
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        for n in range(node.lineno, node.end_lineno + 1)
    }


def test_no_line_of_code_is_over_100_columns_but_a_url_or_what_nbdev_generates():
    """Every tracked file of code and settings (the exported package, tests, bench, tools, the
    scripts and settings) fits 100 columns, a line holding a URL excepted, and what nbdev writes
    itself: each module's `__all__` (wrapped at its fixed 120 columns) and `_modidx.py`. The
    notebooks' cells are `ruff format`'s (tools/test_all.sh checks them)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    code = [
        f
        for f in listed.stdout.split()
        if f.endswith((".py", ".sh", ".toml", ".ini", ".cfg")) or f.startswith((".ci/", "tools/"))
    ]
    assert "speedtronic/trainer.py" in code and "tools/test_all.sh" in code, code[:10]
    long = []
    for f in code:
        if f.endswith("_modidx.py"):
            continue
        generated = nbdev_generated_lines(ROOT / f) if f.startswith("speedtronic/") else set()
        lines = (ROOT / f).read_text(encoding="utf-8").splitlines()
        long += [
            f"{f}:{n}: {len(line)} columns"
            for n, line in enumerate(lines, 1)
            if len(line) > 100 and "://" not in line and n not in generated
        ]
    assert long == [], long
