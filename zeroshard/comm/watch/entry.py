"""Entry checks: every rank has entered the same call before any collective of it runs.

`save_checkpoint`, `load_checkpoint`, `save_pretrained`, `save_16bit_model`,
and at stage 3 `full_state_dict`, `iter_full_parameters`, the model's `state_dict()` (and so
transformers' and PEFT's `save_pretrained`) and `gathered_parameters`, are
collective: called on some ranks only (the usual `if rank == 0: ...`), they
would hang in their first collective until `collective_timeout` (30 minutes
by default) and end in a raw backend error, or, at stage 3 on gloo, abort
the process. So `enter` first meets the other ranks in the process group's
store, with a timeout of its own (`rank_check_timeout`, 20 s by default):

1. this rank publishes its position (the call, its step and micro-step, and
   the call the user made to get there with its fix: `positions.in_call`,
   calls.py) and its record for the call's sequence number (every rank
   counts the checked calls of a comm alike);
2. it adds 1 to the sequence number's counter; the rank that brings it to
   the world size sets the `all` key, which every rank waits for;
3. with everyone in, each rank reads every record (one `multi_get`) and all
   raise the same error if the calls differ, if the steps differ where they
   must not (`same_step`), or if a rank brought a problem of its own (a
   checkpoint inside an accumulation window, say: agreement.py's rule over
   the records, the lowest such rank's error);
4. a rank still waiting after its first look (1 s at most) looks at the
   others' positions each second: a rank in a collective (which cannot land
   while this rank waits here) or in another checked call, seen twice alike
   or saying it raised, is not coming, and this rank gives up at once
   instead of at `rank_check_timeout`. A rank that says nothing (computing,
   in a torch.distributed.barrier() of the user's, or exited) is waited for
   until the timeout;
5. a rank that gives up adds a large number to the counter: if all had
   arrived just before, the call goes on; otherwise the check failed for
   everyone, and a rank arriving later sees the large count and fails too,
   instead of starting collectives that no one joins. Its error names the
   call made, the missing ranks, what each of them published (stuck in a
   collective of step 4, in another call), and the fix for that call.

Store traffic, per call and rank: about eight round trips (a few
milliseconds) when every rank comes within the first look, nothing on the
collectives' books (`comm_stats`); past it, a check every 0.25 s and a read
of the positions (two round trips) every second, until the timeout. Keys live
under the group's own store prefix, then `zeroshard/entry/<comm>/`; a rank
deletes its record of two checks ago, and rank 0 that check's counter, so
the store holds at most two checks' keys per comm. With one rank, `enter`
only raises the rank's own problem.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from zeroshard.comm.watch import calls, positions
from zeroshard.comm.agreement import first_unless_alike, raise_agreed, report
from zeroshard.comm.collectives import Comm
from zeroshard.comm.watch.stall import CollectiveError

_GAVE_UP = 1 << 30  # added to a check's counter by a rank that stopped waiting: no rank can pass it after that
_LOOK_MAX_S = 1.0  # past the first wait, how often a rank looks at the others' positions
_POLL_S = 0.25  # ... and checks for the `all` key (a store.wait that times out logs a warning: check instead)
_FINAL = ("stopped", "gave up")  # a rank whose position says so has raised: no second look needed


def enter(comm: Comm, call: str, *, error: type[Exception] = CollectiveError, problem: Exception | None = None,
          same_step: bool = False, made: str | None = None, fix: str | None = None) -> None:
    """Raise `error` on every rank that entered `call` unless every rank of the group entered it.

    Step and micro-step come from `comm.trace` (the engine sets them). `problem`: an error this
    rank found before the call could start; every rank raises the lowest such rank's (its class
    and message), with its rank in front unless every rank had the same one. `same_step`: the
    ranks must also be at the same step and micro-step (a checkpoint of ranks at different steps
    would mix them). `made`, `fix`: the call the
    user made when it is not `call` itself (transformers' save_pretrained, which calls state_dict) and its
    fix, for the errors of every rank (calls.py).
    """
    if comm.world_size == 1:
        if problem is not None:
            raise problem
        return
    group_store = positions.group_store(comm.group)
    if group_store is None:  # a group without a store (not made by torch.distributed): nothing to meet in
        if problem is not None:
            raise problem
        return
    store = dist.PrefixStore(f"zeroshard/entry/{comm.uid}/", group_store)
    rank, world, trace = comm.rank, comm.world_size, comm.trace
    comm.entries += 1
    seq = comm.entries
    mine = positions.in_call(trace, call, seq, made=made, fix=fix)
    positions.publish(comm.group, rank, mine)
    store.set(f"{seq}/{rank}", json.dumps({**mine, "problem": report(problem)}))
    arrived = store.add(f"{seq}/count", 1)
    if arrived == world:
        store.set(f"{seq}/all", "1")
    away = {} if arrived > _GAVE_UP else _wait(comm, store, seq, mine)
    if away is not None:
        positions.publish(comm.group, rank, {**mine, "state": "gave up"})
        raise error(_missing(comm, mine, away, late=arrived > _GAVE_UP))
    records = [json.loads(r) for r in store.multi_get([f"{seq}/{r}" for r in range(world)])]
    _forget(store, rank, seq - 2)
    positions.publish(comm.group, rank, positions.running(trace))
    _agree(records, rank, call, error, problem, same_step)


def _wait(comm: Comm, store: dist.Store, seq: int, mine: dict) -> dict[int, dict] | None:
    """Wait for every rank to enter check `seq`: None once all did. Else, after rank_check_timeout or as soon
    as some rank is known not to come (`_away`), the positions of the ranks known not to ({} at the timeout)."""
    look = min(_LOOK_MAX_S, positions.grace_s(comm.rank_check_timeout_s) / 2)
    begun = time.monotonic()
    try:  # the usual case: the others are there, or come within the first look
        store.wait([f"{seq}/all"], timedelta(seconds=min(look, comm.rank_check_timeout_s)))
        return None
    except dist.DistStoreError:  # the wait timed out
        pass
    deadline, suspects, away = begun + comm.rank_check_timeout_s, {}, {}
    while not away and time.monotonic() < deadline:
        suspects, away = _away(comm, mine, suspects)
        until = min(deadline, time.monotonic() + look)
        while not away and time.monotonic() < until:
            time.sleep(min(_POLL_S, max(0.0, until - time.monotonic())))
            if store.check([f"{seq}/all"]):
                return None
    return None if _came_before_give_up(store, seq, comm.world_size) else away


def _away(comm: Comm, mine: dict, suspects: dict[int, dict]) -> tuple[dict[int, dict], dict[int, dict]]:
    """One look at the other ranks' positions: (the ranks seen elsewhere now, those of them known not to come:
    a position that says it raised, or the same position as at the last look)."""
    seen = positions.read(comm.group, comm.world_size)
    found = {r: p for r, p in seen.items() if r != comm.rank and positions.not_coming(mine, p)}
    return found, {r: p for r, p in found.items() if p.get("state") in _FINAL or suspects.get(r) == p}


def _came_before_give_up(store: dist.Store, seq: int, world: int) -> bool:
    """Give up, unless every rank came in before anyone gave up: the last arrival sets `all` (it may be
    setting it just now, when this rank is the first to give up and finds the count complete). A rank
    that arrived after a give-up never sets it, so a second rank giving up then fails too."""
    return store.add(f"{seq}/count", _GAVE_UP) == _GAVE_UP + world or store.check([f"{seq}/all"])


def _forget(store: dist.Store, rank: int, seq: int) -> None:
    """Delete this rank's keys of check `seq`: every rank has entered check seq + 1, so is done with seq."""
    if seq < 1:
        return
    keys = [f"{seq}/{rank}"] + ([f"{seq}/count", f"{seq}/all"] if rank == 0 else [])
    for key in keys:
        store.delete_key(key)


