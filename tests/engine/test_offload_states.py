"""`engine.offload_states()` / `engine.reload_states()`: device memory freed between steps, exact across the trip.

Against the same training that never offloaded, in the same rank process: losses and final weights are
bitwise equal (torch.equal) at stages 1-3, fp32 and bf16, with accumulation, offloading at a window's end
and in its middle (the gradients held then come back exactly), all states or subsets, one call or several.
The pools of `memory_stats()` move by bytes the test counts from the tensors themselves (numel x
element size of the flat buffers, shards, masters, gradient buffers, the optimizer's state): the device
pool falls by them, the host pool rises by them (a free staging block is freed, not copied), and reload
puts every pool back as it was. Misuse: each engine call and stage 3's gathers while offloaded, the
module's state_dict, offload between backward and step, another device, an unknown state.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import Case, loss_of, make_engine_with_schedule, micro_batch, train_steps

STEPS = 4
KINDS = ("params", "grads", "master", "optimizer", "staging")
ALL = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _expected(engine, case: Case, include) -> dict[str, int]:
    """Device bytes each kind gives up for `include`, counted from the tensors the stage holds."""
    buckets, mixed = engine.buckets, case.dtype != "fp32"
    flats = [b.flat for b in buckets]
    params = (_nbytes(f.shard_data for f in flats) if case.stage == 3 else _nbytes(f.data for f in flats))
    if case.stage >= 2:
        grads = _nbytes(b.grad_shard for b in buckets)
    else:  # stage 1: the full gradient buffer (grad_shard views it) and, in 16 bits, the fp32 sum
        grads = _nbytes(b.full_grad for b in buckets) + _nbytes(b.grad_acc for b in buckets)
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {"params": params, "grads": grads,
           # In fp32 the master is the parameters' own storage, counted under params.
           "master": _nbytes(b.master for b in buckets) if mixed else 0,
           "optimizer": _nbytes(state), "staging": _nbytes(engine.pool.tensors())}
    named = {"optim_states": "optimizer", "hp_params": "master", "lp_params": "params", "lp_grads": "grads",
             "contiguous_grad_buffer": "staging"}
    chosen = {named[getattr(m, "value", m)] for m in include}
    if not mixed and "master" in chosen:
        chosen.add("params")  # one storage: it moves with either name
    return {kind: out[kind] if kind in chosen else 0 for kind in KINDS}


def _pools(engine) -> dict[str, dict[str, int]]:
    return {pool: dict(engine.memory_stats(pool)) for pool in ("device", "host", "disk")}


def _offload_and_check(engine, case: Case, include, calls) -> dict:
    """Offload `include` in `calls` calls (split in two when 2); the pools' moves against the expected bytes."""
    before, expected = _pools(engine), _expected(engine, case, include)
    parts = [include] if calls == 1 else [include[:1], include[1:]]
    for part in parts:  # DeepSpeed's defaults, spelled out
        engine.offload_states(include=part, device="cpu", pin_memory=True, non_blocking=False)
    after = _pools(engine)
    moved = {k: before["device"][k] - after["device"][k] for k in KINDS}
    copied = {k: after["host"][k] - before["host"][k] for k in KINDS}
    engine.reload_states(non_blocking=False)
    return {"moved": moved, "copied": copied, "expected": expected, "back": _pools(engine) == before,
            "disk": after["disk"] == before["disk"]}


def _train(engine, schedule, case, rank, world, device, offload_at=None, include=ALL, calls=1):
    """Train STEPS steps; after micro-step `offload_at` = (step, micro), offload `include` and reload."""
    checks = []

    def after_micro(step, micro):
        if (step, micro) == offload_at:
            checks.append(_offload_and_check(engine, case, include, calls))
    losses = train_steps(engine, schedule, case, world, rank, device, range(STEPS), after_micro)
    full = engine.full_state_dict()
    return losses, torch.cat([full[n].reshape(-1) for n, _ in engine.module.named_parameters()]), checks


def _round_trips(rank, world, device, runs):
    out = []
    for case, offload_at, include, calls, deepspeed in runs:
        plain = _train(*make_engine_with_schedule(case, device=device), case, rank, world, device)
        engine, schedule = make_engine_with_schedule(case, device=device, deepspeed=deepspeed)
        if deepspeed:  # DeepSpeed's enum members, as its scripts pass them
            from zeroshard.deepspeed import OffloadStateTypeEnum
            include = [OffloadStateTypeEnum(name) for name in include]
        out.append((plain, _train(engine, schedule, case, rank, world, device, offload_at, include, calls)))
    return out


