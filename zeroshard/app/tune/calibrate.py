"""`zeroshard tune`'s calibration: what one rank of this machine holds and how fast it computes, measured on
every rank at once (they share the machine's cores and memory bandwidth, as in training).

`python -m zeroshard.app.tune.calibrate --model M --seq S --micro-batches B1 B2 --measure cgroup|rlimit --out FILE`
runs as the ranks of a trial (`tune_trials.run_trial`, uncapped). Each rank:

- reads the memory it holds without a model, as the trials' limit counts it
  (its memory group's usage, or VmData under RLIMIT_DATA): Python, torch and
  the demo's modules, the process group, the demo's corpus, and what torch
  keeps once it has run a small step of the model (its kernels' buffers and
  thread pools). This is `runtime`, the first term of every predicted peak;
- times a training forward and backward of the model (its loss, in the
  training dtype, no checkpointing) at each micro-batch: the step-time
  model's cost of a micro-step, a + b x micro-batch; and reads what the first
  one adds to its memory at its peak, its gradients already there: the saved
  activations and the temporaries of both passes, whose ratio to the counted
  activations is the predicted peak's `workspace`;
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

import zeroshard.app.demo.train  # noqa: F401  what a trial's rank imports is part of the runtime it holds
from zeroshard.app.estimate.activation_count import training_forward
from zeroshard.app.demo.data import CharCorpus, load_text
from zeroshard.app.flags import positive_int
from zeroshard.app.tune.trials import held_now, peak_since_reset, reset_peak
from zeroshard.dtypes import TRAINING_DTYPES
from zeroshard.estimate import shard_numel, wire_bytes

_REPEATS = 2  # timed runs of each measurement after one warm-up; the fastest counts
_COMM_ELEMENTS = 4_000_000  # the all-reduce's buffer, fp32 (16 MB): long enough that latency is a small part


def _fastest(work, device: torch.device, warm_up: bool = True) -> float:
    """Seconds of the fastest of `_REPEATS` runs of `work()`, after one run that warms up (unless it has)."""
    best = float("inf")
    for repeat in range(_REPEATS + warm_up):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat or not warm_up:
            best = min(best, time.perf_counter() - start)
    return best


def _forward_backward(args: argparse.Namespace, micro_batch: int, device: torch.device) -> tuple[float, int]:
    """(seconds of the fastest forward + backward of `micro_batch` rows, bytes the first one added at its peak).

    The gradients exist before it, as an engine's gradient buffers do, so what it adds is the activations and
    the temporaries of both passes: the workspace of a step beyond the saved activations.
    """
    model, _, forward = training_forward(args.model, micro_batch, args.seq, "none", args.dtype, str(device))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # backward accumulates into them in place
    gc.collect()

    def step() -> None:
        forward().float().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        added = torch.cuda.max_memory_allocated(device) - before
    else:
        before = reset_peak(args.measure)
        step()  # the first, in memory no earlier step has left to the allocator
        added = peak_since_reset(args.measure) - before
    return _fastest(step, device, warm_up=False), added


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
    # torch's first kernels set up buffers and thread pools of their own, and its optimizers' first use imports
    # torch._dynamo (tens of MB): the runtime is what stays once a step of the small GPT (the same kinds of
    # layers, next to no memory of its own for the allocator to keep) and its AdamW have run.
    model, _, forward = training_forward("tiny", 1, 8, "none", args.dtype, str(device))
    forward().float().backward()
    torch.optim.AdamW(model.parameters()).step()
    del model, forward
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runtime = torch.cuda.memory_reserved(device) if device.type == "cuda" else held_now(args.measure)
    # the largest first: memory an earlier one freed, which the allocator keeps, would hide what a later one adds
    measured = {str(b): _forward_backward(args, b, device) for b in sorted(set(args.micro_batches), reverse=True)}
    del corpus
    return {"runtime": runtime, "forward_backward": {b: seconds for b, (seconds, _) in measured.items()},
            "step_added": {b: added for b, (_, added) in measured.items()}, "bandwidth": bandwidth,
            "adam_per_element": _adam_per_element(shard_numel(args.numel, world), device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zeroshard.app.tune.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--numel", type=positive_int, required=True, help="Ψ: the parameters the engine steps")
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--micro-batches", type=positive_int, nargs="+", required=True)
    parser.add_argument("--dtype", choices=TRAINING_DTYPES, default="fp32")
    parser.add_argument("--measure", choices=("cgroup", "rlimit"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # As the demo's ranks do (app/demo/train.py): the machine's cores shared among this machine's ranks.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measure(args))
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(slowest(everyone), indent=2) + "\n", encoding="utf-8")
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        gc.collect()
        dist.destroy_process_group()


def slowest(ranks: list[dict]) -> dict:
    """The figures that bound a step: the largest runtime and times over the ranks, the smallest bandwidth."""
    bandwidths = [r["bandwidth"] for r in ranks if r["bandwidth"] is not None]
    return {"runtime": max(r["runtime"] for r in ranks),
            "forward_backward": {b: max(r["forward_backward"][b] for r in ranks) for b in ranks[0]["forward_backward"]},
            "step_added": {b: max(r["step_added"][b] for r in ranks) for b in ranks[0]["step_added"]},
            "adam_per_element": max(r["adam_per_element"] for r in ranks),
            "bandwidth": min(bandwidths) if bandwidths else None, "ranks": len(ranks)}


if __name__ == "__main__":
    main()
