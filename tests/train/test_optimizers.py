"""Optimizer builder and LR schedule: resume through real files, parity with plain PyTorch (AdamW
and torch.optim.Muon), Newton–Schulz properties, routing, Muon+, cautious masking, GradScaler, lazy
optional imports (subprocesses), shipped configs and the reference model."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings, strategies as st
from torch import nn

from conftest import newton_schulz64, run_python
from conftest import run_command
from speedtronic.config import ConfigError, SpeedtronicConfig, load_config
from speedtronic.model import ReferenceTransformer
from speedtronic.optimizers import (
    CautiousOptimizer,
    HybridOptimizer,
    Muon,
    build_optimizer,
    check_coverage,
    load_optimizer_state,
    newton_schulz,
    orthogonalize,
    post_polar_normalize,
    route_parameters,
)
from speedtronic.profiling import MetricLogger
from speedtronic.schedules import (
    build_scheduler,
    default_warmup,
    load_scheduler_state,
    lr_multiplier,
    lr_of_update,
    resolve_schedule,
    schedule_of,
)

ROOT = Path(__file__).resolve().parents[2]


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


def config(**optimizer) -> SpeedtronicConfig:
    """A real config: AdamW at 1e-2 (plus `optimizer`), a cosine schedule of 6 steps with 2 of
    warmup."""
    return SpeedtronicConfig.from_dict(
        {
            "optimizer": {
                "name": "adamw",
                "lr": 1e-2,
                "fused": False,
                "weight_decay": 0.1,
                **optimizer,
            },
            "scheduler": {"name": "cosine", "warmup_steps": 2, "max_steps": 6, "min_lr_ratio": 0.1},
        }
    )


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
    torch.save(
        {
            "model": first.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
        },
        path,
    )

    state = torch.load(path, weights_only=True)
    second = TinyLM()
    second.load_state_dict(state["model"])
    opt = build_optimizer(second, config(), "cpu")
    if scheduler_first:  # the trainer's order: components built, then resume(state)
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
    train(
        ours,
        build_optimizer(ours, config(weight_decay_on="all", betas=(0.8, 0.9)), "cpu"),
        None,
        xs,
    )
    train(
        theirs,
        torch.optim.AdamW(
            theirs.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1
        ),
        None,
        xs,
    )
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_matrices_mode_matches_hand_built_groups():
    xs = batches(4, seed=2)
    ours, theirs = twin_models()
    train(ours, build_optimizer(ours, config(), "cpu"), None, xs)
    decay = [p for p in theirs.parameters() if p.ndim >= 2]
    rest = [p for p in theirs.parameters() if p.ndim < 2]
    plain = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    train(theirs, plain, None, xs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_scheduler_multiplies_every_group_by_the_pure_function():
    model = TinyLM()
    opt = build_optimizer(model, config(lr=2e-3), "cpu")
    sched = build_scheduler(opt, config())
    for step in range(8):
        f = lr_multiplier(step, warmup_steps=2, max_steps=6, min_lr_ratio=0.1, name="cosine")
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(
            [2e-3 * f] * len(opt.param_groups), rel=1e-12
        )
        opt.step()
        sched.step()


def test_optional_plotting_dependencies_are_not_imported():
    res = run_python(
        "import sys, speedtronic.optimizers, speedtronic.schedules\n"
        "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_missing_matplotlib_names_the_extra():
    res = run_python(
        "import sys; sys.modules['matplotlib'] = None\n"
        "from speedtronic.schedules import plot_schedule\n"
        "try: plot_schedule()\n"
        "except ImportError as e: print(e)\n"
    )
    assert res.returncode == 0, res.stderr
    assert "speedtronic[plot]" in res.stdout and "matplotlib" in res.stdout


def test_shipped_configs():
    smoke, v2 = ROOT / "configs" / "smoke.yaml", ROOT / "configs" / "v2_smoke.yaml"
    cfg = load_config(str(smoke))
    opt = build_optimizer(TinyLM(), cfg, "cpu")
    assert opt.speedtronic_info["name"] == "adamw"
    assert opt.defaults["lr"] == pytest.approx(3e-4)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.01, 0.0}
    sched = build_scheduler(opt, cfg)
    assert (schedule_of(sched).warmup_steps, schedule_of(sched).max_steps) == (1, 4)
    v2_opt = build_optimizer(TinyLM(), load_config(str(v2)), "cpu")  # muon + muon_plus + cautious
    assert (
        type(v2_opt).__name__ == "CautiousOptimizer"
        and type(v2_opt.base).__name__ == "HybridOptimizer"
    )
    assert (
        v2_opt.param_groups[0]["muon_plus"] is True and v2_opt.speedtronic_info["muon_tensors"] == 1
    )


def test_reference_model_every_parameter_steps():
    torch.manual_seed(0)
    ref = ReferenceTransformer(
        vocab_size=32, block_size=8, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=32
    )
    opt = build_optimizer(ref, config(), "cpu")
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ids = torch.randint(0, 32, (2, 8))
    ref(ids, labels=torch.roll(ids, -1, dims=1))["loss"].backward()
    opt.step()
    assert [n for n, p in ref.named_parameters() if torch.equal(p, before[n])] == []
    routing = route_parameters(ref)
    assert len(routing.muon) == 7 * 2
    assert sorted(n for n, _ in routing.adamw) == sorted(
        ["transformer.wte.weight", "transformer.ln_f.weight"]
        + [f"transformer.h.{i}.{ln}.weight" for i in range(2) for ln in ("ln1", "ln2")]
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW is probed on CUDA only")
def test_fused_engages_on_cuda():
    opt = build_optimizer(TinyLM().cuda(), config(fused=None), "cuda")
    assert opt.speedtronic_info["fused"] is True
    assert opt.defaults["fused"] is True


def test_default_warmup_agrees_with_the_config():
    for n in (1, 4, 10, 99, 1000, 5000):
        cfg = SpeedtronicConfig.from_dict({"run": {"max_steps": n}})
        assert (resolve_schedule(cfg).warmup_steps, resolve_schedule(cfg).max_steps) == (
            default_warmup(n),
            n,
        )
        # a target only the runtime knows (build_runtime(max_steps=...)) re-derives the unset warmup
        assert resolve_schedule(cfg, max_steps=3 * n).warmup_steps == default_warmup(3 * n)


# ---------------------------------------------------------------------------------------------
# The Muon family
# ---------------------------------------------------------------------------------------------
def reference(n_layer=1):
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=64, block_size=16, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=32, d_ff=64
    )


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (20, 20), (1, 9), (9, 1)])
def test_muon_matches_torch_muon(scale, shape):
    """Same gradients into our Muon and torch.optim.Muon: the weights agree to bf16 Newton–Schulz
    noise."""
    torch.manual_seed(2)
    ours, theirs = nn.Parameter(torch.randn(*shape)), nn.Parameter(torch.zeros(*shape))
    with torch.no_grad():
        theirs.copy_(ours)
    start = ours.detach().clone()
    a = Muon([ours], lr=0.02, momentum=0.95, weight_decay=0.1, scale=scale)
    b = torch.optim.Muon([theirs], lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn=scale)
    for _ in range(6):
        g = torch.randn(*shape)
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
    moved = (theirs - start).abs().max()
    assert ((ours - theirs).abs().max() / moved).item() < 0.03
    # the same step in bf16: closer still, up to where each rounds
    assert (
        torch.nn.functional.cosine_similarity(
            (ours - start).flatten(), (theirs - start).flatten(), dim=0
        )
        > 0.999
    )


def test_muon_matches_torch_muon_on_a_model():
    """A model's hidden matrices and real (low-rank) gradients, several steps. Against
    torch.optim.Muon's documented update (sum momentum, Nesterov g + mu*B) computed in float64 ours
    agrees to 1e-3; against torch.optim.Muon itself, whose Newton–Schulz runs in bf16, to its bf16
    noise (larger on the faint directions of a low-rank gradient)."""
    ours_model, theirs_model = reference(2), reference(2)
    ours = [p for _, p in route_parameters(ours_model).muon]
    theirs = [p for _, p in route_parameters(theirs_model).muon]
    a = Muon(ours, lr=0.01, weight_decay=0.01, scale="match_rms_adamw")
    b = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    start = [p.detach().clone() for p in ours]
    exact = [p.detach().double().clone() for p in ours]
    bufs = [torch.zeros_like(e) for e in exact]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # the same gradients into all three
        x = torch.randint(0, 64, (2, 16), generator=g)
        ours_model.zero_grad()
        ours_model(x, labels=x)["loss"].backward()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            q.grad = p.grad.clone()
            grad = p.grad.double()
            bufs[i] = 0.95 * bufs[i] + grad
            exact[i] = exact[i] * (1 - 0.01 * 0.01) - 0.01 * 0.2 * max(
                p.shape
            ) ** 0.5 * newton_schulz64(grad + 0.95 * bufs[i])
        a.step()
        b.step()
    for p, q, e, s0 in zip(ours, theirs, exact, start):
        mine, torchs, documented = (
            (p - s0).detach().double(),
            (q - s0).detach().double(),
            e - s0.double(),
        )
        assert ((mine - documented).norm() / documented.norm()).item() < 5e-3
        assert ((mine - torchs).norm() / torchs.norm()).item() < 0.15
        assert torch.nn.functional.cosine_similarity(mine.flatten(), torchs.flatten(), dim=0) > 0.99


def orthogonal(n, gen):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    log_scale=st.floats(-8, 8),
    seed=st.integers(0, 10_000),
    condition=st.floats(1.0, 8.0),
)
def test_newton_schulz_properties(rows, cols, log_scale, seed, condition):
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    s = torch.linspace(1.0, condition, k, dtype=torch.float64)
    X = (orthogonal(rows, gen)[:, :k] * s) @ orthogonal(cols, gen)[:, :k].T
    X = (X * 10**log_scale).float()
    copy = X.clone()
    U = newton_schulz(X)
    assert U.shape == X.shape and U.dtype == torch.float32 and torch.isfinite(U).all()
    assert torch.equal(X, copy)  # input untouched
    sv = torch.linalg.svdvals(U.double())
    assert sv.max() < 1.25 and sv.min() > 0.5, sv  # well-conditioned input: all near 1
    if rows != cols:  # one orientation, whichever is given
        assert torch.equal(newton_schulz(X.T), U.T)
    if float(X.norm()) >= 0.1:  # scale-free while eps=1e-7 is under 1e-6 of the norm it divides
        torch.testing.assert_close(newton_schulz(X * 3.0), U, rtol=1e-4, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 24),
    cols=st.integers(1, 24),
    rank=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_newton_schulz_is_finite_on_degenerate_input(rows, cols, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    X = (
        torch.randn(rows, rank, generator=gen) @ torch.randn(rank, cols, generator=gen)
        if rank
        else torch.zeros(rows, cols)
    )
    U = newton_schulz(X)
    assert torch.isfinite(U).all()
    assert torch.linalg.svdvals(U).max() < 1.25
    if rank == 0:
        assert torch.equal(U, torch.zeros(rows, cols))
    # norm overflows: still finite
    assert torch.isfinite(newton_schulz(torch.full((rows, cols), 3e38))).all()


def test_orthogonalize_batches_equal_single():
    stack = torch.randn(5, 12, 7)
    torch.testing.assert_close(
        orthogonalize(stack), torch.stack([newton_schulz(m) for m in stack]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("mode, unit", [("row", 1), ("col", 0), ("row_col", 0), ("col_row", 1)])
def test_muon_plus_modes(mode, unit):
    U = newton_schulz(torch.randn(7, 13))
    out = post_polar_normalize(U, mode)
    torch.testing.assert_close(
        out.norm(dim=unit), torch.ones(out.shape[1 - unit]), rtol=1e-4, atol=1e-4
    )
    if mode == "col_row":  # 2.0 stopped after the column step
        assert not torch.allclose(out, post_polar_normalize(U, "col"))
        torch.testing.assert_close(out, post_polar_normalize(post_polar_normalize(U, "col"), "row"))


def test_muon_plus_in_the_optimizer_normalises_columns():
    p = nn.Parameter(torch.zeros(6, 10))
    p.grad = torch.randn(6, 10)
    Muon([p], lr=1.0, muon_plus=True).step()
    torch.testing.assert_close(p.detach().norm(dim=0), torch.ones(10), rtol=1e-4, atol=1e-4)


def test_cautious_masks_exactly_the_disagreeing_entries():
    torch.manual_seed(0)
    w, twin = nn.Parameter(torch.randn(50)), nn.Parameter(torch.zeros(50))
    with torch.no_grad():
        twin.copy_(w)
    cautious = CautiousOptimizer(torch.optim.AdamW([w], lr=0.1, weight_decay=0.1))
    plain = torch.optim.AdamW([twin], lr=0.1, weight_decay=0.1)
    for step in range(5):
        g = torch.randn(50)
        g[:5] = 0.0  # no gradient: decay is suppressed there too
        old = w.detach().clone()
        # load_state_dict may alias tensors
        plain.load_state_dict(copy.deepcopy(cautious.state_dict()))
        with torch.no_grad():
            twin.copy_(w)
        w.grad, twin.grad = g.clone(), g.clone()
        cautious.step()
        plain.step()
        agrees = (old - twin.detach()) * g > 0
        assert torch.equal(w.detach(), torch.where(agrees, twin.detach(), old))
        assert torch.equal(w.detach()[:5], old[:5])


def test_every_trainable_parameter_in_exactly_one_group():
    models = [
        TinyLM(),
        reference(2),
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)),
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, dtype=torch.complex64)),
    ]
    models[1].transformer.h[0].ln1.weight.requires_grad_(False)
    for model in models:
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        for cfg in (
            {"name": "adamw"},
            {"name": "muon"},
            {"name": "muon", "cautious": True, "muon_plus": True},
        ):
            opt = build_optimizer(model, cfg, "cpu")
            ids = [id(p) for g in opt.param_groups for p in g["params"]]
            assert sorted(ids) == sorted(trainable), (type(model).__name__, cfg)
        routed = route_parameters(model)
        assert all(p.ndim == 2 and p.is_floating_point() for _, p in routed.muon)


def test_conv_and_non_2d_never_reach_muon():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    model[0]._speedtronic_optimizer_role = "muon"  # asks for Muon, but its weight is 4-D
    assert [n for n, _ in route_parameters(model).muon] == ["2.weight"]
    with pytest.raises(ValueError, match="Muon only takes 2-D parameters"):
        Muon([model[0].weight])


def test_schedule_drives_both_groups_of_the_hybrid():
    model = reference()
    cfg = config(name="muon", lr=2e-3, muon_lr=0.02)
    opt = build_optimizer(model, cfg, "cpu")
    sched = build_scheduler(opt, config())
    x = torch.randint(0, 64, (2, 16))
    for step in range(6):
        f = lr_multiplier(step, warmup_steps=2, max_steps=6, min_lr_ratio=0.1, name="cosine")
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(
            [0.02 * f, 2e-3 * f, 2e-3 * f], rel=1e-12
        )
        opt.zero_grad()
        model(x, labels=x)["loss"].backward()
        opt.step()
        assert opt._muon.param_groups[0]["lr"] == pytest.approx(
            0.02 * f
        ) and opt._adamw.param_groups[0]["lr"] == pytest.approx(2e-3 * f)
        sched.step()


OPTIMIZERS = {
    "adamw": {"name": "adamw"},
    "muon": {"name": "muon"},
    "muon_plus": {"name": "muon", "muon_plus": True},
    "cautious_adamw": {"name": "adamw", "cautious": True},
    "cautious_muon": {"name": "muon", "cautious": True},
}


@pytest.mark.parametrize("variant", OPTIMIZERS)
def test_grad_scaler_step_equals_plain_step_and_skips_inf(variant):
    """A GradScaler (power-of-two scale) gives bit-identical updates, and skips an update with an
    inf gradient."""
    x = torch.randint(0, 64, (2, 16))
    plain_model, scaled_model = reference(), reference()
    plain = build_optimizer(plain_model, {**OPTIMIZERS[variant], "lr": 1e-2}, "cpu")
    scaled = build_optimizer(scaled_model, {**OPTIMIZERS[variant], "lr": 1e-2}, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for _ in range(3):
        plain.zero_grad()
        plain_model(x, labels=x)["loss"].backward()
        plain.step()
        scaled.zero_grad()
        scaler.scale(scaled_model(x, labels=x)["loss"]).backward()
        scaler.unscale_(scaled)
        scaler.step(scaled)
        scaler.update()
    for a, b in zip(plain_model.parameters(), scaled_model.parameters()):
        assert torch.equal(a, b)
    before = [p.detach().clone() for p in scaled_model.parameters()]
    scaled.zero_grad()
    scaler.scale(scaled_model(x, labels=x)["loss"]).backward()
    next(scaled_model.parameters()).grad[0, 0] = float("inf")
    scaler.step(scaled)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, scaled_model.parameters()))


def test_bf16_parameters_keep_fp32_momentum_through_a_checkpoint(tmp_path):
    p = nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = Muon([p], lr=0.01)
    for _ in range(3):
        p.grad = torch.randn(8, 4, dtype=torch.bfloat16)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    again = Muon([p], lr=0.01)
    again.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert again.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(again.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    hybrid = HybridOptimizer([p], [], muon_lr=0.01, adamw_lr=0.01)
    p.grad = torch.randn(8, 4, dtype=torch.bfloat16)
    hybrid.step()
    other = HybridOptimizer([p], [], muon_lr=0.01, adamw_lr=0.01)
    other.load_state_dict(hybrid.state_dict())
    assert torch.equal(other.state[p]["momentum_buffer"], hybrid.state[p]["momentum_buffer"])
    assert other.state[p]["momentum_buffer"].dtype == torch.float32


def test_resuming_across_optimizer_families():
    model = reference()
    x = torch.randint(0, 64, (2, 16))
    states = {}
    for name, cfg in OPTIMIZERS.items():
        opt = build_optimizer(model, cfg, "cpu")
        model.zero_grad()
        model(x, labels=x)["loss"].backward()
        opt.step()
        states[name] = opt.state_dict()
    for saved in OPTIMIZERS:
        for current, cfg in OPTIMIZERS.items():
            opt = build_optimizer(model, cfg, "cpu")
            same_family = OPTIMIZERS[saved]["name"] == cfg["name"]
            if same_family:
                # cautious / muon_plus carry no state
                load_optimizer_state(opt, states[saved], model)
            else:
                with pytest.raises(
                    ValueError, match="Muon keeps one momentum matrix per hidden weight"
                ):
                    load_optimizer_state(opt, states[saved], model)


def test_v2_smoke_and_shorthand_configs_train_from_the_cli(tmp_path):
    v2 = ROOT / "configs" / "v2_smoke.yaml"
    raw = yaml.safe_load(v2.read_text())
    raw.update(optimizer="muon", muon_plus=True, cautious=True)  # 2.0's shorthand and root flags
    shorthand = tmp_path / "shorthand.yaml"
    shorthand.write_text(yaml.safe_dump(raw))
    for cfg in (v2, shorthand):
        out = tmp_path / cfg.stem
        res = run_command(
            [
                sys.executable,
                "-m",
                "speedtronic",
                "train",
                "--config",
                str(cfg),
                "--device",
                "cpu",
                "--output-dir",
                str(out),
                "--verbose",  # the optimizer's and ooo_backprop's event lines are printed
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "completed steps=2" in res.stdout
        assert "optimizer name=muon cautious=True muon_plus=True" in res.stdout + res.stderr
        assert (
            "muon_tensors=7" in res.stdout + res.stderr
            and "adamw_tensors=4" in res.stdout + res.stderr
        )
        assert "ooo_backprop enabled=False reason=device cpu" in res.stdout + res.stderr


@pytest.mark.parametrize(
    "section, message",
    [
        ({"muon_lrr": 0.02}, "optimizer.muon_lrr: unknown key (did you mean optimizer.muon_lr?)"),
        ({"name": "lion"}, "optimizer.name: 'lion'"),
        ({"name": "muon", "muon_lr": "fast"}, "optimizer.muon_lr: expected a number or null"),
        ({"name": "muon", "muon_lr": 0}, "optimizer.muon_lr: must be positive"),
        ({"name": "muon", "muon_scale": "huge"}, "optimizer.muon_scale: 'huge'"),
        ({"name": "muon", "muon_momentum": 1.0}, "optimizer.muon_momentum: must be in [0, 1)"),
        ({"name": "muon", "muon_ns_steps": 0}, "optimizer.muon_ns_steps: must be positive"),
        ({"name": "muon", "muon_norm_eps": -1e-8}, "optimizer.muon_norm_eps: must be positive"),
        ({"name": "muon", "cautious": "yes"}, "optimizer.cautious: expected true or false"),
        ({"muon_plus": True}, "optimizer.muon_plus: is only valid with optimizer.name: muon"),
    ],
)
def test_bad_optimizer_keys_are_named(section, message):
    with pytest.raises(ConfigError) as err:
        build_optimizer(TinyLM(), section, "cpu")
    assert message in str(err.value)


def test_default_optimizer_covers_and_reports_every_weight():
    model = reference(2)
    model.transformer.h[1].ln2.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    events = []
    with MetricLogger(
        stream=False, hooks=[lambda event, payload: events.append((event, payload))]
    ) as logger:
        opt = build_optimizer(model, {"name": "adamw"}, "cpu", logger=logger)
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(
        id(p) for p in trainable
    )
    ((event, info),) = [(e, p) for e, p in events if e == "optimizer"]
    assert (info["adamw_tensors"], info["muon_tensors"], info["skipped_tensors"]) == (
        len(trainable),
        0,
        1,
    )
    assert info["adamw_params"] == info["param_count"] == sum(p.numel() for p in trainable)


def test_an_optimizer_missing_a_weight_is_refused():
    lin = nn.Linear(3, 3)
    check_coverage(torch.optim.SGD(lin.parameters(), lr=0.1), list(lin.named_parameters()))
    with pytest.raises(RuntimeError, match=r"never trained: \['bias'\]"):
        check_coverage(torch.optim.SGD([lin.weight], lr=0.1), list(lin.named_parameters()))
    with pytest.raises(RuntimeError, match="frozen or foreign tensors: 1"):
        check_coverage(torch.optim.SGD(lin.parameters(), lr=0.1), [("weight", lin.weight)])
