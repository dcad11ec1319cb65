"""Mixed precision (bf16, fp16) at stages 0-3: parity, memory, communication, loss scaling.

References: the single-process mixed-precision recipe (16-bit forward and
backward, fp32 master, fp32 gradient sum), the ZeRO paper's 2 + 2 + 12 bytes
per parameter, the storage the process really holds, and for fp16's skipped
steps a run that never saw the skipped batch. One spawn per world size runs
every check of that size; the tests read its results.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

import pytest
import torch

from tests.core.test_memory import measure
from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    loss_of,
    make_model,
    make_optimizer,
    micro_batch,
    relative_error,
    run_zeroshard,
    train_reference_mixed,
)
from zeroshard.core.optim import state_tensors
from zeroshard.core.precision import LossScaleError, cast_inputs

STEPS = 50
# No clipping: the global norm sums shards in another order at each stage, and over 50 steps one bf16
# rounding apart grows past the 1e-6 that stage 1's master must stay from stage 0's. Few large units.
TRACK = [Case(stage=s, dtype="bf16", optimizer="adamw1_slow", bucket=12000) for s in (0, 1, 2, 3)]
MEMORY = [Case(stage=s, dtype="bf16") for s in (0, 1, 2, 3)] + [
    Case(stage=1, dtype="bf16", accumulation=2), Case(stage=2, dtype="bf16", accumulation=2),
    Case(stage=3, dtype="bf16", accumulation=2),
    Case(stage=0, dtype="bf16", wire="fp32"), Case(stage=2, dtype="bf16", wire="fp32")]
COMM = [Case(stage=s, dtype="bf16", wire=w) for s in (0, 1, 2, 3) for w in (None, "fp32")]
FP16 = {"enabled": True, "initial_scale_power": 8}  # 256: no overflow in the first steps
POISONED = (3, 6)  # steps whose loss is inf on rank 1


def _masters(engine) -> list[torch.Tensor]:
    return [u.master.detach().clone() for u in engine.buckets]


def _track(rank, world, device):
    out = {}
    for case in TRACK:
        engine, losses = run_zeroshard(rank, world, device, case, STEPS)
        full = engine.full_state_dict()  # stage 3: the parameters themselves are empty between steps
        weights = torch.cat([full[name].float().reshape(-1) for name, _ in engine.module.named_parameters()])
        out[case.stage] = (losses, _masters(engine), weights)
    return out


def _memory(rank, world, device):
    cases = MEMORY if world == 2 else MEMORY[:4]  # the variants once, at 2 ranks
    return [measure(rank, world, device, case)[1:] for case in cases]


def _master_init(rank, world, device):
    """Whether each unit's master holds the model's fp32 values (not their bf16 rounding), at stages 0 and 1."""
    import zeroshard

    out = []
    for stage in (0, 1):
        model = make_model(device=device)
        original = {id(p): p.detach().clone() for p in model.parameters()}
        engine = zeroshard.initialize(model, make_optimizer("adamw", model), Case(stage=stage, dtype="bf16").config())
        for u in engine.buckets:
            full = torch.cat([original[id(p)].reshape(-1) for p in u.params])
            full = torch.cat([full, full.new_zeros(u.flat.padded_numel - full.numel())])
            rounded = (u.flat.shard(u.flat.data) if stage else u.flat.data).float()
            out.append((torch.equal(u.master, u.flat.shard(full) if stage else full), torch.equal(u.master, rounded)))
    return out


def _comm(rank, world, device):
    out = []
    for case in COMM:
        engine, _ = run_zeroshard(rank, world, device, case, 1)
        before = engine.comm_stats()
        engine.backward(loss_of(engine, *(t.to(device) for t in micro_batch(1, case, world, rank, 0))))
        engine.step()
        after = engine.comm_stats()
        padded = sum(u.flat.padded_numel for u in engine.buckets)
        out.append((padded, {op: after[op].bytes - before[op].bytes for op in after}))
    return out


def _snapshot(engine) -> list[torch.Tensor]:
    """Every value a step may change: 16-bit parameters, fp32 masters, optimizer state."""
    own = [u.flat.shard_data if u.switches.shard_params else u.flat.data for u in engine.buckets]  # stage 3: shards
    return [t.detach().clone() for t in own + _masters(engine)
            + state_tensors(engine.optimizer)]


def _fp16_run(rank, world, device, case, steps, poisoned=(), skip=(), fp16=FP16, plain=False):
    """fp16 training; rank 1's loss is inf at `poisoned` steps, `skip`ped steps are not run at all; `plain`:
    `loss.backward()` instead of `engine.backward(loss)`.

    Returns the snapshot before each step run and after the last, the loss scale, skipped
    steps and global grad norm after each step, and the error that stopped training, if any.
    """
    import zeroshard

    model = make_model(device=device)
    config = case.config() | {"fp16": fp16}
    engine = zeroshard.initialize(model, make_optimizer(case.optimizer, model), config)
    snapshots, history = [], []
    for step in (s for s in range(steps) if s not in skip):
        snapshots.append(_snapshot(engine))
        loss = loss_of(engine, *(t.to(device) for t in micro_batch(step, case, world, rank, 0)))
        if rank == 1 and step in poisoned:
            loss = loss * math.inf
        loss.backward() if plain else engine.backward(loss)
        try:
            engine.step()
        except LossScaleError as error:
            return snapshots, history, str(error)
        history.append((engine.loss_scale, engine.skipped_steps, engine.global_steps, engine.global_grad_norm))
    snapshots.append(_snapshot(engine))
    return snapshots, history, None


def _fp16(rank, world, device):
    out = {}
    for stage in (0, 2):
        case = Case(stage=stage, dtype="fp16", optimizer="adamw1", clip=1.0)
        poisoned = _fp16_run(rank, world, device, case, 7, poisoned=POISONED)
        reference = _fp16_run(rank, world, device, case, 6, skip=(3,))
        out[stage] = (poisoned, reference)
    tiny_scale = {"enabled": True, "initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}
    out["min_scale"] = _fp16_run(rank, world, device, Case(stage=1, dtype="fp16"), 3, poisoned=(0, 1),
                                 fp16=tiny_scale)[1:]
    return out


def _bf16_model(rank, world, device):
    """A model already in bf16 is accepted; its master is the exact fp32 value of its weights."""
    import zeroshard

    model = make_model(device=device).bfloat16()
    values = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    engine = zeroshard.initialize(model, make_optimizer("adamw1", model),
                                  {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    shards = [m.clone() for m in _masters(engine)]
    engine.backward(loss_of(engine, *micro_batch(0, Case(), world, rank, 0)))
    engine.step()
    return values, shards, [u.flat.data.dtype for u in engine.buckets], engine.global_steps


def _everything(rank, world, device):
    out = {"track": _track(rank, world, device), "memory": _memory(rank, world, device)}
    if world == 2:
        out |= {"comm": _comm(rank, world, device), "fp16": _fp16(rank, world, device),
                "bf16_model": _bf16_model(rank, world, device), "master_init": _master_init(rank, world, device)}
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return run_ranks(_everything, world)


@functools.lru_cache(maxsize=None)
def reference(world: int) -> tuple[list[float], torch.Tensor]:
    return train_reference_mixed(TRACK[0], world, STEPS)  # the stage does not change the recipe


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_tracks_the_single_process_recipe(world):
    per_rank = results(world)
    for case in TRACK:
        ref_losses, ref_master = reference(world)
        losses = torch.tensor([r["track"][case.stage][0] for r in per_rank]).mean(0)
        err = ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max().item()
        assert err <= 1e-2, f"stage {case.stage} at {world} ranks: loss error {err:.2e}"
        weights = per_rank[0]["track"][case.stage][2]
        assert all(torch.equal(r["track"][case.stage][2], weights) for r in per_rank)
        assert relative_error(weights, ref_master) <= 2e-2  # bf16 weights vs the fp32 master: 4e-3 apart at best
        assert relative_error(weights, torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])) > 0.05


def test_bf16_master_of_stage1_equals_stage0():
    per_rank = results(2)
    stage0 = per_rank[0]["track"][0][1]
    stage1 = [torch.cat(shards) for shards in zip(*(r["track"][1][1] for r in per_rank))]
    assert len(stage0) == len(stage1) > 1
    for whole, gathered in zip(stage0, stage1):
        assert whole.dtype == gathered.dtype == torch.float32
        assert (whole - gathered).abs().max().item() <= 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_memory_is_2_2_12_bytes_per_parameter(world):
    for case, (padded, units, _, stats, held) in zip(MEMORY, results(world)[0]["memory"]):
        shard = padded // world
        states = padded if case.stage == 0 else shard
        fp32_grads = case.accumulation > 1 or case.wire == "fp32"
        if case.stage >= 2:
            grads = (4 if fp32_grads else 2) * shard
        else:  # 16-bit gradients, plus the fp32 sum over micro-steps (or fp32 reduction buffer)
            grads = 2 * padded + (4 * padded if fp32_grads else 0)
        assert stats["params"] == 2 * (shard if case.stage == 3 else padded), case
        assert stats["grads"] == grads, case
        assert stats["master"] == 4 * states, case
        assert stats["optimizer"] == 8 * states + 4 * units, case
        if held is not None:
            assert held == stats.held(), f"{case}: held {held} vs reported {stats}"


def test_bf16_reduction_sends_half_the_bytes_of_fp32():
    for case, (padded, delta) in zip(COMM, results(2)[0]["comm"]):
        reduce_op = "all_reduce" if case.stage == 0 else "reduce_scatter"
        assert delta[reduce_op] == (4 if case.wire == "fp32" else 2) * padded, case
        gathers = {0: 0, 1: 1, 2: 1, 3: 2}[case.stage]  # stage 3: forward and backward
        assert delta["all_gather"] == gathers * 2 * padded, case  # bf16 parameters


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    for rank_result in results(2):
        (snapshots, history, error), (ref_snapshots, _, _) = rank_result["fp16"][stage]
        assert error is None
        # (loss scale, skipped steps, global steps, grad norm) after each step: hysteresis 2
        # absorbs the first overflow; the second, with none left, halves the scale.
        assert [h[:3] for h in history] == [
            (256.0, 0, 1), (256.0, 0, 2), (256.0, 0, 3), (256.0, 1, 4), (256.0, 1, 5), (256.0, 1, 6),
            (128.0, 2, 7)]
        assert [math.isinf(h[3]) for h in history] == [s in POISONED for s in range(7)]
        for k in POISONED:  # parameters, masters and optimizer state untouched by a skipped step
            assert all(torch.equal(a, b) for a, b in zip(snapshots[k], snapshots[k + 1]))
        assert not all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))
        # After step 5 the run equals one that never saw step 3, bit for bit.
        assert all(torch.equal(a, b) for a, b in zip(snapshots[6], ref_snapshots[-1]))


def test_fp16_overflow_at_the_minimum_scale_stops_with_advice():
    for rank_result in results(2):
        history, error = rank_result["fp16"]["min_scale"]
        assert history == [(1.0, 1, 1, math.inf)]
        assert error == (
            "fp16 gradients overflowed (inf or nan) at step 1 with the loss scale already at min_loss_scale=1: "
            "they exceed fp16's range (max 65504) even unscaled, so every step would be skipped. Train in bf16 "
            "(\"bf16\": {\"enabled\": true}, fp32's range) where the hardware supports it, or look for the "
            "source of inf/nan (learning rate too high, a loss that is inf or nan)")


def test_master_starts_from_the_fp32_model_not_its_bf16_rounding():
    for rank_result in results(2):
        exact, rounded = zip(*rank_result["master_init"])
        assert len(exact) > 2 and all(exact) and not all(rounded)


def test_a_bf16_model_is_accepted_as_is():
    values, shards, dtypes, steps = results(2)[0]["bf16_model"]
    rank1_shards = results(2)[1]["bf16_model"][1]
    assert set(dtypes) == {torch.bfloat16} and steps == 1
    masters = torch.cat([torch.cat(pair) for pair in zip(shards, rank1_shards)])
    # At the default bucket size one bucket holds every parameter, in reverse registration order
    # (backward's), then zero padding to a multiple of N: element by element, each one's exact value.
    expected = torch.cat(values.split([p.numel() for p in make_model().parameters()])[::-1])
    assert len(shards) == 1 and masters.numel() == -(-expected.numel() // 2) * 2
    assert torch.equal(masters[:expected.numel()], expected)
    assert not masters[expected.numel():].any()


def test_inputs_are_cast_where_floating_point():
    Pair = namedtuple("Pair", "a b")
    ints, floats = torch.arange(3), torch.ones(2)
    cast = cast_inputs((ints, [floats, {"x": floats, "n": 3}], Pair(floats, ints)), torch.bfloat16)
    assert cast[0] is ints
    assert cast[1][0].dtype == cast[1][1]["x"].dtype == torch.bfloat16 and cast[1][1]["n"] == 3
    assert isinstance(cast[2], Pair) and cast[2].a.dtype == torch.bfloat16 and cast[2].b is ints
