"""Trainer behaviour on the real reference model and default optimizer (spec §7)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.optimizers import build_optimizer
from speedtronic.profiling import MetricLogger
from speedtronic.registry import build_model
from speedtronic.trainer import Trainer, TrainResult, resolve_loss

TINY = {
    "model": {
        "vocab_size": 64,
        "max_seq_len": 16,
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "d_model": 32,
        "d_ff": 64,
    },
    "data": {"block_size": 16, "micro_batch_size": 2, "target_batch_size": 2},
    "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
    "precision": "fp32",
    "checkpoint": {"enabled": False},
}


def config(**over) -> SpeedtronicConfig:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for section, values in over.items():
        raw.setdefault(section, {}).update(values) if isinstance(values, dict) else raw.__setitem__(
            section, values
        )
    return SpeedtronicConfig.from_dict(raw).validate()


def token_batches(n: int, bs: int, seed: int = 0, T: int = 16, V: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, V, (bs, T + 1), generator=g)
        out.append({"input_ids": t[:, :-1], "labels": t[:, 1:]})
    return out


def quiet(**kw) -> MetricLogger:
    return MetricLogger(stream=False, **kw)


def make(cfg: SpeedtronicConfig, data, **kw) -> Trainer:
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    return Trainer(model, opt, data, device="cpu", config=cfg, logger=quiet(), **kw)


def test_every_trainable_parameter_changes_after_one_step():
    cfg = config()
    t = make(cfg, token_batches(2, 2), max_steps=1)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    assert before, "the reference model has trainable parameters"
    t.fit()
    unchanged = [
        n for n, p in t.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])
    ]
    assert unchanged == []


class RecordingSGD(torch.optim.SGD):
    "Plain SGD that keeps a copy of the gradients of every update it applies."

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def assert_same_gradients(ga: list[torch.Tensor], gb: list[torch.Tensor], names: list[str]) -> None:
    """Equal up to float32 rounding of the two summation orders, judged against each tensor's own
    scale."""
    for n, a, b in zip(names, ga, gb):
        scale = b.abs().max().item() or 1.0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=n)


def test_accumulation_equals_one_big_batch():
    # What accumulation must preserve is the gradient: K microbatches of B give the gradient of one
    # batch of K*B. The gradients themselves are compared (and the weights after plain SGD, a linear
    # function of them); an adaptive optimizer would turn last-bit differences of near-zero
    # gradients into full-size updates.
    small = token_batches(4, 2)
    big = [{k: torch.cat([small[i][k], small[i + 1][k]]) for k in small[0]} for i in (0, 2)]
    ta = make(config(data={"micro_batch_size": 2, "target_batch_size": 4}), small, max_steps=2)
    tb = make(config(data={"micro_batch_size": 4, "target_batch_size": 4}), big, max_steps=2)
    for t in (ta, tb):
        t.optimizer = RecordingSGD(t.model.parameters(), lr=0.1)
    assert ta.accumulation_steps == 2 and tb.accumulation_steps == 1
    ra, rb = ta.fit(), tb.fit()
    names = [n for n, _ in ta.model.named_parameters()]
    assert len(ta.optimizer.seen) == len(tb.optimizer.seen) == 2
    for ga, gb in zip(ta.optimizer.seen, tb.optimizer.seen):
        assert_same_gradients(ga, gb, names)
    for (n, pa), pb in zip(ta.model.named_parameters(), tb.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=n)
    assert ra.samples == rb.samples == 8 and ra.tokens == rb.tokens == 128
    assert [m["micro_batches"] for m in ra.metrics] == [2, 2]
    assert ra.metrics[0]["loss"] == pytest.approx(rb.metrics[0]["loss"], rel=1e-5)


def test_gradient_clipping_bounds_the_update():
    cfg = config(optimizer={"grad_clip": 1e-6, "lr": 1.0, "weight_decay": 0.0})
    t = make(cfg, token_batches(1, 2), max_steps=1)
    t.optimizer = torch.optim.SGD(t.model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.fit()
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(t.model.parameters(), before)))
    assert 0 < moved.item() <= 1e-6 * 1.01


_SEEDED = torch.Generator().manual_seed(0)  # the same table in every pytest-xdist worker
LOGITS = torch.randn(2, 5, 7, generator=_SEEDED)
LABELS = torch.randint(0, 7, (2, 5), generator=_SEEDED)
CE_FULL = F.cross_entropy(LOGITS.reshape(-1, 7), LABELS.reshape(-1)).item()
CE_SHORT = F.cross_entropy(LOGITS[:, :-1].reshape(-1, 7), LABELS[:, 1:].reshape(-1)).item()
DICT = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": LABELS}


@pytest.mark.parametrize(
    "output,batch,expected",
    [
        ({"loss": torch.tensor(1.5), "logits": LOGITS}, DICT, 1.5),  # mapping with loss
        ({"logits": LOGITS}, DICT, CE_FULL),  # same-length labels
        ({"logits": LOGITS}, {**DICT, "labels": LABELS[:, 1:]}, CE_SHORT),  # T-1 labels
        (torch.tensor([1.0, 2.0, 3.0]), DICT, 2.0),  # tensor, mean-reduced
        (torch.full((2, 5, 7), 0.5), DICT, 0.5),  # 3-D tensor is a loss
        ((LOGITS, "aux"), (DICT["input_ids"], LABELS), CE_FULL),  # tuple of causal logits
        ((torch.tensor(4.0), LOGITS), DICT, 4.0),  # tuple with scalar first
        # incompatible labels
        (
            (torch.full((2, 5, 7), 2.0),),
            (DICT["input_ids"], LABELS[:, :2]),
            2.0,
        ),
    ],
)
def test_loss_resolution_table(output, batch, expected):
    assert resolve_loss(output, batch).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "output,error,text",
    [
        ({"logits": torch.ones(2, 5)}, ValueError, "needs a 'loss'"),
        ({"hidden": torch.ones(2)}, ValueError, "needs a 'loss'"),
        (("not a tensor",), ValueError, "must be a tensor"),
        ((), TypeError, "cannot take a loss"),
        (None, TypeError, "cannot take a loss"),
    ],
)
def test_loss_resolution_errors(output, error, text):
    with pytest.raises(error, match=text):
        resolve_loss(output, DICT)


def test_all_ignored_labels_give_a_differentiable_zero():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    loss = resolve_loss({"logits": logits}, {"labels": torch.full((1, 3), -100)})
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 1), 0

    def forward(self, x, y):
        self.calls += 1
        raise ValueError("a bug inside the model")


def test_model_error_under_compile_propagates_and_runs_once():
    model = Raises()
    t = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(torch.ones(2, 4), torch.ones(2))],
        device="cpu",
        logger=quiet(),
        max_steps=1,
    )
    t.compiled_model = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match="a bug inside the model"):
        t.fit()
    assert model.calls == 1
    assert t.compiled_model is not None  # not disabled: nothing was wrong with compilation


def test_compile_failure_falls_back_to_eager_once():
    def failing_backend(gm, example_inputs):
        raise RuntimeError("backend cannot compile this")

    model = nn.Sequential(nn.Linear(4, 1))
    data = [(torch.ones(2, 4), torch.ones(2))]

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, y):
            return F.mse_loss(self.inner(x).squeeze(-1), y)

    w = Wrap()
    events = []
    logger = quiet(hooks=[lambda e, p: events.append((e, p))])
    t = Trainer(
        w, torch.optim.SGD(w.parameters(), lr=0.1), data, device="cpu", logger=logger, max_steps=3
    )
    t.compiled_model = torch.compile(w, backend=failing_backend)
    result = t.fit()
    logger.close()
    assert result.steps == 3 and t.compiled_model is None
    compile_events = [p for e, p in events if e == "compile"]
    assert len(compile_events) == 1 and compile_events[0]["enabled"] is False
    assert "backend cannot compile this" in compile_events[0]["reason"]


def test_metrics_history_is_bounded_and_keeps_the_newest():
    cfg = config(logging={"metrics_history": 4})
    t = make(cfg, token_batches(3, 2), max_steps=12)
    result = t.fit()
    assert isinstance(result, TrainResult)
    assert [m["step"] for m in result.metrics] == [9, 10, 11, 12]
    assert result.final_loss == result.metrics[-1]["loss"]


def test_unbounded_history_when_null():
    t = make(config(logging={"metrics_history": None}), token_batches(3, 2), max_steps=5)
    assert t.metrics_history is None  # null means unbounded, not the 10000 default
    assert len(t.fit().metrics) == 5


def test_logged_lr_is_the_rate_of_the_update():
    from speedtronic.schedules import build_scheduler

    cfg = config(
        scheduler={"name": "cosine", "warmup_steps": 1, "max_steps": 4, "min_lr_ratio": 0.1},
        optimizer={"lr": 3e-4},
    )
    t = make(cfg, token_batches(2, 2), max_steps=4)
    t.scheduler = build_scheduler(t.optimizer, cfg, max_steps=4)
    lrs = [m["lr"] for m in t.fit().metrics]
    # the first update runs at the warmed-up base rate; the last at the cosine floor region
    assert lrs[0] == pytest.approx(3e-4)
    assert lrs == sorted(lrs, reverse=True)


class Poisonable(nn.Module):
    """Linear regression; a batch can ask for a NaN loss (`bad=1`), a NaN gradient under a finite
    loss (`bad=2`), or an infinite loss with finite gradients (`bad=3`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, input_ids, labels, bad):
        loss = F.mse_loss(self.lin(input_ids).squeeze(-1), labels)
        if int(bad) == 1:
            loss = loss * float("nan")
        if int(bad) == 2:
            # 0, gradient 0 * inf
            loss = loss + (self.lin.weight - self.lin.weight.detach()).abs().sqrt().sum()
        if int(bad) == 3:
            loss = loss + torch.tensor(float("inf"))  # a constant: the gradients stay finite
        return {"loss": loss}


