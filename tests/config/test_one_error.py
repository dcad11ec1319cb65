"""A config with three mistakes: one ConfigError names all three, and under torchrun on 2 ranks the output holds
it once (issue 28, acceptance 4): rank 0 raises it whole, rank 1 in one line, neither chained to another error.

The script runs as a user's would, under `torchrun --nproc-per-node 2`; its whole output is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = """
import torch, zeroshard
model = torch.nn.Linear(4, 4)
zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
    "zero_optimization": {"stage": "3"},                       # a string, not a number
    "bf16": {"enabled": True}, "fp16": {"enabled": True},      # two precisions
    "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,  # 30 is not a multiple of 4 x 2 ranks
})
"""
MISTAKES = [
    'zero_optimization.stage must be one of 0, 1, 2, 3; got "3"',
    "bf16.enabled and fp16.enabled are both true; enable one of them",
    "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 x world size 2 (= 8), so "
    "gradient_accumulation_steps cannot be derived from it; make train_batch_size a multiple of 8",
]


def test_three_mistakes_in_one_error_printed_once_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    for mistake in MISTAKES:
        assert output.count(mistake) == 1, (mistake, output)
    assert output.count("zeroshard.config.errors.ConfigError: invalid zeroshard config (dict):") == 1, output
    assert "rank 0's ConfigError names every problem" in output, output
    assert "During handling of the above exception" not in output, output
