"""The non-finite guard and the step check: inf or nan gradients, the global norm, ranks out of step.

Before every optimizer step the ranks exchange, in one all-gather, their
gradient squares, a non-finite flag and their counters (core/grad_norm.py).
References: the state before the poisoned step (bitwise), single-process
PyTorch on the global batches that were not poisoned (fp32; the batch
simply omitted), a zeroshard run that never saw the poisoned batch (bf16,
bitwise), and `torch.nn.utils.clip_grad_norm_`'s norm on one process.
Poisons, on the last rank: a nan loss, or inf written into element 0 of one
gradient by a tensor hook. One spawn per world size runs every case.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    flat_weights,
    global_batch,
    loss_of,
    make_model,
    make_optimizer,
    micro_batch,
    relative_error,
)

STEPS = 4
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}


@dataclass(frozen=True)
class Run:
    case: Case
    poison: tuple[int, ...] = ()  # optimizer steps whose gradients the last rank poisons
    how: str = "nan"  # "nan": the loss is nan; "inf": a hook writes inf into one gradient element
    non_finite: tuple[tuple[str, object], ...] = ()  # the config's "non_finite" section, as (key, value) pairs
    omit: tuple[int, ...] = ()  # optimizer steps not run at all (the reference of a poisoned run)
    save: bool = False  # save and load a checkpoint after the last step, then train one more step
    counters_off: bool = False  # the last rank resumes one step ahead before step 1

    def config(self) -> dict:
        return self.case.config() | {"scheduler": SCHEDULER, "non_finite": dict(self.non_finite)}

    @property
    def steps(self) -> list[int]:
        return [s for s in range(STEPS) if s not in self.omit]


def _snapshot(engine) -> list:
    """Everything a step may change: parameters (their shards at stage 3), masters, optimizer state,
    learning rates, the LR scheduler's state."""
    from zeroshard.core.optim import state_tensors

    flats = [b.flat.shard_data if b.switches.shard_params else b.flat.data for b in engine.buckets]
    tensors = [t.detach().clone() for t in flats + [b.master for b in engine.buckets]
               + state_tensors(engine.optimizer)]
    return [tensors, [g["lr"] for g in engine.optimizer.param_groups], engine.lr_scheduler.state_dict()]


