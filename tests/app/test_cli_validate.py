"""`speedtronic validate` and CLI error handling in real subprocesses (spec §2.2, §2.3, §15.3,
§15.8)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from speedtronic.cli import CHECKED
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
SPEC_13 = [
    ROOT / "configs" / "smoke.yaml",
    ROOT / "configs" / "v2_smoke.yaml",
    ROOT / "configs" / "diloco.yaml",
    ROOT / "examples" / "diloco_master.yaml",
]
SHIPPED = sorted(
    [
        *(ROOT / "configs").glob("*.y*ml"),
        *(ROOT / "configs").glob("*.json"),
        *(ROOT / "examples").glob("*.y*ml"),
        *(ROOT / "examples").glob("*.json"),
    ]
)
HF_SECRET = "hf_ENVIRONMENT_SECRET_value_123"
FILE_SECRET = "hf_FILE_SECRET_value_456"
WANDB_SECRET = "wb_FILE_SECRET_value_789"
CONSOLE = Path(sys.executable).parent / "speedtronic"
VERDICT = re.compile(  # the last line of `validate --deep` on a config that can run
    r"ok: this config can run: (\S+) parameters, (\S+) tokens per step, "
    r"~(\S+ (?:ms|s|min|h)) per step on this machine"
)


def _env() -> dict[str, str]:
    # PYTHONPATH makes the checkout importable even where the editable install predates the package
    # files.
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_TOKEN": HF_SECRET, "PYTHONUNBUFFERED": "1"}


def _entry_points() -> list[list[str]]:
    points = [[sys.executable, "-m", "speedtronic"]]
    if CONSOLE.exists():
        points.append([str(CONSOLE)])
    return points


ENTRY_IDS = ["module", "console"][: len(_entry_points())]


def cli(
    *args: str, entry: list[str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return run_command(
        [*(entry or _entry_points()[0]), *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_clean_error(
    proc: subprocess.CompletedProcess, *needles: str, lines: int | None = 1
) -> list[str]:
    """Exit 2, no traceback, only `speedtronic: error:` lines on stderr, each needle present, no
    secret."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = proc.stderr.splitlines()
    assert errors and all(line.startswith("speedtronic: error: ") for line in errors), proc.stderr
    if lines is not None:
        assert len(errors) == lines, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    assert_no_secret(proc)
    return errors


def assert_no_secret(proc: subprocess.CompletedProcess):
    for secret in (HF_SECRET, FILE_SECRET, WANDB_SECRET):
        assert secret not in proc.stdout and secret not in proc.stderr, secret


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def secret_config(tmp_path) -> Path:
    return write(
        tmp_path,
        "secret.yaml",
        f"""
name: secretive
max_steps: 8
distributed:
  token: {FILE_SECRET}
logging:
  wandb: {{project: demo, mode: offline, api_key: {WANDB_SECRET}}}
""",
    )


@pytest.mark.parametrize("entry", _entry_points(), ids=ENTRY_IDS)
def test_good_config_prints_normalised_yaml(entry, tmp_path):
    proc = cli("validate", "--config", str(ROOT / "configs" / "smoke.yaml"), entry=entry)
    assert (proc.returncode, proc.stderr) == (0, "")
    data = yaml.safe_load(proc.stdout)
    assert list(data)[:3] == ["run", "model", "data"]
    assert (
        data["run"]["name"],
        data["scheduler"]["max_steps"],
        data["scheduler"]["warmup_steps"],
    ) == ("smoke", 4, 1)
    assert data["model"]["n_kv_head"] == 2 and data["data"]["block_size"] == 32


def test_every_shipped_config_is_checked():
    names = {p.relative_to(ROOT).as_posix() for p in SHIPPED}
    assert {
        "configs/demo.yaml",
        "examples/diloco_local_worker.yaml",
        "examples/diloco_local_master.yaml",
    } <= names
    assert len(names) >= 7, names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_config_validates(path):
    proc = cli("validate", "--config", str(path))
    assert (proc.returncode, proc.stderr) == (0, "")
    data = yaml.safe_load(proc.stdout)
    # the schedule the run will use
    assert data["scheduler"]["warmup_steps"] <= data["scheduler"]["max_steps"]
    # what is read
    assert data["data"]["synthetic"] is False or not (
        data["data"]["text_path"] or data["data"]["token_file"]
    )


