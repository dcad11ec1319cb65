"""Explaining a collective that failed or timed out: what each rank was doing.

Every collective is noted in the rank's `Trace` for the current step. When a
wait fails (gloo: the configured timeout passed), each rank posts its trace
to the process group's store, which still answers when the group's
collectives are stuck, reads the others', and raises one error that names
the step, the ranks and the first collective on which they disagree,
instead of hanging. Before that timeout, a wait that outlasts a short grace
period already compares where the ranks are (`positions.py`) and stops as
soon as one rank is known to be elsewhere; this explanation covers what that
cannot see (a dead peer, a point-to-point exchange, ranks that never said
where they were).

Gloo aborts the whole process when a message has another size than the one
expected, which is what ranks running different units send. So at stage 3
on gloo, ranks first agree on each collective (`order_check`: an all-gather
of one checksum of its description per rank) and all raise the same error
when they differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from zeroshard.errors import ZeroshardError

# How long a rank waits for the others' traces: they fail at about the same time.
_PEER_WAIT_S = 10.0
_MAX_OPS = 100_000
_ADVICE = ("every rank must run the same collectives in the same order: at stage 3 each unit's "
           "forward and backward gathers it, so control flow that differs between ranks (skipping "
           "a layer on some ranks, data-dependent branches) must be made to agree")


# What gloo and NCCL say when the process at the other end of a connection is gone.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "remote process exited")


class CollectiveError(ZeroshardError, RuntimeError):
    """A collective failed or timed out; the message says where each rank was."""


@dataclass
class Trace:
    """This rank's collectives in the current micro-step, in issue order, and where the engine is.

    The engine sets the counters and the phase as it goes (plain attribute
    writes: nothing leaves the process until a collective is slow, see
    positions.py).
    """

    micro_step: int = 0  # the engine's micro_steps when this micro-step began
    ops: list[str] = field(default_factory=list)
    global_step: int = 0  # the engine's global_steps (optimizer steps done) when this micro-step began
    phase: str = "forward"  # "forward" | "backward" | "step", or the call being made (save_checkpoint, ...)
    published: int = 0  # positions this rank published (positions.py tells a new note from an old one)
    diverged: str | None = None  # why the ranks' collectives no longer match, once that is known

    def begin(self, micro_step: int, global_step: int | None = None) -> None:
        self.micro_step, self.ops, self.phase = micro_step, [], "forward"
        if global_step is not None:
            self.global_step = global_step

    def at(self) -> str:
        return f"step {self.global_step} (micro-step {self.micro_step})"

    def note(self, op: str) -> int:
        """Record a collective; its index in the step. A long loop without steps (generation,
        say) keeps counting but stops recording, the same way on every rank."""
        if len(self.ops) < _MAX_OPS:
            self.ops.append(op)
        return len(self.ops) - 1


def explain(rank: int, world: int, trace: Trace, index: int, error: BaseException, timeout_s: float | None,
            store: dist.Store | None = None, where: str = "") -> str:
    """The message of the `CollectiveError` for this rank's collective number `index` (0-based).

    `store`: the group's store, through which the ranks exchange traces; `where`: every rank's
    published position in words (positions.py), if any rank published one.
    """
    peer_wait_s = min(_PEER_WAIT_S, timeout_s or _PEER_WAIT_S)
    mine = {"step": [trace.global_step, trace.micro_step], "ops": trace.ops}
    lines = [f"rank {rank}, {trace.at()}: collective #{index + 1} of the step "
             f"({trace.ops[index]}) did not complete: {error}"]
    traces = _exchange(rank, world, mine, peer_wait_s, store)
    silent = [r for r in range(world) if r not in traces]
    gone = next((phrase for phrase in _PEER_GONE if phrase.lower() in str(error).lower()), None)
    if silent and gone is not None:  # a dead rank, not ranks that diverged: no advice about control flow
        lines.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                     f"{'are' if len(silent) > 1 else 'is'} gone: the connection reported \"{gone}\" and "
                     f"{'they' if len(silent) > 1 else 'it'} did not report within {peer_wait_s:.0f} s (a process "
                     "that died or was killed, a machine or link lost). These ranks cannot go on: restart the "
                     "run from its latest checkpoint (`zeroshard train --max-restarts N`, or torchrun "
                     "--max-restarts N, restarts the ranks by itself; docs/fault-tolerance.md)")
        return "\n  ".join(lines)
    if silent:
        lines.append(f"ranks {silent} did not report within {peer_wait_s:.0f} s (still computing, "
                     "finished, or dead)")
    lines.append(_first_difference(traces) or "the ranks that reported ran the same collectives")
    if where:
        lines.append(f"where each rank last said it was: {where}")
    lines.append(_ADVICE + "; raise collective_timeout if a rank was only slow")
    return "\n  ".join(lines)


def mismatch(rank: int, trace: Trace, index: int, labels: list[str]) -> str:
    """The message when the ranks' collective number `index` of the step differ (`labels`, per rank)."""
    said = ", ".join(f"rank {r}: {label}" for r, label in enumerate(labels))
    return (f"rank {rank}, {trace.at()}: the ranks first differ at collective #{index + 1} of the "
            f"step: {said}\n  {_ADVICE}")


def _exchange(rank: int, world: int, mine: dict, wait_s: float, store: dist.Store | None) -> dict[int, dict]:
    """Post this rank's trace to the store and read every rank's that arrives in `wait_s`."""
    try:
        store = dist.PrefixStore("zeroshard/stall/", store)
        store.set(str(rank), json.dumps(mine))
    except Exception:  # no store to talk through: report this rank alone
        return {rank: mine}
    traces = {rank: mine}
    for r in range(world):
        if r == rank:
            continue
        try:
            store.wait([str(r)], timedelta(seconds=wait_s))
            traces[r] = json.loads(store.get(str(r)))
        except Exception:  # that rank never posted: not stuck in a collective
            continue
    return traces


def _first_difference(traces: dict[int, dict]) -> str | None:
    ranks = sorted(traces)
    steps = {r: tuple(traces[r]["step"]) for r in ranks}
    if len(set(steps.values())) > 1:
        return "the ranks are at different steps: " + ", ".join(
            f"rank {r} at step {g} (micro-step {m})" for r, (g, m) in steps.items())
    longest = max(len(traces[r]["ops"]) for r in ranks)
    for i in range(longest):
        ops = {r: traces[r]["ops"][i] if i < len(traces[r]["ops"]) else None for r in ranks}
        if len(set(ops.values())) > 1:
            said = ", ".join(f"rank {r}: {op or 'nothing (it ran only ' + str(i) + ')'}" for r, op in ops.items())
            return f"the ranks first differ at collective #{i + 1} of step {steps[ranks[0]][0]}: {said}"
    return None
