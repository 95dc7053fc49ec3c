"""transformers interop end to end: `speedtronic export` folders load in transformers (also in a process that
cannot import speedtronic) and compute our logits; `model.init_from` starts a run from a Llama folder.

Every comparison is between our reference transformer and the real `transformers` LlamaForCausalLM.
"""
import json
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT, ok, one_error_line, run_cli, tiny_config
from speedtronic.generation import generate_ids
from speedtronic.hf import load_trained

transformers = pytest.importorskip("transformers")
FIXTURES = ROOT.parent / "shared" / "fixtures" / "v2.0"
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
IDS = [list(b"the quick brown"), list(b"jumps over the ")]


def trained_run(tmp: Path, **sections) -> Path:
    "A reference run trained 4 steps by `speedtronic train` on a small text; returns its output folder."
    (tmp / "text.txt").write_text(TEXT)
    model = {"vocab_size": 256, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "max_seq_len": 32, **sections.pop("model", {})}
    data = {"text_path": str(tmp / "text.txt"), "synthetic": False, "block_size": 32, **sections.pop("data", {})}
    ok(run_cli("train", "--config", str(tiny_config(tmp, model=model, data=data, **sections)), "--device", "cpu", cwd=tmp))
    return tmp / "out"


def our_answers(model, ids=IDS, new=10) -> tuple[torch.Tensor, list[list[int]]]:
    "Our logits for `ids` and greedy continuations of each row."
    with torch.no_grad(): logits = model(torch.tensor(ids))["logits"]
    return logits, [list(generate_ids(model, row, max_new_tokens=new, temperature=0)) for row in ids]


HF_SIDE = '''
import json, sys
try:
    import speedtronic
    raise SystemExit("speedtronic is importable here: " + speedtronic.__file__)
except ModuleNotFoundError: pass
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor(ids)).logits
    greedy = [model.generate(torch.tensor([row]), max_new_tokens=new, do_sample=False)[0, len(row):].tolist() for row in ids]
tokenizer = AutoTokenizer.from_pretrained(folder)
print(json.dumps({"class": type(model).__name__, "logits": logits.tolist(), "greedy": greedy,
                  "encoded": tokenizer("the lazy dog")["input_ids"]}))
'''

def hf_side(folder: Path, ids=IDS, new=10) -> dict:
    "What transformers computes from `folder`, in a Python that sees only the installed packages (no speedtronic)."
    site = sysconfig.get_paths()["purelib"]  # on sys.path without its .pth files: the editable speedtronic stays out
    code = f"import sys; sys.path.append({site!r})\n" + HF_SIDE
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(folder), json.dumps(ids), str(new)], capture_output=True, text=True,
                          timeout=300, cwd=folder, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("hf"))


def test_an_exported_run_is_a_llama_that_computes_our_logits(run_dir, tmp_path):
    out = ok(run_cli("export", "--run", str(run_dir), "--to", str(tmp_path / "llama"), cwd=tmp_path)).stdout
    assert out.strip() == f"exported to {tmp_path / 'llama'}"
    assert sorted(p.name for p in (tmp_path / "llama").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["tie_word_embeddings"]) == (2, 4, True)
    theirs = hf_side(tmp_path / "llama")
    logits, greedy = our_answers(load_trained(run_dir).model)
    diff = (logits - torch.tensor(theirs["logits"])).abs().max().item()
    print(f"max |ours - transformers| logit difference: {diff:.2e}")
    assert theirs["class"] == "LlamaForCausalLM"
    assert diff <= 1e-4
    assert theirs["greedy"] == greedy
    assert theirs["encoded"] == list(b"the lazy dog")      # the byte tokenizer's ids


def test_untied_heads_and_ordinary_attention_export_too(tmp_path):
    run = trained_run(tmp_path, model={"tie_weights": False, "n_kv_head": 4, "rope_base": 500.0})
    ok(run_cli("export", "--checkpoint", str(sorted((run / "checkpoints").glob("step_*.pt"))[-1]),
               "--to", str(tmp_path / "llama"), cwd=tmp_path))
    theirs = hf_side(tmp_path / "llama")
    logits, greedy = our_answers(load_trained(run).model)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4
    assert theirs["greedy"] == greedy
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_tokenizer_json_run_exports_its_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    run = trained_run(tmp_path, model={"vocab_size": 320}, data={"tokenizer": str(tmp_path / "tokenizer.json")})
    ok(run_cli("export", "--run", str(run), "--to", str(tmp_path / "llama"), cwd=tmp_path))
    ids = [tok.encode("the quick brown fox").ids]
    theirs = hf_side(tmp_path / "llama", ids=ids)
    assert theirs["encoded"] == tok.encode("the lazy dog").ids
    logits, greedy = our_answers(load_trained(run).model, ids=ids)
    assert (logits - torch.tensor(theirs["logits"])).abs().max().item() <= 1e-4
    assert theirs["greedy"] == greedy


CUSTOM_MODEL = '''
from speedtronic.model import ReferenceTransformer
from speedtronic.registry import register_model

class Mine(ReferenceTransformer):
    "Looks like the reference transformer, but its forward could be anything."

register_model("mine", lambda **kw: Mine(**kw))
'''

def test_only_the_reference_transformer_is_exported(tmp_path):
    (tmp_path / "mine_models.py").write_text(CUSTOM_MODEL)
    run = trained_run(tmp_path, model={"name": "mine", "imports": ["mine_models"]})
    proc = run_cli("export", "--run", str(run), "--to", str(tmp_path / "llama"), cwd=tmp_path)
    one_error_line(proc, "only the reference transformer", "mine_models.Mine")
    assert not (tmp_path / "llama").exists()
    one_error_line(run_cli("export", "--run", str(tmp_path / "nowhere"), "--to", str(tmp_path / "x"), cwd=tmp_path),
                   "nowhere", "does not exist")


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures/v2.0 is not beside the checkout")
def test_a_checkpoint_written_by_2_0_exports(tmp_path):
    newest = FIXTURES / "checkpoint-adamw" / "run" / "checkpoints" / "step_000000000008.pt"
    proc = ok(run_cli("export", "--checkpoint", str(newest), "--to", str(tmp_path / "llama"), cwd=tmp_path))
    assert "speedtronic: warning: no tokenizer exported: the byte tokenizer with vocab_size 64" in proc.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32).eval()
    ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
    ours, _ = our_answers(load_trained(checkpoint=newest).model, ids=ids)
    with torch.no_grad(): theirs = model(torch.tensor(ids)).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
