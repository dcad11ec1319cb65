"""`zeroshard.accelerate.Accelerator` under `accelerate launch` on 2 CPU processes, against plain Accelerate (DDP).

One script (script.py beside this file), launched four times for the whole
file (module-scoped): plain Accelerate as the reference, zeroshard at
stages 2 and 3 (stage 3, every parameter sharded, calling save_state after
3 of its 6 steps and training on), and a second stage-3 run resumed from
that state. Stage 1 differs from stage 2 inside the engine only, which the
engine's own parity tests and tests/lightning cover; a launch costs about
20 s of start-up on the CI's 2 cores. The same
loop, data and seed each time; only the Accelerator differs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("script.py")
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 240
SAVE_AT = 3  # of the 6 optimizer steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, *args: str) -> dict:
    """`accelerate launch --multi_gpu --num_processes 2` of the script on CPU (gloo); rank 0's record.

    `--multi_gpu` is what starts several processes through torchrun: `--cpu` alone runs one (Accelerate's
    multi-CPU launch is mpirun's); with no GPU visible Accelerate makes them CPU processes on gloo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(SCRIPT), str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-6000:]}"
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("accelerate")
    state = tmp / "state"
    return {
        "ddp": launch(tmp / "ddp.json"),
        2: launch(tmp / "stage2.json", "--stage", "2", "--probe-errors"),
        3: launch(tmp / "stage3.json", "--stage", "3", "--save", str(state), "--at", str(SAVE_AT)),
        "resumed": launch(tmp / "resumed.json", "--stage", "3", "--resume", str(state), "--at", str(SAVE_AT)),
        "state": state,
    }


def max_relative(values, reference) -> float:
    assert len(values) == len(reference)
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(values, reference))


def assert_weights_close(weights: dict, reference: dict, atol: float) -> None:
    assert sorted(weights) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(reference[name]), atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("stage", [2, 3])
def test_training_equals_plain_accelerate(runs, stage):
    """Per micro-step losses, per step learning rates (the schedule stepped num_processes times a step, as
    Accelerate's DDP path does) and clip_grad_norm_'s norms, then the weights save_model writes."""
    run, ddp = runs[stage], runs["ddp"]
    assert len(ddp["losses"]) == 12 and len(ddp["lrs"]) == 6
    assert max_relative(run["losses"], ddp["losses"]) < 2e-5
    assert max_relative(run["lrs"], ddp["lrs"]) < 1e-12
    assert max_relative(run["norms"], ddp["norms"]) < 1e-5
    assert max(ddp["norms"]) > 1.0  # clipping at 1.0 took effect in some step
    assert_weights_close(run["weights"], ddp["weights"], atol=1e-4)


def test_resumed_run_equals_the_uninterrupted_one(runs):
    """load_state from the state saved after step 3 (the engine's checkpoint with Accelerate's files), the first
    batches skipped: the rest of the run, and the final weights, as without the interruption."""
    whole, resumed = runs[3], runs["resumed"]
    tail = len(resumed["lrs"])
    assert tail == 6 - SAVE_AT
    assert max_relative(resumed["losses"], whole["losses"][-2 * tail:]) < 1e-6
    assert resumed["lrs"] == whole["lrs"][-tail:]
    assert max_relative(resumed["norms"], whole["norms"][-tail:]) < 1e-6
    assert_weights_close(resumed["weights"], whole["weights"], atol=1e-6)
    names = {p.name for p in runs["state"].iterdir()}
    assert {"latest", "pytorch_model", "random_states_0.pkl", "random_states_1.pkl"} <= names


def test_clip_grad_norm_with_another_max_norm_names_the_fix(runs):
    kind, message = runs[2]["errors"]["clip"]
    assert kind == "ConfigError"
    assert "max_norm=0.5" in message and "clips to 1.0" in message
    assert "Accelerator(max_grad_norm=0.5)" in message and '"gradient_clipping": 0.5' in message


def test_a_second_model_is_refused(runs):
    errors = runs[2]["errors"]
    assert errors["second_model"][0] == "UnsupportedError" and "already given a model" in errors["second_model"][1]
    assert errors["two_models"][0] == "UnsupportedError" and "prepare got 2 models" in errors["two_models"][1]


def test_save_state_inside_a_window_names_sync_gradients(runs):
    kind, message = runs[2]["errors"]["mid_window_save"]
    assert kind == "UnsupportedError" and "inside an accumulation window (1 of its 2" in message
    assert "accelerator.sync_gradients is True" in message
