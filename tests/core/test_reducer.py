"""GradReducer: when each target's reduction is launched, waited for, and what is said about unused parameters.

References: for the launch order, a few lines below (`expected_launches`)
that restate the contract independently of the reducer: ordered mode
launches the longest prefix of the target list whose gradients are all in;
unordered mode (stage 3) launches nothing itself but says which targets are
complete, and its caller (the schedule, once every rank has them: stage3/
agreement.py) launches them: `CallerLaunches` does so right after the arrival
that completes one. finish() launches the rest in list order. The fake targets record every call, so the
test sees the order and the timing of launches and waits in calls, never in
seconds. The multi-rank check trains a model whose ranks finish buckets in
different orders and compares it with the same update computed in one process.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from zeroshard.core import reducer as reducer_module
from zeroshard.core.switches import StageSwitches
from zeroshard.core.reducer import GradReducer

COMM, POOL = object(), object()  # the fake targets ignore them; the reducer must pass them through
SCALE = 0.125


class FakePending:
    def __init__(self, events: list, name: str):
        self.events, self.name, self.waits = events, name, 0

    def wait(self) -> None:
        self.waits += 1
        self.events.append(("wait", self.name))


class FakeTarget:
    """A target with `n` parameters that records the reducer's calls into `events`."""

    def __init__(self, name: str, n: int, events: list, shard_grads: bool = True):
        self.name, self.events = name, events
        self.params = [nn.Parameter(torch.zeros(1)) for _ in range(n)]
        self.switches = StageSwitches.for_stage(2 if shard_grads else 1)
        self.pendings: list[FakePending] = []

    def attach_grads(self) -> None:
        self.events.append(("attach", self.name))

    def take_grad(self, index: int, pool) -> None:
        assert pool is POOL
        self.events.append(("take", self.name, index))

    def reduce_grad(self, comm, pool, scale: float) -> FakePending:
        assert comm is COMM and pool is POOL and scale == SCALE
        self.events.append(("reduce", self.name))
        self.pendings.append(FakePending(self.events, self.name))
        return self.pendings[-1]


class CallerLaunches(GradReducer):
    """Unordered mode's caller, restated: each target `complete()` reports is launched at once, in list order."""

    def on_grad(self, target_index: int, param_index: int) -> None:
        super().on_grad(target_index, param_index)
        assert not self.launched(target_index) or not self.complete(target_index)
        for k in range(len(self.targets)):
            if self.complete(k):
                self.launch(k)


def make(sizes: list[int], ordered: bool, overlap: bool = True, shard_grads: bool = True):
    """(reducer, targets named A, B, C..., the shared event list, the on_launch calls)."""
    events: list = []
    targets = [FakeTarget(chr(ord("A") + i), n, events, shard_grads) for i, n in enumerate(sizes)]
    names = {id(p): f"{t.name}.{i}" for t in targets for i, p in enumerate(t.params)}
    launched: list[int] = []
    red = (GradReducer if ordered else CallerLaunches)(targets, COMM, POOL, overlap, names, ordered=ordered,
                      on_launch=lambda i: (launched.append(i), events.append(("on_launch", i))))
    return red, targets, events, launched


def reduces(events: list) -> list[str]:
    return [e[1] for e in events if e[0] == "reduce"]


def expected_launches(sizes: list[int], arrivals: list[tuple[int, int]], ordered: bool):
    """The contract, restated: (targets launched by each arrival, targets launched by finish())."""
    have = [set() for _ in sizes]
    done: list[int] = []
    per_arrival = []
    for t, p in arrivals:
        have[t].add(p)
        if ordered:
            prefix = 0
            while prefix < len(sizes) and len(have[prefix]) == sizes[prefix]:
                prefix += 1
            new = [i for i in range(prefix) if i not in done]
        else:
            new = [t] if len(have[t]) == sizes[t] and t not in done else []
        done += new
        per_arrival.append(new)
    return per_arrival, [i for i in range(len(sizes)) if i not in done]


