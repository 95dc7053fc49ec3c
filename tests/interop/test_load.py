"""`speedtronic.load` picks a trained model up in one line: a run, a checkpoint, a DiLoCo global, an
exported transformers folder; `generate`/`export` read a DiLoCo global; `model.init_from` takes the
architecture from the folder; `speedtronic[hf]` brings transformers.

Every model here was trained by real `speedtronic train` processes (a DiLoCo master and worker over
a shared directory for the global), or written by Speedtronic 2.0 (the shared fixtures).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, V2_FIXTURES, cli_env, needs_v2_fixtures, ok, one_error_line, run_cli
from test_diloco import run_nodes
from test_generate import trained_run

import speedtronic
from speedtronic.generation import generate
from speedtronic.hf import load_trained

FIXTURES = V2_FIXTURES
GREEDY = dict(max_new_tokens=12, temperature=0)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("load"))


def test_a_run_its_checkpoint_and_its_export_load_in_one_line(run_dir, tmp_path):
    reference = load_trained(run_dir)
    run = speedtronic.load(run_dir)
    checkpoint = speedtronic.load(reference.checkpoint)
    assert not run.model.training and same_weights(run.model, reference.model)
    assert checkpoint.checkpoint == reference.checkpoint and same_weights(
        checkpoint.model, run.model
    )
    text = generate(reference.model, reference.tokenizer, "the qu", **GREEDY)
    assert run.generate("the qu", **GREEDY) == text and len(text) == 12
    sampled = dict(max_new_tokens=20, temperature=0.8, top_k=5, seed=3)
    assert run.generate("fox", **sampled) == generate(run.model, run.tokenizer, "fox", **sampled)

    ok(run_cli("export", "--run", str(run_dir), "--to", str(tmp_path / "hf"), cwd=tmp_path))
    exported = speedtronic.load(tmp_path / "hf")
    assert not exported.model.training and repr(exported.tokenizer) == repr(run.tokenizer)
    ids = torch.tensor([list(b"the quick brown")])
    with torch.no_grad():
        assert torch.allclose(
            exported.model(ids)["logits"], run.model(ids)["logits"], atol=1e-5, rtol=0
        )
    assert exported.generate("the qu", **GREEDY) == text


def test_a_path_that_holds_no_model_is_one_clear_error(tmp_path):
    with pytest.raises(Exception, match="does not exist; give a run folder") as e:
        speedtronic.load(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(Exception, match="not a DiLoCo repository"):
        speedtronic.load(tmp_path / "notes")
    proc = run_cli(
        "generate", "--checkpoint", str(tmp_path / "notes"), "--prompt", "x", cwd=tmp_path
    )
    one_error_line(proc, str(tmp_path / "notes"), "transformers folder")


@pytest.fixture(scope="module")
def diloco(tmp_path_factory):
    "A master and a worker trained 10 steps (rounds of 5) through a shared directory."
    tmp = tmp_path_factory.mktemp("diloco")
    run_nodes(tmp, repo=str(tmp / "repo"), transport="directory", names=("master", "w1"), steps=10)
    return tmp


def test_a_diloco_global_loads_generates_and_exports(diloco, tmp_path):
    final = diloco / "repo" / "global" / "latest.safetensors"
    master = load_trained(diloco / "master")  # its final checkpoint holds the final global model
    for where in (final, diloco / "repo", diloco):
        model = speedtronic.load(where)
        assert model.checkpoint == final and same_weights(model.model, master.model)
        assert model.config.model.d_model == 16 and not model.model.training
    assert same_weights(load_trained(checkpoint=final).model, master.model)
    prompt = "\x01\x02\x03"  # byte ids inside the tiny model's 64-token vocabulary
    text = generate(master.model, master.tokenizer, prompt, **GREEDY)
    assert model.generate(prompt, **GREEDY) == text

    args = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    out = ok(run_cli("generate", "--checkpoint", str(final), *args, cwd=tmp_path)).stdout
    assert out == prompt + text + "\n"
    ok(run_cli("export", "--checkpoint", str(final), "--to", str(tmp_path / "hf"), cwd=tmp_path))
    assert same_weights(speedtronic.load(tmp_path / "hf").model, master.model)

    alone = tmp_path / "copied" / "global"  # the repository copied away from the nodes' run folders
    alone.mkdir(parents=True)
    shutil.copy(final, alone / "latest.safetensors")
    proc = run_cli(
        "generate", "--checkpoint", str(alone / "latest.safetensors"), *args, cwd=tmp_path
    )
    one_error_line(proc, str(alone / "latest.safetensors"), "--config NODE.yaml")
    assert proc.stdout == ""
    given = ["--config", str(diloco / "w1.yaml")]
    again = run_cli(
        "generate", "--checkpoint", str(alone / "latest.safetensors"), *given, *args, cwd=tmp_path
    )
    assert ok(again).stdout == out


@needs_v2_fixtures
def test_the_global_of_a_2_0_diloco_repository_loads_with_its_nodes_config(tmp_path):
    repo = FIXTURES / "diloco-repo"
    final = repo / "global" / "latest.safetensors"
    with pytest.raises(Exception, match="pass the config of a node of that run"):
        speedtronic.load(final)
    model = speedtronic.load(final, config=repo / "master-config.json")
    assert model.config.model.n_layer == 2 and len(model.generate("def ", **GREEDY)) == 12
    proc = run_cli(
        "generate",
        "--checkpoint",
        str(final),
        "--config",
        str(repo / "master-config.json"),
        "--prompt",
        "def ",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        cwd=tmp_path,
    )
    assert ok(proc).stdout == "def " + model.generate("def ", **GREEDY) + "\n"


def init_from_config(tmp: Path, folder: Path, **model) -> Path:
    "A run that starts from `folder` with a model section holding only `init_from` and `model`."
    (tmp / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    raw = {
        "run": {"seed": 3, "max_steps": 2, "output_dir": str(tmp / "out")},
        "model": {"init_from": str(folder), **model},
        "data": {
            "text_path": str(tmp / "text.txt"),
            "synthetic": False,
            "micro_batch_size": 2,
            "target_batch_size": 2,
        },
        "precision": "fp32",
        "checkpoint": {"every_steps": 2},
        "logging": {"progress": False, "loss_plot": False},
    }
    path = tmp / "init.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_init_from_takes_the_architecture_from_the_folder(run_dir, tmp_path):
    from speedtronic.runtime import build_runtime, close_logger

    folder = tmp_path / "hf"
    ok(run_cli("export", "--run", str(run_dir), "--to", str(folder), cwd=tmp_path))
    exported = speedtronic.load(folder)
    config = yaml.safe_load(init_from_config(tmp_path, folder).read_text())
    trainer, _ = build_runtime(config, device="cpu")
    try:
        assert same_weights(trainer.model, exported.model)
        m, want = trainer.config.model, exported.config.model
        got = [(m.vocab_size, m.d_model, m.n_layer, m.n_head, m.n_kv_head, m.d_ff)]
        assert got == [(256, 32, 1, 4, 2, want.d_ff)]
    finally:
        close_logger(trainer.logger)
        trainer.run_claim.release()
    (tmp_path / "cli").mkdir()
    cfg = init_from_config(tmp_path / "cli", folder)
    ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path))
    trained = speedtronic.load(tmp_path / "cli" / "out")
    assert trained.step == 2 and trained.config.model.d_model == 32


@pytest.mark.parametrize(
    "setting, needles",
    [
        ({"d_model": 64}, ["model.d_model: 64 in the config", "hidden_size is 32"]),
        ({"d_ff": 1024}, ["model.d_ff: 1024", "SwiGLU width of 684", "intermediate_size is"]),
    ],
)
def test_init_from_refuses_only_a_set_value_that_differs(run_dir, tmp_path, setting, needles):
    folder = tmp_path / "hf"
    ok(run_cli("export", "--run", str(run_dir), "--to", str(folder), cwd=tmp_path))
    cfg = init_from_config(tmp_path, folder, n_layer=1, **setting)
    proc = run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path)
    line = one_error_line(proc, *needles, str(folder / "config.json"))
    assert "model.n_layer" not in line and not (tmp_path / "out").exists()


def test_the_hf_extra_brings_transformers_and_export_names_it(run_dir, tmp_path):
    out = tmp_path / "egg"
    out.mkdir()
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    requires = next(out.glob("*.egg-info")).joinpath("requires.txt").read_text()
    assert "[hf]\ntransformers" in requires, requires
    assert 'elif [ "${1:-}" = "hf" ]' in (ROOT / "tools" / "setup.sh").read_text()
    code = (
        "import sys; sys.modules['transformers'] = None; from speedtronic.cli import main; "
        f"sys.exit(main(['export', '--run', {str(run_dir)!r}, '--to', {str(tmp_path / 'hf')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "pip install 'speedtronic[hf]'" in proc.stdout and "bash tools/setup.sh hf" in proc.stdout
    )
    with_it = ok(
        run_cli("export", "--run", str(run_dir), "--to", str(tmp_path / "hf2"), cwd=tmp_path)
    )
    assert "speedtronic[hf]" not in with_it.stdout