def test_shipped_configs_match_spec_13():
    smoke, v2, diloco, master = (
        yaml.safe_load(cli("validate", "--config", str(p)).stdout) for p in SPEC_13
    )
    assert (
        smoke["run"]["max_steps"],
        smoke["optimizer"]["lr"],
        smoke["checkpoint"]["every_steps"],
    ) == (4, 3e-4, 2)
    assert (
        v2["scheduler"]["max_steps"],
        v2["scheduler"]["warmup_steps"],
        v2["optimizer"]["name"],
    ) == (2, 0, "muon")
    assert (v2["ooo_backprop"], v2["ooo_streams"], v2["optimizer"]["muon_plus"]) == (True, 2, True)
    assert (diloco["compile"], diloco["gradient_checkpointing"], diloco["data"]["text_path"]) == (
        True,
        True,
        "data/train.txt",
    )
    assert (
        master["distributed"]["enabled"],
        master["distributed"]["role"],
        master["distributed"]["token"],
    ) == (True, "master", None)


@pytest.mark.parametrize("entry", _entry_points(), ids=ENTRY_IDS)
def test_secrets_never_printed(entry, secret_config):
    for fmt in ("yaml", "json"):
        proc = cli("validate", "--config", str(secret_config), "--format", fmt, entry=entry)
        assert proc.returncode == 0, proc.stderr
        assert_no_secret(proc)
        data = yaml.safe_load(proc.stdout)  # JSON is YAML too
        assert data["distributed"]["token"] == "<redacted>"
        assert data["logging"]["wandb"] == {
            "project": "demo",
            "mode": "offline",
            "api_key": "<redacted>",
        }


def test_secret_in_a_bad_config_is_not_echoed(tmp_path):
    bad = write(tmp_path, "bad.yaml", f"distributed:\n  token: [{FILE_SECRET}\n  repo_id: x\n")
    assert_clean_error(cli("validate", "--config", str(bad)), "invalid YAML at line")
    mistyped = write(tmp_path, "mistyped.yaml", f"distributed:\n  token: [{FILE_SECRET}]\n")
    assert_clean_error(
        cli("validate", "--config", str(mistyped)), "distributed.token: expected a string or null"
    )


def test_save_redacts_and_round_trips(secret_config, tmp_path):
    code = (
        "import sys; from speedtronic.config import load_config\n"
        "cfg = load_config(sys.argv[1])\n"
        "for name in sys.argv[2:]: cfg.save(name)\n"
    )
    outs = [tmp_path / "saved.yaml", tmp_path / "saved.json", tmp_path / "nested" / "saved.cfg"]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(secret_config), *map(str, outs)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for out in outs:
        text = out.read_text()
        assert FILE_SECRET not in text and WANDB_SECRET not in text and HF_SECRET not in text
        again = cli("validate", "--config", str(out), "--format", "json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["run"]["name"] == "secretive"


def test_json_and_yaml_outputs_round_trip(tmp_path):
    first = cli("validate", "--config", str(ROOT / "configs" / "v2_smoke.yaml"), "--format", "json")
    as_json = write(tmp_path, "v2.json", first.stdout)
    second = cli("validate", "--config", str(as_json), "--format", "yaml")
    as_yaml = write(tmp_path, "v2.yaml", second.stdout)
    third = cli("validate", "--config", str(as_yaml), "--format", "json")
    assert first.returncode == second.returncode == third.returncode == 0
    assert json.loads(first.stdout) == json.loads(third.stdout) == yaml.safe_load(second.stdout)


@pytest.mark.parametrize("entry", _entry_points(), ids=ENTRY_IDS)
def test_typo_is_one_line_with_a_suggestion(entry, tmp_path):
    typo = write(tmp_path, "typo.yaml", "data:\n  micro_batchsize: 2\n")
    assert_clean_error(
        cli("validate", "--config", str(typo), entry=entry),
        "speedtronic: error: data.micro_batchsize: unknown key (did you mean "
        "data.micro_batch_size?)",
    )


def test_every_problem_is_reported_at_once(tmp_path):
    bad = write(
        tmp_path,
        "many.yaml",
        "compile: 'false'\nrun: {max_steps: 0}\nmodel: {n_head: 8, n_kv_head: 3}\n"
        "optimizer: {lr: fast}\ndata: {micro_batch_size: 2.5}\n",
    )
    errors = assert_clean_error(cli("validate", "--config", str(bad)), lines=5)
    for needle in (
        "compile: expected true or false",
        "run.max_steps: must be positive",
        "model.n_kv_head: must divide",
        "optimizer.lr: expected a number",
        "data.micro_batch_size: expected an integer",
    ):
        assert any(needle in e for e in errors), (needle, errors)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("run:\n  name: [x\n", "invalid YAML at line 3, column 1"),
        ("run: {max_steps: true}\n", "run.max_steps: expected an integer, got true"),
        ("gradient_checkpointing: 'false'\n", "gradient_checkpointing: expected true or false"),
        ("data: [1, 2]\n", "data: must be a mapping, got a list"),
        ("- just\n- a list\n", "configuration root must be a mapping"),
        (
            "scheduler: {warmup_steps: 100}\nmax_steps: 50\n",
            "set scheduler.warmup_steps to at most 50",
        ),
        ("model: {d_model: 72, n_head: 8}\n", "must be even for RoPE"),
        ("distributed: {enabled: true}\n", "distributed.repo_id: is required"),
    ],
)
def test_bad_values_are_one_line(tmp_path, text, needle):
    assert_clean_error(cli("validate", "--config", str(write(tmp_path, "bad.yaml", text))), needle)


