"""`zeroshard tune`'s calibration: what one rank of this machine holds and how fast it computes, measured on
every rank at once (they share the machine's cores and memory bandwidth, as in training).

`python -m zeroshard.app.tune_calibrate --model M --seq S --micro-batches B1 B2 --measure cgroup|rlimit --out FILE`
runs as the ranks of a trial (`tune_trials.run_trial`, uncapped). Each rank:

- reads the memory it holds without a model, as the trials' limit counts it
  (its memory group's usage, or VmData under RLIMIT_DATA): Python, torch and
  the demo's modules, the process group, the demo's corpus, and what torch
  keeps once it has run a step (its kernels' buffers and thread pools, the
  allocator's retained free memory). This is `runtime`, the first term of
  every predicted peak;
- times a training forward and backward of the model (its loss, in the
  training dtype, no checkpointing) at each micro-batch: the step-time
  model's cost of a micro-step, a + b x micro-batch;
- times AdamW steps over one flat fp32 tensor of a rank's shard (the engine
  steps flat master shards): seconds per element;
- times all-reduces of a buffer over the ranks: bytes each rank sends per second.

Rank 0 writes the slowest rank's figures (the largest memory and times, the
smallest bandwidth) to --out as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard.app.train  # noqa: F401  what a trial's rank imports is part of the runtime it holds
from zeroshard.app.activation_count import training_forward
from zeroshard.app.data import CharCorpus, load_text
from zeroshard.app.flags import positive_int
from zeroshard.app.tune_trials import held_now
from zeroshard.dtypes import TRAINING_DTYPES
from zeroshard.estimate import shard_numel, wire_bytes

_REPEATS = 2  # timed runs of each measurement after one warm-up; the fastest counts
_COMM_ELEMENTS = 4_000_000  # the all-reduce's buffer, fp32 (16 MB): long enough that latency is a small part


def _fastest(work, device: torch.device) -> float:
    """Seconds of the fastest of `_REPEATS` runs of `work()`, after one run that warms up."""
    best = float("inf")
    for repeat in range(_REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:
            best = min(best, time.perf_counter() - start)
    return best


def _forward_backward(args: argparse.Namespace, micro_batch: int, device: torch.device) -> float:
    model, _, forward = training_forward(args.model, micro_batch, args.seq, "none", args.dtype, str(device))

    def step() -> None:
        forward().float().backward()
        model.zero_grad(set_to_none=True)

    return _fastest(step, device)


def _adam_per_element(numel: int, device: torch.device) -> float:
    master = torch.zeros(numel, device=device, requires_grad=True)
    master.grad = torch.full_like(master, 1e-3)
    optimizer = torch.optim.AdamW([master], lr=1e-4)
    return _fastest(optimizer.step, device) / numel


def _bandwidth(world: int, device: torch.device) -> float | None:
    """Bytes each rank sends per second in an all-reduce (None for one rank: nothing is sent)."""
    if world == 1:
        return None
    buffer = torch.ones(_COMM_ELEMENTS, device=device)
    seconds = _fastest(lambda: dist.all_reduce(buffer), device)
    return wire_bytes(buffer.numel() * buffer.element_size(), world, "all_reduce") / seconds


def measure(args: argparse.Namespace) -> dict:
    """This rank's figures (the process group is up)."""
    world = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    corpus = CharCorpus.from_text(load_text(None))  # the demo's ranks hold their corpus while they train
    bandwidth = _bandwidth(world, device)
    sizes = sorted(set(args.micro_batches))
    compute = {str(sizes[0]): _forward_backward(args, sizes[0], device)}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # torch's first kernels set up buffers and thread pools of their own, and the allocator keeps some of what
    # a step freed: the runtime is what stays once a step of this model has run and its model is gone.
    runtime = torch.cuda.memory_reserved(device) if device.type == "cuda" else held_now(args.measure)
    compute |= {str(b): _forward_backward(args, b, device) for b in sizes[1:]}
    del corpus
    return {"runtime": runtime, "forward_backward": compute, "bandwidth": bandwidth,
            "adam_per_element": _adam_per_element(shard_numel(args.numel, world), device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zeroshard.app.tune_calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--numel", type=positive_int, required=True, help="Ψ: the parameters the engine steps")
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--micro-batches", type=positive_int, nargs="+", required=True)
    parser.add_argument("--dtype", choices=TRAINING_DTYPES, default="fp32")
    parser.add_argument("--measure", choices=("cgroup", "rlimit"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # As the demo's ranks do (app/train.py): the machine's cores shared among this machine's ranks.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measure(args))
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(slowest(everyone), indent=2) + "\n", encoding="utf-8")
    finally:
        dist.destroy_process_group()


def slowest(ranks: list[dict]) -> dict:
    """The figures that bound a step: the largest runtime and times over the ranks, the smallest bandwidth."""
    bandwidths = [r["bandwidth"] for r in ranks if r["bandwidth"] is not None]
    return {"runtime": max(r["runtime"] for r in ranks),
            "forward_backward": {b: max(r["forward_backward"][b] for r in ranks) for b in ranks[0]["forward_backward"]},
            "adam_per_element": max(r["adam_per_element"] for r in ranks),
            "bandwidth": min(bandwidths) if bandwidths else None, "ranks": len(ranks)}


if __name__ == "__main__":
    main()
