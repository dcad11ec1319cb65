"""Offload: the same training with the optimizer state (and stage 3's parameters) on the host or on disk.

Against the same run without offload, in the same process: the arithmetic
is the same (the optimizer steps the same fp32 masters with the same kernel,
sub-group by sub-group; in bf16 the host's fp32 gradient shard is rounded as
the device's bf16 one would be), so losses and weights are bitwise equal, in
fp32 and bf16, with clipping, accumulation over 3 micro-steps, a block used
twice per forward and reentrant checkpointing (a unit's gradients arriving
in two backward passes). Every case also checks placement: after training
no master or optimizer state is in the device pool.

The copy-discipline mode (ZEROSHARD_OFFLOAD_POISON) fills the destination
of every asynchronous read or copy with NaN before issuing it and holds its
completion back: a read of a buffer before its wait would show as NaN in
the losses or weights, so training must still equal the run without offload.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import Case, relative_error, train_zeroshard
from zeroshard.offload.transfer import POISON_ENV

STEPS = 4


def _cases(nvme: str) -> list[Case]:
    disk = {"nvme_path": nvme}
    return [
        Case(stage=1, accumulation=3, clip=0.5, offload="cpu"),
        Case(stage=2, accumulation=3, offload="cpu", schedule=True),
        Case(stage=3, accumulation=3, clip=0.5, offload="cpu"),
        Case(stage=1, accumulation=3, offload="nvme", sub_group=1, **disk),  # more sub-groups than buffers
        Case(stage=2, accumulation=3, clip=0.5, offload="nvme", bucket=1500, **disk),
        Case(stage=3, accumulation=3, offload="nvme", variant="twice", sub_group=1, **disk),
        Case(stage=3, accumulation=3, clip=0.5, offload="cpu", offload_params="cpu", variant="twice"),
        Case(stage=3, accumulation=3, offload="nvme", offload_params="nvme", variant="reentrant", **disk),
        # No parameter shard kept in memory between the step and the next forward: every one read back.
        Case(stage=3, accumulation=2, clip=0.5, offload="cpu", offload_params="nvme", param_buffer=1, **disk),
        Case(stage=2, accumulation=2, offload="cpu", ratio=0.5),
        Case(stage=3, accumulation=2, offload="nvme", ratio=0.5, offload_params="cpu", **disk),
        # bf16: the host sums in fp32 what the device keeps in bf16 for a one-micro-step window, rounded alike.
        Case(stage=1, dtype="bf16", optimizer="adamw1_slow", clip=0.5, offload="nvme", **disk),
        Case(stage=2, dtype="bf16", optimizer="adamw1_slow", offload="cpu"),
        Case(stage=2, accumulation=3, dtype="bf16", optimizer="adamw1_slow", offload="nvme", sub_group=1, **disk),
        Case(stage=3, accumulation=3, dtype="bf16", optimizer="adamw1_slow", offload="nvme", offload_params="nvme",
             **disk),
        Case(stage=3, dtype="bf16", optimizer="adamw1_slow", offload="cpu", offload_params="cpu", variant="twice"),
    ]


def _placement(engine, case: Case) -> dict:
    device, host, disk = (engine.memory_stats(pool) for pool in ("device", "host", "disk"))
    return {"device": dict(device), "host": dict(host), "disk": dict(disk)}


def _run(rank, world, device, cases):
    out = []
    for case in cases:
        plain = train_zeroshard(rank, world, device, dataclasses.replace(case, offload="none",
                                                                         offload_params="none"), STEPS)
        from tests.recipes import run_zeroshard
        engine, losses = run_zeroshard(rank, world, device, case, STEPS)
        full = engine.full_state_dict()
        weights = torch.cat([full[n].reshape(-1).cpu() for n, _ in engine.module.named_parameters()])
        out.append((plain, (losses, weights), _placement(engine, case)))
        engine.offload.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_offload_equals_the_run_without_it(world, tmp_path):
    cases = _cases(str(tmp_path))
    per_rank = run_ranks(_run, world, cases)
    for i, case in enumerate(cases):
        (ref_losses, ref_weights), (losses, weights), pools = per_rank[0][i]
        assert losses == ref_losses, f"{case}: losses differ from the run without offload"
        assert torch.equal(weights, ref_weights), (
            f"{case}: weights differ from the run without offload ({relative_error(weights, ref_weights):.2e})")
        full = case.ratio == 1.0
        if full:
            assert pools["device"]["master"] == 0 and pools["device"]["optimizer"] == 0, (case, pools)
        tier = "disk" if case.offload == "nvme" else "host"
        assert pools[tier]["master"] > 0 and pools[tier]["optimizer"] > 0, (case, pools)
        if case.offload_params == "nvme":
            assert pools["disk"]["params"] > 0, (case, pools)
    assert not os.listdir(tmp_path) or all(not os.listdir(tmp_path / d) for d in os.listdir(tmp_path))


def _run_poisoned(rank, world, device, cases, delay_ms):
    os.environ[POISON_ENV] = str(delay_ms)
    try:
        return _run(rank, world, device, cases)
    finally:
        del os.environ[POISON_ENV]


def test_poisoned_transfers_change_nothing(tmp_path):
    disk = {"nvme_path": str(tmp_path)}
    cases = [
        Case(stage=3, accumulation=3, clip=0.5, offload="nvme", offload_params="nvme", **disk),
        Case(stage=3, accumulation=2, offload="nvme", offload_params="nvme", param_buffer=1, **disk),
        Case(stage=3, clip=0.5, offload="cpu", offload_params="nvme", param_buffer=2500, **disk),  # some kept
        Case(stage=2, accumulation=2, offload="nvme", bucket=1500, sub_group=1, **disk),
        Case(stage=1, clip=0.5, offload="nvme", **disk),
    ]
    for i, ((ref_losses, ref_weights), (losses, weights), _) in enumerate(run_ranks(_run_poisoned, 2, cases, 2)[0]):
        assert losses == ref_losses and torch.equal(weights, ref_weights), (
            f"{cases[i]}: poisoned transfers changed the training ({relative_error(weights, ref_weights):.2e})")


def _own_nvme_paths(rank, world, device, case, root):
    """Each rank its own nvme_path (one NVMe drive per GPU): the ranks agree, and train as on one path."""
    own = Path(root) / f"drive{rank}"
    own.mkdir()
    cases = (case, dataclasses.replace(case, nvme_path=str(own)))
    return [train_zeroshard(rank, world, device, c, STEPS) for c in cases]


def test_each_rank_may_offload_to_its_own_nvme_path(tmp_path):
    case = Case(stage=3, clip=0.5, offload="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    for (shared_losses, shared_weights), (losses, weights) in run_ranks(_own_nvme_paths, 2, case, str(tmp_path)):
        assert losses == shared_losses and torch.equal(weights, shared_weights), "per-rank nvme_paths differ"
