"""Ranks that are not in the same call end in a clear error on every rank, not in a hang.

A collective call made on some ranks only (`if rank == 0: engine.save_checkpoint(...)`), a rank
that runs one more step than the others, a config that fails on one rank: each ends, on every
rank, in a `ZeroshardError` that names the call, the ranks and where each of them is, well before
`collective_timeout` (run_ranks' own timeout catches a hang; nothing here measures time).

References: the control flow each test sets up itself (which rank calls what, at which step),
the engine's own `full_state_dict` before the failure and after a reload, `comm_stats()` and the
store's key count before and after. Every scenario runs on a fresh gloo group of its own, so a
collective left stuck by one scenario cannot meet the next one's.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    loss_of,
    make_model,
    make_optimizer,
    micro_batch,
    relative_error,
    train_reference,
)
from zeroshard.comm.watch import positions
from zeroshard.comm.watch.entry import enter

RANK_CHECK_S = 2.0  # rank_check_timeout here: the grace period of a stuck collective is 0.5 s
GROUP_TIMEOUT_S = 15  # gloo drops a collective left stuck on an abandoned group after this
TIMEOUT_S = 150  # run_ranks: a hang fails the test


# -- helpers, run on every rank ---------------------------------------------------------------------


def _group():
    return dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _engine(stage: int, device, group, rank_check_s: float = RANK_CHECK_S):
    model = make_model(device=device)
    config = Case(stage=stage).config() | {"rank_check_timeout": rank_check_s, "collective_timeout": GROUP_TIMEOUT_S}
    return zeroshard.initialize(model, make_optimizer("adamw", model), config, group=group)


def _step(engine, step: int, rank: int, device) -> None:
    x, y = (t.to(device) for t in micro_batch(step, Case(), 2, rank, 0))
    engine.backward(loss_of(engine, x, y))
    engine.step()


def _attempt(fn) -> tuple[str, str] | None:
    try:
        fn()
    except zeroshard.ZeroshardError as exc:
        return type(exc).__name__, str(exc)
    return None


def _held(engine) -> list[torch.Tensor]:
    """What this rank holds of the model states: its masters and optimizer state (copies)."""
    state = [v for b in engine.buckets for v in engine.optimizer.state.get(b.master, {}).values()
             if torch.is_tensor(v)]
    return [t.detach().clone() for t in [b.master for b in engine.buckets] + state]


# -- (a), (b): save_checkpoint or load_checkpoint on rank 0 only -------------------------------------


def _rank0_only(rank: int, world: int, device, root: str, stage: int, call: str) -> dict:
    save_dir = Path(root) / f"{call}{stage}"
    engine = _engine(stage, device, _group())
    for step in range(2):
        _step(engine, step, rank, device)
    engine.save_checkpoint(save_dir, tag="good")
    saved = engine.full_state_dict()
    _step(engine, 2, rank, device)
    before = _held(engine)
    if rank == 0:
        if call == "save":
            error = _attempt(lambda: engine.save_checkpoint(save_dir, tag="bad"))
        else:
            error = _attempt(lambda: engine.load_checkpoint(save_dir))
    else:  # goes on training: its next collective finds rank 0 elsewhere
        error = _attempt(lambda: _step(engine, 3, rank, device))
    unchanged = rank != 0 or all(torch.equal(a, b) for a, b in zip(before, _held(engine)))
    # The restarted job: a fresh group and engine load the last good checkpoint.
    fresh = _engine(stage, device, _group())
    fresh.load_checkpoint(save_dir)
    loaded = fresh.full_state_dict()
    return {"error": error, "unchanged": unchanged, "latest": (save_dir / "latest").read_text().strip(),
            "names": sorted(p.name for p in save_dir.iterdir()),
            "reloaded": sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)}


def _rank0_only_all(rank: int, world: int, device, root: str) -> dict:
    return {(stage, call): _rank0_only(rank, world, device, root, stage, call)
            for call in ("save", "load") for stage in (2, 3)}


def test_save_or_load_on_rank0_only_ends_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    ranks = run_ranks(_rank0_only_all, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for (stage, call), r0 in ranks[0].items():
        r1 = ranks[1][(stage, call)]
        name = f"{call}_checkpoint"
        kind, message = r0["error"]
        assert kind == "CheckpointError", (stage, call, r0["error"])
        # Rank 0 saw rank 1 in a collective (twice alike) while it waited: it did not wait out rank_check_timeout.
        assert f"rank(s) 1 will not enter {name}: rank 1 is waiting in collective" in message, message
        assert f"rank 0: in {name} after 3 optimizer steps (3 micro-steps)" in message, message
        # Stage 3's first collective is the ranks' round on the units (3 units: 1 + 2 x 3 bytes a rank).
        first = "#1 (unit_check of 14 bytes for the units of the step)" if stage == 3 else "#1 ("
        assert f"rank 1: waiting in collective {first}" in message and "of step 3 (micro-step 3)" in message, message
        assert f"call engine.{name}(...) on every rank: every rank " in message, message
        assert ("`if rank == 0: engine.save_checkpoint(...)` is the usual cause" in message) == (call == "save")
        kind, message = r1["error"]
        assert kind == "CollectiveError", (stage, call, r1["error"])
        assert "but rank(s) 0 will never join that collective" in message, message
        assert f"rank 0: in {name} after 3 optimizer steps (3 micro-steps)" in message, message
        assert ("of the forward of step 3" if stage == 3 else "of the backward of step 3") in message, message
        for r in (r0, r1):
            assert r["latest"] == "good" and not any("bad" in n for n in r["names"]), (stage, call, r["names"])
            assert r["unchanged"] and r["reloaded"], (stage, call)


# -- (c): one rank runs one more step, then both call save_checkpoint ----------------------------------


def _one_more_step(rank: int, world: int, device, root: str) -> dict:
    return {stage: _steps_then_save(rank, device, Path(root) / f"stage{stage}", stage) for stage in (0, 1, 2)}


def _steps_then_save(rank: int, device, save_dir: Path, stage: int) -> list:
    engine = _engine(stage, device, _group())
    ran = _attempt(lambda: [_step(engine, step, rank, device) for step in range(2 + rank)])  # rank 1: one more
    return [ran, _attempt(lambda: engine.save_checkpoint(save_dir))]


def _check_one_more_step(r0: dict, r1: dict) -> None:
    for stage in (0, 1, 2):
        (step0, save0), (step1, save1) = r0[stage], r1[stage]
        assert step0 is None, (stage, step0)  # rank 0 ran its 2 steps
        assert step1[0] == "CollectiveError", (stage, step1)  # rank 1's third step cannot complete
        # Rank 1's engine failed: its save raises too (EngineStateError, or CheckpointError if it came late).
        assert save0[0] == "CheckpointError" and save1 is not None, (stage, save0, save1)
        for message in (step1[1], save0[1]):
            assert "rank 0: in save_checkpoint after 2 optimizer steps (2 micro-steps)" in message, message
            assert "rank 1: waiting in collective #1 (" in message, message
            assert "of the backward of step 2 (micro-step 2)" in message, message


# -- (d), (e), (f): calls on one rank at stage 3, a config error on one rank, the happy path ----------


def _stage3_solo_calls(rank: int, device) -> dict:
    engine = _engine(3, device, _group(), rank_check_s=1.0)
    _step(engine, 0, rank, device)
    engine.full_state_dict()  # both ranks: passes
    store = dist.distributed_c10d._get_default_store()
    errors = {}
    if rank == 0:
        errors["full_state_dict"] = _attempt(engine.full_state_dict)
        errors["gathered_parameters"] = _attempt(lambda: _gather(engine))
        store.set("test/solo_done", "1")
    else:
        store.wait(["test/solo_done"], timedelta(seconds=60))
    return errors


def _gather(engine) -> None:
    with zeroshard.gathered_parameters(engine.module.blocks[0].parameters()):
        pass


def _config_typo_on_rank1(rank: int, device):
    model = make_model(device=device)
    config = Case(stage=2).config() | ({"zero_optimizaton": {"stage": 2}} if rank == 1 else {})
    return _attempt(lambda: zeroshard.initialize(model, make_optimizer("adamw", model), config))


def _counting(calls: list[str]):
    """Wrap positions.publish and positions.read so that every use of the store by them is counted."""
    def wrap(name):
        fn = getattr(positions, name)
        return lambda *args, **kwargs: (calls.append(name), fn(*args, **kwargs))[1]
    return wrap("publish"), wrap("read")


def _happy_path(rank: int, device, root: str) -> dict:
    group = _group()
    engine = _engine(3, device, group, rank_check_s=60.0)
    calls: list[str] = []
    original = positions.publish, positions.read
    positions.publish, positions.read = _counting(calls)
    try:
        for step in range(3):  # stage 3: gathers, reduce-scatters, the step check
            _step(engine, step, rank, device)
    finally:
        positions.publish, positions.read = original
    engine.save_checkpoint(Path(root) / "happy")
    full = engine.full_state_dict()
    with zeroshard.gathered_parameters(engine.module.blocks[0].parameters(), modifier_rank=0):
        pass
    engine.load_checkpoint(Path(root) / "happy")
    store, keys = dist.distributed_c10d._get_default_store(), []
    stats = engine.comm_stats()
    for n in range(23):
        enter(engine.comm, "probe")
        if n in (2, 22):  # every rank is past the same checks: count the store's keys
            dist.barrier(group=group)
            keys.append(store.num_keys())
            dist.barrier(group=group)
    after, entries = engine.comm_stats(), engine.comm.entries
    return {"same_stats": all((after[op].calls, after[op].bytes) == (s.calls, s.bytes) for op, s in stats.items()),
            "keys": keys, "entries": entries, "store_calls_in_steps": calls,
            "full_equal": all(torch.equal(full[k], v) for k, v in engine.full_state_dict().items())}


def _slow_rank(rank: int, device) -> dict:
    """Rank 1 reaches step 0's first collective late: rank 0 looks where it is (running), and waits on."""
    group = _group()
    engine = _engine(2, device, group, rank_check_s=1.0)  # grace period 0.25 s, then a look every 0.125 s
    if rank == 1:  # "computing" until rank 0 has published that it waits, and for a few of its looks more
        while positions.read(group, 2).get(0, {}).get("where") != "collective":
            time.sleep(0.01)
        time.sleep(0.5)
    error = _attempt(lambda: _step(engine, 0, rank, device))
    full = engine.full_state_dict()
    weights = torch.cat([full[name].reshape(-1) for name, _ in engine.module.named_parameters()])
    return {"error": error, "published": engine.comm.trace.published, "weights": weights}