def drive(red, targets, events, arrivals):
    """Feed the arrivals one by one: (names of the targets each one launched, names launched by finish())."""
    per_arrival = []
    for t, p in arrivals:
        before = len(reduces(events))
        red.on_grad(t, p)
        per_arrival.append(reduces(events)[before:])
    before = len(reduces(events))
    red.finish()
    return per_arrival, reduces(events)[before:]


def test_ordered_launch_waits_for_a_late_target_and_never_reorders():
    red, _targets, events, launched = make([2, 2, 2, 2], ordered=True)
    red.begin(True, SCALE)
    assert [e for e in events if e[0] == "attach"] == [("attach", n) for n in "ABCD"]
    # B and D complete first, then A: A releases B; C releases D.
    steps = [((1, 0), []), ((1, 1), []), ((3, 1), []), ((3, 0), []), ((0, 1), []), ((0, 0), ["A", "B"]),
             ((2, 0), []), ((2, 1), ["C", "D"])]
    for (t, p), want in steps:
        before = len(reduces(events))
        red.on_grad(t, p)
        assert reduces(events)[before:] == want, (t, p)
    red.finish()
    assert reduces(events) == ["A", "B", "C", "D"]
    assert launched == [0, 1, 2, 3]
    # on_launch follows its own target's reduce_grad, before the next launch
    order = [e for e in events if e[0] in ("reduce", "on_launch")]
    assert order == [x for i, n in enumerate("ABCD") for x in (("reduce", n), ("on_launch", i))]
    # every gradient was staged once (stage >= 2 switches), as it arrived
    assert sorted(e[1:] for e in events if e[0] == "take") == [(n, i) for n in "ABCD" for i in (0, 1)]


def test_unordered_mode_launches_nothing_itself_and_reports_complete_targets():
    red, targets, events, launched = make([2, 2], ordered=True)
    names = {id(p): f"{t.name}.{i}" for t in targets for i, p in enumerate(t.params)}
    plain = GradReducer(targets, COMM, POOL, True, names, ordered=False)
    plain.begin(True, SCALE)
    for t, p in ((1, 0), (1, 1), (0, 0), (0, 1)):
        plain.on_grad(t, p)
    assert reduces(events) == [] and plain.complete(1) and plain.complete(0)
    plain.launch(1)
    assert reduces(events) == ["B"] and plain.launched(1) and not plain.complete(1) and plain.complete(0)
    plain.finish()  # the rest, in list order
    assert reduces(events) == ["B", "A"]


def test_unordered_launch_takes_each_target_as_soon_as_it_is_complete():
    red, targets, events, launched = make([2, 2, 2, 2], ordered=False)
    red.begin(True, SCALE)
    arrivals = [(1, 0), (1, 1), (3, 1), (3, 0), (0, 1), (0, 0), (2, 0), (2, 1)]
    per_arrival, at_finish = drive(red, targets, events, arrivals)
    assert per_arrival == [[], ["B"], [], ["D"], [], ["A"], [], ["C"]]
    assert at_finish == []
    assert launched == [1, 3, 0, 2]


