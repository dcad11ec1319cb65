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
from tests.recipes import Case, global_batch, make_optimizer, relative_error
from zeroshard.app.estimate.model_count import part_numels
from zeroshard.app.models import GPT, PRESETS, GPTStage, lm_loss
from zeroshard.estimate.formulas import comm_bytes_per_step, step_check_bytes
from zeroshard.estimate.parallel import part_state_bytes
from zeroshard.parallel import PipelineStage, parallelize_gpt

CFG = replace(PRESETS["tiny"], n_layer=4)  # 4 blocks: 2 per stage at pp=2


@dataclass(frozen=True)
class MeshCase:
    case: Case
    micro_batches: int = 1  # per step and dp rank: the pipeline's micro-batches (pp > 1)
    schedule: str = "Schedule1F1B"
    per_micro_batch: bool = False  # reduce-scatter after each micro-batch (stages 2-3)
    checkpointing: str = ""  # GPTConfig.checkpointing of each block ("deepspeed": the config's block applies)
    activation_checkpointing: dict | None = None  # the config's activation_checkpointing block


def make_gpt(checkpointing: str = "") -> GPT:
    torch.manual_seed(0)
    return GPT(replace(CFG, checkpointing=checkpointing))


def rows_per_rank(mc: MeshCase) -> int:
    return mc.case.micro_rows * mc.case.accumulation * mc.micro_batches


def batch(step: int, mc: MeshCase, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, rows_per_rank(mc) * dp)
    return x[:, : CFG.block_size], y[:, : CFG.block_size]


@dataclass
class Run:
    """What a rank brings back: its losses (None off the last stage), its part's full weights, its figures."""

    losses: list[float | None]
    weights: dict[str, torch.Tensor]
    memory: dict[str, int]
    comm: dict[str, dict[str, int]]  # dim -> op -> calls
    comm_bytes: dict[str, dict[str, int]]  # dim -> op -> logical bytes
    buckets: int  # each one reduction (a stage-3 unit reduces each of its buckets)
    tied_buckets: int  # buckets reduced with a copy of a tied parameter (at stage 3: its unit's buckets)
    local_numel: int  # trained elements of this rank's part
    padded_numel: int  # of its flat buffers, each padded to a multiple of dp
    part: tuple[int, int]  # (pp, tp) coordinates


def make_engine(mesh, device, mc: MeshCase):
    part = GPTStage(make_gpt(mc.checkpointing), mesh.rank("pp"), mesh.pp).to(device)
    parallelize_gpt(part, mesh)
    config = mc.case.config() | ({"activation_checkpointing": mc.activation_checkpointing}
                                 if mc.activation_checkpointing else {})
    engine = zeroshard.initialize(part, make_optimizer(mc.case.optimizer, part), config=config, mesh=mesh,
                                  tied=part.tied())
    step_fn = _pipeline_step(engine, mc) if mesh.pp > 1 else _plain_step(engine, mc)
    return engine, part, step_fn


def train_steps(mesh, device, mc: MeshCase, step_fn, steps: range) -> list[float | None]:
    losses = []
    for step in steps:
        x, y = batch(step, mc, mesh.dp)
        mine = slice(mesh.rank("dp") * rows_per_rank(mc), (mesh.rank("dp") + 1) * rows_per_rank(mc))
        losses.append(step_fn(x[mine].to(device), y[mine].to(device)))
    return losses


def train_on_mesh(mesh, device, mc: MeshCase, steps: int) -> Run:
    engine, part, step_fn = make_engine(mesh, device, mc)
    losses = train_steps(mesh, device, mc, step_fn, range(steps))
    return report(engine, part, losses)


def report(engine, part, losses) -> Run:
    tied = {id(t.param) for t in engine.cross.ties}
    stats = {dim: engine.comm_stats(dim) for dim in ("dp", "tp", "pp", "mesh")}
    comm = {dim: {op: s.calls for op, s in ops.items()} for dim, ops in stats.items()}
    comm_bytes = {dim: {op: s.bytes for op, s in ops.items()} for dim, ops in stats.items()}
    tied_buckets = sum(len(getattr(t, "buckets", [t])) for t in engine.reducer.targets
                       if any(id(p) in tied for p in t.params))
    return Run(losses, full_weights(engine, part), dict(engine.memory_stats()), comm, comm_bytes, len(engine.buckets),
               tied_buckets,
               sum(b.flat.numel for b in engine.buckets), sum(b.flat.padded_numel for b in engine.buckets),
               (engine.mesh.rank("pp"), engine.mesh.rank("tp")))


