"""dp2 x tp2 (4 ranks): ZeRO stages 0-3 over dp with DTensor tensor parallelism over tp reproduce one process.

The GPT's blocks are split Megatron's way (`gpt_tp_plan`); each rank's engine
flattens, shards and reduces its local DTensor parts. A second model runs
its LayerNorm sequence-parallel: its gradient comes out `Partial` over tp
and must be summed over tp before the dp reduction (the "tp" comm records it).
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import zeroshard
from tests.distributed import run_ranks
from tests.parallel.mesh_recipes import (
    MeshCase,
    check_mesh_runs,
    make_engine,
    reference,
    train_on_mesh,
    train_steps,
)
from tests.recipes import Case, relative_error
from zeroshard.errors import ModelError
from zeroshard.parallel import build_mesh

STEPS = 6
CASES = [
    MeshCase(Case(stage=0, clip=0.5)),
    MeshCase(Case(stage=1, accumulation=2)),
    MeshCase(Case(stage=2, clip=0.5, optimizer="sgd")),
    MeshCase(Case(stage=3, accumulation=2)),
]


BF16 = MeshCase(Case(stage=2, dtype="bf16", optimizer="adamw1_slow"))


class SPNet(nn.Module):
    """LayerNorm on sequence-sharded activations, then a column/row-split MLP."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        return self.out(torch.relu(self.fc(self.ln(x))))


SP_PLAN = {"ln": SequenceParallel(), "fc": ColwiseParallel(input_layouts=Shard(1)),
           "out": RowwiseParallel(output_layouts=Shard(1))}


def sp_batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step))  # (dp x 2 rows, sequence, features)


def sp_reference(steps: int):
    torch.manual_seed(0)
    net = SPNet()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(steps):
        net(sp_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


def train_sp(mesh, device, stage: int, steps: int):
    torch.manual_seed(0)
    net = parallelize_module(SPNet().to(device), mesh.device_mesh["tp"], SP_PLAN)
    engine = zeroshard.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}}, mesh=mesh)
    tp, dp = mesh.rank("tp"), mesh.rank("dp")
    for step in range(steps):
        x = sp_batch(step)[2 * dp: 2 * dp + 2].chunk(2, dim=1)[tp].to(device)  # this rank's rows and tokens
        out = engine(x)
        engine.backward(out.square().sum() / (2 * 8 * 16))  # its part of the global mean
        engine.step()
    weights = {n: p.full_tensor().detach().cpu() for n, p in net.named_parameters()}
    torch.manual_seed(0)
    unknown = parallelize_module(SPNet().to(device), mesh.device_mesh["tp"], SP_PLAN)
    with pytest.raises(ModelError, match="DTensors"):  # tp without the mesh: its gradients cannot be summed
        zeroshard.initialize(unknown, torch.optim.AdamW(unknown.parameters()), {})
    return weights, engine.comm_stats("tp")["all_reduce"].calls


def resume(mesh, device, mc: MeshCase, ckpt) -> tuple[list, list]:
    """Losses of 2 steps after a checkpoint at step 2: by the run that saved it, and by a fresh engine loading it."""
    ran = []
    for load in (False, True):
        engine, part, step_fn = make_engine(mesh, device, mc)
        if load:
            engine.load_checkpoint(ckpt)
        else:
            train_steps(mesh, device, mc, step_fn, range(2))
            engine.save_checkpoint(ckpt)
        ran.append(train_steps(mesh, device, mc, step_fn, range(2, 4)))
    return ran[0], ran[1]


def _ranks(rank, world, device, cases, ckpt):
    mesh = build_mesh(tp=2)
    runs = [train_on_mesh(mesh, device, mc, STEPS) for mc in cases]
    bf16 = train_on_mesh(mesh, device, BF16, STEPS).losses  # DTensor parameters cast: swapped, not re-pointed
    return runs, train_sp(mesh, device, 2, STEPS), resume(mesh, device, cases[3], ckpt), bf16


def test_dp2_tp2_stages_0_to_3_match_one_process(tmp_path):
    per_rank = run_ranks(_ranks, 4, CASES, tmp_path)
    for i, mc in enumerate(CASES):
        runs = [r[0][i] for r in per_rank]
        check_mesh_runs(runs, mc, {"pp": 1, "dp": 2, "tp": 2}, STEPS)
        for r in runs:  # the tp pair's replicated parameters take the same update on both ranks
            assert torch.equal(r.weights["wte.weight"], runs[0].weights["wte.weight"])
    ref = sp_reference(STEPS)
    for weights, tp_sums in (r[1] for r in per_rank):
        got, want = torch.cat([w.reshape(-1) for w in weights.values()]), torch.cat([ref[n].reshape(-1) for n in weights])
        assert relative_error(got, want) <= 1e-4, f"sequence parallel: weight error {relative_error(got, want):.2e}"
        assert tp_sums == 2 * STEPS, "the LayerNorm's weight and bias are summed over tp once per step each"
    for saved_run, reloaded in (r[2] for r in per_rank):  # tp's local shards saved per model part, exactly
        assert saved_run == reloaded
    fp32 = torch.tensor(reference(BF16, 2, STEPS)[0])
    for losses in (r[3] for r in per_rank):  # bf16 rounding only: within 1% of fp32 training
        assert ((torch.tensor(losses) - fp32).abs() / fp32).max() <= 1e-2, losses
