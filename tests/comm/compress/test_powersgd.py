"""PowerSGD at stages 0-1 (comm/compress/powersgd.py) against torch's own `powerSGD_hook`, its bytes, state and memory.

One spawn per world size runs every check of that world:

- parity: each rank's gradients chosen per step (a model whose loss is
  sum(p * g), so p's gradient is g exactly), reduced by torch's hook and by
  zeroshard at stages 0 and 1, equal to the bit over the warm-up and the
  compressed steps: on DDP (one bucket) for rank 4 (QR) with error feedback
  and warm start, and rank 2 (Gram-Schmidt) with neither; and the hook
  called bucket by bucket on zeroshard's two buckets, so that the seeds are
  drawn across buckets in order (DDP's own buckets' hooks overlap on gloo
  and their collectives interleave differently on each rank: torch's own
  multi-bucket runs abort there). The one exception is bounded: DDP's first
  step over 4 ranks (see `_first_step_bound`);
- bytes: comm_stats()'s all-reduce bytes equal 4 x the elements torch's
  PowerSGDState counts as sent, and `estimate.powersgd_bytes`;
- an inf gradient on one rank: the step is skipped and the state (error, Q)
  of the bucket it reached is left as it was;
- resume: a save at step k and a load into a fresh engine continue the
  uninterrupted run bit for bit (weights and PowerSGD state); a load on
  another number of ranks drops the state, logged;
- memory: memory_stats()['compression'] equals `estimate.powersgd_state_bytes`,
  the other kinds keep stage 0's formula, and all of them add up to the
  tensor storage this process holds (stage 0 in fp32, stage 1 in bf16);
- fp16 is refused at initialize, stages 2-3 by the config, with the reason.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import Case, flat_weights, make_model, make_optimizer, micro_batch

SHAPES = [(24, 40), (40,), (6, 4, 10), (24, 40), (3, 3), (16, 8), (5,), (48, 50)]
SPLIT = 48 * 50  # reduce_bucket_size: (48, 50) in a bucket of its own, the other 2342 elements in a second
STEPS, START = 6, 2
WARM = {"rank": 4, "error_feedback": True, "warm_start": True}  # QR
COLD = {"rank": 2, "error_feedback": False, "warm_start": False}  # Gram-Schmidt
TWO_BUCKETS = [[7], [6, 5, 4, 3, 2, 1, 0]]  # zeroshard's buckets (backward order) at reduce_bucket_size SPLIT
# (settings, the reference's buckets (None: DDP's one), zeroshard's reduce_bucket_size, dtype, accumulation)
CASES = [(WARM, None, 10**7, "fp32", 1), (COLD, None, 10**7, "fp32", 1), (WARM, TWO_BUCKETS, SPLIT, "fp32", 1),
         (WARM, TWO_BUCKETS, SPLIT, "bf16", 2)]


class Given(torch.nn.Module):
    """Parameters of many shapes; the loss sum(p * g) makes each p's gradient the given g."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in SHAPES)

    def forward(self, *grads):
        return sum((p * g).sum() for p, g in zip(self.ps, grads))


def _grads(rank: int, micro: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * micro + rank)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def _window(rank: int, step: int, device, dtype: str, accumulation: int) -> list[torch.Tensor]:
    """A rank's gradients of one step as zeroshard reduces them, in fp32 for torch's hook: each micro-step's
    in `dtype`, summed in fp32 and rounded once to `dtype` (the reduce dtype)."""
    from zeroshard.dtypes import DTYPES

    micro = [_grads(rank, step * accumulation + m, device) for m in range(accumulation)]
    wide = DTYPES[dtype]
    return [sum(g[i].to(wide).float() for g in micro).to(wide).float() for i in range(len(SHAPES))]


class _Bucket:
    """What torch's hook reads of DDP's GradBucket, over a flat buffer of the given gradients."""

    def __init__(self, index: int, count: int, grads: list[torch.Tensor]):
        self._index, self._count = index, count
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        offsets = [sum(g.numel() for g in grads[:i]) for i in range(len(grads))]
        self._views = [self._buffer[o : o + g.numel()].view(g.shape) for o, g in zip(offsets, grads)]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def gradients(self):
        return self._views


