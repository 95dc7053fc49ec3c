"""Every config shipped in configs/ validates, and runs as shipped or says on its first line what it
needs.

A config that runs as shipped is started from an empty folder, as a newcomer would start it: it must
finish, or train at least one step (it is then stopped with Ctrl-C, which keeps the step in a
checkpoint). A config that needs something it cannot ship (your own text, a GPU) says so on its
first line, `# Needs: ...`; as shipped it is refused with one error line naming what is missing,
and that is named on the first line too.
"""

import re, signal, subprocess, sys, time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, cli_env, communicate_or_dump, ok, one_error_line, run_cli
from conftest import spawn

CONFIGS = sorted((ROOT / "configs").glob("*.y*ml"))
STEP_DONE = re.compile(r"\bstep[ =]+[1-9]")  # a line about a finished step, in any output format


def needs(path: Path) -> str | None:
    "What the config says it needs on its first line (`# Needs: ...`); None: it runs as shipped."
    first = next((l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()), "")
    m = re.match(r"#\s*Needs:\s*(.+)", first)
    return m.group(1) if m else None


def checkpoint_steps(out: Path) -> list[int]:
    "The steps of the checkpoints under `out`."
    return sorted(int(m[1]) for p in out.rglob("step_*") if (m := re.match(r"step_(\d+)", p.name)))


def test_the_shipped_configs_are_found():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "smoke.yaml", "v2_smoke.yaml", "diloco.yaml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tmp_path):
    "`speedtronic validate` accepts it from any folder and prints it normalised."
    proc = ok(run_cli("validate", "--config", str(path), cwd=tmp_path))
    assert proc.stderr == "" and isinstance(yaml.safe_load(proc.stdout), dict)


def start(path: Path, cwd: Path, timeout: float = 600) -> tuple[int, str, list[int]]:
    """Train `path` as shipped from `cwd` (output under `cwd/out`) until it ends or has finished a
    step, then press Ctrl-C; (exit status, output, the steps of its checkpoints)."""
    out_file = cwd / "output.txt"
    with open(out_file, "w") as sink:
        proc = spawn(
            [sys.executable, "-m", "speedtronic", "train", "--config", str(path)]
            + ["--device", "cpu", "--output-dir", str(cwd / "out")],
            cwd=cwd,
            env=cli_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if STEP_DONE.search(out_file.read_text(errors="replace")):
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.5)
        communicate_or_dump(proc, max(deadline - time.monotonic(), 60))
    return proc.returncode, out_file.read_text(errors="replace"), checkpoint_steps(cwd / "out")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_runs_or_says_what_it_needs(path, tmp_path):
    """Started from an empty folder, a config trains a step; or its first line names what it needs
    and the refusal names it too."""
    said = needs(path)
    if said is None:
        code, output, steps = start(path, tmp_path)
        assert "Traceback" not in output, output[-3000:]
        # 130: the CLI caught the Ctrl-C; -SIGINT: it came after the run had ended, while Python
        # was shutting down with the default handler back (a shell shows both as 130)
        assert code in (0, 130, -signal.SIGINT), (code, output[-3000:])
        assert code != -signal.SIGINT or "completed steps=" in output, output[-3000:]
        assert steps and steps[-1] >= 1, (code, steps, output[-3000:])
    else:
        line = one_error_line(
            run_cli("train", "--config", str(path), "--device", "cpu", cwd=tmp_path)
        )
        missing = re.search(r"file not found: (\S+)", line)
        assert missing and missing[1] in said, (line, said)