RUNS = [  # (case, offload after (step, micro-step), include, calls, DeepSpeed engine)
    (Case(stage=1, accumulation=2), (1, 1), ALL, 1, False),
    (Case(stage=2, accumulation=2), (1, 1), ALL, 1, False),
    (Case(stage=3, accumulation=2), (1, 1), ALL, 1, True),
    # In the middle of a window: the gradients summed so far come back exactly.
    (Case(stage=1, accumulation=2), (1, 0), ALL, 1, False),
    (Case(stage=2, accumulation=2, dtype="bf16", optimizer="adamw1_slow"), (1, 0), ALL, 1, True),
    (Case(stage=3, accumulation=2), (2, 0), ["lp_grads", "lp_params"], 2, False),
    # Subsets: the states named, in one call or two.
    (Case(stage=1, dtype="bf16", optimizer="adamw1_slow"), (1, 0), ["optim_states", "hp_params"], 2, False),
    (Case(stage=3, dtype="bf16", optimizer="adamw1_slow"), (1, 0), ["hp_params", "lp_params"], 1, False),
    (Case(stage=2), (1, 0), ["hp_params"], 1, False),  # fp32: the master is the parameters' storage
    # Offloaded by config: nothing of them on the device to move; the rest still moves and comes back.
    (Case(stage=3, accumulation=2, offload="cpu", offload_params="cpu"), (1, 0), ALL, 1, False),
]


def test_round_trip_trains_bitwise_as_never_offloaded_and_moves_the_bytes_counted():
    per_rank = run_ranks(_round_trips, 2, RUNS)
    for rank_out in per_rank:
        for (case, *_), (plain, offloaded) in zip(RUNS, rank_out):
            (plain_losses, plain_weights, _), (losses, weights, checks) = plain, offloaded
            assert losses == plain_losses, case
            assert torch.equal(weights, plain_weights), case
            (check,) = checks
            expected = check["expected"]
            if case.offload != "none":  # on the host by config: shards, masters, their gradients and state
                expected = expected | {"master": 0, "optimizer": 0, "params": 0, "grads": 0}
            assert check["moved"] == expected, case
            assert check["copied"] == expected | {"staging": 0}, case  # free blocks: freed, never copied
            assert any(expected.values()) and check["back"] and check["disk"], case


def _misuse(rank, world, device, stage):
    import zeroshard
    from zeroshard.deepspeed import OffloadDeviceEnum

    case = Case(stage=stage)
    engine, _ = make_engine_with_schedule(case, device=device)
    x, y = (t.to(device) for t in micro_batch(0, case, world, rank, 0))
    errors = {}

    def attempt(name, call):
        try:
            call()
            errors[name] = None
        except Exception as exc:
            errors[name] = (type(exc).__name__, str(exc))

    loss = loss_of(engine, x, y)
    engine.backward(loss)
    attempt("between backward and step", engine.offload_states)
    engine.step()
    attempt("device nvme", lambda: engine.offload_states(device=OffloadDeviceEnum.nvme))
    attempt("unknown state", lambda: engine.offload_states(include=["lp_params", "activations"]))
    before = _pools(engine)
    engine.reload_states()  # nothing offloaded: nothing to do
    errors["reload without offload changes nothing"] = _pools(engine) == before
    engine.offload_states()
    offloaded = _pools(engine)
    engine.offload_states()  # everything is off already: nothing more moves
    errors["double offload changes nothing"] = _pools(engine) == offloaded
    attempt("forward", lambda: engine(x))
    attempt("step", engine.step)
    attempt("state_dict", engine.module.state_dict)
    attempt("save_checkpoint", lambda: engine.save_checkpoint(f"/nonexistent/offload-{stage}"))
    if stage == 3:
        attempt("gathered_parameters", lambda: zeroshard.gathered_parameters(
            list(engine.module.parameters())).__enter__())
    engine.reload_states()
    attempt("forward after reload", lambda: engine.backward(loss_of(engine, x, y)))
    return errors


@pytest.mark.parametrize("stage", [1, 3])
def test_misuse_is_a_clear_error(stage):
    for errors in run_ranks(_misuse, 2, stage):
        assert errors["between backward and step"][0] == "EngineStateError"
        assert "after engine.step()" in errors["between backward and step"][1]
        assert errors["device nvme"][0] == "ValueError" and "device='cpu'" in errors["device nvme"][1]
        assert errors["unknown state"][0] == "ValueError" and "['activations']" in errors["unknown state"][1]
        assert errors["reload without offload changes nothing"] and errors["double offload changes nothing"]
        calls = ["forward", "step", "state_dict", "save_checkpoint"] + (["gathered_parameters"] if stage == 3 else [])
        for call in calls:
            name, message = errors[call]
            assert name == "StatesOffloadedError" and "engine.reload_states()" in message, (call, errors[call])
        assert errors["forward after reload"] is None
