"""Asynchronous checkpoint benchmark: the step during which a checkpoint is written, against a plain step
and against a synchronous save's stall (issue 27, acceptance 4: at most 1.2x a plain step at ~100M
parameters on 2 ranks).

    torchrun --nproc-per-node 2 benchmarks/async_save.py --model 100m --stage 2 --rounds 3

Each rank trains the demo GPT preset on random tokens. Per round: `--plain` plain steps (their median is
the plain step), then an asynchronous save (the call itself: its staging copy to host memory), then steps
until the save is published (each timed: the steps during which the checkpoint is written), then a
synchronous save of the same state (its whole write is a stall). Rank 0 prints one JSON line per round and
a summary: the ratio of the slowest step during a write to the plain step, the staging time, the
synchronous stall, and the bytes written. Checkpoints go to --dir (deleted at the end unless --keep).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.models import GPT, PRESETS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(PRESETS), default="100m")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain", type=int, default=5, help="plain steps per round (default: %(default)s)")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "zero_optimization": {"stage": args.stage}}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine = zeroshard.initialize(model, optimizer, config)
    cfg = model.cfg
    rank = dist.get_rank()
    root = Path(args.dir or (tempfile.mkdtemp(prefix="zeroshard-async-") if rank == 0 else ""))
    root = Path(_broadcast(str(root)))

    def step() -> float:
        x = torch.randint(cfg.vocab_size, (args.micro_batch, cfg.block_size), device=device)
        start = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up: buffers and optimizer state exist
    rounds = []
    for i in range(args.rounds):
        plain = statistics.median(step() for _ in range(args.plain))
        start = time.perf_counter()
        engine.save_checkpoint(root / "async", tag=f"round{i}", asynchronous=True)
        staging = time.perf_counter() - start
        during = []
        while engine._checkpoints.in_flight is not None:  # published at the end of the step that finds every file done
            during.append(step())
        start = time.perf_counter()
        engine.save_checkpoint(root / "sync", tag=f"round{i}")
        stall = time.perf_counter() - start
        size = sum(f.stat().st_size for f in (root / "sync" / f"round{i}").iterdir())
        row = {"round": i, "plain_step_s": plain, "staging_s": staging, "steps_during_write_s": during,
               "worst_ratio": max(during) / plain, "sync_save_s": stall, "bytes": size}
        rounds.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print(json.dumps({"model": args.model, "params": engine.num_params, "stage": args.stage, "dtype": args.dtype,
                          "world": dist.get_world_size(), "device": device.type,
                          "median_worst_ratio": statistics.median(r["worst_ratio"] for r in rounds),
                          "median_staging_s": statistics.median(r["staging_s"] for r in rounds),
                          "median_sync_save_s": statistics.median(r["sync_save_s"] for r in rounds),
                          "median_plain_step_s": statistics.median(r["plain_step_s"] for r in rounds)}))
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _broadcast(text: str) -> str:
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