@pytest.mark.parametrize("ordered", [True, False])
def test_launches_match_the_contract_for_random_arrival_orders(ordered):
    rng = random.Random(1234)
    for trial in range(40):
        sizes = [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
        arrivals = [(t, p) for t, n in enumerate(sizes) for p in range(n)]
        rng.shuffle(arrivals)
        arrivals = arrivals[:len(arrivals) - rng.randint(0, 2)]  # sometimes a parameter or two never arrive
        red, targets, events, launched = make(sizes, ordered)
        red.begin(True, SCALE)
        want_each, want_finish = expected_launches(sizes, arrivals, ordered)
        got_each, got_finish = drive(red, targets, events, arrivals)
        names = [t.name for t in targets]
        assert got_each == [[names[i] for i in new] for new in want_each], (trial, sizes, arrivals)
        assert got_finish == [names[i] for i in want_finish], (trial, sizes, arrivals)
        assert launched == [i for new in want_each for i in new] + want_finish
        assert all(len(t.pendings) == 1 and t.pendings[0].waits == 1 for t in targets)  # once each, all landed


@pytest.mark.parametrize("ordered", [True, False])
def test_unreached_targets_launch_at_finish_in_order_and_are_named_once(ordered, caplog):
    red, targets, events, _launched = make([2, 1, 2, 1], ordered)
    arrivals = [(1, 0), (0, 0), (3, 0)]  # A.1 and all of C never arrive
    caplog.set_level(logging.WARNING, logger="zeroshard.core.reducer")
    red.begin(True, SCALE)
    per_arrival, at_finish = drive(red, targets, events, arrivals)
    if ordered:  # A is incomplete, so it holds B and D back
        assert per_arrival == [[], [], []] and at_finish == ["A", "B", "C", "D"]
    else:
        assert per_arrival == [["B"], [], ["D"]] and at_finish == ["A", "C"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].endswith(": A.1, C.0, C.1"), warnings[0]
    assert "received no gradient" in warnings[0]

    # The same parameters unused again: launched again, not named again.
    caplog.clear()
    events.clear()
    red.begin(True, SCALE)
    per_arrival, at_finish = drive(red, targets, events, arrivals)
    assert [n for new in per_arrival for n in new] + at_finish == (
        ["A", "B", "C", "D"] if ordered else ["B", "D", "A", "C"])
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]

    # Another parameter unused for the first time: named alone.
    red.begin(True, SCALE)
    drive(red, targets, events, [(0, 0), (0, 1), (2, 0), (2, 1), (3, 0)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].endswith(": B.0"), warnings


def test_a_micro_step_without_reduction_stages_but_never_launches_or_warns(caplog):
    caplog.set_level(logging.WARNING, logger="zeroshard.core.reducer")
    red, _targets, events, launched = make([2, 2], ordered=True)
    red.begin(False, SCALE)
    red.on_grad(0, 0)
    red.on_grad(0, 1)
    red.on_grad(1, 1)  # B.0 unused: no reduction this micro-step, so nothing to say yet
    red.finish()
    assert reduces(events) == [] and launched == []
    assert [e for e in events if e[0] == "take"] == [("take", "A", 0), ("take", "A", 1), ("take", "B", 1)]
    assert not caplog.records


def test_stages_0_and_1_hand_each_gradient_to_the_bucket_once():
    red, _targets, events, _ = make([2], ordered=True, shard_grads=False)
    red.begin(True, SCALE)
    red.on_grad(0, 0)
    red.on_grad(0, 1)
    red.finish()
    assert [e for e in events if e[0] == "take"] == [("take", "A", 0), ("take", "A", 1)]
    assert reduces(events) == ["A"]


@pytest.mark.parametrize("ordered", [True, False])
def test_a_second_gradient_after_launch_is_the_reentrant_checkpointing_error(ordered):
    red, targets, events, _ = make([2, 1], ordered)
    red.begin(True, SCALE)
    red.on_grad(0, 0)
    red.on_grad(0, 1)
    assert reduces(events) == ["A"]
    with pytest.raises(RuntimeError, match=r"parameter 'A\.1' received a second gradient") as error:
        red.on_grad(0, 1)
    assert "use_reentrant=False" in str(error.value)
    assert reduces(events) == ["A"]  # not launched twice
    red.abandon()
    assert targets[0].pendings[0].waits == 1


def test_a_second_gradient_before_launch_is_staged_again():
    """Ordered: B is complete but held behind A, so another gradient for it is still accepted."""
    red, _targets, events, _ = make([1, 2], ordered=True)
    red.begin(True, SCALE)
    red.on_grad(1, 0)
    red.on_grad(1, 1)
    red.on_grad(1, 0)  # B complete, not launched: accumulates
    assert reduces(events) == []
    red.on_grad(0, 0)
    assert reduces(events) == ["A", "B"]
    assert [e[1:] for e in events if e[0] == "take"] == [("B", 0), ("B", 1), ("B", 0), ("A", 0)]
    red.finish()


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_reductions_in_flight_are_bounded_and_land_in_launch_order(limit, monkeypatch):
    monkeypatch.setattr(reducer_module, "MAX_IN_FLIGHT", limit)
    red, targets, events, _ = make([1] * 6, ordered=False)
    red.begin(True, SCALE)
    in_flight, peak = [], 0
    for t in range(6):
        red.on_grad(t, 0)
        in_flight = [e[1] for e in events if e[0] == "reduce" and ("wait", e[1]) not in events]
        peak = max(peak, len(in_flight))
        assert len(in_flight) <= limit
    assert peak == limit
    assert in_flight == [targets[t].name for t in range(6 - limit, 6)]  # the newest ones
    red.finish()
    assert [e[1] for e in events if e[0] == "wait"] == list("ABCDEF")  # oldest first
    assert all(t.pendings[0].waits == 1 for t in targets)
    # A wait for the oldest comes before the launch that would exceed the limit.
    for k in range(limit, 6):
        assert events.index(("wait", targets[k - limit].name)) < events.index(("reduce", targets[k].name))


def test_without_overlap_each_reduction_lands_before_the_next_gradient():
    red, targets, events, _ = make([1, 1, 1], ordered=True, overlap=False)
    red.begin(True, SCALE)
    for t in range(3):
        red.on_grad(t, 0)
        assert events[-2:] == [("wait", targets[t].name), ("on_launch", t)]
    red.finish()
    assert all(t.pendings[0].waits == 1 for t in targets)


# -- on real ranks: a parameter unused on one rank only ------------------------------------------

WIDTH, LAYERS, SKIPPED, LR = 8, 4, 1, 0.1


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.skip: int | None = None

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return (x - y).pow(2).mean()


def _chain() -> Chain:
    torch.manual_seed(0)
    return Chain()


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _skip_on_rank1(rank, world, device):
    """Stage 2, one bucket per layer; rank 1 never uses layer SKIPPED, so its later bucket is ready first."""
    import zeroshard

    model = _chain().to(device)
    model.skip = SKIPPED if rank == 1 else None
    numel = WIDTH * WIDTH + WIDTH
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": numel, "allgather_bucket_size": numel}})
    names = {id(p): n.rsplit(".", 1)[0] for n, p in model.named_parameters()}
    order: list[str] = []
    for bucket in engine.buckets:
        def record(*args, bucket=bucket, launch=bucket.reduce_grad):
            order.append(names[id(bucket.params[0])])
            return launch(*args)
        bucket.reduce_grad = record
    records = _Records()
    logging.getLogger("zeroshard.core.reducer").addHandler(records)
    orders = []
    for step in range(2):
        order.clear()
        x, y = (t.to(device) for t in _batch(step, rank))
        engine.backward(engine(x, y))
        engine.step()
        orders.append(list(order))
    full = engine.full_state_dict()
    return orders, records.messages, {k: v.cpu() for k, v in full.items()}


def test_ranks_finishing_buckets_in_different_orders_launch_them_alike():
    results = run_ranks(_skip_on_rank1, 2)
    # The buckets' list order: one layer each, last layer first (backward order).
    want = [f"layers.{i}" for i in reversed(range(LAYERS))]
    for orders, _, _ in results:
        assert orders == [want, want]
    assert results[0][1] == []
    assert len(results[1][1]) == 1  # named once, in the first step only
    named = results[1][1][0].rsplit(": ", 1)[1].split(", ")
    assert sorted(named) == [f"layers.{SKIPPED}.bias", f"layers.{SKIPPED}.weight"]
    # Reference: one process, the mean of the two ranks' losses (rank 1 without the layer).
    model = _chain()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(2):
        losses = []
        for rank in range(2):
            model.skip = SKIPPED if rank == 1 else None
            losses.append(model(*_batch(step, rank)))
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    for name, ref in model.state_dict().items():
        assert torch.equal(results[0][2][name], results[1][2][name]), name
        torch.testing.assert_close(results[0][2][name], ref, rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(ref, initial[name]), name  # every layer trained, the skipped one on rank 0's data
