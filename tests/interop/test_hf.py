"""transformers interop end to end: `speedtronic export` folders load in transformers (also in a
process that cannot import speedtronic) and compute our logits; `model.init_from` starts a run from
a Llama folder.

Every comparison is between our reference transformer and the real `transformers` LlamaForCausalLM.
"""

import json
import subprocess
import sys
import importlib.metadata
import re
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from conftest import (
    ROOT,
    V2_FIXTURES,
    bpe_tokenizer_file,
    needs_v2_fixtures,
    ok,
    one_error_line,
    run_cli,
    tiny_config,
)
from speedtronic.generation import generate_ids
from speedtronic.hf import load_trained

transformers = pytest.importorskip("transformers")
FIXTURES = V2_FIXTURES
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
IDS = [list(b"the quick brown"), list(b"jumps over the ")]


def trained_run(tmp: Path, **sections) -> Path:
    """A reference run trained 4 steps by `speedtronic train` on a small text; returns its output
    folder."""
    (tmp / "text.txt").write_text(TEXT)
    model = {
        "vocab_size": 256,
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "max_seq_len": 32,
        **sections.pop("model", {}),
    }
    data = {
        "text_path": str(tmp / "text.txt"),
        "synthetic": False,
        "block_size": 32,
        **sections.pop("data", {}),
    }
    ok(
        run_cli(
            "train",
            "--config",
            str(tiny_config(tmp, model=model, data=data, **sections)),
            "--device",
            "cpu",
            cwd=tmp,
        )
    )
    return tmp / "out"


def our_answers(model, ids=IDS, new=10) -> tuple[torch.Tensor, list[list[int]]]:
    "Our logits for `ids` and greedy continuations of each row."
    with torch.no_grad():
        logits = model(torch.tensor(ids))["logits"]
    return logits, [
        list(generate_ids(model, row, max_new_tokens=new, temperature=0)) for row in ids
    ]


HF_SIDE = """
import json, sys
for name in ("speedtronic", "fastcore", "nbdev"):
    try: module = __import__(name)
    except ModuleNotFoundError: continue
    raise SystemExit(f"{name} is importable here: {module.__file__}")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor(ids)).logits
    greedy = [
        model.generate(torch.tensor([row]), max_new_tokens=new, do_sample=False)[0, len(row) :]
        for row in ids
    ]
    greedy = [row.tolist() for row in greedy]
tokenizer = AutoTokenizer.from_pretrained(folder)
print(json.dumps({"class": type(model).__name__, "logits": logits.tolist(), "greedy": greedy,
                  "encoded": tokenizer("the lazy dog")["input_ids"]}))
"""


def only_torch_and_transformers(folder: Path) -> Path:
    """`folder` holding links to torch, transformers and what they require (their metadata too): a
    Python environment of those alone."""
    seen, todo = set(), ["torch", "transformers"]
    while todo:
        name = todo.pop()
        if (key := re.sub(r"[-_.]+", "-", name).lower()) in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(name)
        todo += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(dist.locate_file(top))
    return folder


@pytest.fixture(scope="module")
def hf_env(tmp_path_factory) -> Path:
    return only_torch_and_transformers(tmp_path_factory.mktemp("torch-and-transformers"))


def hf_side(folder: Path, ids=IDS, new=10, *, env: Path) -> dict:
    """What transformers computes from `folder`, in a Python whose only packages are torch,
    transformers and their requirements."""
    # -I -S: no site-packages, no .pth, no PYTHONPATH
    code = f"import sys; sys.path.append({str(env)!r})\n" + HF_SIDE
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(folder), json.dumps(ids), str(new)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("hf"))


