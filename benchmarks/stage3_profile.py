"""Where a stage-3 step's time goes: phases, CPU time and context switches of both ranks, rank 0's profile.

Run under torchrun (gloo, 1 thread per rank), on an otherwise idle machine:

    torchrun --nproc-per-node 2 benchmarks/stage3_profile.py --model 4m --steps 60 [--reuse-distance N]

The engine is bench.py's stage-3 variant (GPT preset, `wrap=[Block]`, torch's
fused Adam, bucket 6,553,600, `overlap_comm`), one 128-token sequence per
rank. Each step is timed after a barrier; the medians of forward (with the
loss), backward and step are printed, then the CPU seconds (user, system)
and context switches per step summed over the ranks (`getrusage`), then the
functions of rank 0's cProfile by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.models.gpt import GPT, PRESETS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="4m")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reuse-distance", type=int, default=None, help="stage3_max_reuse_distance (default: its own)")
    p.add_argument("--top", type=int, default=12, help="profile rows to print")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model])
    zero = {"stage": 3, "reduce_bucket_size": 6_553_600, "overlap_comm": True}
    if args.reuse_distance is not None:
        zero["stage3_max_reuse_distance"] = args.reuse_distance
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4, fused=True),
                                  {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1},
                                  wrap=[type(model.blocks[0])])
    tokens = torch.randint(0, PRESETS[args.model].vocab_size, (1, 129), generator=torch.Generator().manual_seed(rank))
    phases = {"forward": [], "backward": [], "step": []}
    for _ in range(args.warmup):
        _step(engine, tokens, {k: [] for k in phases})
    profile = cProfile.Profile() if rank == 0 else None
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(args.steps):
        dist.barrier()
        if profile:
            profile.enable()
        _step(engine, tokens, phases)
        if profile:
            profile.disable()
    _report(rank, args, phases, before, profile)
    dist.destroy_process_group()


def _step(engine, tokens: torch.Tensor, phases: dict[str, list[float]]) -> None:
    start = time.perf_counter()
    logits = engine(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    forward = time.perf_counter()
    engine.backward(loss)
    backward = time.perf_counter()
    engine.step()
    phases["forward"].append(forward - start)
    phases["backward"].append(backward - forward)
    phases["step"].append(time.perf_counter() - backward)


def _report(rank: int, args, phases: dict[str, list[float]], before, profile) -> None:
    after = resource.getrusage(resource.RUSAGE_SELF)
    usage = torch.tensor([after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                          after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw], dtype=torch.float64)
    dist.all_reduce(usage)
    if rank != 0:
        return
    steps = args.steps
    medians = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
    total = [sum(t) * 1e3 for t in zip(*phases.values())]
    print(f"{args.model}: step {statistics.median(total):.1f} ms (median of {steps}); "
          + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    print(f"both ranks, per step: CPU user {usage[0] / steps * 1e3:.1f} ms, system {usage[1] / steps * 1e3:.1f} ms; "
          f"context switches {usage[2] / steps:.0f} voluntary, {usage[3] / steps:.0f} involuntary")
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]
    print("rank 0, own time per step:")
    for (file, line, name), (_, calls, own, _, _) in rows:
        print(f"  {own / steps * 1e3:6.2f} ms  {calls / steps:6.1f} calls  {name} ({file.split('/')[-1]}:{line})")


if __name__ == "__main__":
    main()