def reference(mc: MeshCase, dp: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the whole GPT on the same global batches."""
    model = make_gpt()
    opt = make_optimizer(mc.case.optimizer, model)
    losses = []
    for step in range(steps):
        x, y = batch(step, mc, dp)
        loss = lm_loss(model(x), y)
        loss.backward()
        if mc.case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), mc.case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_parity(runs: list[Run], mc: MeshCase, dp: int, steps: int) -> None:
    """Losses within 2e-5 and all weights within 1e-4 relative of the reference; training moved them."""
    ref_losses, ref_weights = reference(mc, dp, steps)
    losses = torch.tensor([r.losses for r in runs if r.losses[0] is not None]).mean(0)
    err = ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max().item()
    assert err <= 2e-5, f"{mc}: loss error {err:.2e}"
    names = sorted({n for r in runs for n in r.weights})
    assert names == sorted(ref_weights), f"{mc}: the parts hold {names}, the model {sorted(ref_weights)}"
    got = torch.cat([r.weights[n].reshape(-1) for r in runs for n in sorted(r.weights)])
    want = torch.cat([ref_weights[n].reshape(-1) for r in runs for n in sorted(r.weights)])
    initial = dict(make_gpt().named_parameters())
    start = torch.cat([initial[n].detach().reshape(-1) for r in runs for n in sorted(r.weights)])
    assert relative_error(got, want) <= 1e-4, f"{mc}: weight error {relative_error(got, want):.2e}"
    assert relative_error(got, start) > 1e-3, f"{mc}: training did not move the weights"


def _plain_step(engine, mc: MeshCase):
    rows = mc.case.micro_rows

    def step(x, y):
        total = 0.0
        for micro in range(mc.case.accumulation):
            loss = lm_loss(engine(x[micro * rows:(micro + 1) * rows]), y[micro * rows:(micro + 1) * rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / mc.case.accumulation
        return total
    return step


def _pipeline_step(engine, mc: MeshCase):
    stage = PipelineStage(engine, reduce_per_micro_batch=mc.per_micro_batch)
    kind = getattr(schedules, mc.schedule)
    stages = [stage] if issubclass(kind, schedules.PipelineScheduleMulti) else stage  # one stage per rank
    schedule = kind(stages, n_microbatches=mc.micro_batches, loss_fn=lm_loss)
    return lambda x, y: stage.train_step(schedule, x, y)


def full_weights(engine, part) -> dict[str, torch.Tensor]:
    """This part's weights as full tensors, by the whole GPT's names (every rank of the part must call it)."""
    state = engine.full_state_dict() if engine.config.stage == 3 else dict(part.named_parameters())
    out = {}
    for name, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[part.full_name(name)] = value.detach().cpu().clone()
    return out


def check_memory(run: Run, mc: MeshCase, mesh_sizes: dict[str, int]) -> None:
    """memory_stats() equals ZeRO's formula over this rank's part (fp32, after a step: no gradient left on
    .grad), and the part's trained elements are what `zeroshard estimate --tp --pp` counts."""
    assert run.local_numel == part_numels(CFG, pp=mesh_sizes["pp"], tp=mesh_sizes["tp"])[run.part]
    sgd = mc.case.optimizer == "sgd"
    want = part_state_bytes(run.padded_numel, mesh_sizes["dp"], mc.case.stage, optimizer_bytes=4 if sgd else 8,
                            optimizer_scalar_bytes=0 if sgd else 4 * run.buckets)
    got = {k: run.memory[k] for k in want}
    assert got == want, f"{mc} part {run.part}: memory_stats {got}, formula {want}"


def check_comm(run: Run, mc: MeshCase, world: int, steps: int) -> None:
    """comm_stats() by dimension equals the formulas: dp, ZeRO's bytes per step over this rank's part
    (stages 0-2, reduced once a step or once per micro-step); pp, one fp32 sum of the tied embedding per
    step on the stages that hold it; mesh, the step check over every rank."""
    if mc.case.stage < 3 and not mc.per_micro_batch:
        want = comm_bytes_per_step(run.padded_numel, mc.case.stage, accumulation=mc.case.accumulation)
        got = {op: run.comm_bytes["dp"].get(op, 0) for op in want}
        assert got == {op: steps * n for op, n in want.items()}, f"{mc} part {run.part}: dp bytes {got}"
    tie = CFG.vocab_size * CFG.n_embd * 4 if run.tied_buckets else 0
    assert run.comm_bytes["pp"].get("all_reduce", 0) == steps * tie
    assert run.comm_bytes["mesh"]["step_check"] == steps * step_check_bytes(world)


def check_mesh_runs(runs: list[Run], mc: MeshCase, mesh_sizes: dict[str, int], steps: int) -> None:
    """Every rank's run of one case on a mesh: parity with one process, then each rank's traffic and memory."""
    check_parity(runs, mc, mesh_sizes["dp"], steps)
    for run in runs:
        check_comm(run, mc, mesh_sizes["pp"] * mesh_sizes["dp"] * mesh_sizes["tp"], steps)
        check_memory(run, mc, mesh_sizes)