def test_an_exported_run_is_a_llama_that_computes_our_logits(run_dir, tmp_path, hf_env):
    out = ok(
        run_cli("export", "--run", str(run_dir), "--to", str(tmp_path / "llama"), cwd=tmp_path)
    ).stdout
    assert out.strip() == f"exported to {tmp_path / 'llama'}"
    assert sorted(p.name for p in (tmp_path / "llama").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert (
        config["num_key_value_heads"],
        config["num_attention_heads"],
        config["tie_word_embeddings"],
    ) == (2, 4, True)
    theirs = hf_side(tmp_path / "llama", env=hf_env)
    logits, greedy = our_answers(load_trained(run_dir).model)
    diff = (logits - torch.tensor(theirs["logits"])).abs().max().item()
    print(f"max |ours - transformers| logit difference: {diff:.2e}")
    assert theirs["class"] == "LlamaForCausalLM"
    assert diff <= 1e-4
    assert theirs["greedy"] == greedy
    assert theirs["encoded"] == list(b"the lazy dog")  # the byte tokenizer's ids


def test_the_environment_transformers_loads_the_export_in_has_only_torch_and_transformers(hf_env):
    """The Python of `hf_side`: torch and transformers import there; speedtronic, fastcore, nbdev,
    pytest and datasets do not."""
    code = (
        f"import sys; sys.path.append({str(hf_env)!r})\nimport importlib.util as u, torch, "
        "transformers\n"
        "print([n for n in ('speedtronic', 'fastcore', 'nbdev', 'pytest', 'datasets') if "
        "u.find_spec(n)])"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=hf_env,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
    assert {"torch", "transformers", "tokenizers", "safetensors"} <= {
        p.name for p in hf_env.iterdir()
    }


def test_untied_heads_and_ordinary_attention_export_too(tmp_path, hf_env):
    # norm_eps far from the default: a config.json that did not carry it would give other logits
    run = trained_run(
        tmp_path, model={"tie_weights": False, "n_kv_head": 4, "rope_base": 500.0, "norm_eps": 0.25}
    )
    ok(
        run_cli(
            "export",
            "--checkpoint",
            str(sorted((run / "checkpoints").glob("step_*.pt"))[-1]),
            "--to",
            str(tmp_path / "llama"),
            cwd=tmp_path,
        )
    )
    theirs = hf_side(tmp_path / "llama", env=hf_env)
    logits, greedy = our_answers(load_trained(run).model)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4
    assert theirs["greedy"] == greedy
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["rms_norm_eps"]) == (False, 0.25)


def test_a_tokenizer_json_run_exports_its_tokenizer(tmp_path, hf_env):
    tok, _ = bpe_tokenizer_file(tmp_path, TEXT)
    run = trained_run(
        tmp_path, model={"vocab_size": 320}, data={"tokenizer": str(tmp_path / "tokenizer.json")}
    )
    ok(run_cli("export", "--run", str(run), "--to", str(tmp_path / "llama"), cwd=tmp_path))
    ids = [tok.encode("the quick brown fox").ids]
    theirs = hf_side(tmp_path / "llama", ids=ids, env=hf_env)
    assert theirs["encoded"] == tok.encode("the lazy dog").ids
    logits, greedy = our_answers(load_trained(run).model, ids=ids)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4
    assert theirs["greedy"] == greedy


CUSTOM_MODEL = """
from speedtronic.model import ReferenceTransformer
from speedtronic.registry import register_model

class Mine(ReferenceTransformer):
    "Looks like the reference transformer, but its forward could be anything."

register_model("mine", lambda **kw: Mine(**kw))
"""


def test_only_the_reference_transformer_is_exported(tmp_path):
    (tmp_path / "mine_models.py").write_text(CUSTOM_MODEL)
    run = trained_run(tmp_path, model={"name": "mine", "imports": ["mine_models"]})
    proc = run_cli("export", "--run", str(run), "--to", str(tmp_path / "llama"), cwd=tmp_path)
    one_error_line(proc, "only the reference transformer", "mine_models.Mine")
    assert not (tmp_path / "llama").exists()
    one_error_line(
        run_cli(
            "export", "--run", str(tmp_path / "nowhere"), "--to", str(tmp_path / "x"), cwd=tmp_path
        ),
        "nowhere",
        "does not exist",
    )


def test_export_onto_a_file_is_one_error_line_and_the_file_is_kept(run_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for to in ("notes.txt", "notes.txt/llama"):
        one_error_line(
            run_cli("export", "--run", str(run_dir), "--to", str(tmp_path / to), cwd=tmp_path),
            "notes.txt is a file, not a folder",
        )
    assert (tmp_path / "notes.txt").read_text() == "mine"


@needs_v2_fixtures
def test_a_checkpoint_written_by_2_0_exports(tmp_path):
    newest = FIXTURES / "checkpoint-adamw" / "run" / "checkpoints" / "step_000000000008.pt"
    proc = ok(
        run_cli(
            "export", "--checkpoint", str(newest), "--to", str(tmp_path / "llama"), cwd=tmp_path
        )
    )
    assert (
        "speedtronic: warning: no tokenizer exported: the byte tokenizer with vocab_size 64"
        in proc.stderr
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "llama", dtype=torch.float32
    ).eval()
    ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
    ours, _ = our_answers(load_trained(checkpoint=newest).model, ids=ids)
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


# -- import: model.init_from -----------------------------------------------------------------------


def llama_folder(folder: Path, *, tied: bool = True, n_kv: int = 2, **settings) -> Path:
    """A random tiny LlamaForCausalLM saved by transformers to `folder` (weights wide enough that
    greedy text varies; norm gains random too)."""
    config = transformers.LlamaConfig(
        **{
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 88,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": n_kv,
            "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500.0,
            "tie_word_embeddings": tied,
            **settings,
        }
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    return folder


def init_config(tmp: Path, folder: Path, *, tied: bool = True, n_kv: int = 2, **model) -> dict:
    "A run whose model section matches `llama_folder` and starts from `folder`."
    (tmp / "text.txt").write_text(TEXT)
    return {
        "run": {"seed": 3, "max_steps": 2, "output_dir": str(tmp / "out")},
        "model": {
            "vocab_size": 256,
            "max_seq_len": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": n_kv,
            "d_model": 32,
            "d_ff": 132,
            "tie_weights": tied,
            "rope_base": 500.0,
            "init_from": str(folder),
            **model,
        },
        "data": {
            "text_path": str(tmp / "text.txt"),
            "synthetic": False,
            "block_size": 32,
            "micro_batch_size": 2,
            "target_batch_size": 2,
        },
        "precision": "fp32",
        "logging": {"progress": False, "loss_plot": False},
    }


@pytest.mark.parametrize(
    "tied, n_kv, eps", [(True, 2, 1e-5), (False, 4, 1e-5), (True, 1, 1e-5), (False, 2, 0.25)]
)
def test_a_run_starts_from_a_llama_folder(tmp_path, tied, n_kv, eps):
    from speedtronic.runtime import build_runtime, close_logger

    folder = llama_folder(tmp_path / "llama", tied=tied, n_kv=n_kv, rms_norm_eps=eps)
    trainer, _ = build_runtime(
        init_config(tmp_path, folder, tied=tied, n_kv=n_kv, norm_eps=eps), device="cpu"
    )
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32
        ).eval()
        ids = torch.tensor(IDS)
        with torch.no_grad():
            diff = (trainer.model.eval()(ids)["logits"] - theirs(ids).logits).abs().max().item()
        assert diff <= 1e-4, diff
        assert (trainer.model.lm_head.weight is trainer.model.transformer.wte.weight) == tied
    finally:
        close_logger(trainer.logger)
        trainer.run_claim.release()


def test_the_cli_trains_from_a_llama_folder_and_exports_it_back(tmp_path, hf_env):
    import yaml

    folder = llama_folder(tmp_path / "llama")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(init_config(tmp_path, folder)))
    ok(run_cli("train", "--config", str(tmp_path / "cfg.yaml"), "--device", "cpu", cwd=tmp_path))
    ok(
        run_cli(
            "export", "--run", str(tmp_path / "out"), "--to", str(tmp_path / "back"), cwd=tmp_path
        )
    )
    theirs = hf_side(tmp_path / "back", env=hf_env)
    logits, greedy = our_answers(load_trained(tmp_path / "out").model)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4 and theirs[
        "greedy"
    ] == greedy
    assert all(len(set(row)) > 3 for row in greedy)  # varied text, not one token repeated
    before = json.loads((folder / "config.json").read_text())
    assert {k: before[k] for k in ("hidden_size", "num_key_value_heads")} == {
        "hidden_size": 32,
        "num_key_value_heads": 2,
    }


@pytest.mark.parametrize(
    "settings, model, needles",
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
            {},
            ["'llama3'", "only default RoPE"],
        ),
        ({"attention_bias": True}, {}, ["attention_bias true"]),
        ({"mlp_bias": True}, {}, ["mlp_bias true"]),
        ({"hidden_act": "gelu"}, {}, ["hidden_act 'gelu'"]),
        ({"head_dim": 16}, {}, ["head_dim 16"]),
        (
            {"rms_norm_eps": 1e-6},
            {"norm_eps": 1e-5},
            ["model.norm_eps: 1e-05 in the config", "rms_norm_eps is 1e-06"],
        ),
        ({"rms_norm_eps": -1.0}, {}, ["rms_norm_eps -1.0 (must be a positive number)"]),
        (
            {"tie_word_embeddings": False},
            {},
            ["model.tie_weights: True in the config", "tie_word_embeddings is False"],
        ),
        ({}, {"tie_weights": False}, ["model.tie_weights: False in the config", "is True"]),
        ({}, {"d_model": 64}, ["model.d_model: 64 in the config", "hidden_size is 32"]),
        ({}, {"d_ff": 256}, ["model.d_ff: 256 in the config", "intermediate_size is 88"]),
    ],
)
def test_what_the_reference_transformer_cannot_compute_is_refused_by_name(
    tmp_path, settings, model, needles
):
    import yaml

    folder = llama_folder(tmp_path / "llama", **settings)
    raw = init_config(tmp_path, folder, **model)
    raw["model"]["init_from"] = str(folder)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    proc = run_cli("train", "--config", str(tmp_path / "cfg.yaml"), "--device", "cpu", cwd=tmp_path)
    one_error_line(proc, "model.init_from", *needles)
    assert not list((tmp_path / "out").glob("**/step_*.pt"))