def _same(a: list, b: list) -> bool:
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def _poison_hook(armed: list[bool]):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not armed[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad
    return hook


def _step(engine, run: Run, step: int, world: int, rank: int, device, poison: bool) -> float:
    """One optimizer step's micro-steps; the mean loss (nan when poisoned)."""
    losses = []
    for micro in range(run.case.accumulation):
        loss = loss_of(engine, *(t.to(device) for t in micro_batch(step, run.case, world, rank, micro)))
        loss = loss * math.nan if poison and run.how == "nan" else loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return sum(losses) / len(losses)


def _train(rank, world, device, run: Run, ckpt: str):
    import zeroshard
    from zeroshard.checkpoint import Counters

    model = make_model(device=device)
    engine = zeroshard.initialize(model, make_optimizer(run.case.optimizer, model), run.config())
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("zeroshard.engine.optimizer_step").addHandler(handler)
    armed, last = [False], rank == world - 1
    if run.how == "inf":  # before accumulation and reduction: one element of one rank's gradient
        engine.module.blocks[0].attn.qkv.weight.register_hook(_poison_hook(armed))
    out = {"losses": [], "counters": [], "norms": [], "unchanged": [], "errors": {}}
    for step in run.steps:
        if run.counters_off and step == 1 and last:
            engine._adapter.restore_counters(Counters(2, 0))  # as if this rank had loaded a later checkpoint
        before = _snapshot(engine)
        armed[0] = last and step in run.poison
        try:
            out["losses"].append(_step(engine, run, step, world, rank, device, armed[0]))
        except (zeroshard.NonFiniteError, zeroshard.CollectiveError) as error:
            out["errors"][step] = (type(error).__name__, str(error), engine.state.name)
            if engine.state.name == "FAILED":
                break
            out["losses"].append(math.nan)
        out["counters"].append((engine.global_steps, engine.skipped_steps))
        out["norms"].append(engine.global_grad_norm)
        out["unchanged"].append(_same(before, _snapshot(engine)))
    logging.getLogger("zeroshard.engine.optimizer_step").removeHandler(handler)
    out["log"] = messages
    if engine.state.name == "FAILED":
        return out
    full = engine.full_state_dict()
    out["weights"] = torch.cat([full[n].float().reshape(-1).cpu() for n, _ in engine.module.named_parameters()])
    if run.save:
        saved = _snapshot(engine)
        engine.save_checkpoint(ckpt)
        engine.load_checkpoint(ckpt)
        out["loaded"] = (engine.global_steps, engine.skipped_steps, _same(saved, _snapshot(engine)))
        _step(engine, run, STEPS, world, rank, device, False)
        out["after_load"] = (engine.global_steps, engine.skipped_steps, _same(saved, _snapshot(engine)))
    return out


def _all(rank, world, device, runs: list[Run], ckpt: str):
    return [_train(rank, world, device, run, f"{ckpt}/{i}") for i, run in enumerate(runs)]


def _fp32(stage: int, **kw) -> Case:
    return Case(stage=stage, optimizer="adamw1", **kw)


def _bf16(stage: int) -> Case:
    return Case(stage=stage, dtype="bf16", optimizer="adamw1_slow")


ERROR = (("action", "error"),)
RUNS = {
    2: [Run(_fp32(s), poison=(2,), how="nan", save=s == 2) for s in (0, 1, 2, 3)]
    + [Run(_fp32(s, accumulation=2), poison=(1,), how="inf") for s in (0, 2)]
    + [Run(_bf16(s), poison=(2,), how="inf") for s in (1, 3)]
    + [Run(_bf16(s), omit=(2,)) for s in (1, 3)]
    + [Run(_fp32(s, clip=0.05)) for s in (0, 1, 2, 3)]
    + [Run(_fp32(1), poison=(1,), non_finite=ERROR),
       Run(_fp32(3), poison=(0, 2, 3), how="inf", non_finite=(("max_consecutive_skips", 1),))]
    + [Run(_fp32(s), counters_off=True) for s in (0, 1, 2, 3)],
    4: [Run(_fp32(1), poison=(2,), how="inf"),
        Run(_bf16(3), poison=(2,), how="nan", save=True),
        Run(_bf16(3), omit=(2,)),
        Run(_fp32(2), poison=(3,), how="inf", non_finite=ERROR),
        Run(_fp32(0), counters_off=True)],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    return functools.lru_cache(maxsize=None)(lambda world: run_ranks(_all, world, RUNS[world], str(root / str(world))))


@functools.lru_cache(maxsize=None)
def _reference(run: Run, world: int) -> tuple[list[float], list[float], torch.Tensor]:
    """Single-process fp32 training on the global batches not poisoned: (loss per step, grad norm per step,
    final weights), with the same LR schedule."""
    import zeroshard
    from zeroshard.config.build import schedule_for

    model = make_model()
    opt = make_optimizer(run.case.optimizer, model)
    schedule = schedule_for(zeroshard.Config.load(run.config()), opt)
    losses, norms = [], []
    for step in (s for s in range(STEPS) if s not in run.poison):
        x, y = global_batch(step, run.case.micro_rows * world * run.case.accumulation)
        loss = loss_of(model, x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.case.clip or math.inf).item())
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses, norms, flat_weights(model)


def _cases(world: int, test) -> list[tuple[int, Run]]:
    return [(i, run) for i, run in enumerate(RUNS[world]) if test(run)]


def _skipping(run: Run) -> bool:
    return bool(run.poison) and not run.non_finite


# -- (a) skip: nothing changes, training goes on, the run equals one without the batch ---------------------


@pytest.mark.parametrize("world", [2, 4])
def test_a_poisoned_step_changes_nothing_and_training_goes_on(results, world):
    for i, run in _cases(world, _skipping):
        (k,) = run.poison
        for rank, out in enumerate(results(world)):
            r = out[i]
            assert r["errors"] == {}, run
            assert r["unchanged"] == [s == k for s in range(STEPS)], (run, rank)  # bitwise, every state
            assert r["counters"] == [(s + 1, int(s >= k)) for s in range(STEPS)], run  # (global, skipped)
            assert [math.isinf(n) for n in r["norms"]] == [s == k for s in range(STEPS)], run
            assert torch.equal(r["weights"], results(world)[0][i]["weights"]), (run, rank)
        log = results(world)[0][i]["log"]
        assert len(log) == 1 and log[0].startswith(f"gradients hold inf or nan at step {k} (reduced gradients "), log
        assert log[0].endswith("step skipped on every rank (1 in a row, at most 10)"), log
        assert all(out[i]["log"] == [] for out in results(world)[1:]), "only rank 0 logs"


@pytest.mark.parametrize("world", [2, 4])
def test_the_run_matches_one_that_omitted_the_poisoned_batch(results, world):
    for i, run in _cases(world, _skipping):
        losses = torch.tensor([out[i]["losses"] for out in results(world)]).mean(0)
        kept = [s for s in range(STEPS) if s not in run.poison]
        weights = results(world)[0][i]["weights"]
        if run.case.dtype == "fp32":  # single-process PyTorch that never saw the batch
            ref_losses, _, ref_weights = _reference(run, world)
            assert ((losses[kept] - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max() <= 2e-5, run
            assert relative_error(weights, ref_weights) <= 1e-4, run
            assert relative_error(weights, flat_weights(make_model())) > 1e-3, run
        else:  # zeroshard on the same batches without the poisoned one: bit for bit
            (j, clean), = _cases(world, lambda r: r.case == run.case and r.omit == run.poison)
            clean_losses = torch.tensor([out[j]["losses"] for out in results(world)]).mean(0)
            assert torch.equal(losses[kept], clean_losses), run
            assert all(torch.equal(out[i]["weights"], out[j]["weights"]) for out in results(world)), run


@pytest.mark.parametrize("world", [2, 4])
def test_save_and_load_after_a_skip(results, world):
    for i, run in _cases(world, lambda r: r.save):
        for out in results(world):
            assert out[i]["loaded"] == (STEPS, 1, True), run  # the skip is counted in the checkpoint
            assert out[i]["after_load"] == (STEPS + 1, 1, False), run  # and training goes on


# -- (b) "error", (c) max_consecutive_skips ----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_action_error_raises_the_same_error_everywhere_and_the_engine_goes_on(results, world):
    for i, run in _cases(world, lambda r: r.non_finite == ERROR):
        (k,) = run.poison
        errors = [out[i]["errors"] for out in results(world)]
        assert all(set(e) == {k} for e in errors), errors
        assert len({e[k] for e in errors}) == 1, "every rank raises the same error"
        kind, message, state = errors[0][k]
        assert (kind, state) == ("NonFiniteError", "IDLE"), errors[0]
        assert message.startswith(f"gradients hold inf or nan at step {k} (in the reduced gradients that rank(s) ")
        assert "the step was not applied on any rank" in message and '"action": "skip"' in message
        for out in results(world):
            assert out[i]["unchanged"] == [s == k for s in range(STEPS)]  # not applied; the later steps train
            assert out[i]["counters"][-1] == (STEPS, 1)


def test_the_skip_after_max_consecutive_skips_raises(results):
    (i, run), = _cases(2, lambda r: "max_consecutive_skips" in dict(r.non_finite))  # 1; poisoned steps 0, 2, 3
    errors = [out[i]["errors"] for out in results(2)]
    assert all(set(e) == {3} for e in errors) and len({e[3] for e in errors}) == 1, errors
    kind, message, state = errors[0][3]
    assert (kind, state) == ("NonFiniteError", "IDLE")
    assert message.startswith("gradients hold inf or nan in 2 consecutive steps (2 to 3; the last at step 3 ")
    assert "more than non_finite.max_consecutive_skips=1" in message
    for out in results(2):
        assert out[i]["unchanged"] == [True, False, True, True]  # step 1 was applied: the count restarts
        assert out[i]["counters"] == [(1, 1), (2, 1), (3, 2), (4, 3)]
    log = results(2)[0][i]["log"]
    assert [line[line.rindex("("):] for line in log] == ["(1 in a row, at most 1)"] * 2, log


# -- (d) the global norm; (e) ranks out of step -------------------------------------------------------------


def test_global_grad_norm_is_clip_grad_norms_on_one_process(results):
    runs = _cases(2, lambda r: r.case.dtype == "fp32" and (r.case.clip or _skipping(r)))
    assert {run.case.stage for _, run in runs} == {0, 1, 2, 3} and {run.case.clip for _, run in runs} == {0, 0.05}
    for i, run in runs:
        _, ref_norms, _ = _reference(run, 2)
        kept = [s for s in range(STEPS) if s not in run.poison]
        for out in results(2):
            norms = torch.tensor(out[i]["norms"])[kept]
            assert ((norms - torch.tensor(ref_norms)).abs() / torch.tensor(ref_norms)).max() <= 1e-4, run
        if run.case.clip:
            assert min(ref_norms) > 2 * run.case.clip, "the case should clip"
            assert relative_error(results(2)[0][i]["weights"], _reference(run, 2)[2]) <= 1e-4, run


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_at_different_steps_raise_a_collective_error_naming_both(results, world):
    for i, run in _cases(world, lambda r: r.counters_off):
        errors = [out[i]["errors"] for out in results(world)]
        assert all(set(e) == {1} for e in errors), (run, errors)
        assert all(e[1] == errors[0][1] for e in errors), "every rank raises the same error"
        kind, message, state = errors[0][1]
        assert (kind, state) == ("CollectiveError", "FAILED")
        behind = ", ".join(f"rank {r} at step 1 (micro-step 2)" for r in range(world - 1))
        assert f"{behind}, rank {world - 1} at step 2 (micro-step 3)." in message, message
        assert "Every rank must run the same number of engine.backward() and engine.step() calls" in message


# -- the config section ----------------------------------------------------------------------------------


@pytest.mark.parametrize("section, line", [
    ({"action": "stop"}, 'non_finite.action must be "skip" or "error"; got "stop"'),
    ({"action": ["skip"]}, 'non_finite.action must be "skip" or "error"; got ["skip"]'),
    ({"max_consecutive_skips": 0}, "non_finite.max_consecutive_skips must be a positive integer; got 0"),
    ({"max_consecutive_skips": True}, "non_finite.max_consecutive_skips must be a positive integer; got true"),
    ({"actoin": "skip"}, "unknown key 'non_finite.actoin' (did you mean 'action'?); allowed keys in 'non_finite': "
                         "action, max_consecutive_skips"),
    ("skip", 'non_finite must be a JSON object such as {"action": "skip"}; got "skip"'),
])
def test_config_section_errors_name_the_key(section, line):
    import zeroshard

    with pytest.raises(zeroshard.ConfigError) as info:
        zeroshard.Config.load({"non_finite": section})
    assert str(info.value).splitlines()[1:] == [f"  - {line}"]


def test_config_section_defaults_and_fp16():
    import zeroshard

    assert zeroshard.Config.load({}).non_finite.model_dump() == {"action": "skip", "max_consecutive_skips": 10}
    config = zeroshard.Config.load({"non_finite": {"action": "error", "max_consecutive_skips": 3}})
    assert config.non_finite.model_dump() == {"action": "error", "max_consecutive_skips": 3}
    with pytest.raises(zeroshard.ConfigError, match='non_finite.action "error" does not apply with fp16.enabled'):
        zeroshard.Config.load({"fp16": {"enabled": True}, "non_finite": {"action": "error"}})
