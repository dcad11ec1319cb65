"""The share of each optimizer step spent in zeroshard's step check (norm, non-finite flag and
counters in one all-gather), at stages 0-3, measured inside real steps of the demo GPT.

    torchrun --nproc-per-node 2 benchmarks/step_check_share.py --size 100m --steps 13

The time includes waiting in the all-gather for the slower rank, so it is an upper bound of
what the check adds (that wait would otherwise fall on the step's next collective).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import zeroshard
import zeroshard.engine.optimizer_step as engine_module
from zeroshard.app.models import GPT, PRESETS


def timed_check(spent: list[float]):
    check_step = engine_module.check_step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = check_step(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return result
    return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(PRESETS), default="4m")
    p.add_argument("--steps", type=int, default=33, help="steps per stage; the first 3 are not counted")
    args = p.parse_args()
    torch.set_num_threads(1)  # as benchmarks/bench.py: one thread per rank on a 2-core machine
    spent: list[float] = []
    engine_module.check_step = timed_check(spent)
    cfg = PRESETS[args.size]
    for stage in range(4):
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                                      {"zero_optimization": {"stage": stage}},
                                      wrap=[type(model.blocks[0])] if stage == 3 else None)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
        steps, spent[:] = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.backward(engine(tokens, tokens))
            engine.step()
            steps.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            step, check = statistics.median(steps[3:]), statistics.median(spent[3:])
            print(f"stage {stage}: step {step * 1e3:.1f} ms, step check {check * 1e3:.2f} ms "
                  f"({100 * check / step:.2f}%)", flush=True)


if __name__ == "__main__":
    main()
