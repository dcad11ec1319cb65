"""An Accelerate training script, run by tests/accelerate/test_accelerate.py under `accelerate launch`.

    accelerate launch --multi_gpu --num_processes 2 tests/accelerate/script.py OUT.json [--stage S]
        [--save DIR --at K] [--resume DIR --at K] [--probe-errors]

Without --stage it is plain Accelerate (DDP); with it, the same loop on
`zeroshard.accelerate.Accelerator` at ZeRO stage S. A small MLP, fixed-seed
data (not shuffled), AdamW, a LambdaLR schedule, accumulation 2, clipping
1.0. Rank 0 writes OUT.json: per micro-step the mean loss over the ranks,
per optimizer step the learning rate and the norm clip_grad_norm_ returned,
and the final weights (through accelerator.save_model, read back).
--save DIR calls save_state after K optimizer steps and trains on;
--resume DIR calls load_state first and skips the K steps' batches.
--probe-errors records the messages of the refusals the tests check.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

ACCUMULATION, CLIP, BATCH, SAMPLES = 2, 1.0, 4, 96  # 96 / (4 x 2 ranks x 2) = 6 optimizer steps


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    inputs = torch.randn(SAMPLES, 8)
    targets = torch.randn(SAMPLES, 4)
    return model, DataLoader(TensorDataset(inputs, targets), batch_size=BATCH, shuffle=False)


def make_accelerator(stage: int | None):
    if stage is None:
        from accelerate import Accelerator
        return Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    from zeroshard.accelerate import Accelerator
    # Every parameter sharded at stage 3 (the default threshold would keep this small model's whole).
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return Accelerator(config=config, gradient_accumulation_steps=ACCUMULATION, max_grad_norm=CLIP, cpu=True)


def train(args) -> dict:
    accelerator = make_accelerator(args.stage)
    model, loader = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 40)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    done = 0
    if args.resume:
        accelerator.load_state(args.resume)
        done = args.at
        loader = accelerator.skip_first_batches(loader, done * ACCUMULATION)
    record = {"losses": [], "lrs": [], "norms": []}
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        record["losses"].append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients:
            done += 1
            record["norms"].append(float(norm))
            record["lrs"].append(scheduler.get_last_lr()[0])
            if args.save and done == args.at:
                accelerator.save_state(args.save)
    record["weights"] = final_weights(accelerator, model)
    if args.probe_errors:
        record["errors"] = probe_errors(accelerator, model)
    return record if accelerator.is_main_process else None


def final_weights(accelerator, model) -> dict:
    """The weights as accelerator.save_model writes them (every rank calls it; the main one writes)."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = accelerator.gather_for_metrics([tmp], use_gather_object=True)[0]  # rank 0's directory
        accelerator.save_model(model, directory)
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            return {}
        return {name: tensor.tolist() for name, tensor in load_file(f"{directory}/model.safetensors").items()}


def probe_errors(accelerator, model) -> dict:
    """The message of each refusal: another max_norm, a second model, two models at once, a save_state inside
    an accumulation window."""
    errors = {}
    probes = {"clip": lambda: accelerator.clip_grad_norm_(model.parameters(), 0.5),
              "second_model": lambda: accelerator.prepare(torch.nn.Linear(2, 2)),
              "two_models": lambda: accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))}
    for name, probe in probes.items():
        try:
            probe()
        except Exception as exc:  # the test checks the class and the message
            errors[name] = [type(exc).__name__, str(exc)]
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)  # one micro-batch of a new window, then a save
    engine = accelerator.engine  # outside the loop's accumulate: the engine's own micro-step
    engine.backward(F.mse_loss(model(x), y))
    engine.step()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            accelerator.save_state(tmp)
    except Exception as exc:
        errors["mid_window_save"] = [type(exc).__name__, str(exc)]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--at", type=int, default=0, help="optimizer steps before --save or --resume")
    parser.add_argument("--probe-errors", action="store_true")
    args = parser.parse_args()
    record = train(args)
    if record is not None:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
