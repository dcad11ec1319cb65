"""Compressed gradient reductions (comm/compress/reduce.py) at 2 and 4 ranks, against the exact mean.

Each rank draws 50 steps of heavy-tailed gradients (a signal shared by the
ranks plus noise of its own, Student-t 3), seeded so that every rank can
recompute every rank's gradient and so the exact mean (the reference:
torch's own sum, in float64, of the same tensors). For each codec, op
(stage 0's all-reduce, stages 1-3's reduce-scatter) and hop layout (flat;
at 4 ranks also 2 nodes x 2):

- without bias: the error of each step, over all its elements and steps,
  averages to zero within 4 standard errors;
- with error feedback, the running sum of the errors (what the applied
  updates lack against the exact ones) equals minus the mean of what the
  ranks' feedback still holds (telescoping, to float rounding), and stays
  within three steps' errors at every step; without it, it drifts past
  three by step 50 (it grows as the square root of the steps: about 5).

All cases run in one spawn per world size; the tests read its results.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from zeroshard.comm import Comm, CommRecorder, CompressedReduction, Hops
from zeroshard.comm.topology import build_topology
from zeroshard.estimate import compressed_reduction_bytes, error_feedback_bytes
from zeroshard.dtypes import WIRE_BITS
from zeroshard.engine.wire import named_codec

STEPS = 50
SHARD = 1009  # elements per rank's chunk: a prime, so the last block of each chunk is partial
CODECS = ("int8", "int4", "fp8_e4m3")  # int4 with its default rotation
OPS = ("all_reduce", "reduce_scatter")


def grads(step: int, world: int, numel: int) -> torch.Tensor:
    """(world, numel): every rank's gradient at `step`."""
    g = torch.Generator().manual_seed(step)
    signal = torch.randn(numel, generator=g)
    noise = torch.randn(world, numel, generator=g) / (torch.randn(3, world, numel, generator=g).square().mean(0)
                                                        .sqrt())
    return signal + noise


def _run(comm: Comm, hops: Hops, codec_name: str, op: str, feedback_on: bool) -> dict:
    world, rank = comm.world_size, comm.rank
    numel = world * SHARD
    codec = named_codec(codec_name, 128, codec_name == "int4")
    reduction = CompressedReduction(comm, hops, codec, feedback_on)
    feedback = reduction.feedback_for(numel, all_reduce=op == "all_reduce", device=torch.device("cpu"))
    running = torch.zeros(numel if op == "all_reduce" else SHARD, dtype=torch.float64)
    per_step, before = [], comm.recorder.snapshot()
    for step in range(STEPS):
        every = grads(step, world, numel)
        exact = every.double().mean(0)
        mine = every[rank].clone()
        if op == "all_reduce":
            reduction.all_reduce(mine, feedback).wait()
            error = mine.double() - exact
        else:
            shard = torch.empty(SHARD)
            reduction.reduce_scatter(shard, mine, feedback).wait()
            error = shard.double() - exact.view(world, SHARD)[rank]
        running += error
        per_step.append((error, running.norm().item()))
    after = comm.recorder.snapshot()
    held = [None] * world
    dist.all_gather_object(held, {} if feedback is None else feedback.tensors())
    return {"per_step": per_step, "running": running, "held": held,
            "sent": {name: after[name].bytes - before[name].bytes for name in ("reduce_scatter", "all_gather")},
            "feedback_bytes": 0 if feedback is None else feedback.nbytes}


def _cases(rank, world, device):
    comm = Comm.create(dist.group.WORLD, CommRecorder())
    layouts = {"flat": Hops.flat(comm)}
    if world == 4:
        layouts["2x2"] = Hops.create(comm, build_topology(dist.group.WORLD, 2))
    return {(layout, codec, op, fed): _run(comm, hops, codec, op, fed)
            for layout, hops in layouts.items() for codec in CODECS for op in OPS for fed in (True, False)}


@functools.lru_cache(maxsize=None)
def results(world: int):
    return run_ranks(_cases, world)


CASES = [(w, layout, codec, op) for w in (2, 4) for layout in (("flat", "2x2") if w == 4 else ("flat",))
         for codec in CODECS for op in OPS]


@pytest.mark.parametrize("world,layout,codec,op", CASES)
def test_the_error_has_no_bias(world, layout, codec, op):
    for fed in (True, False):
        error = torch.cat([e.reshape(-1) for r in results(world) for e, _ in r[layout, codec, op, fed]["per_step"]])
        assert error.abs().max() > 0  # it is compressed
        assert error.mean().abs() <= 4 * error.std() / error.numel() ** 0.5, (fed, error.mean(), error.std())


@pytest.mark.parametrize("world,layout,codec,op", CASES)
def test_error_feedback_keeps_the_running_sum_bounded(world, layout, codec, op):
    for r, rank_result in enumerate(results(world)):
        fed, plain = rank_result[layout, codec, op, True], rank_result[layout, codec, op, False]
        step_error = sum(e.norm().item() for e, _ in fed["per_step"]) / STEPS
        assert max(running for _, running in fed["per_step"]) <= 3 * step_error
        plain_error = sum(e.norm().item() for e, _ in plain["per_step"]) / STEPS
        assert plain["per_step"][-1][1] >= 3 * plain_error  # without feedback the sum drifts

        # Telescoping: the sum of the errors is minus what the feedback still holds, averaged over the ranks.
        held = fed["held"]
        if op == "all_reduce":  # every chunk, plus what each owner's gather left out
            left = torch.cat([_left(held, layout, owner) + held[owner]["gathered"][0].double()
                              for owner in range(world)])
        else:
            left = _left(held, layout, r)
        assert torch.allclose(fed["running"], -left, atol=1e-4), r


def _left(held: list[dict], layout: str, owner: int) -> torch.Tensor:
    """What the ranks' feedback holds of chunk `owner`'s mean (each message's part, / N)."""
    world = len(held)
    if layout == "flat":
        return sum(h["hop1"][owner].double() for h in held) / world
    # 2 nodes x 2 (comm/compress/qgz.py): every rank sends its node's peer d the chunks k*2 + d, as its rows d*2 + k;
    # that peer on each node sends node k its partial sum of chunk k*2 + d, as its row k.
    node, index = divmod(owner, 2)
    inside = sum(h["hop1"][index * 2 + node].double() for h in held)
    return (inside + sum(held[2 * k + index]["hop2"][node].double() for k in (0, 1))) / world


@pytest.mark.parametrize("world,layout,codec,op", CASES)
def test_bytes_and_feedback_memory_equal_the_estimate(world, layout, codec, op):
    per_node = None if layout == "flat" else 2
    bits = WIRE_BITS[codec]
    numel = world * SHARD
    expected = compressed_reduction_bytes(numel, world, bits, 128, op == "all_reduce", per_node)
    for rank_result in results(world):
        for fed in (True, False):
            case = rank_result[layout, codec, op, fed]
            assert case["sent"] == {name: STEPS * b for name, b in expected.items()}
            memory = error_feedback_bytes(numel, world, op == "all_reduce", per_node) if fed else 0
            assert case["feedback_bytes"] == memory
        # the bytes are the ratio the issue asks for, scales included: int8 0.27x, int4 0.14x of fp32
        assert expected["reduce_scatter"] <= (0.27 if bits == 8 else 0.14) * 4 * numel * (1 if per_node is None
                                                                                           else 1 + 1 / 2)