def _reference(device, settings: dict, buckets: list[list[int]] | None, dtype: str, accumulation: int
               ) -> tuple[list[list[torch.Tensor]], int]:
    """Torch's hook: each step's reduced gradients (fp32, / accumulation), and the elements it counts as sent
    when compressing.

    `buckets` None: on DDP itself, one bucket (DDP's buckets' hooks run concurrently on gloo, and their
    collectives then interleave differently on each rank). Else the hook called bucket by bucket, each
    holding those tensors (indices into SHAPES) in that order: zeroshard's buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch.distributed as dist

    state = PowerSGDState(None, matrix_approximation_rank=settings["rank"], start_powerSGD_iter=START,
                          use_error_feedback=settings["error_feedback"], warm_start=settings["warm_start"])
    model = Given().to(device)
    if buckets is None:
        ddp = DDP(model, bucket_cap_mb=25, device_ids=[device] if device.type == "cuda" else None)
        ddp.register_comm_hook(state, powerSGD_hook)
    out = []
    for step in range(STEPS):
        grads = _window(dist.get_rank(), step, device, dtype, accumulation)
        if buckets is None:
            ddp(*grads).backward()
            out.append([p.grad.detach().clone() for p in model.ps])
            model.zero_grad()
            continue
        reduced = [None] * len(SHAPES)
        for index, members in enumerate(buckets):
            bucket = _Bucket(index, len(buckets), [grads[i] for i in members])
            powerSGD_hook(state, bucket).wait()
            for i, view in zip(members, bucket.gradients()):
                reduced[i] = view / accumulation
        out.append(reduced)
    return out, state.total_numel_after_compression


def _config(stage: int, settings: dict, bucket: int, dtype: str, accumulation: int) -> dict:
    return ({} if dtype == "fp32" else {dtype: {"enabled": True}}) | {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
            "communication_compression": {"gradients": {"codec": "powersgd", "start_step": START} | settings}}


def _zeroshard_run(rank, device, stage: int, settings: dict, bucket: int, dtype: str, accumulation: int) -> dict:
    import zeroshard
    from zeroshard import estimate

    model = Given().to(device)
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  _config(stage, settings, bucket, dtype, accumulation))
    index = {id(p): i for i, p in enumerate(model.ps)}
    grads, sent = [], []
    for step in range(STEPS):
        before = engine.comm_stats()["all_reduce"].bytes
        for micro in range(accumulation):
            if micro:
                engine.step()  # inside the window: no step yet
            engine.backward(engine(*_grads(rank, step * accumulation + micro, device)))
        grads.append([p.grad.detach().clone() for p in model.ps])
        sent.append(engine.comm_stats()["all_reduce"].bytes - before)
        engine.step()
    shapes = [[tuple(s) for s in b.flat.shapes] for b in engine.buckets]
    formula = sum(estimate.powersgd_bytes(s, settings["rank"]) for s in shapes)
    return {"grads": grads, "sent": sent, "formula": formula,  # the warm-up: every element, in the reduce dtype
            "warm_up": sum(b.flat.numel * b.flat.data.element_size() for b in engine.buckets),
            "buckets": [[index[id(p)] for p in b.params] for b in engine.buckets],
            "skip": _skipped_step_keeps_state(engine, model, rank, device)}


def _skipped_step_keeps_state(engine, model, rank, device) -> dict:
    """An inf gradient on rank 0: every rank skips the step, and the state of the bucket it reached (its
    result not finite) is what it was; the next step is finite again."""
    bucket = next(b for b in engine.buckets if any(p is model.ps[-1] for p in b.params))
    low = bucket.powersgd
    carried = [low.error] + ([low.q] if low.settings.warm_start else [])  # P, and Q when drawn, are made anew
    before = [t.clone() for t in carried if t is not None]
    for micro in range(engine.config.gradient_accumulation_steps):
        grads = _grads(rank, 1000 + micro, device)
        if rank == 0:
            grads[-1][0, 0] = float("inf")
        engine.backward(engine(*grads))
        engine.step()
    kept = all(torch.equal(a, b) for a, b in zip(before, [t for t in carried if t is not None]))
    for micro in range(engine.config.gradient_accumulation_steps):
        engine.backward(engine(*_grads(rank, 2000 + micro, device)))
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.ps)
        engine.step()
    return {"skipped": engine.skipped_steps, "kept": kept, "finite": finite}


def _parity(rank, world, device):
    out = []
    for settings, buckets, size, dtype, accumulation in CASES:
        reference, counted = _reference(device, settings, buckets, dtype, accumulation)
        runs = {stage: _zeroshard_run(rank, device, stage, settings, size, dtype, accumulation) for stage in (0, 1)}
        out.append((settings, buckets, dtype, accumulation, reference, counted, runs))
    return out


def _bound(world: int, step: int, i: int, dtype: str, accumulation: int) -> torch.Tensor:
    """How far zeroshard's exact mean of tensor i may lie from torch's where the two sum in another order.

    DDP reduces its first step's bucket in the parameters' registration order (it rebuilds it in backward
    order, zeroshard's, after that step), so over more than 2 ranks gloo's ring sums an element in another
    order; and a 16-bit warm-up sums in the reduce dtype where torch's hook (on fp32) sums in fp32. Each of
    the N - 1 additions of x_r / N (divided exactly: N a power of two) is off by at most u x the sum of |x_r|
    / N so far, u = 2^-24 (fp32) or 2^-8 (bf16); the two means differ by at most
    (N - 1) / N x (u_zeroshard + u_torch) x S, S = sum_r |x_r| / accumulation."""
    total = sum(_window(rank, step, "cpu", dtype, accumulation)[i].abs() for rank in range(world)) / accumulation
    u = {"fp32": 2.0**-24, "bf16": 2.0**-8}[dtype]
    return (world - 1) / world * (u + 2.0**-24) * total


def _check_parity(results, world: int) -> None:
    for settings, buckets, dtype, accumulation, reference, counted, runs in results:
        for stage, run in runs.items():
            where = (f"{settings}, {'DDP' if buckets is None else 'two buckets'}, {dtype}, accumulation "
                     f"{accumulation}, stage {stage}, {world} ranks")
            assert run["buckets"] == (buckets or [list(range(len(SHAPES)))[::-1]]), where
            for step, (ours, theirs) in enumerate(zip(run["grads"], reference)):
                for i, (a, b) in enumerate(zip(ours, theirs)):
                    a, b = a.cpu(), b.cpu()
                    if step < START and (dtype != "fp32" or (step == 0 and buckets is None and world > 2)):
                        bound = _bound(world, step, i, dtype, accumulation)
                        assert (a.float() - b).abs().le(bound).all(), f"{where}, step {step}, tensor {i}"
                    else:  # torch's fp32 result, rounded once to the reduce dtype
                        b = b.to(a.dtype)
                        assert torch.equal(a, b), f"{where}, step {step}, tensor {SHAPES[i]}: {(a - b).abs().max()}"
            # The warm-up sends every element in the reduce dtype; then what torch counts, 4 bytes each.
            assert run["sent"][:START] == [run["warm_up"]] * START, where
            assert sum(run["sent"][START:]) == 4 * counted == (STEPS - START) * run["formula"], where
            assert run["skip"] == {"skipped": 1, "kept": True, "finite": True}, where


GPT_LOW_RANK = {"rank": 2, "start_step": 1}


def _gpt_engine(rank, world, device, stage: int, dtype: str = "fp32", group=None):
    import zeroshard

    case = Case(stage=stage, dtype=dtype)
    config = case.config() | {"communication_compression": {"gradients": {"codec": "powersgd"} | GPT_LOW_RANK}}
    model = make_model(device=device)
    return zeroshard.initialize(model, make_optimizer(case.optimizer, model), config, group=group), case


def _gpt_step(engine, case, step: int, rank: int, world: int, device) -> None:
    x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
    engine.backward(engine(x, y))
    engine.step()


def _memory(rank, world, device) -> dict:
    """After two steps (the second compresses) of two engines, stage 0 in fp32 and stage 1 in bf16: each one's
    memory_stats()['compression'] and its formula, and all their kinds against the storage held."""
    from tests.core.test_memory import held_storage_bytes
    from zeroshard import estimate

    baseline = held_storage_bytes()
    engines = [_gpt_engine(rank, world, device, stage, dtype) for stage, dtype in ((0, "fp32"), (1, "bf16"))]
    for engine, case in engines:
        for step in range(2):
            _gpt_step(engine, case, step, rank, world, device)
    stats = [engine.memory_stats() for engine, _ in engines]
    held = held_storage_bytes() - baseline if device.type == "cpu" else None
    formulas = [sum(estimate.powersgd_state_bytes([tuple(s) for s in b.flat.shapes], GPT_LOW_RANK["rank"])
                    for b in engine.buckets) for engine, _ in engines]
    padded = sum(b.flat.padded_numel for b in engines[0][0].buckets)
    return {"stats": stats, "formulas": formulas, "held": held, "padded": padded, "buckets": len(engines[0][0].buckets)}


def _resume(rank, world, device, stage: int, path: str) -> dict:
    """Six steps straight, against three, a save, a load into a fresh engine and three more: the same bits."""
    straight, case = _gpt_engine(rank, world, device, stage)
    for step in range(6):
        if step == 3:
            straight.save_checkpoint(path, tag=f"stage{stage}")
        _gpt_step(straight, case, step, rank, world, device)
    resumed, _ = _gpt_engine(rank, world, device, stage)
    resumed.load_checkpoint(path, tag=f"stage{stage}")
    for step in range(3, 6):
        _gpt_step(resumed, case, step, rank, world, device)
    same_state = all(torch.equal(a, b) for x, y in zip(straight.buckets, resumed.buckets)
                     for a, b in zip(x.powersgd.state_dict().values(), y.powersgd.state_dict().values()))
    return {"weights": torch.equal(flat_weights(straight.module), flat_weights(resumed.module)),
            "state": same_state, "draws": [e.buckets[0].powersgd.seeds.draws for e in (straight, resumed)],
            "buckets": len(straight.buckets)}


def _dropped_on_other_world(rank, world, device, path: str) -> dict | None:
    """Rank 0 alone (a group of 1) loads the checkpoint of `world` ranks: the state is dropped, said in the log."""
    import torch.distributed as dist

    group = dist.new_group([0])  # every rank takes part in making it
    if rank != 0:
        return None
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("zeroshard.checkpoint.rank_state")
    logger.addHandler(handler)
    try:
        engine, _ = _gpt_engine(rank, 1, device, 1, group=group)
        engine.load_checkpoint(path, tag="stage1")
    finally:
        logger.removeHandler(handler)
    lows = [b.powersgd for b in engine.buckets]
    return {"lines": lines, "reset": all(low.step == 3 and not low.q_valid and not low.error.any() for low in lows)}


def _fp16_refused(rank, world, device) -> str:
    from zeroshard.config import ConfigError

    try:
        _gpt_engine(rank, world, device, 1, "fp16")
    except ConfigError as error:
        return str(error)
    return "no error"


def _each_rank(rank, world, device, path):
    memory = _memory(rank, world, device)
    resume = {stage: _resume(rank, world, device, stage, path) for stage in (0, 1)}
    dropped = _dropped_on_other_world(rank, world, device, path) if world == 2 else None
    return {"memory": memory, "parity": _parity(rank, world, device), "resume": resume, "dropped": dropped,
            "fp16": _fp16_refused(rank, world, device)}


@pytest.mark.parametrize("world", [2, 4])
def test_powersgd(world, tmp_path):
    results = run_ranks(_each_rank, world, str(tmp_path))
    for rank, result in enumerate(results):
        _check_parity(result["parity"], world)
        memory = result["memory"]
        for stats, formula in zip(memory["stats"], memory["formulas"]):
            assert stats["compression"] == formula > 0, memory
        padded, buckets = memory["padded"], memory["buckets"]  # stage 0 in fp32 keeps its formula, AdamW's
        assert {k: v for k, v in memory["stats"][0].items() if k not in ("compression", "activations", "peak")} == {
            "params": 4 * padded, "grads": 4 * padded, "master": 0, "optimizer": 8 * padded + 4 * buckets,
            "staging": 0, "hpz_secondary": 0}, memory
        if memory["held"] is not None:
            assert memory["held"] == sum(stats.held() for stats in memory["stats"]), memory
        for stage, resume in result["resume"].items():
            # Warm start: one random start a bucket, the seeds restored to stand after them.
            assert resume == {"weights": True, "state": True, "draws": [resume["buckets"]] * 2,
                              "buckets": resume["buckets"]}, (rank, stage)
        assert result["fp16"].startswith("communication_compression.gradients.codec \"powersgd\" cannot run with "
                                         "fp16.enabled: its error feedback carries each step's loss-scaled"), result
    if world == 2:
        dropped = results[0]["dropped"]
        assert dropped["reset"], dropped
        assert dropped["lines"] == ["PowerSGD's state in the checkpoint is not used: it was written by 2 ranks and "
                                    "this job has 1, while each rank's state is its own and cannot be split or "
                                    "merged. Each bucket starts over at step 3"]


def test_stages_2_and_3_refuse_powersgd():
    from zeroshard.config import Config

    for stage in (2, 3):
        with pytest.raises(ValueError, match=f"PowerSGD needs every rank to hold each matrix's whole gradient, which "
                                             f"stage {stage} never does"):
            Config.model_validate({"zero_optimization": {"stage": stage},
                                   "communication_compression": {"gradients": {"codec": "powersgd"}}})
