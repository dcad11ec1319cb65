"""The error-feedback invariant through the engine: over 50 steps, what the codec delivered sums to the exact means.

An engine trains a model whose gradients are set (loss = sum_i <w_i, g_i>,
so d loss / d w_i = g_i exactly) with SGD, lr 1 and no clipping, from zero
weights: after T steps each rank's master is minus the sum of the gradients
the optimizer was delivered. Every rank draws 50 steps of gradients (seeded
per step, micro-step, rank and parameter; Gaussian times a magnitude of
10^-2 to 10^2 drawn for each), so every rank can work out every rank's
gradient and the exact mean of each step in float64: the reference.

The invariant (comm/compress/reduce.py): each message's residual e is what it
left out, sent with the next one, so the delivered sum telescopes. For each
hop, the sum over the steps of what was delivered minus the sum of the exact
means is -(1/N) sum_j e_j(T) of the ranks' last residuals (qgZ's hop 2 and
stage 0's gather likewise; a gathered chunk's residual counts whole, every
rank decodes the same bytes), times 1/accumulation, the scale applied after
the codec. Checked: at stages 0-3, 2 and 4 gloo ranks (flat, and 4 declared
2 nodes x 2: qgZ's two hops), every codec with and without the Hadamard
rotation, and with 2 micro-steps a window at stages 1 (one reduction a
window) and 2 (one a micro-step); LAYOUTS says which where.

Tolerance: the identity is exact in real arithmetic; in fp32 each step
rounds the sum g + e, the new residual, the receivers' sum of N values, the
division by N, the scale after and the optimizer's update, each within one
unit roundoff u = 2^-24 of a value at most N times the step's largest
gradient. So the max-abs deviation is held to 4 N u sum_t max|g_t| (4 ulps
of the step maxima, N of them; fp32 stayed under a tenth of it here); and that tolerance
must be 100 times smaller than the sum of each step's largest error, so the
check could see a residual applied twice or lost (the errors feedback keeps
from adding up).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard
from zeroshard.dtypes import DTYPES
from tests.comm.compress.test_reduce import _left as held_of_chunk
from tests.distributed import run_ranks

STEPS = 50
SIZES = ((700, 301), (999, 333))  # two pieces (stage 3's units) of two parameters; no size a multiple of a block
U = 2.0 ** -24
CODECS = [(fmt, rotated) for fmt in ("int8", "int4", "fp8_e4m3", "fp8_e5m2") for rotated in (False, True)]


class Piece(nn.Module):
    """Two parameters whose gradients are the forward's inputs."""

    def __init__(self, sizes: tuple[int, int]):
        super().__init__()
        self.a, self.b = (nn.Parameter(torch.zeros(n)) for n in sizes)

    def forward(self, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
        # In fp32 (fp16 training: the loss stays finite; the gradient is still exactly fp16(g) x the loss scale)
        return (self.a.float() * ga.float()).sum() + (self.b.float() * gb.float()).sum()


class Given(nn.Module):
    def __init__(self):
        super().__init__()
        self.pieces = nn.ModuleList(Piece(s) for s in SIZES)

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        return sum(piece(*grads[2 * i: 2 * i + 2]) for i, piece in enumerate(self.pieces))


def gradients(step: int, micro: int, rank: int, dtype: str = "fp32") -> list[torch.Tensor]:
    """Rank `rank`'s gradient of each parameter at `step`, `micro`: Gaussian times 10^U(-2, 2) (fp16: rounded to
    it, as the engine casts the inputs)."""
    g = torch.Generator().manual_seed(((step * 7 + micro) * 16 + rank) * 1000)
    return [(torch.randn(n, generator=g) * 10.0 ** (4 * torch.rand((), generator=g).item() - 2)).to(DTYPES[dtype])
            for sizes in SIZES for n in sizes]


def config(stage: int, fmt: str, rotated: bool, accumulation: int, dtype: str, nodes: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 1200, "allgather_bucket_size": 1200}
    if stage == 3:
        zero |= {"stage3_wrap_classes": ["Piece"], "stage3_param_persistence_threshold": 0}
    if nodes > 1:
        zero["zeropp_ranks_per_node"] = 2
    # fp16: the loss scale doubles every 10 steps (1 to 32), the reduction in fp32 (a 16-bit shard rounds more)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 0, "loss_scale_window": 10},
            "communication_data_type": "fp32"} if dtype == "fp16" else {}
    return fp16 | {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0, "zero_optimization": zero,
            "communication_compression": {"gradients": {"codec": fmt, "hadamard": rotated,
                                                         "hierarchical": nodes > 1}}}