# -- publishing: --push-to-hub ---------------------------------------------------------------------

TOKEN = "hf_export_write_token_0123456789"
READ_ONLY = "hf_export_read_token_0123456789"


@pytest.fixture
def hub_tokens():
    return {TOKEN: "write", READ_ONLY: "read"}


def test_push_to_hub_uploads_the_export_in_one_commit(run_dir, tmp_path, hub, hf_env):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = ok(
        run_cli(
            "export",
            "--run",
            str(run_dir),
            "--to",
            str(tmp_path / "llama"),
            "--push-to-hub",
            "org/tiny-llama",
            cwd=tmp_path,
            env=env,
        )
    )
    assert TOKEN not in proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"pushed to {hub.url}/org/tiny-llama/commit/")
    repo = hub.repos["org/tiny-llama"]
    assert [c.message for c in repo.commits] == [
        "initial commit",
        "Upload model exported by speedtronic",
    ] and repo.private
    local = {p.name: p.read_bytes() for p in (tmp_path / "llama").iterdir()}
    assert sorted(repo.commits[-1].added) == sorted(local)  # every file in the one upload commit
    assert hub.files("org/tiny-llama") == local
    # what was pushed loads from the Hub with transformers
    from huggingface_hub import snapshot_download

    # at the commit the push printed (the Hub's repo_info may still answer the head before it)
    pushed = proc.stdout.splitlines()[-1].rsplit("/", 1)[1]
    got = snapshot_download(
        "org/tiny-llama",
        endpoint=hub.url,
        token=TOKEN,
        cache_dir=tmp_path / "cache",
        revision=pushed,
    )
    assert hf_side(Path(got), env=hf_env)["greedy"] == our_answers(load_trained(run_dir).model)[1]
    # pushing the same export again finds the repository and leaves it as it is
    ok(
        run_cli(
            "export",
            "--run",
            str(run_dir),
            "--to",
            str(tmp_path / "llama"),
            "--push-to-hub",
            "org/tiny-llama",
            cwd=tmp_path,
            env=env,
        )
    )
    assert len(hub.repos["org/tiny-llama"].commits) == 2 and hub.files("org/tiny-llama") == local