def _out_of_step(rank: int, world: int, device, root: str) -> dict:
    # The config error first, on the default group, before any scenario could leave it busy.
    return {"config": _config_typo_on_rank1(rank, device), "solo": _stage3_solo_calls(rank, device),
            "happy": _happy_path(rank, device, root), "slow": _slow_rank(rank, device),
            "one_more_step": _one_more_step(rank, world, device, root)}


def test_ranks_out_of_step_end_in_errors_naming_where_each_rank_is(tmp_path):
    """(c) one more step on one rank, (d) stage-3 calls on one rank, (e) a config error on one rank, and
    (f) the happy path, in one pair of processes (each scenario on a group of its own)."""
    r0, r1 = run_ranks(_out_of_step, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    _check_one_more_step(r0["one_more_step"], r1["one_more_step"])
    # (e) A typo in rank 1's config: both ranks raise the same ConfigError, naming rank 1 and the key.
    assert r0["config"] == r1["config"], (r0["config"], r1["config"])
    kind, message = r0["config"]
    assert kind == "ConfigError" and message.startswith("the config of rank 1 cannot be used"), message
    assert "zero_optimizaton" in message, message
    # (d) full_state_dict and gathered_parameters at stage 3 on rank 0 alone: an error naming rank 1.
    assert r1["solo"] == {}
    for call, (kind, message) in r0["solo"].items():
        assert kind == "CollectiveError", (call, kind, message)
        assert f"rank(s) 1 did not enter {call} within rank_check_timeout (1 s), while rank(s) 0 did" in message
        assert "rank 1: running (no collective of it has waited long)" in message, message
    # (f) The happy path: every call passes; entry checks are store traffic, not collectives, and
    # the store holds as many keys after 23 checks as after 3.
    for r in (r0, r1):
        happy = r["happy"]
        assert happy["same_stats"] and happy["full_equal"], happy
        assert happy["entries"] == 4 + 23, happy  # save, full_state_dict, gathered_parameters, load, probes
        assert happy["keys"][0] == happy["keys"][1], happy
        assert happy["store_calls_in_steps"] == [], happy  # training steps never touch the store
    # A rank that is only slow is waited for: rank 0 published where it waited (and that it went on),
    # rank 1 never had to; the step matches single-process training on the global batch.
    assert r0["slow"]["error"] is None and r1["slow"]["error"] is None, (r0["slow"]["error"], r1["slow"]["error"])
    assert (r0["slow"]["published"], r1["slow"]["published"]) == (3, 1)  # running, collective, running; running
    _, reference = train_reference(Case(stage=2), 2, 1)
    assert torch.equal(r0["slow"]["weights"], r1["slow"]["weights"])
    assert relative_error(r0["slow"]["weights"], reference) < 1e-4


# -- the timeouts themselves ---------------------------------------------------------------------------


def test_timeouts_beyond_1e9_seconds_are_config_errors():
    # timedelta(seconds=1e300) overflows in Python; from about 7.5e9 s torch.distributed's clocks do.
    for key in ("collective_timeout", "rank_check_timeout"):
        for value, shown in ((1e300, "1e+300"), (2e9, "2000000000.0")):
            with pytest.raises(zeroshard.ConfigError) as info:
                zeroshard.Config.load({key: value})
            assert str(info.value) == (
                f"invalid zeroshard config (dict):\n  - {key} must be at most 1e9 seconds (31 years; longer "
                f"overflows torch.distributed's clocks): use 1e9 for no practical limit; got {shown}")
        assert getattr(zeroshard.Config.load({key: 1e9}), key) == 1e9
    with pytest.raises(zeroshard.ConfigError, match="rank_check_timeout must be a number of seconds > 0; got 0"):
        zeroshard.Config.load({"rank_check_timeout": 0})
