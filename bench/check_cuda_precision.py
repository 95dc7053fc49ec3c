"""Check the precision plan on a real CUDA machine: the resolved plans, a few training steps
under each plan (GradScaler for fp16), autocast dtypes, fused AdamW and device-index errors.

Run: `python bench/check_cuda_precision.py`. Without CUDA it prints "no CUDA" and exits 0.
Exits 1 if any check fails.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from speedtronic.precision import (
    DeviceCapabilities,
    DeviceError,
    autocast_context,
    describe_plan,
    make_grad_scaler,
    resolve_device,
    resolve_precision,
    supports_fused_adamw,
)
from speedtronic.shapes import resolve_shape_profile


def train_steps(plan, device, steps: int = 8) -> tuple[list[float], torch.dtype, int]:
    "A few AdamW steps of a small MLP under `plan`: (losses, autocast output dtype, skipped steps)."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64)).to(
        device
    )
    fused = supports_fused_adamw(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    scaler = make_grad_scaler(plan)
    x = torch.randn(32, 64, device=device)
    losses, out_dtype, skipped = [], None, 0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with autocast_context(plan, device):
            out = model(x)
            out_dtype = out.dtype
            loss = (out.float() - x).pow(2).mean()
        if scaler is not None:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.get_scale() < before)
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, out_dtype, skipped


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA")
        return 0
    failures = []
    check = lambda ok, what: (
        print(("ok    " if ok else "FAIL  ") + what),
        None if ok else failures.append(what),
    )
    device = resolve_device("auto")
    caps = DeviceCapabilities.detect(device)
    print(
        f"device={device} name={torch.cuda.get_device_name(device)} torch={torch.__version__} "
        f"caps={caps}"
    )
    check(device.type == "cuda", "auto device is CUDA")
    check(
        supports_fused_adamw(device) == caps.fused_adamw,
        f"supports_fused_adamw={supports_fused_adamw(device)}",
    )
    n = torch.cuda.device_count()
    try:
        resolve_device(f"cuda:{n}")
        check(False, f"cuda:{n} rejected")
    except DeviceError as exc:
        check(f"only {n} CUDA device" in str(exc), f"cuda:{n} rejected: {exc}")
    for mode in ("auto", "bf16", "fp16", "fp32"):
        plan = resolve_precision(mode, device)
        print(f"plan[{mode}]: {describe_plan(plan)}")
        losses, out_dtype, skipped = train_steps(plan, device)
        expected = plan.dtype if plan.autocast_enabled else torch.float32
        check(out_dtype == expected, f"{mode}: autocast output dtype {out_dtype} == {expected}")
        check(
            all(math.isfinite(v) for v in losses),
            f"{mode}: losses finite ({losses[0]:.4f} -> {losses[-1]:.4f})",
        )
        check(losses[-1] < losses[0], f"{mode}: loss decreased")
        check(
            (make_grad_scaler(plan) is not None) == (plan.mode == "fp16"),
            f"{mode}: scaler only for fp16 (skipped steps {skipped})",
        )
        profile = resolve_shape_profile(device, plan)
        check(
            profile.alignment == (8 if plan.is_mixed_precision else None),
            f"{mode}: shape alignment {profile.alignment}",
        )
    if caps.bf16:
        check(resolve_precision("auto", device).mode == "bf16", "auto uses bf16 on a bf16 GPU")
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
