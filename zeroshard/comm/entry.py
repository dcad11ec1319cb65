"""Entry checks: every rank has entered the same call before any collective of it runs.

`save_checkpoint`, `load_checkpoint`, and at stage 3 `full_state_dict` and
`gathered_parameters`, are collective: called on some ranks only (the usual
`if rank == 0: engine.save_checkpoint(...)`), they would hang in their first
collective until `collective_timeout` (30 minutes by default) and end in a
raw backend error, or, at stage 3 on gloo, abort the process. So `enter`
first meets the other ranks in the process group's store, with a timeout of
its own (`rank_check_timeout`, 60 s by default):

1. this rank publishes its position (the call, its step and micro-step:
   `positions.in_call`) and its record for the call's sequence number
   (every rank counts the checked calls of a comm alike);
2. it adds 1 to the sequence number's counter; the rank that brings it to
   the world size sets the `all` key, which every rank waits for;
3. with everyone in, each rank reads every record (one `multi_get`) and all
   raise the same error if the calls differ, if the steps differ where they
   must not (`same_step`), or if a rank brought a problem of its own (a
   checkpoint inside an accumulation window, say);
4. a rank that times out adds a large number to the counter: if all had
   arrived just before, the call goes on; otherwise the check failed for
   everyone, and a rank arriving later sees the large count and fails too,
   instead of starting collectives that no one joins. Its error names the
   missing ranks, what each of them published (stuck in a collective of
   step 4, in another call), and the fix.

Store traffic, per call and rank: about eight round trips (a few
milliseconds), nothing on the collectives' books (`comm_stats`). Keys live
under the group's own store prefix, then `zeroshard/entry/<comm>/`; a rank
deletes its record of two checks ago, and rank 0 that check's counter, so
the store holds at most two checks' keys per comm. With one rank, `enter`
only raises the rank's own problem.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from zeroshard.comm import positions
from zeroshard.comm.collectives import Comm
from zeroshard.comm.stall import CollectiveError

_GAVE_UP = 1 << 30  # added to a check's counter by a rank that stopped waiting: no rank can pass it after that
_FIX = ("call it on every rank of the group, in the same order as the other collective calls; "
        "`if rank == 0: engine.save_checkpoint(...)` is the usual cause (every rank writes its own shard). "
        "The ranks' collectives are out of step now: restart the job from a checkpoint")


def enter(comm: Comm, call: str, *, error: type[Exception] = CollectiveError, problem: Exception | None = None,
          same_step: bool = False) -> None:
    """Raise `error` on every rank that entered `call` unless every rank of the group entered it.

    Step and micro-step come from `comm.trace` (the engine sets them). `problem`: an error this
    rank found before the call could start; every rank raises it (on this rank as its own
    type), with its rank in front unless every rank had the same one. `same_step`: the ranks must also be at the same step and
    micro-step (a checkpoint of ranks at different steps would mix them).
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
    mine = positions.in_call(trace, call, seq)
    positions.publish(comm.group, rank, mine)
    store.set(f"{seq}/{rank}", json.dumps({**mine, "problem": None if problem is None else str(problem)}))
    arrived = store.add(f"{seq}/count", 1)
    if arrived == world:
        store.set(f"{seq}/all", "1")
    if arrived > _GAVE_UP or not _everyone_came(store, seq, world, comm.rank_check_timeout_s):
        positions.publish(comm.group, rank, positions.in_call(trace, call, seq, "gave up"))
        raise error(_missing(comm, call, seq, late=arrived > _GAVE_UP))
    records = [json.loads(r) for r in store.multi_get([f"{seq}/{r}" for r in range(world)])]
    _forget(store, rank, seq - 2)
    positions.publish(comm.group, rank, positions.running(trace))
    _agree(records, rank, call, error, problem, same_step)


def _everyone_came(store: dist.Store, seq: int, world: int, timeout_s: float) -> bool:
    try:
        store.wait([f"{seq}/all"], timedelta(seconds=timeout_s))
        return True
    except Exception:  # DistStoreError on timeout; anything else reads as a timeout too
        pass
    # Give up, unless every rank came in before anyone gave up: the last arrival sets `all` (it may be
    # setting it just now, when this rank is the first to give up and finds the count complete). A rank
    # that arrived after a give-up never sets it, so a second rank giving up then fails too.
    return store.add(f"{seq}/count", _GAVE_UP) == _GAVE_UP + world or store.check([f"{seq}/all"])


def _forget(store: dist.Store, rank: int, seq: int) -> None:
    """Delete this rank's keys of check `seq`: every rank has entered check seq + 1, so is done with seq."""
    if seq < 1:
        return
    keys = [f"{seq}/{rank}"] + ([f"{seq}/count", f"{seq}/all"] if rank == 0 else [])
    for key in keys:
        store.delete_key(key)


def _missing(comm: Comm, call: str, seq: int, late: bool) -> str:
    """Why this rank stops in `call`'s entry check: who did not come, and where every rank is."""
    world = comm.world_size
    published = positions.read(comm.group, world)
    came = [r for r, p in published.items() if p.get("where") == "call" and p.get("seq") == seq
            and p.get("call") == call]
    missing = [r for r in range(world) if r not in came]
    if late:
        head = (f"rank {comm.rank} entered {call} after the other ranks had stopped waiting for it "
                f"(rank_check_timeout {comm.rank_check_timeout_s:g} s)")
    else:
        head = (f"rank(s) {', '.join(map(str, missing)) or '?'} did not enter {call} within rank_check_timeout "
                f"({comm.rank_check_timeout_s:g} s), while rank(s) {', '.join(map(str, came))} did")
    return (f"{head}. Where every rank is: {positions.describe_all(published, world)}.\n  {call} is a "
            f"collective call: {_FIX}; if a rank was only slow to get there, raise rank_check_timeout")


def _agree(records: list[dict], rank: int, call: str, error: type[Exception], problem: Exception | None,
           same_step: bool) -> None:
    """Raise the same error on every rank if the records differ in call or step, or hold a problem."""
    said = "; ".join(f"rank {r}: {positions.describe(p)}" for r, p in enumerate(records))
    if len({r["call"] for r in records}) > 1:
        raise error(f"the ranks made different calls at the same point: {said}. Every rank must make the same "
                    f"calls in the same order: {_FIX}")
    if same_step and len({(r["step"], r["micro"]) for r in records}) > 1:
        raise error(f"the ranks entered {call} at different steps: {said}. Every rank must run the same number "
                    "of engine.backward() and engine.step() calls (the same number of batches on every rank) "
                    "before it; restart the job from a checkpoint")
    failed = [(r, rec["problem"]) for r, rec in enumerate(records) if rec["problem"] is not None]
    if failed:
        first, text = failed[0]
        if len(failed) < len(records) or len({t for _, t in failed}) > 1:  # else: one mistake, made everywhere
            text = f"rank {first}: {text}"
        raise type(problem)(text) if problem is not None else error(text)
