"""Where each rank is, told through the process group's store, so that a stuck collective can say why.

The store (the key-value server torch.distributed rendezvoused through, a
TCPStore under torchrun) answers while the group's collectives are stuck.
A rank leaves one note there, its *position*, only when something is slow:

- `running`: nothing to tell (at `Comm.create`, and after a slow wait ends);
- `call`: it waits in the entry check of a call every rank must make
  (`save_checkpoint`, `load_checkpoint`, `save_pretrained`, stage 3's
  `full_state_dict`, `state_dict()` and `gathered_parameters`; see
  `entry.py`), with the call the user made and its fix (calls.py), which
  the other ranks' errors name;
- `collective`: one of its collectives has waited longer than the grace
  period (`grace_s`); the note names it, the phase (forward, backward,
  step) and the step and micro-step the engine set on the comm's `Trace`.

The happy path writes nothing: a collective that lands within the grace
period costs the one `work.wait(timeout)` it always cost.

`wait_watched` is that wait. Past the grace period it publishes this rank's
position and reads the others' every poll; a rank that is known to be
elsewhere (in an entry check, or stuck in a collective of another step or
micro-step), twice in a row with the same note, means the collectives will
never match: `CollectiveError` names every rank's position and the fix (for
a rank in an entry check, its call as made and that call's fix). A
rank whose position says nothing (computing, or at the same place) keeps
the wait going up to `collective_timeout`, as a slow collective should.

Which work handles can be polled (measured on gloo, torch 2.13, CPU):
`work.wait(timeout)` on all_reduce, broadcast, all_to_all_single and
all_gather_single (the step check) raises
"Operation timed out!" and can be called again: the operation still lands,
with the right values, and the group stays usable; `work.is_completed()`
is False until it lands. Batched isend/irecv (our all-gather and
reduce-scatter on gloo) is different: a timed-out wait closes the pair ("Application timeout caused
pair closure"), and `is_completed()` never turns True before `wait()`. So
point-to-point work is waited once, with the whole collective_timeout, in a
thread of the comm's own (`Waiter`), and the rank polls that wait instead.
On NCCL, `work.wait()` only makes the current stream wait and returns at
once, and `is_completed()` is a non-blocking event query: a stuck NCCL
collective shows at the next host synchronisation, not here. There zeroshard
relies on the entry checks (store-based, backend-independent), on the step
check's comparison of the ranks' records (stall.py), and on NCCL's watchdog
with the group's timeout.

A rank stuck in a collective also publishes its record's checksum at that
collective (`stall.Trace`): a rank whose own record disagrees at the same
number, or a rank that saw such a disagreement, knows the ranks ran
different collectives, and all of them compare their rings through the
store and raise the same `CollectiveError` naming the first difference.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from zeroshard.comm.watch import calls
from zeroshard.comm.watch.stall import CollectiveError, Trace, differ

_PREFIX = "zeroshard/position/"
_PHASES = {"step": "engine.step()"}  # the trace's phase, in words
_GRACE_MAX_S = 5.0  # a collective slower than this on gloo is already unusual; the check costs nothing before


class Watched(Protocol):
    """What `wait_watched` needs of a comm (`Comm` in collectives.py)."""

    group: dist.ProcessGroup
    trace: Trace
    timeout_s: float | None
    rank_check_timeout_s: float

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def grace_s(rank_check_timeout_s: float) -> float:
    """How long a collective waits before this rank looks at where the others are: a quarter of
    rank_check_timeout, at most 5 s, so that a divergence is named within half of rank_check_timeout."""
    return min(_GRACE_MAX_S, rank_check_timeout_s / 4)


def group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The store of `group` (keys already prefixed with the group's name), or None where there is none."""
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except Exception:  # a group torch.distributed does not know (a fake in a test, a destroyed one)
        return None


def publish(group: dist.ProcessGroup, rank: int, position: dict[str, Any]) -> None:
    """Leave `position` in the store as this rank's; a failure to reach the store is not an error of its own."""
    store = group_store(group)
    if store is not None:
        try:
            store.set(f"{_PREFIX}{rank}", json.dumps(position))
        except Exception:  # the store is gone: the collective that follows will say so
            pass


