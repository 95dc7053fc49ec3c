"""A checkpoint directory written by Speedtronic 2.0 (`step_*.pt` + `latest.json`, spec §8) resumes.

2.0's default AdamW held only the routed AdamW parameters in one group and stored NumPy's RNG state as
an array; the file is made here with plain `torch.save`, as 2.0 wrote it.
"""
import json, os, random, subprocess, sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent

def write_v2_checkpoint(directory: Path, step: int = 2) -> None:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.optimizers import v2_adamw_parameters
    from speedtronic.registry import build_model
    cfg = SpeedtronicConfig.load(ROOT / 'configs' / 'smoke.yaml')
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(v2_adamw_parameters(model), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x = torch.randint(0, 128, (2, 32))
    model(x, labels=x)['loss'].backward(); opt.step(); sched.step()
    state = {'model': model.state_dict(), 'optimizer': opt.state_dict(), 'scaler': None, 'scheduler': sched.state_dict(),
             'step': step, 'samples': 2 * step, 'tokens': 64 * step, 'config': cfg.to_dict(redact_secrets=True),
             'rng': {'python': random.getstate(), 'numpy': np.random.get_state(), 'torch': torch.get_rng_state()},
             'coordinator': None, 'precision': {'mode': 'fp32', 'autocast_enabled': False, 'use_scaler': False}}
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / f'step_{step:012d}.pt')
    (directory / 'latest.json').write_text(json.dumps({'step': step, 'file': f'step_{step:012d}.pt'}, indent=2))

def test_v2_checkpoint_resumes_from_the_cli(tmp_path):
    write_v2_checkpoint(tmp_path / 'checkpoints')
    res = subprocess.run([sys.executable, '-m', 'speedtronic', 'train', '--config', str(ROOT / 'configs' / 'smoke.yaml'),
                          '--device', 'cpu', '--resume', '--output-dir', str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, 'PYTHONPATH': str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert 'resumed from' in res.stdout and 'optimizer state written by 2.0' in res.stdout
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith('completed steps=4 samples=8 tokens=256 loss=') and not last.endswith('None')
    assert (tmp_path / 'checkpoints' / 'step_000000000004.pt').exists()
    assert (tmp_path / 'checkpoints' / 'step_000000000002.pt').exists()   # 2.0's file is not ours to prune
