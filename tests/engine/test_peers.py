"""Peers in the same run: stage 0 tracks DistributedDataParallel, stage 1 ZeroRedundancyOptimizer,
stage 3 FSDP2's fully_shard with the same units (each Block, then the root)."""

import contextlib
import dataclasses

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tests.distributed import run_ranks
from tests.recipes import (
    ADAMW1,
    Case,
    flat_weights,
    make_model,
    micro_batch,
    relative_error,
    train_zeroshard,
)

STEPS = 6
CASE = Case(accumulation=2, clip=0.5, optimizer="adamw1")


def _train_peer(rank, world, device, peer: str):
    model = make_model(device=device)
    ddp = DistributedDataParallel(model)
    if peer == "zero_redundancy":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW1)
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW1)
    return _peer_steps(ddp, model, opt, rank, world, device, ddp.no_sync), flat_weights(model)


def _peer_steps(wrapped, model, opt, rank, world, device, no_sync=None) -> list[float]:
    """The peers' loop: CASE's accumulation (gradient sync only in the last micro-step when
    `no_sync` is given), clipping, and the mean loss of each step."""
    losses = []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(CASE.accumulation):
            last = micro == CASE.accumulation - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                x, y = (t.to(device) for t in micro_batch(step, CASE, world, rank, micro))
                loss = wrapped(x, y) / CASE.accumulation
                loss.backward()
                step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CASE.clip)
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses


def _train_fsdp2(rank, world, device):
    from zeroshard.app.models.gpt import Block

    model = make_model(device=device)
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW1)
    losses = _peer_steps(model, model, opt, rank, world, device)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, torch.cat([full[name].reshape(-1).cpu() for name, _ in model.named_parameters()])


def _side_by_side(rank, world, device):
    return {
        "ddp": _train_peer(rank, world, device, "ddp"),
        "stage0": train_zeroshard(rank, world, device, dataclasses.replace(CASE, stage=0), STEPS),
        "zero_redundancy": _train_peer(rank, world, device, "zero_redundancy"),
        "stage1": train_zeroshard(rank, world, device, dataclasses.replace(CASE, stage=1), STEPS),
        "fsdp2": _train_fsdp2(rank, world, device),
        "stage3": train_zeroshard(rank, world, device, dataclasses.replace(CASE, stage=3), STEPS),
    }


def test_stages_track_their_peers():
    for res in run_ranks(_side_by_side, 2):
        for ours, peer in (("stage0", "ddp"), ("stage1", "zero_redundancy"), ("stage3", "fsdp2")):
            our_losses, peer_losses = torch.tensor(res[ours][0]), torch.tensor(res[peer][0])
            assert ((our_losses - peer_losses).abs() / peer_losses).max() <= 2e-5, (ours, peer)
            assert relative_error(res[ours][1], res[peer][1]) <= 1e-4, (ours, peer)
            assert relative_error(res[ours][1], flat_weights(make_model())) > 1e-3
