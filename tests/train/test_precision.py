"""Precision and device checks that need a fresh process or real training steps (spec §5, P1,
P4)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    "Run `code` in a fresh Python with the repository importable."
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cuda_request_fails_cleanly_without_cuda():
    "With no GPU visible, `cuda` and `cuda:1` give one DeviceError naming the request and the fix."
    res = run_py(
        """
        from speedtronic.precision import resolve_device, DeviceError
        for req in ("cuda", "cuda:1", "CUDA:0"):
            try:
                resolve_device(req)
            except DeviceError as exc:
                print("ERR", req, "|", exc)
        print("AUTO", resolve_device("auto").type)
    """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert res.returncode == 0, res.stderr
    errs = [l for l in res.stdout.splitlines() if l.startswith("ERR")]
    assert len(errs) == 3, res.stdout
    for line in errs:
        assert "CUDA was requested" in line and "--device cpu" in line, line
    assert "AUTO cuda" not in res.stdout


def test_uncaught_device_error_is_one_readable_line():
    """An uncaught bad device string ends with a DeviceError line that names the string and the
    choices."""
    res = run_py("from speedtronic.precision import resolve_device; resolve_device('gpu:0')")
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("speedtronic.precision.DeviceError: Unknown device 'gpu:0'"), last
    assert "'cpu', 'cuda', 'cuda:N' or 'mps'" in last


def test_cpu_bf16_probe_matches_real_training():
    """The probe's verdict agrees with running a reference-like block forward/backward/step in CPU
    bf16."""
    res = run_py("""
        import sys
        import torch
        from torch import nn
        from speedtronic.precision import probe_cpu_bf16_autocast, resolve_precision
        ok, err = probe_cpu_bf16_autocast()
        torch.manual_seed(0)
        block = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 96), nn.SiLU(),
                              nn.Linear(96, 64))
        opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
        ids = torch.randint(0, 64, (4, 16))
        plan = resolve_precision("bf16", "cpu")
        losses, in_bf16 = [], True
        try:
            for _ in range(3):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = block(ids)
                in_bf16 = in_bf16 and logits.dtype == torch.bfloat16
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
                loss.backward(); opt.step(); losses.append(loss.item())
            real = in_bf16 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        except RuntimeError as exc:  # a CPU without a bf16 kernel (NotImplementedError is one)
            print("FAILED", type(exc).__name__, exc, file=sys.stderr)
            real = False
        print("PROBE", ok, "REAL", real, "PLAN", plan.mode, "REASON", plan.reason)
    """)
    assert res.returncode == 0, res.stderr
    words = res.stdout.split()
    probe, real, mode = words[1], words[3], words[5]
    assert probe == real, res.stdout + res.stderr
    assert mode == ("bf16" if probe == "True" else "fp32"), res.stdout


def test_probe_leaves_global_rng_untouched_and_is_cached():
    "Running the probe draws no random numbers, and a second call returns the cached result."
    res = run_py("""
        import torch
        import speedtronic.precision as P
        torch.manual_seed(7); a = torch.rand(4)
        torch.manual_seed(7); assert P._CPU_BF16_PROBE is None
        first = P.probe_cpu_bf16_autocast(); b = torch.rand(4)
        assert P._CPU_BF16_PROBE == first and P.probe_cpu_bf16_autocast() is P._CPU_BF16_PROBE
        print("SAME", bool(torch.equal(a, b)))
    """)
    assert res.returncode == 0, res.stderr
    assert "SAME True" in res.stdout


def test_fp32_on_cpu_does_not_run_the_probe():
    "Resolving an fp32/auto plan on CPU never runs the bf16 probe (nothing to check)."
    res = run_py("""
        import speedtronic.precision as P
        plans = [P.resolve_precision(m, "cpu") for m in ("auto", "fp32", "fp16")]
        print([p.mode for p in plans], P._CPU_BF16_PROBE)
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['fp32', 'fp32', 'fp32'] None", res.stdout


def test_cpu_plan_trains_with_trainer_calls():
    """A CPU bf16 plan (when the probe passes) trains a few steps through autocast_context; no
    scaler."""
    from speedtronic.precision import (
        autocast_context,
        make_grad_scaler,
        resolve_precision,
        probe_cpu_bf16_autocast,
    )

    plan = resolve_precision("bf16", "cpu")
    assert make_grad_scaler(plan) is None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with autocast_context(plan, "cpu"):
            out = model(x)
        assert out.dtype == (torch.bfloat16 if probe_cpu_bf16_autocast()[0] else torch.float32)
        loss = (out.float() - x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_cuda_check_script_exits_zero_without_cuda():
    "bench/check_cuda_precision.py says 'no CUDA' and exits 0 where no GPU is visible."
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "check_cuda_precision.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "no CUDA"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_check_script_passes_on_gpu():
    "On a GPU machine every check of the CUDA script passes."
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "check_cuda_precision.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks passed" in res.stdout
