"""Training on a mesh (pp x dp x tp) beside the single-process reference on the same global batch.

A rank trains its model part (`GPTStage`, parallelized over tp with
`gpt_tp_plan`) for a few steps, with torch's 1F1B (or another) schedule when
pp > 1, and returns its losses and its part's full weights by the whole
GPT's parameter names, so the parent compares them with `train_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed.pipelining import schedules
from torch.distributed.tensor import DTensor

import zeroshard
from tests.recipes import Case, global_batch, make_optimizer
from zeroshard.app.models import GPT, PRESETS, GPTStage
from zeroshard.parallel import PipelineStage, parallelize_gpt

CFG = replace(PRESETS["tiny"], n_layer=4)  # 4 blocks: 2 per stage at pp=2


@dataclass(frozen=True)
class MeshCase:
    case: Case
    micro_batches: int = 1  # per step and dp rank: the pipeline's micro-batches (pp > 1)
    schedule: str = "Schedule1F1B"
    per_micro_batch: bool = False  # reduce-scatter after each micro-batch (stages 2-3)


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def rows_per_rank(mc: MeshCase) -> int:
    return mc.case.micro_rows * mc.case.accumulation * mc.micro_batches


def batch(step: int, mc: MeshCase, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, rows_per_rank(mc) * dp)
    return x[:, : CFG.block_size], y[:, : CFG.block_size]


def train_on_mesh(mesh, device, mc: MeshCase, steps: int):
    """(this rank's losses per step or None, {full name: full weight} of its part) after `steps` steps."""
    part = GPTStage(make_gpt(), mesh.rank("pp"), mesh.pp).to(device)
    parallelize_gpt(part, mesh)
    engine = zeroshard.initialize(part, make_optimizer(mc.case.optimizer, part), config=mc.case.config(),
                                  mesh=mesh, tied=part.tied())
    step_fn = _pipeline_step(engine, part, mesh, mc) if mesh.pp > 1 else _plain_step(engine, mesh, mc)
    losses = []
    for step in range(steps):
        x, y = batch(step, mc, mesh.dp)
        mine = slice(mesh.rank("dp") * rows_per_rank(mc), (mesh.rank("dp") + 1) * rows_per_rank(mc))
        losses.append(step_fn(x[mine].to(device), y[mine].to(device)))
    return losses, full_weights(engine, part)


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _plain_step(engine, mesh, mc: MeshCase):
    rows = mc.case.micro_rows

    def step(x, y):
        total = 0.0
        for micro in range(mc.case.accumulation):
            loss = _loss(engine(x[micro * rows:(micro + 1) * rows]), y[micro * rows:(micro + 1) * rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / mc.case.accumulation
        return total
    return step


def _pipeline_step(engine, part, mesh, mc: MeshCase):
    stage = PipelineStage(engine, reduce_per_micro_batch=mc.per_micro_batch)
    schedule = getattr(schedules, mc.schedule)(stage, n_microbatches=mc.micro_batches, loss_fn=_loss)

    def step(x, y):
        losses: list[torch.Tensor] = []
        if part.first:
            schedule.step(x)
        elif part.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        engine.step()
        return sum(l.item() for l in losses) / len(losses) if part.last else None
    return step


def full_weights(engine, part) -> dict[str, torch.Tensor]:
    """This part's weights as full tensors, by the whole GPT's names (every rank of the part must call it)."""
    state = engine.full_state_dict() if engine.config.stage == 3 else dict(part.named_parameters())
    out = {}
    for name, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[part.full_name(name)] = value.detach().cpu().clone()
    return out
