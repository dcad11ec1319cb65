"""The record of each rank's collectives, and what it says when the ranks' collectives differ.

Every collective is noted in the rank's `Trace`: a running CRC-32 of its
label (op, bytes, and what it moves: "unit 'blocks.1'", a bucket's name),
and a ring of the last `_RING` labels. Noting costs a checksum of a short
string and nothing leaves the process: there is no collective per collective.
The ranks compare their records where they meet anyway:

- at the step check before each optimizer step (core/grad_norm.py), the
  running checksum travels as one more figure: ranks whose checksums differ
  ran different collectives (two units of the same size paired wrongly
  included), and before anything is updated each posts its ring to the
  process group's store, reads the others', and all raise one
  `CollectiveError` naming the first collective that differs (`differ`);
- when a collective stalls (positions.py), each waiting rank publishes its
  checksum there; one whose history is not a prefix of another's has
  diverged, and the rings name where (`differ` again), instead of a hang;
- when a wait fails (gloo: the configured timeout passed), the rings explain
  it the same way (`explain`): the step, the ranks, the first difference.

On gloo the all-gather's point-to-point messages are tagged with the
running checksum (collectives.py): gloo aborts the process on a message of
another size than the one expected, and ranks whose records differ use
different tags, so their messages never meet: the gather stalls, and the
stall is explained.
"""

from __future__ import annotations

import json
import zlib
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from zeroshard.errors import ZeroshardError

# How long a rank waits for the others' rings: they find the difference at about the same time.
_PEER_WAIT_S = 10.0
# Collectives each rank remembers: a stage-3 step of a 100-layer model with 8 micro-steps runs about 2,500.
_RING = 4096
_ADVICE = ("every rank must run the same collectives in the same order: at stage 3 each unit's "
           "forward and backward gathers it, so control flow that differs between ranks (skipping "
           "a layer on some ranks, running layers in another order, data-dependent branches) must be made to agree")


# What gloo and NCCL say when the process at the other end of a connection is gone.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "remote process exited")


class CollectiveError(ZeroshardError, RuntimeError):
    """A collective failed or timed out, or the ranks ran different ones; the message says where each rank was."""


@dataclass
class Trace:
    """This rank's record of its collectives, and where the engine is.

    The engine sets the counters and the phase as it goes (plain attribute
    writes: nothing leaves the process until a collective is slow, see
    positions.py, or the records differ at the step check).
    """

    micro_step: int = 0  # the engine's micro_steps when this micro-step began
    global_step: int = 0  # the engine's global_steps (optimizer steps done) when this micro-step began
    phase: str = "forward"  # "forward" | "backward" | "step", or the call being made (save_checkpoint, ...)
    published: int = 0  # positions this rank published (positions.py tells a new note from an old one)
    diverged: str | None = None  # why the ranks' collectives no longer match, once that is known
    noted: int = 0  # collectives noted since the comm was made; a collective's number is its place in this count
    digest: int = 0  # running CRC-32 of the labels of every collective noted, in order
    in_step: int = 0  # collectives noted in this micro-step
    # The last _RING collectives: (step, micro-step, index in it, label, `digest` just after it), oldest first.
    ring: deque = field(default_factory=lambda: deque(maxlen=_RING))

    def begin(self, micro_step: int, global_step: int | None = None) -> None:
        self.micro_step, self.in_step, self.phase = micro_step, 0, "forward"
        if global_step is not None:
            self.global_step = global_step

    def at(self) -> str:
        return f"step {self.global_step} (micro-step {self.micro_step})"

    def note(self, op: str) -> int:
        """Record a collective (`op`: its label); returns its number."""
        self.digest = zlib.crc32(op.encode(), self.digest)
        self.ring.append((self.global_step, self.micro_step, self.in_step, op, self.digest))
        self.noted += 1
        self.in_step += 1
        return self.noted - 1

    def entry(self, number: int) -> tuple[int, int, int, str, int] | None:
        """Collective `number`'s ring entry, None once the ring has dropped it."""
        back = self.noted - number
        return self.ring[-back] if 0 < back <= len(self.ring) else None

    def named(self, number: int) -> str:
        """Collective `number` in words: its index in its micro-step and its label."""
        entry = self.entry(number)
        return f"collective #{entry[2] + 1} of the step ({entry[3]})" if entry else f"collective number {number}"

    def record(self) -> dict:
        """What this rank posts to the store when the ranks' records are compared."""
        return {"step": [self.global_step, self.micro_step], "noted": self.noted, "ring": list(self.ring)}