def _missing(comm: Comm, mine: dict, away: dict[int, dict], late: bool) -> str:
    """Why this rank stops in the entry check at `mine`: who did not come (`away`: those known not to, with
    their positions), and where every rank is."""
    world, call, named = comm.world_size, mine["call"], calls.named(mine)
    published = {comm.rank: mine, **positions.read(comm.group, world), **away}
    came = [r for r, p in published.items() if p.get("where") == "call" and p.get("seq") == mine["seq"]
            and p.get("call") == call]
    missing = [r for r in range(world) if r not in came]
    if late:
        head = (f"rank {comm.rank} entered {named} after the other ranks had stopped waiting for it "
                f"(rank_check_timeout {comm.rank_check_timeout_s:g} s)")
    elif away:
        head = (f"rank(s) {', '.join(map(str, sorted(away)))} will not enter {named}: "
                f"{'; '.join(f'rank {r} is {positions.describe(p)}' for r, p in sorted(away.items()))}; "
                f"while rank(s) {', '.join(map(str, came))} did")
    else:
        head = (f"rank(s) {', '.join(map(str, missing)) or '?'} did not enter {named} within rank_check_timeout "
                f"({comm.rank_check_timeout_s:g} s), while rank(s) {', '.join(map(str, came))} did")
    slow = "" if away else "; if a rank was only slow to get there, raise rank_check_timeout"
    return f"{head}. Where every rank is: {positions.describe_all(published, world)}.\n  {calls.advice(mine)}{slow}"


def _agree(records: list[dict], rank: int, call: str, error: type[Exception], problem: Exception | None,
           same_step: bool) -> None:
    """Raise the same error on every rank if the records differ in call or step, or hold a problem."""
    said = "; ".join(f"rank {r}: {positions.describe(p)}" for r, p in enumerate(records))
    if len({r["call"] for r in records}) > 1:
        raise error(f"the ranks made different calls at the same point: {said}. Every rank must make the same "
                    f"calls in the same order: {calls.fix(records[rank])}. The ranks' collectives are out of step "
                    "now: restart the job from a checkpoint")
    if same_step and len({(r["step"], r["micro"]) for r in records}) > 1:
        raise error(f"the ranks entered {call} at different steps: {said}. Every rank must run the same number "
                    "of engine.backward() and engine.step() calls (the same number of batches on every rank) "
                    "before it; restart the job from a checkpoint")
    raise_agreed([r["problem"] for r in records], rank, problem, word=first_unless_alike, default=error)