def read(group: dist.ProcessGroup, world: int) -> dict[int, dict[str, Any]]:
    """Every rank's published position (ranks that never published are left out)."""
    store = group_store(group)
    if store is None:
        return {}
    keys = [f"{_PREFIX}{r}" for r in range(world)]
    try:
        if store.check(keys):  # the usual case: two round trips, whatever the world size
            return {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}
        return {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    except Exception:
        return {}


def running(trace: Trace) -> dict[str, Any]:
    trace.published += 1
    return {"where": "running", "n": trace.published}


def in_call(trace: Trace, call: str, seq: int, state: str = "waiting", made: str | None = None,
            fix: str | None = None) -> dict[str, Any]:
    """In the entry check of `call`; `made`, `fix`: the call the user made to get there and its fix (calls.py)."""
    trace.published += 1
    extra = {k: v for k, v in (("made", made), ("fix", fix)) if v is not None}
    return {"where": "call", "call": call, "seq": seq, "state": state, "step": trace.global_step,
            "micro": trace.micro_step, "n": trace.published, "noted": trace.noted, **extra}


def in_collective(trace: Trace, number: int) -> dict[str, Any]:
    trace.published += 1
    entry = trace.entry(number)
    index, op, digest = (entry[2], entry[3], entry[4]) if entry else (number, "?", None)
    return {"where": "collective", "index": index, "op": op, "phase": trace.phase, "step": trace.global_step,
            "micro": trace.micro_step, "n": trace.published, "noted": number + 1, "digest": digest}


def describe(position: dict[str, Any] | None) -> str:
    """A position in words. Steps count from 0: 'step 3' is the fourth, run after 3 optimizer steps."""
    if position is None:
        return "nothing published (computing, finished, or not started)"
    where, step, micro = position.get("where"), position.get("step"), position.get("micro")
    if where == "call":
        gave_up = ", and gave up waiting" if position.get("state") == "gave up" else ""
        return f"in {calls.named(position)} after {step} optimizer steps ({micro} micro-steps){gave_up}"
    if where == "collective":
        phase = _PHASES.get(position["phase"], position["phase"])
        stopped = ", and stopped waiting (it raised)" if position.get("state") == "stopped" else ""
        return (f"waiting in collective #{position['index'] + 1} ({position['op']}) of the {phase} of step {step} "
                f"(micro-step {micro}){stopped}")
    return "running (no collective of it has waited long)"


def describe_all(positions: dict[int, dict[str, Any]], world: int) -> str:
    return "; ".join(f"rank {r}: {describe(positions.get(r))}" for r in range(world))


def elsewhere(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether a rank at `theirs` can never join the collective this rank waits in at `mine`."""
    if theirs.get("where") == "call":
        return True  # an entry check runs no collective: whatever this rank waits for, it is not that
    if theirs.get("where") == "collective":
        return (theirs.get("step"), theirs.get("micro")) != (mine.get("step"), mine.get("micro"))
    return False


def not_coming(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether a rank at `theirs` cannot be on its way to the entry check this rank waits in at `mine`."""
    if theirs.get("where") == "collective":
        # This rank runs no collective while it waits, so the other's cannot land, unless this rank launched it
        # before (a slow one it has done its part of: it lands, however long it takes).
        return theirs.get("noted", 0) > mine.get("noted", 0)
    if theirs.get("where") == "call":
        other = (theirs.get("call"), theirs.get("seq")) != (mine["call"], mine["seq"])
        return other or theirs.get("state") == "gave up"
    return False


def records_differ(trace: Trace, theirs: dict[str, Any]) -> bool:
    """Whether a rank at `theirs` ran other collectives than this rank (its record's checksum at the collective
    it waits in differs from this rank's at the same number), or found that some rank did."""
    if theirs.get("differs"):
        return True
    if theirs.get("where") != "collective" or theirs.get("digest") is None:
        return False
    mine = trace.entry(theirs["noted"] - 1)
    return mine is not None and mine[4] != theirs["digest"]


def wait_watched(work, comm: Watched, number: int) -> None:
    """Wait for a pollable work handle (see the module's docstring) up to `comm.timeout_s`.

    Raises `CollectiveError` once another rank is known to be elsewhere, and the
    work's own RuntimeError if it fails or times out (the caller explains it).
    """
    grace = min(grace_s(comm.rank_check_timeout_s), comm.timeout_s / 2)  # a look before the timeout
    if comm.trace.diverged is None and _landed(work, grace):  # the happy path: one wait, as ever
        return
    _wait_slow(work, comm, number, grace)


def _wait_slow(work, comm: Watched, number: int, grace: float) -> None:
    """The wait past the grace period: publish this rank's position, and look at the others' each poll."""
    trace, group, rank, world = comm.trace, comm.group, comm.rank, comm.world_size
    if trace.diverged is not None:
        if _landed(work, min(0.01, grace)):
            return
        raise CollectiveError(trace.diverged)  # known already: the ranks' collectives no longer match
    deadline = time.monotonic() + comm.timeout_s - grace
    mine = in_collective(trace, number)
    publish(group, rank, mine)
    suspects: dict[int, dict] = {}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            work.wait(timeout=timedelta(milliseconds=1))  # lands, or raises the timeout to be explained
            break
        if _landed(work, min(grace / 2, left)):
            break
        positions = read(group, world)
        differing = sorted(r for r, p in positions.items() if r != rank and records_differ(trace, p))
        if differing:  # a fact, not a guess: no second look needed
            mine.update(state="stopped", differs=True)
            publish(group, rank, mine)
            when = (f"while waiting in {trace.named(number)}, this rank found that rank(s) "
                    f"{', '.join(map(str, differing))} ran other collectives")
            trace.diverged = differ(rank, world, trace, group_store(group), when)
            raise CollectiveError(trace.diverged)
        found = {r: p for r, p in positions.items() if r != rank and elsewhere(mine, p)}
        # The same note twice, or a rank that gave up waiting in an entry check (it raised: it will not come).
        confirmed = sorted(r for r, p in found.items() if suspects.get(r) == p or p.get("state") == "gave up")
        if confirmed:
            mine["state"] = "stopped"
            publish(group, rank, mine)
            trace.diverged = diverged(rank, world, mine, positions, confirmed)
            raise CollectiveError(trace.diverged)
        suspects = found
    publish(group, rank, running(trace))


_IDLE_S = 0.1  # a Waiter's thread ends after this long without work (a new one starts at the next wait)
# A Waiter's thread only blocks in a wait: 1 MiB of stack, not the default 8 MiB, which a rank capped by
# RLIMIT_DATA (it counts thread stacks) would pay for every comm.
_STACK_BYTES = 1 << 20


def _start_with_small_stack(thread: threading.Thread) -> None:
    before = threading.stack_size(_STACK_BYTES)
    try:
        thread.start()
    finally:
        threading.stack_size(before)


class Waiter:
    """A thread of one comm's own that waits for work that cannot be polled (gloo's point-to-point), so the
    rank can poll that wait and look at where the others are meanwhile. The thread ends once idle for
    `_IDLE_S` (a stuck wait holds it until the collective_timeout), so that no thread outlives the training."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a job is never queued for a thread that has decided to end
        self._thread: threading.Thread | None = None

    def submit(self, works: list, timeout_s: float) -> "Waited":
        """Wait for `works` in turn, each up to `timeout_s`, in the thread; returns the wait to poll."""
        waited = Waited()
        with self._lock:
            self._queue.put((works, timeout_s, waited))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="zeroshard-wait")
                _start_with_small_stack(self._thread)
        return waited

    def _run(self) -> None:
        while True:
            try:
                works, timeout_s, waited = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                for work in works:
                    work.wait(timeout=timedelta(seconds=timeout_s))
            except Exception as error:  # the poller raises it in the rank's own thread
                waited.error = error
            # Drop this thread's references before the rank's thread goes on, so that the rank's thread, which
            # still holds the works, destroys them: a work destroyed here could be mid-destruction (the GIL
            # released) when the interpreter finalizes, and the process would abort.
            works = work = None
            waited.done.set()
            waited = None


class Waited:
    """Work being waited in a `Waiter`'s thread, polled as a work handle is (`wait(timeout)`, `is_completed`)."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> None:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out waiting for the point-to-point exchange")
        if self.error is not None:
            raise self.error


def _landed(work, seconds: float) -> bool:
    """Wait up to `seconds`: True if the work landed, False if it is still in flight; raises if it failed."""
    try:
        work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError:
        if work.is_completed():  # it ended, with an error: the caller explains that
            raise
        return False
    return True


def diverged(rank: int, world: int, mine: dict, positions: dict[int, dict], elsewhere_ranks: list[int]) -> str:
    """Why this rank, waiting at `mine`, stops: ranks `elsewhere_ranks` are elsewhere (in a call every rank must
    make, or at another step); a rank in such a call is named with it and its fix (calls.py)."""
    positions = {**positions, rank: mine}
    others = ", ".join(map(str, elsewhere_ranks))
    head = (f"rank {rank} is {describe(mine)}, but rank(s) {others} will never join that collective. "
            f"Where every rank is: {describe_all(positions, world)}.\n  ")
    in_call = next((positions[r] for r in elsewhere_ranks if positions[r].get("where") == "call"), None)
    if in_call is not None:
        return head + calls.advice(in_call)
    return head + ("Every rank must make the same calls in the same order: run the same number of engine(...), "
                   "engine.backward() and engine.step() calls (the same number of batches on every rank), and "
                   "call save_checkpoint, load_checkpoint, full_state_dict (stage 3) and gathered_parameters "
                   "(stage 3) on every rank. Restart the job from a checkpoint")