def regression_batches(n: int, bad: dict[int, int] = {}) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randn(2, 4, generator=g),
            "labels": torch.randn(2, generator=g),
            "bad": torch.tensor(bad.get(i, 0)),
        }
        for i in range(n)
    ]


class Events(MetricLogger):
    "A quiet logger that also keeps what was emitted."

    def __init__(self, **kw):
        super().__init__(stream=False, **kw)
        self.seen = []

    def emit(self, event, payload=None, *, force=False):
        shown = super().emit(event, payload, force=force)
        if shown:
            self.seen.append((event, dict(payload or {})))
        return shown


def regression_run(data, steps, *, skips=0, clip=None, every=1):
    torch.manual_seed(0)
    model = Poisonable()
    cfg = SpeedtronicConfig.from_dict(
        {
            "optimizer": {"max_nonfinite_skips": skips, "grad_clip": clip},
            "checkpoint": {"enabled": False},
            "shape_validation": {"enabled": False},
        }
    ).validate()
    logger = Events(every_steps=every)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        data,
        device="cpu",
        config=cfg,
        logger=logger,
        max_steps=steps,
    )
    return trainer, logger


@pytest.mark.parametrize("clip", [None, 1.0], ids=["norm", "clip"])
def test_a_skipped_nonfinite_update_leaves_everything_as_if_the_batch_was_never_there(clip):
    # each kind of bad update once, each alone
    poisoned = regression_batches(11, bad={3: 1, 7: 2, 9: 3})
    clean = [b for b in poisoned if int(b["bad"]) == 0]
    t, log = regression_run(poisoned, 8, skips=1, clip=clip)
    ref, _ = regression_run(clean, 8, clip=clip)
    result, expected = t.fit(), ref.fit()
    # no bit of a skipped update
    assert all(torch.equal(p, r) for p, r in zip(t.model.parameters(), ref.model.parameters()))
    assert (
        t.optimizer.state_dict()["state"][0]["step"]
        == ref.optimizer.state_dict()["state"][0]["step"]
        == 8
    )
    assert (
        (result.steps, result.samples, result.tokens)
        == (expected.steps, expected.samples, expected.tokens)
        == (8, 16, 64)
    )
    assert [(r["step"], r["loss"]) for r in result.metrics] == [
        (r["step"], r["loss"]) for r in expected.metrics
    ]
    skipped = [p for e, p in log.seen if e == "optimizer_step_skipped"]
    assert [(p["step"], p["reason"]) for p in skipped] == [
        (4, "nonfinite_loss"),
        (7, "nonfinite_gradient"),
        (8, "nonfinite_loss"),
    ]


