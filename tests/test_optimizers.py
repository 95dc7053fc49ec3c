"""Optimizer builder and LR schedule: resume through real files, parity with plain PyTorch,
lazy optional imports (subprocesses), shipped configs and the reference model."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from speedtronic.optimizers import OptimizerNotAvailable, build_optimizer, route_parameters
from speedtronic.schedules import build_scheduler, lr_multiplier, load_scheduler_state, lr_of_update, schedule_of

ROOT = Path(__file__).resolve().parents[1]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.norm(torch.relu(self.proj(self.wte(idx)))))


def config(**optimizer):
    opt = {"name": "adamw", "lr": 1e-2, "fused": False, "weight_decay": 0.1, **optimizer}
    sched = {"name": "cosine", "warmup_steps": 2, "max_steps": 6, "min_lr_ratio": 0.1,
             "warmup_steps_explicit": True, "max_steps_explicit": True}
    return SimpleNamespace(optimizer=SimpleNamespace(**opt), scheduler=SimpleNamespace(**sched))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (2, 5), generator=g) for _ in range(n)]


def train(model, opt, sched, xs):
    rates = []
    for x in xs:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            rates.append(lr_of_update(sched))
            sched.step()
    return rates


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_resume_through_a_file_continues_identically(tmp_path, scheduler_first):
    xs = batches(6)
    torch.manual_seed(0)
    straight = TinyLM()
    init = {k: v.clone() for k, v in straight.state_dict().items()}
    opt = build_optimizer(straight, config(), "cpu")
    rates_straight = train(straight, opt, build_scheduler(opt, config()), xs)

    torch.manual_seed(0)
    first = TinyLM()
    first.load_state_dict(init)
    opt = build_optimizer(first, config(), "cpu")
    sched = build_scheduler(opt, config())
    rates = train(first, opt, sched, xs[:3])
    path = tmp_path / "state.pt"
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)

    state = torch.load(path, weights_only=True)
    second = TinyLM()
    second.load_state_dict(state["model"])
    opt = build_optimizer(second, config(), "cpu")
    if scheduler_first:                      # the trainer's order: components built, then resume(state)
        sched = build_scheduler(opt, config())
        opt.load_state_dict(state["optimizer"])
    else:
        opt.load_state_dict(state["optimizer"])
        sched = build_scheduler(opt, config())
    load_scheduler_state(sched, state["scheduler"])
    rates += train(second, opt, sched, xs[3:])

    assert rates == rates_straight
    for (name, a), b in zip(straight.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def twin_models() -> tuple[TinyLM, TinyLM]:
    "Two models with the same weights: one for our optimizer, one for a hand-built torch one."
    torch.manual_seed(0)
    ours, theirs = TinyLM(), TinyLM()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def test_matches_plain_pytorch_adamw():
    xs = batches(4, seed=1)
    ours, theirs = twin_models()
    train(ours, build_optimizer(ours, config(weight_decay_on="all", betas=(0.8, 0.9)), "cpu"), None, xs)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1), None, xs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_matrices_mode_matches_hand_built_groups():
    xs = batches(4, seed=2)
    ours, theirs = twin_models()
    train(ours, build_optimizer(ours, config(), "cpu"), None, xs)
    decay = [p for p in theirs.parameters() if p.ndim >= 2]
    rest = [p for p in theirs.parameters() if p.ndim < 2]
    plain = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2,
                              betas=(0.9, 0.95))
    train(theirs, plain, None, xs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_scheduler_multiplies_every_group_by_the_pure_function():
    model = TinyLM()
    opt = build_optimizer(model, config(lr=2e-3), "cpu")
    sched = build_scheduler(opt, config())
    for step in range(8):
        f = lr_multiplier(step, warmup_steps=2, max_steps=6, min_lr_ratio=0.1, name="cosine")
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3 * f] * len(opt.param_groups), rel=1e-12)
        opt.step()
        sched.step()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_optional_plotting_dependencies_are_not_imported():
    res = run_python("import sys, speedtronic.optimizers, speedtronic.schedules\n"
                     "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_missing_matplotlib_names_the_extra():
    res = run_python("import sys; sys.modules['matplotlib'] = None\n"
                     "from speedtronic.schedules import plot_schedule\n"
                     "try: plot_schedule()\n"
                     "except ImportError as e: print(e)\n")
    assert res.returncode == 0, res.stderr
    assert "speedtronic[plot]" in res.stdout and "matplotlib" in res.stdout


def test_shipped_configs():
    cfgmod = pytest.importorskip("speedtronic.config")
    smoke, v2 = ROOT / "configs" / "smoke.yaml", ROOT / "configs" / "v2_smoke.yaml"
    if not smoke.exists() or not v2.exists():
        pytest.skip("shipped configs not written yet")
    cfg = cfgmod.load_config(str(smoke))
    opt = build_optimizer(TinyLM(), cfg, "cpu")
    assert opt.speedtronic_info["name"] == "adamw"
    assert opt.defaults["lr"] == pytest.approx(3e-4)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.01, 0.0}
    sched = build_scheduler(opt, cfg)
    assert (schedule_of(sched).warmup_steps, schedule_of(sched).max_steps) == (1, 4)
    with pytest.raises(OptimizerNotAvailable, match="optimizer.name: muon is not available"):
        build_optimizer(TinyLM(), cfgmod.load_config(str(v2)), "cpu")


def test_reference_model_every_parameter_steps():
    model_mod = pytest.importorskip("speedtronic.model")
    torch.manual_seed(0)
    ref = model_mod.ReferenceTransformer(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=32)
    opt = build_optimizer(ref, config(), "cpu")
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ids = torch.randint(0, 32, (2, 8))
    ref(ids, labels=torch.roll(ids, -1, dims=1))["loss"].backward()
    opt.step()
    assert [n for n, p in ref.named_parameters() if torch.equal(p, before[n])] == []
    routing = route_parameters(ref)
    assert len(routing.muon) == 7 * 2
    assert sorted(n for n, _ in routing.adamw) == sorted(
        ["transformer.wte.weight", "transformer.ln_f.weight"] + [f"transformer.h.{i}.{ln}.weight" for i in range(2) for ln in ("ln1", "ln2")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW is probed on CUDA only")
def test_fused_engages_on_cuda():
    opt = build_optimizer(TinyLM().cuda(), config(fused=None), "cuda")
    assert opt.speedtronic_info["fused"] is True
    assert opt.defaults["fused"] is True


def test_default_warmup_agrees_with_the_config():
    cfgmod = pytest.importorskip("speedtronic.config")
    from speedtronic.schedules import default_warmup, resolve_schedule
    for n in (1, 4, 10, 99, 1000, 5000):
        cfg = cfgmod.SpeedtronicConfig.from_dict({"run": {"max_steps": n}})
        assert cfg.scheduler.warmup_steps == default_warmup(n)
        assert (resolve_schedule(cfg).warmup_steps, resolve_schedule(cfg).max_steps) == (default_warmup(n), n)
        # a target only the runtime knows (build_runtime(max_steps=...)) re-derives the unset warmup
        assert resolve_schedule(cfg, max_steps=3 * n).warmup_steps == default_warmup(3 * n)