def explain(rank: int, world: int, trace: Trace, number: int, error: BaseException, timeout_s: float | None,
            store: dist.Store | None = None, where: str = "") -> str:
    """The message of the `CollectiveError` for this rank's collective `number` that did not complete.

    `store`: the group's store, through which the ranks exchange records; `where`: every rank's
    published position in words (positions.py), if any rank published one.
    """
    peer_wait_s = min(_PEER_WAIT_S, timeout_s or _PEER_WAIT_S)
    lines = [f"rank {rank}, {trace.at()}: {trace.named(number)} did not complete: {error}"]
    records = _exchange(rank, world, trace.record(), peer_wait_s, store, "stall")
    silent = [r for r in range(world) if r not in records]
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
    lines.append(_at_different_steps(records) or first_difference(records)
                 or "the ranks that reported ran the same collectives")
    if where:
        lines.append(f"where each rank last said it was: {where}")
    lines.append(_ADVICE + "; raise collective_timeout if a rank was only slow")
    return "\n  ".join(lines)


def differ(rank: int, world: int, trace: Trace, store: dist.Store | None, when: str) -> str:
    """The message of the `CollectiveError` when the ranks' records are known to differ (`when`: how that
    was found): the rings, exchanged through `store`, name the first collective that differs."""
    records = _exchange(rank, world, trace.record(), _PEER_WAIT_S, store, "differ")
    found = first_difference(records) or (
        f"the ranks that reported (ranks {sorted(records)}) hold the same last collectives: the difference "
        f"lies before the {_RING} each rank keeps")
    return f"rank {rank}, {trace.at()}: {when}: {found}\n  {_ADVICE}. Restart the job from a checkpoint"


def _exchange(rank: int, world: int, mine: dict, wait_s: float, store: dist.Store | None,
              why: str) -> dict[int, dict]:
    """Post this rank's record to the store and read every rank's that arrives in `wait_s`."""
    try:
        store = dist.PrefixStore(f"zeroshard/{why}/", store)
        store.set(str(rank), json.dumps(mine))
    except Exception:  # no store to talk through: report this rank alone
        return {rank: mine}
    records = {rank: mine}
    for r in range(world):
        if r == rank:
            continue
        try:
            store.wait([str(r)], timedelta(seconds=wait_s))
            records[r] = json.loads(store.get(str(r)))
        except Exception:  # that rank never posted: not stuck in a collective
            continue
    return records


def _at_different_steps(records: dict[int, dict]) -> str | None:
    steps = {r: tuple(records[r]["step"]) for r in sorted(records)}
    if len(set(steps.values())) > 1:
        return "the ranks are at different steps: " + ", ".join(
            f"rank {r} at step {g} (micro-step {m})" for r, (g, m) in steps.items())
    return None


def first_difference(records: dict[int, dict]) -> str | None:
    """The first collective that differs between the ranks' rings (aligned by number), in words; None if
    the rings agree where they overlap."""
    ranks = sorted(records)
    rings = {r: {records[r]["noted"] - len(records[r]["ring"]) + i: tuple(e) for i, e in enumerate(records[r]["ring"])}
             for r in ranks}
    start = max(min(ring, default=records[r]["noted"]) for r, ring in rings.items())
    for number in range(start, max(records[r]["noted"] for r in ranks)):
        entries = {r: rings[r].get(number) for r in ranks}
        if len({e[:4] if e else None for e in entries.values()}) > 1:
            step, micro, index, _, _ = next(e for e in entries.values() if e)
            said = ", ".join(f"rank {r}: {e[3] if e else 'nothing more'}" for r, e in entries.items())
            return f"the ranks first differ at collective #{index + 1} of step {step} (micro-step {micro}): {said}"
        if number == start and len({e[4] for e in entries.values()}) > 1:
            return (f"the ranks' collectives differ before the last {len(rings[ranks[0]])} that each rank keeps "
                    f"(from collective #{entries[ranks[0]][2] + 1} of step {entries[ranks[0]][0]})")
    return None
