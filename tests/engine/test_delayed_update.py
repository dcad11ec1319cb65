"""ZeRO-Offload's one-step delayed parameter update (`offload_optimizer.delayed_update`), against the same
update applied one step late by hand.

The reference is the same run without offload whose optimizer applies each
step's gradients (clipped, as the engine hands them over) at the next step,
with the learning rate of the step they came from (`OneStepLateAdamW`):
from the warm-up on, the forward of step k+1 sees the updates of steps up to
k-1, and every gradient is applied once. The delayed run must equal it bit
for bit, every step's loss and the weights, before and after the last
update lands (`engine.flush_update`); at 2 ranks, stages 1-3, on the host
and on disk (stage 3 with the parameter shards on disk too, read by the
forward while the CPU step swaps the optimizer state), fp32 and bf16, with
accumulation, clipping and an LR schedule that changes the learning rate
while an update is in flight. A checkpoint saved mid-run lands the update
first, and a run resumed from it equals the run that saved.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import Case, make_engine_with_schedule, make_optimizer, train_steps
from zeroshard.errors import ModelError

STEPS = 5


class OneStepLateAdamW(torch.optim.AdamW):
    """AdamW that, from its call `start` on (counting from 0), applies each call's gradients at the next call,
    with that call's settings (learning rate); `flush` applies the last ones."""

    def __init__(self, params, start: int = 0, **kwargs):
        super().__init__(params, **kwargs)
        self.start, self.calls = start, 0
        self.late: tuple[list, list] | None = None  # (gradients, group settings) not applied yet

    # AdamW's own, for zeroshard's probes of the class (they pass its settings back by these names).
    __init__.__signature__ = inspect.signature(torch.optim.AdamW.__init__)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _settings(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

    def step(self, closure=None):
        self.calls += 1
        if self.calls <= self.start:  # the warm-up: at once
            return super().step()
        now = ([None if p.grad is None else p.grad.clone() for p in self._params()], self._settings())
        late, self.late = self.late, now
        if late is not None:
            self._apply(late)

    def flush(self) -> None:
        if self.late is not None:
            self._apply(self.late)
            self.late = None

    def _apply(self, late: tuple[list, list]) -> None:
        grads, settings = late
        params, live = self._params(), self._settings()
        given = [p.grad for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad
        for group, setting in zip(self.param_groups, settings):
            group.update(setting)
        try:
            super().step()
        finally:
            for p, grad in zip(params, given):
                p.grad = grad
            for group, setting in zip(self.param_groups, live):
                group.update(setting)


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[name].reshape(-1).cpu() for name, _ in engine.module.named_parameters()])


def _reference(rank, world, device, case: Case):
    """The run without offload, its optimizer one step late: (losses, weights, weights after the flush)."""
    plain = dataclasses.replace(case, offload="none", offload_params="none", delayed=None)
    engine, schedule = make_engine_with_schedule(plain, device=device, optimizer=lambda model: OneStepLateAdamW(
        make_optimizer(case.optimizer, model).param_groups, start=case.delayed))
    losses = train_steps(engine, schedule, plain, world, rank, device, range(STEPS))
    before = _weights(engine)
    engine.optimizer.flush()
    engine.offload.tiers.cast_to_params()  # the masters the flush changed, into the parameters
    engine._update.gather_params()  # stages 1-2: the updated shards, all-gathered
    return losses, before, _weights(engine)


def _delayed(rank, world, device, case: Case):
    engine, schedule = make_engine_with_schedule(case, device=device)
    losses = train_steps(engine, schedule, case, world, rank, device, range(STEPS))
    before = _weights(engine)
    engine.flush_update()
    after = _weights(engine)
    engine.offload.close()
    return losses, before, after


def _run(rank, world, device, cases):
    return [(_reference(rank, world, device, case), _delayed(rank, world, device, case)) for case in cases]


def test_delayed_update_equals_the_update_applied_one_step_late(tmp_path):
    disk = {"nvme_path": str(tmp_path)}
    cases = [
        Case(stage=1, accumulation=2, clip=0.5, offload="cpu", delayed=0),
        Case(stage=2, offload="cpu", schedule=True, delayed=2),  # the LR halves while an update is in flight
        Case(stage=2, accumulation=2, offload="nvme", delayed=1, bucket=1500, **disk),
        Case(stage=3, clip=0.5, offload="nvme", offload_params="nvme", schedule=True, delayed=0, **disk),
        Case(stage=3, accumulation=2, dtype="bf16", optimizer="adamw1_slow", offload="cpu", offload_params="cpu",
             delayed=1),
    ]
    for case, (reference, delayed) in zip(cases, run_ranks(_run, 2, cases)[0]):
        (ref_losses, ref_before, ref_after), (losses, before, after) = reference, delayed
        assert losses == ref_losses, f"{case}: losses differ from the update applied one step late"
        assert torch.equal(before, ref_before), f"{case}: weights differ before the last update lands"
        assert torch.equal(after, ref_after), f"{case}: weights differ after the last update lands"
        assert not torch.equal(before, after), f"{case}: the last update was not in flight"


def _resumed(rank, world, device, case: Case, save_dir: str):
    """The run that saves after step 2 (landing the update in flight) and goes on, and a run resumed there."""
    engine, _ = make_engine_with_schedule(case, device=device)
    first = train_steps(engine, None, case, world, rank, device, range(3))
    engine.save_checkpoint(save_dir)
    whole = first + train_steps(engine, None, case, world, rank, device, range(3, STEPS))
    engine.flush_update()
    weights = _weights(engine)
    engine.offload.close()
    resumed, _ = make_engine_with_schedule(case, device=device, seed=1)  # other initial weights: all from the load
    resumed.load_checkpoint(save_dir)
    rest = train_steps(resumed, None, case, world, rank, device, range(3, STEPS))
    resumed.flush_update()
    resumed_weights = _weights(resumed)
    resumed.offload.close()
    return whole, weights, rest, resumed_weights


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resume_equals_the_delayed_run_that_saved(tmp_path, stage):
    case = Case(stage=stage, clip=0.5, offload="nvme", delayed=1, nvme_path=str(tmp_path))
    whole, weights, rest, resumed_weights = run_ranks(_resumed, 2, case, str(tmp_path / "ck"))[0]
    assert rest == whole[3:], "the resumed run's losses differ from the run that saved"
    assert torch.equal(resumed_weights, weights)


def _edit(rank, world, device, case: Case):
    """An edit kept by gathered_parameters while the update is in flight, then after it landed."""
    engine, _ = make_engine_with_schedule(case, device=device)
    train_steps(engine, None, case, world, rank, device, range(1))
    params = list(engine.module.parameters())
    try:
        with zeroshard.gathered_parameters(params, modifier_rank=0):
            pass
        refused = ""
    except ModelError as exc:
        refused = str(exc)
    engine.flush_update()
    with zeroshard.gathered_parameters(params[0], modifier_rank=0):
        if rank == 0:
            params[0].data.fill_(0.5)
    engine.offload.close()
    return refused, engine.full_state_dict()[next(n for n, _ in engine.module.named_parameters())]


@pytest.mark.parametrize("stage", [2, 3])
def test_an_edit_of_the_masters_waits_for_the_update_to_land(stage):
    for refused, edited in run_ranks(_edit, 2, Case(stage=stage, offload="cpu", delayed=0)):
        assert "call engine.flush_update() on every rank before the block" in refused  # on every rank
        assert torch.all(edited == 0.5)
