"""The demo after torchrun restarts its ranks: where to resume, and the global batch on fewer ranks.

`zeroshard train --max-restarts N` hands restarts to torchrun's elastic
agent: when a rank dies, the agent stops the others and starts every rank
again (up to N times), with `TORCHELASTIC_RESTART_COUNT` counting the
restarts. A restarted rank resumes from the latest complete checkpoint of
`--save-dir` (its `latest`: an interrupted save never becomes it), so the
run goes on from the last checkpoint instead of the first step. A first
start resumes only from `--resume`.

The checkpoint says which step it ended (`demo_step`) and the global batch
it trained with (`global_batch`, rows per optimizer step). The batch of a
step is a function of the seed and the step alone (`CharCorpus.global_batch`),
so the data position is the step; on another number of ranks (an elastic
restart with fewer nodes) the same rows are split over the ranks left, with
gradient accumulation raised to keep the global batch.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from zeroshard.app.errors import UsageError
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.files import LATEST, read_state, resolve

log = logging.getLogger(__name__)


def restart_count() -> int:
    """How many times torchrun's agent has restarted the ranks (0 on a first start, or without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def resume_source(args: argparse.Namespace) -> str | None:
    """The checkpoint to resume from: after a restart, the latest complete one of --save-dir when it has one
    (the run's own progress); otherwise --resume (None: start from the first step)."""
    if restart_count() > 0 and args.save_every is not None and (Path(args.save_dir) / LATEST).is_file():
        return args.save_dir  # 'latest' names a complete checkpoint only (a save cut short is a hidden partial)
    return args.resume


def completed(args: argparse.Namespace) -> bool:
    """Whether a restarted run's latest checkpoint is already at --steps (a rank died after the last step,
    in the report or at exit): then there is nothing to train again."""
    source = resume_source(args)
    if restart_count() == 0 or source is None:
        return False
    try:
        done = read_state(resolve(source, None)).get("client_state", {}).get("demo_step", 0)
    except CheckpointError:  # the load says what is wrong with it
        return False
    if done >= args.steps:
        log.info("restart %d: %s is at step %d of %d; the run is complete", restart_count(), source, done, args.steps)
    return done >= args.steps


def keep_global_batch(args: argparse.Namespace, source: str, world: int) -> bool:
    """Set `args.accumulation` so that micro-batch x ranks x accumulation is the checkpoint's global batch;
    returns whether it changed. Raises `UsageError` naming the flags to change when no whole accumulation
    does it (a checkpoint of another program, without `global_batch`, changes nothing)."""
    try:
        rows = read_state(resolve(source, None)).get("client_state", {}).get("global_batch")
    except CheckpointError:  # the load says what is wrong with it, on every rank
        return False
    per_step = args.micro_batch * world
    if rows is None or rows == per_step * args.accumulation:
        return False
    if rows % per_step:
        raise UsageError(f"{source} trained with a global batch of {rows} rows per step; --micro-batch "
                         f"{args.micro_batch} x {world} ranks = {per_step} rows does not divide it, so no gradient "
                         "accumulation keeps it: give a --micro-batch (config train_micro_batch_size_per_gpu) "
                         f"that times {world} ranks divides {rows}, or run on as many ranks as that allows")
    log.info("resuming on %d ranks: gradient accumulation %d -> %d keeps the checkpoint's global batch of %d rows",
             world, args.accumulation, rows // per_step, rows)
    args.accumulation = rows // per_step
    return True


def resume(engine, schedule: torch.optim.lr_scheduler.LRScheduler, source: str, steps: int) -> int:
    """Load `source` into the engine, the LR schedule and the RNG; returns the number of steps already done."""
    path, client_state = engine.load_checkpoint(source, must_exist=True)  # a source names one: no (None, None)
    if "demo_step" not in client_state:
        raise CheckpointError(f"{path} was not written by the demo (`zeroshard train --save-every`), so it does "
                              "not say which step it ended; load it with engine.load_checkpoint in your own script")
    start = client_state["demo_step"]
    if start >= steps:
        raise CheckpointError(f"{path} is at step {start} and --steps is {steps}: nothing left to train; "
                              f"give --steps above {start}")
    schedule.load_state_dict(client_state["lr_schedule"])
    planned = client_state.get("schedule_steps", steps)
    if planned != steps:  # the schedule's shape is a function of --steps; only its position is in the checkpoint
        same = f" (give --steps {planned} to continue it unchanged)" if start < planned else ""
        log.warning("%s was trained on an LR schedule over %d steps; with --steps %d its steps from %d on follow "
                    "a schedule over %d, so their learning rates differ from that run's%s", path, planned, steps,
                    start + 1, steps, same)
    if "rng" in client_state:  # the demo draws nothing from it while training; a model with dropout would
        torch.set_rng_state(client_state["rng"])
    why = f"torchrun restart {restart_count()}" if restart_count() > 0 else "--resume"
    log.info("resumed from %s at step %d (%s)", path, start, why)
    return start


def save(engine, schedule: torch.optim.lr_scheduler.LRScheduler, args: argparse.Namespace, steps_done: int,
         global_batch: int) -> None:
    """Every --save-every steps and after the last one: a checkpoint with the demo's step, LR schedule,
    global batch and RNG (asynchronous with --async-save: published at a later step, or by the final wait)."""
    if args.save_every is None or (steps_done % args.save_every and steps_done != args.steps):
        return
    engine.save_checkpoint(args.save_dir, client_state={
        "demo_step": steps_done, "lr_schedule": schedule.state_dict(), "schedule_steps": args.steps,
        "global_batch": global_batch, "rng": torch.get_rng_state()})