def test_nonfinite_updates_past_the_budget_stop_at_the_same_step_with_the_same_weights():
    data = regression_batches(10, bad={5: 1, 6: 1})  # two in a row, one allowed
    t, log = regression_run(data, 9, skips=1)
    with pytest.raises(Exception) as stop:
        t.fit()
    assert "step 6: the loss is nan after 1 skipped update in a row" in str(stop.value)
    ref, _ = regression_run(data[:5], 5)
    ref.fit()
    assert (
        t.step == 5
        and t.samples == 10
        and all(torch.equal(p, r) for p, r in zip(t.model.parameters(), ref.model.parameters()))
    )
    assert [p["step"] for e, p in log.seen if e == "optimizer_step_skipped"] == [6, 6]


def test_the_logging_cadence_changes_nothing_but_what_is_written():
    data = regression_batches(12, bad={4: 1})
    every1, log1 = regression_run(data, 10, skips=1, every=1)
    every5, log5 = regression_run(data, 10, skips=1, every=5)
    r1, r5 = every1.fit(), every5.fit()
    assert all(
        torch.equal(p, q) for p, q in zip(every1.model.parameters(), every5.model.parameters())
    )
    counted = lambda result: [
        (r["step"], r["loss"], r["lr"], r["samples"], r["tokens"]) for r in result.metrics
    ]
    assert counted(r1) == counted(r5) and len(r1.metrics) == 10
    assert [p["step"] for e, p in log5.seen if e == "train_step"] == [5, 10]
    assert (r1.steps, r1.samples, r1.tokens) == (r5.steps, r5.samples, r5.tokens) == (10, 20, 80)


def test_a_model_left_in_eval_mode_between_fits_trains_in_train_mode():
    t = make(config(), token_batches(6, 2), max_steps=3)
    t.fit(1)
    t.model.eval()  # e.g. an evaluation between two fit calls
    seen = []
    t.model.register_forward_pre_hook(
        lambda module, args: seen.append(all(m.training for m in module.modules()))
    )
    t.fit(2)
    next(iter(t.model.children())).eval()  # one submodule only
    t.fit(3)
    assert seen == [True, True] and t.step == 3