@pytest.mark.parametrize(
    "token, needles",
    [
        (READ_ONLY, ["org/tiny-llama", "HTTP 403", "write access"]),
        ("hf_not_a_known_token_000000", ["org/tiny-llama", "HTTP 401", "HF_TOKEN"]),
    ],
)
def test_a_push_without_write_access_is_one_error_line_without_the_token(
    run_dir, tmp_path, hub, token, needles
):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = run_cli(
        "export",
        "--run",
        str(run_dir),
        "--to",
        str(tmp_path / "llama"),
        "--push-to-hub",
        "org/tiny-llama",
        cwd=tmp_path,
        env=env,
    )
    one_error_line(proc, *needles)
    assert token not in proc.stdout + proc.stderr
    assert (tmp_path / "llama" / "model.safetensors").is_file()  # the export itself is kept
    assert "org/tiny-llama" not in hub.repos


def test_a_resumed_run_reads_its_checkpoint_not_the_llama_folder(tmp_path):
    import shutil, yaml
    from conftest import jsonl_records

    folder = llama_folder(tmp_path / "llama")
    raw = init_config(tmp_path, folder)
    raw["logging"]["json_file"] = str(tmp_path / "metrics.jsonl")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    ok(run_cli("train", "--config", str(tmp_path / "cfg.yaml"), "--device", "cpu", cwd=tmp_path))
    shutil.rmtree(folder)  # not needed any more
    ok(
        run_cli(
            "train",
            "--config",
            str(tmp_path / "cfg.yaml"),
            "--device",
            "cpu",
            "--resume",
            "--max-steps",
            "4",
            cwd=tmp_path,
        )
    )
    assert [r["step"] for r in jsonl_records(tmp_path / "metrics.jsonl")][-2:] == [3, 4]
    fresh = run_cli(
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "new"),
        cwd=tmp_path,
    )
    # a fresh run still needs it, found before it makes its folder
    one_error_line(fresh, "model.init_from", "folder not found")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_torchrun_run_exports_and_generates_from_its_checkpoint(tmp_path, strategy, hf_env):
    """A 2-rank torchrun run (fsdp: sharded step_<N>.dcp folders) exports a Llama folder
    transformers agrees with, and generates."""
    from test_parallel import finish, torchrun, write_config

    cfg = write_config(
        tmp_path,
        "job",
        micro=4,
        data={"synthetic": True, "num_tokens": 400},
        steps=4,
        model={"vocab_size": 256, "n_kv_head": 1, "n_layer": 2},
        parallel={"strategy": strategy},
    )
    finish(torchrun(cfg))
    saved = sorted((tmp_path / "job" / "checkpoints").glob("step_*"))
    assert saved and all(p.suffix == (".dcp" if strategy == "fsdp" else ".pt") for p in saved), (
        saved
    )
    ok(
        run_cli(
            "export", "--run", str(tmp_path / "job"), "--to", str(tmp_path / "llama"), cwd=tmp_path
        )
    )
    ids = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    theirs = hf_side(tmp_path / "llama", ids=ids, new=6, env=hf_env)
    trained = load_trained(tmp_path / "job")
    assert trained.step == 4
    logits, greedy = our_answers(trained.model, ids=ids, new=6)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4 and theirs[
        "greedy"
    ] == greedy
    out = ok(
        run_cli(
            "generate",
            "--run",
            str(tmp_path / "job"),
            "--prompt",
            "ab",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
            "--device",
            "cpu",
            cwd=tmp_path,
        )
    ).stdout
    assert out.startswith("ab") and len(out) >= len("ab\n")