def _train(rank: int, world: int, stage: int, fmt: str, rotated: bool, accumulation: int, dtype: str,
           nodes: int) -> dict:
    """50 steps; per bucket: this rank's delivered sum, the exact sum, the residuals' share, the step errors."""
    model = Given()
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                  config(stage, fmt, rotated, accumulation, dtype, nodes))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    exact_sum = [torch.zeros(n, dtype=torch.float64) for sizes in SIZES for n in sizes]
    before = [b.master.double().clone() for b in engine.buckets]
    step_error = [0.0] * len(engine.buckets)
    largest = 0.0  # sum over the steps of the largest gradient any rank had
    for step in range(STEPS):
        exact = [torch.zeros(n, dtype=torch.float64) for sizes in SIZES for n in sizes]
        for micro in range(accumulation):
            every = [gradients(step, micro, r, dtype) for r in range(world)]
            for r in range(world):
                for i, g in enumerate(every[r]):
                    exact[i] += g.double() / (world * accumulation)
            largest += max(g.abs().max().item() for grads in every for g in grads)
            engine.backward(engine(*every[rank]))
            engine.step()
        for i, e in enumerate(exact):
            exact_sum[i] += e
        for j, bucket in enumerate(engine.buckets):
            now = bucket.master.double().clone()
            step_error[j] += (before[j] - now - _mine(bucket, exact, index)).abs().max().item()
            before[j] = now
    held = []
    for bucket in engine.buckets:
        every = [None] * world
        dist.all_gather_object(every, bucket.feedback.tensors())
        held.append(every)
    return {"delivered": [-b.master.double() for b in engine.buckets],
            "exact": [_mine(b, exact_sum, index) for b in engine.buckets],
            "held": held, "step_error": step_error, "largest": largest, "sharded": stage >= 1,
            "loss_scale": engine.loss_scale}


def _mine(bucket, values: list[torch.Tensor], index: dict[int, int]) -> torch.Tensor:
    """`values` (one per parameter) laid out as the bucket's padded flat buffer: this rank's shard of it, or all."""
    full = torch.zeros(bucket.flat.padded_numel, dtype=torch.float64)
    for view, p in zip(bucket.flat.views(full), bucket.params):
        view.copy_(values[index[id(p)]].view_as(view))
    return bucket.flat.shard(full) if bucket.switches.shard_optimizer else full


# 2 ranks: every codec at stage 2 and every format at the other stages, the rotation on for half of them
# (the other half at stage 2 with 2 micro-steps), and with 2 micro-steps a window at stages 1 and 2. 4 ranks
# (flat, and 2 nodes x 2: qgZ's two hops): every stage, a format each, the rotation on for half of them; with
# 2 micro-steps at stage 2 over the two hops. (Each 4-rank case costs a 2-rank one's time four times over.)
ALTERNATE = {1: [("int8", False), ("int4", True), ("fp8_e4m3", True), ("fp8_e5m2", False)],
             2: [("int8", True), ("int4", False), ("fp8_e4m3", False), ("fp8_e5m2", True)]}
LAYOUTS = {(2, 1): [(stage, *codec, 1, "fp32") for stage in (0, 1, 3) for codec in ALTERNATE[1]]
                   + [(2, *codec, 1, "fp32") for codec in CODECS]
                   + [(1, *codec, 2, "fp32") for codec in ALTERNATE[1]]
                   + [(2, *codec, 2, "fp32") for codec in ALTERNATE[2]]
                   # fp16: the loss scale changes (x2 every 10 steps); at stage 1 one reduction a window of 2
                   + [(stage, "int8", False, 1, "fp16") for stage in (0, 2, 3)] + [(1, "int4", True, 2, "fp16")],
           (4, 1): [(stage, *ALTERNATE[1][stage], 1, "fp32") for stage in (0, 1, 2, 3)],
           (4, 2): [(stage, *ALTERNATE[2][stage], 1, "fp32") for stage in (0, 1, 2, 3)]
                   + [(2, *ALTERNATE[2][2], 2, "fp32")]}
PARAMS = [(world, nodes, *case) for (world, nodes), cases in LAYOUTS.items() for case in cases]


def _cases(rank: int, world: int, device, nodes: int) -> dict:
    return {case: _train(rank, world, *case, nodes) for case in LAYOUTS[world, nodes]}


@functools.lru_cache(maxsize=None)
def results(world: int, nodes: int) -> list[dict]:
    return run_ranks(_cases, world, nodes)


@pytest.mark.parametrize("world,nodes,stage,fmt,rotated,accumulation,dtype", PARAMS,
                         ids=[f"{w}ranks-{n}nodes-stage{s}-{f}{'+h' if r else ''}-acc{a}-{d}"
                              for w, n, s, f, r, a, d in PARAMS])
def test_delivered_sum_is_the_exact_sum_less_the_last_residuals(world, nodes, stage, fmt, rotated, accumulation,
                                                                dtype):
    layout = "flat" if nodes == 1 else "2x2"
    for rank, result in enumerate(results(world, nodes)):
        case = result[stage, fmt, rotated, accumulation, dtype]
        tolerance = 4 * world * U * case["largest"]
        for j, (delivered, exact, held) in enumerate(zip(case["delivered"], case["exact"], case["held"])):
            # the residuals hold loss-scaled gradients: the last step's scale (1 without fp16)
            left = residuals(held, layout, rank, sharded=case["sharded"]) / (accumulation * case["loss_scale"])
            assert left.abs().max() > 0  # the codec left something out at the last step
            deviation = (delivered - exact + left).abs().max().item()
            assert deviation <= tolerance, (rank, j, deviation, tolerance, (delivered - exact).abs().max().item())
            assert tolerance * 100 <= case["step_error"][j], (rank, j, tolerance, case["step_error"][j])


def residuals(held: list[dict], layout: str, rank: int, sharded: bool) -> torch.Tensor:
    """What the ranks' last residuals hold of this rank's shard (stages 1-3) or of the whole buffer (stage 0's
    all-reduce: each chunk's hops, and its owner's residual of the gathered mean, whole)."""
    if sharded:
        return held_of_chunk(held, layout, rank)
    return torch.cat([held_of_chunk(held, layout, owner) + held[owner]["gathered"][0].double()
                      for owner in range(len(held))])
