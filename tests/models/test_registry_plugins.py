"""Custom models outside the training process: entry points of installed packages and
`model.imports`.

Every test runs a fresh interpreter (the registry is process-local). Plugins are real files: a
module plus a `*.dist-info` folder with `METADATA` and `entry_points.txt`, found through
`PYTHONPATH` exactly as an installed distribution would be (no pip needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import one_error_line, run_python  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

PLUGIN_MODULE = """
import torch
from torch import nn

class TinyLM(nn.Module):
    "A bag-of-embeddings language model: enough to train."
    def __init__(self, vocab_size=64, d_model=16, **_):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)
        self.head = nn.Linear(d_model, vocab_size)
    def forward(self, input_ids, labels=None, **_):
        logits = self.head(self.emb(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return out

def tiny_factory(**kwargs):
    return TinyLM(**kwargs)
"""

REGISTERING_MODULE = """
from speedtronic.registry import register_model
from demo_plugin_models import TinyLM

@register_model("plugin_by_module")
def by_module(**kwargs):
    return TinyLM(**kwargs)
"""


def make_distribution(root: Path, entry_points: str) -> Path:
    "Write the plugin modules and a dist-info folder declaring `entry_points` under `root`."
    root.mkdir(parents=True, exist_ok=True)
    (root / "demo_plugin_models.py").write_text(PLUGIN_MODULE)
    (root / "demo_plugin_registering.py").write_text(REGISTERING_MODULE)
    info = root / "demo_speedtronic_plugin-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: demo-speedtronic-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return root


ENTRY_POINTS = """
    [speedtronic.models]
    plugin_tiny = demo_plugin_models:tiny_factory
    plugin_by_module = demo_plugin_registering
    plugin_broken = demo_plugin_missing_module:factory
    plugin_silent = demo_plugin_models
"""


@pytest.fixture()
def plugin_dir(tmp_path: Path) -> Path:
    return make_distribution(tmp_path / "site", ENTRY_POINTS)


def test_entry_point_factory_is_found_lazily(plugin_dir):
    code = textwrap.dedent("""
        import sys
        from speedtronic.registry import build_model, registry
        assert "demo_plugin_models" not in sys.modules          # nothing loaded before the lookup
        assert "plugin_tiny" in registry.names()
        m = build_model({"name": "plugin_tiny", "vocab_size": 32, "d_model": 8})
        print(type(m).__name__, tuple(m.emb.weight.shape))
    """)
    out = run_python(code, paths=[plugin_dir])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TinyLM", "(32,", "8)"]


def test_entry_point_module_registers_its_models(plugin_dir):
    code = textwrap.dedent("""
        from speedtronic.registry import build_model, ModelRegistry
        print(type(build_model({"name": "plugin_by_module", "d_model": 4, "n_head": 2})).__name__)
        # a fresh registry finds it too
        print(type(ModelRegistry().build("plugin_by_module")).__name__)
    """)
    out = run_python(code, paths=[plugin_dir])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TinyLM", "TinyLM"]


def test_entry_points_can_be_switched_off(plugin_dir):
    code = textwrap.dedent("""
        from speedtronic.registry import ModelRegistry
        r = ModelRegistry(entry_points=False)
        print(",".join(r.names()))
        try: r.get("plugin_tiny")
        except KeyError as e: print("KeyError", e)
    """)
    out = run_python(code, paths=[plugin_dir])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "gpt,reference_transformer"
    assert lines[1].startswith(
        "KeyError unknown model 'plugin_tiny'; registered models: gpt, reference_transformer"
    )


def test_broken_entry_point_names_itself(plugin_dir):
    code = textwrap.dedent("""
        from speedtronic.registry import build_model
        for name in ("plugin_broken", "plugin_silent"):
            try: build_model({"name": name})
            except Exception as e: print(type(e).__name__, "|", e)
    """)
    out = run_python(code, paths=[plugin_dir])
    assert out.returncode == 0, out.stderr
    broken, silent = out.stdout.splitlines()
    assert broken.startswith("ImportError |") and "demo_plugin_missing_module:factory" in broken
    assert "demo-speedtronic-plugin" in broken
    assert "did not call register_model('plugin_silent'" in silent


def test_unknown_name_lists_installed_plugins(plugin_dir):
    code = textwrap.dedent("""
        from speedtronic.registry import build_model
        try: build_model({"name": "nope"})
        except KeyError as e: print(e)
    """)
    out = run_python(code, paths=[plugin_dir])
    assert out.returncode == 0, out.stderr
    assert (
        "registered models: gpt, plugin_broken, plugin_by_module, plugin_silent, plugin_tiny, "
        "reference_transformer" in out.stdout
    )
    assert "model.imports" in out.stdout


USER_MODELS = (
    PLUGIN_MODULE
    + """
from speedtronic.registry import register_model
register_model("user_tiny", tiny_factory)
"""
)


def write_config(path: Path, model_name: str, imports: list[str], output_dir: Path) -> Path:
    "A smoke-sized run with a custom model."
    path.write_text(
        textwrap.dedent(f'''
        run: {{name: plugin, seed: 1, max_steps: 2, output_dir: "{output_dir}"}}
        model: {{name: {model_name}, imports: {imports}, vocab_size: 64, max_seq_len: 16,
                 d_model: 16, n_head: 2, n_layer: 1}}
        data: {{synthetic: true, num_tokens: 16, block_size: 16, micro_batch_size: 2,
               target_batch_size: 2, num_workers: 0}}
        checkpoint: {{enabled: false}}
        precision: fp32
    ''')
    )
    return path


def test_model_imports_from_yaml_in_a_script(tmp_path):
    # A script elsewhere on disk: the current directory is not on sys.path, as with the
    # `speedtronic`
    # console script; `import_model_modules` still finds `user_models.py` in the current directory
    # (the rule is the working directory, not the config's folder: here they are the same).
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    cfg = write_config(tmp_path / "run.yaml", "user_tiny", ["user_models"], tmp_path / "out")
    script = tmp_path / "elsewhere" / "build.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(f"""
        import sys
        assert {str(tmp_path)!r} not in sys.path
        from speedtronic.config import load_config
        from speedtronic.registry import build_model
        print(type(build_model(load_config({str(cfg)!r}).model)).__name__)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TinyLM"


def speedtronic_cli() -> list[str]:
    exe = Path(sys.executable).with_name("speedtronic")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "speedtronic"]


def test_cli_trains_a_custom_model_named_in_yaml(tmp_path):
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    cfg = write_config(tmp_path / "run.yaml", "user_tiny", ["user_models"], tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*speedtronic_cli(), "train", "--config", str(cfg), "--device", "cpu", "--verbose"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("completed steps=2 ")
    # (--verbose: train_start's fields are printed) the model trained is the user's: 64x16
    # embedding + 16x64 head with bias (the reference model would be far larger)
    assert "parameters=2112 " in out.stdout + out.stderr, out.stderr[-3000:]


def test_cli_reports_a_missing_model_module(tmp_path):
    cfg = write_config(
        tmp_path / "run.yaml", "user_tiny", ["no_such_user_models"], tmp_path / "out"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*speedtronic_cli(), "train", "--config", str(cfg), "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    one_error_line(out, "model.imports", "'no_such_user_models'", "PYTHONPATH")