def test_bad_json_names_line_and_column(tmp_path):
    bad = write(tmp_path, "bad.json", '{\n  "run": {"name": "x",}\n}\n')
    assert_clean_error(
        cli("validate", "--config", str(bad)), f"{bad}: invalid JSON at line 2, column 23"
    )


def test_missing_file_and_directory(tmp_path):
    assert_clean_error(
        cli("validate", "--config", str(tmp_path / "nope.yaml")),
        "config file not found",
        "nope.yaml",
    )
    assert_clean_error(cli("validate", "--config", str(tmp_path)), "is a directory")
    assert_clean_error(
        cli("train", "--config", str(tmp_path / "nope.yaml")), "config file not found"
    )


def test_usage_errors_exit_2(tmp_path):
    assert cli().returncode == 2
    for bad in ("0", "-3", "two"):
        proc = cli("train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--max-steps", bad)
        assert (
            proc.returncode == 2
            and "positive integer" in proc.stderr
            and "Traceback" not in proc.stderr
        )
    assert cli("validate", "--config", "x.yaml", "--format", "toml").returncode == 2
    assert cli("--help").returncode == 0 and cli("validate", "--help").returncode == 0


def test_validate_and_import_load_no_torch():
    probe = (
        "import sys, runpy\n"
        "import speedtronic.cli\n"
        "assert 'torch' not in sys.modules, 'import speedtronic.cli loaded torch'\n"
        "sys.argv = ['speedtronic', 'validate', '--config', 'configs/diloco.yaml', '--format', "
        "'json']\n"
        "try: runpy.run_module('speedtronic', run_name='__main__')\n"
        "except SystemExit as e: assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'validate loaded torch'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-c", "import speedtronic.cli, sys; assert 'torch' not in sys.modules"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_train_config_errors_stop_before_the_runtime(tmp_path):
    bad = write(tmp_path, "bad.yaml", "optimizer: {name: adamx}\n")
    assert_clean_error(
        cli("train", "--config", str(bad), "--device", "cpu"),
        "optimizer.name",
        "did you mean adamw?",
    )
    warm = write(tmp_path, "warm.yaml", "max_steps: 100\nscheduler: {warmup_steps: 10}\n")
    assert_clean_error(
        cli(
            "train",
            "--config",
            str(warm),
            "--max-steps",
            "5",
            "--output-dir",
            str(tmp_path / "out"),
        ),
        "scheduler.warmup_steps: 10 is longer than the schedule horizon of 5 steps",
    )
    assert not (tmp_path / "out").exists()


def test_a_warmup_as_long_as_the_schedule_is_accepted(tmp_path):
    for text in (
        "max_steps: 1\nscheduler: {warmup_steps: 1}\n",
        "scheduler: {warmup_steps: 1, max_steps: 1}\n",
    ):
        proc = cli("validate", "--config", str(write(tmp_path, "equal.yaml", text)))
        assert proc.returncode == 0, proc.stderr
        assert yaml.safe_load(proc.stdout)["scheduler"]["warmup_steps"] == 1


def test_deep_validation_uses_the_runtime(tmp_path):
    ok = cli(
        "validate", "--config", str(ROOT / "configs" / "smoke.yaml"), "--deep", "--device", "cpu"
    )
    # what was checked, then the verdict, and nothing else
    assert (ok.returncode, ok.stderr.splitlines()[:-1]) == (
        0,
        [f"speedtronic: {ROOT / 'configs' / 'smoke.yaml'}: {CHECKED}"],
    ), ok.stderr
    assert VERDICT.fullmatch(ok.stderr.splitlines()[-1]), ok.stderr
    missing = write(tmp_path, "missing.yaml", f"data: {{text_path: {tmp_path / 'nowhere.txt'}}}\n")
    proc = cli("validate", "--config", str(missing), "--deep", "--device", "cpu")
    assert_clean_error(proc, "nowhere.txt", lines=None)
    assert proc.stdout.startswith("run:")


def test_deep_validation_ends_with_the_numbers_of_the_run(tmp_path):
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.progress import format_rate
    from speedtronic.registry import build_model

    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    demo["run"]["output_dir"] = str(tmp_path / "out")
    demo["data"]["text_path"] = str(tmp_path / "out" / "stdlib_docs.txt")  # the demo corpus
    demo["logging"]["json_file"] = str(tmp_path / "out" / "metrics.jsonl")
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(demo))
    proc = cli("validate", "--config", str(path), "--deep", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.splitlines()[-1]
    found = VERDICT.fullmatch(last)
    assert found and len(last) <= 100, proc.stderr
    config = SpeedtronicConfig.load(path)
    real = sum(p.numel() for p in build_model(config.model).parameters())
    d = config.data
    assert found.group(1, 2) == (format_rate(real), format_rate(d.target_batch_size * d.block_size))
    assert not (tmp_path / "out").exists()  # no corpus, checkpoint or metrics file written
    accumulating = tmp_path / "accumulating.yaml"
    demo["data"]["target_batch_size"] = 128  # four micro-batches per step
    accumulating.write_text(yaml.safe_dump(demo))
    proc = cli("validate", "--config", str(accumulating), "--deep", "--device", "cpu")
    assert VERDICT.fullmatch(proc.stderr.splitlines()[-1]).group(2) == format_rate(128 * 64)


def test_deep_validation_says_why_a_step_was_not_timed(tmp_path):
    big = write(
        tmp_path,
        "big.yaml",
        "model: {vocab_size: 256, max_seq_len: 1024, d_model: 512, n_layer: 8, n_head: 8, "
        "n_kv_head: 8, d_ff: 2048}\n"
        "data: {synthetic: true, block_size: 1024, micro_batch_size: 16, target_batch_size: 16}\n"
        f"run: {{output_dir: {tmp_path / 'out'}}}\n",
    )
    proc = cli("validate", "--config", str(big), "--deep", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"ok: this config can run: \S+ parameters, 16.4k tokens per step; time per step not "
        r"measured: a micro-batch is ~\S+ operations, over 2e\+11 on cpu",
        last,
    ), proc.stderr
    assert not (tmp_path / "out").exists()


def test_deep_validation_refuses_a_model_that_cannot_fit_in_memory(tmp_path):
    huge = write(
        tmp_path,
        "huge.yaml",
        "model: {vocab_size: 50000000, d_model: 4096, n_head: 8, n_kv_head: 8}\n"
        f"run: {{output_dir: {tmp_path / 'out'}}}\n",
    )
    line = assert_clean_error(
        cli("validate", "--config", str(huge), "--deep", "--device", "cpu"), "parameters"
    )[0]
    assert "GiB for weights, gradients and adamw state" in line and "GiB available" in line, line
    assert "model.vocab_size 50000000" in line
    assert_clean_error(cli("train", "--config", str(huge), "--device", "cpu"), "GiB available")
    assert not (tmp_path / "out").exists()  # refused before the run's directory was made


def test_train_finds_what_it_can_before_creating_the_run_directory(tmp_path):
    out = tmp_path / "out"
    late = write(
        tmp_path,
        "late.yaml",
        f"run: {{output_dir: {out}}}\nmodel: {{max_seq_len: 16}}\ndata: {{block_size: 32, "
        f"synthetic: true}}\n",
    )
    assert_clean_error(
        cli("train", "--config", str(late), "--device", "cpu"),
        "data.block_size (32) is larger than model.max_seq_len (16)",
    )
    assert not out.exists()  # nothing created for a run that could not start


def test_random_tokens_not_asked_for_come_with_one_warning(tmp_path):
    base = (
        f"run: {{output_dir: {tmp_path / 'out'}, max_steps: 1}}\n"
        "model: {vocab_size: 64, max_seq_len: 16, n_layer: 1, n_head: 2, n_kv_head: 2, d_model: "
        "32, d_ff: 64}\n"
        "checkpoint: {enabled: false}\nlogging: {progress: false, loss_plot: false}\n"
    )
    quiet = cli(
        "train",
        "--config",
        str(write(tmp_path, "asked.yaml", base + "data: {synthetic: true, num_tokens: 8}\n")),
        "--device",
        "cpu",
    )
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
    noisy = cli(
        "train",
        "--config",
        str(write(tmp_path, "unasked.yaml", base + "data: {num_tokens: 8}\n")),
        "--device",
        "cpu",
    )
    warnings_ = [l for l in noisy.stderr.splitlines() if l.startswith("speedtronic: warning:")]
    assert noisy.returncode == 0 and len(warnings_) == 1, noisy.stderr
    assert "no data source is set" in warnings_[0] and "data.synthetic: true" in warnings_[0]
    shown = yaml.safe_load(
        cli(
            "validate", "--config", str(write(tmp_path, "text.yaml", "data: {text_path: a.txt}\n"))
        ).stdout
    )
    assert shown["data"]["synthetic"] is False  # the printed config says what is read
