"""Logical collectives as free functions: tensors, group and recorder are passed in.

Each function records the logical operation and its bytes, then runs it with
the algorithm chosen for the backend (`Algorithms`). On NCCL the native
collectives are right: reduce-scatter and all-gather each cost about half an
all-reduce. On gloo (torch 2.13, CPU) the native reduce-scatter and all-gather
are slower than an all-reduce of the same buffer, so there:

- reduce-scatter runs as an all-to-all plus a local sum: each rank still
  receives only the chunks that reduce into its own shard, (N-1)/N of the
  buffer, the same volume as a ring reduce-scatter;
- all-gather runs as a direct exchange: each rank sends its shard to every
  other rank and receives theirs in place (batched send/recv), the same
  (N-1)/N of the buffer as a ring all-gather.

Both run as batched point-to-point messages tagged with the rank's running
checksum of its collectives (`_tagged_exchange`, stall.py), the all-to-all
too: ranks that ran different collectives then stall instead of meeting a
message of another size, on which gloo aborts the process. (The figures
below measured the all-to-all as gloo's `all_to_all_single`, which sends the
same chunks.)

Measured with `torchrun --nproc-per-node 2|4 benchmarks/collectives.py` (gloo,
torch 2.13, 1 thread per rank, 190 MiB fp32 buffer, 2-core CPU machine),
milliseconds at 2 / 4 ranks: all-gather by exchange 83 / 161, native 220 /
372, as an all-reduce of a zero-filled buffer 193 / 398; reduce-scatter by
all-to-all plus sum 149 / 210, native 308 / 614; an all-reduce 167 / 370.

With one rank every collective is the identity, and nothing is sent.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from zeroshard.comm.watch import positions
from zeroshard.comm.gloo_exit import drain_gloo_at_exit
from zeroshard.comm.recorder import CommRecorder, Scope
from zeroshard.comm.watch.stall import CollectiveError, Trace, differ, explain

_created: dict[str, int] = {}  # comms made per group name in this process, in the same order on every rank
@dataclass(frozen=True)
class Algorithms:
    """How the logical reduce-scatter and all-gather run on this group's backend."""

    reduce_scatter: str  # "native" | "all_to_all"
    all_gather: str  # "native" | "send_recv"

    @classmethod
    def for_group(cls, group: dist.ProcessGroup) -> "Algorithms":
        if dist.get_backend(group) == "gloo":
            return cls(reduce_scatter="all_to_all", all_gather="send_recv")
        return cls(reduce_scatter="native", all_gather="native")


@dataclass
class Comm:
    """What every collective needs: the group, its size and rank, the log, the algorithms."""

    group: dist.ProcessGroup
    recorder: CommRecorder
    algorithms: Algorithms
    trace: Trace = field(default_factory=Trace)  # this rank's record of its collectives (stall.py)
    # Seconds a wait may block before the stall is explained (gloo). NCCL gets the group's own
    # timeout instead: a wait with a timeout would block the CPU on every collective.
    timeout_s: float | None = None
    # Seconds the ranks wait for each other in an entry check (entry.py); a quarter of it, at most
    # 5 s, is the grace period after which a slow collective compares positions (positions.py).
    rank_check_timeout_s: float = 20.0
    uid: int = 0  # this comm among the comms of its group: the entry checks' keys in the store
    entries: int = 0  # entry checks so far (entry.py); every rank counts the same calls
    # Where the group lies, for bytes by scope: "node" (inside one node), "cross_node", None (unknown).
    scope: Scope | None = None
    waiter: positions.Waiter | None = None  # waits for point-to-point work (gloo), made at its first wait

    @classmethod
    def create(cls, group: dist.ProcessGroup, recorder: CommRecorder, timeout_s: float | None = None,
               rank_check_timeout_s: float = 20.0, scope: Scope | None = None) -> "Comm":
        gloo = dist.get_backend(group) == "gloo"
        if gloo:
            drain_gloo_at_exit()  # this comm keeps the group, and its worker threads, alive until exit
        name = dist.distributed_c10d._get_process_group_name(group)
        _created[name] = uid = _created.get(name, 0) + 1
        comm = cls(group, recorder, Algorithms.for_group(group), timeout_s=timeout_s if gloo else None,
                   rank_check_timeout_s=rank_check_timeout_s, uid=uid, scope=scope)
        if comm.world_size > 1:  # every rank has a position from the start: one read fetches them all
            positions.publish(group, comm.rank, positions.running(comm.trace))
        return comm

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


class Landing:
    """What to run once something in flight has landed: `then` before or after, `_landed` runs them once."""

    def __init__(self):
        self._thens: list[Callable[[], object]] = []
        self._done = False

    def then(self, fn: Callable[[], object]):
        """Run `fn` once it has landed (at `wait`, or now if it was waited for); returns self."""
        if self._done:
            fn()
        else:
            self._thens.append(fn)
        return self

    def _landed(self) -> None:
        self._done = True
        for fn in self._thens:
            fn()
        self._thens.clear()


class Pending(Landing):
    """An asynchronous collective: the backend's work handle and what to do once it lands.

    Waiting is explicit for every backend. On gloo a wait that outlasts a
    grace period looks at where the other ranks are (`positions.wait_watched`);
    point-to-point work (`pollable=False`) cannot be waited twice, so it is
    waited once, up to the timeout, in the comm's `Waiter` thread, and that
    wait is polled.
    """

    def __init__(self, comm: Comm, op: str, work=None, number: int = 0, pollable: bool = True):
        super().__init__()
        self._comm, self._op = comm, op
        self._number = number  # its number in the comm's trace
        self._pollable = pollable
        # Backend work handles: one per collective, several for a batch of sends and receives.
        self._works = work if isinstance(work, list) else [w for w in (work,) if w is not None]
        self._failure: CollectiveError | None = None
        # Waited with other collectives as one job (`wait_all`): that job, and the number whose record covers
        # them all (the last), under which a stall is watched and explained.
        self._shared: positions.Waited | None = None
        self._watched = number

    def waits_in_thread(self) -> bool:
        """Whether its wait goes through the comm's `Waiter` (gloo's point-to-point work, still in flight)."""
        return bool(self._works) and not self._done and self._failure is None and not self._pollable \
            and self._comm.timeout_s is not None and self._shared is None

    def wait(self) -> None:
        if self._failure is not None:  # waited once and failed: it never lands
            raise self._failure
        if self._done:
            return
        start = time.perf_counter()
        comm = self._comm
        works = self._works  # this thread keeps them until they land: it, not the Waiter, destroys them
        if self._shared is not None:
            works = [self._shared]
        elif comm.timeout_s is not None and not self._pollable and works:
            comm.waiter = comm.waiter or positions.Waiter()
            works = [comm.waiter.submit(works, comm.timeout_s)]
        for work in works:
            try:
                if comm.timeout_s is None:
                    work.wait()
                else:
                    positions.wait_watched(work, comm, self._watched)
            except CollectiveError as error:
                self._failure = error
                raise
            except RuntimeError as error:
                self._failure = CollectiveError(_explain(comm, self._watched, error))
                raise self._failure from error
        self._works, self._shared = [], None
        self._comm.recorder.add_seconds(self._op, time.perf_counter() - start)
        self._landed()


class PendingGroup:
    """Several collectives in flight, waited for as one (in launch order)."""

    def __init__(self, pendings: list[Pending]):
        self.pendings = pendings

    def wait(self) -> None:
        wait_all(self.pendings)


def wait_all(pendings: list) -> None:
    """Wait for each collective in turn: the one way zeroshard lets several land."""
    flat = [p for item in pendings for p in (item.pendings if isinstance(item, PendingGroup) else [item])]
    _share_wait(flat)
    for pending in flat:
        pending.wait()


def _share_wait(pendings: list[Pending]) -> None:
    """Point-to-point work of one comm, waited in its `Waiter` thread as one job: a hand-over between
    threads per batch rather than per collective (each costs context switches on a busy CPU). The first
    collective's wait polls the job, watched under the last one's number, whose record covers the whole batch:
    ranks that ran other collectives anywhere in it differ there. The others find it landed."""
    threaded = [p for p in pendings if isinstance(p, Pending) and p.waits_in_thread()]
    for comm in {id(p._comm): p._comm for p in threaded}.values():
        mine = [p for p in threaded if p._comm is comm]
        if len(mine) > 1:
            comm.waiter = comm.waiter or positions.Waiter()
            waited = comm.waiter.submit([w for p in mine for w in p._works], comm.timeout_s)
            last = max(p._number for p in mine)
            for p in mine:
                p._shared, p._watched = waited, last


def _explain(comm: Comm, number: int, error: BaseException) -> str:
    """Why collective `number` failed: every rank's record, and the positions ranks published."""
    published = positions.read(comm.group, comm.world_size)
    where = ""
    if any(p.get("where") != "running" for p in published.values()):
        where = positions.describe_all(published, comm.world_size)
    return explain(comm.rank, comm.world_size, comm.trace, number, error, comm.timeout_s,
                   positions.group_store(comm.group), where)


def divergence(comm: Comm, when: str) -> CollectiveError:
    """The error every rank raises once the ranks' records are known to differ (`when`: how that was
    found, the same on every rank): their rings, compared through the store, name the first difference."""
    comm.trace.diverged = differ(comm.rank, comm.world_size, comm.trace, positions.group_store(comm.group), when)
    return CollectiveError(comm.trace.diverged)


def _launch(comm: Comm, op: str, nbytes: int, algorithm: str, call, async_op: bool, what: str = "",
            pollable: bool = True, uncompressed: int | None = None) -> Pending:
    comm.recorder.record(op, nbytes, algorithm, comm.scope, uncompressed)
    label = f"{op} of {nbytes} bytes" + (f" for {what}" if what else "")
    number = comm.trace.note(label)
    start = time.perf_counter()
    work = call()
    comm.recorder.add_seconds(op, time.perf_counter() - start)
    pending = Pending(comm, op, work, number, pollable)
    if not async_op:
        pending.wait()
    return pending


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nothing() -> None:
    """The call of a collective over one rank: there is nothing to send."""


def all_reduce(comm: Comm, tensor: torch.Tensor, async_op: bool = True, what: str = "") -> Pending:
    """Sum `tensor` over the group, in place. Logical bytes: the tensor. `what`: for messages."""
    if comm.world_size == 1:
        return _launch(comm, "all_reduce", _nbytes(tensor), "local", _nothing, async_op, what)
    call = partial(dist.all_reduce, tensor, group=comm.group, async_op=True)
    return _launch(comm, "all_reduce", _nbytes(tensor), "native", call, async_op, what)


def reduce_scatter(
    comm: Comm, shard: torch.Tensor, full: torch.Tensor, scratch: torch.Tensor | None = None,
    async_op: bool = True, what: str = "",
) -> Pending:
    """Sum `full` (1-D, N equal chunks) over the group; this rank's chunk lands in `shard`.

    `shard` may be this rank's chunk of `full` itself (in place). The
    all-to-all algorithm needs `scratch`, a buffer the size of `full`.
    Logical bytes: `full`.
    """
    n = comm.world_size
    nbytes = _nbytes(full)
    if n == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full)
        return _launch(comm, "reduce_scatter", nbytes, "local", _nothing, async_op, what)
    if comm.algorithms.reduce_scatter == "native":
        call = partial(dist.reduce_scatter_single, shard, full, group=comm.group, async_op=True)
        return _launch(comm, "reduce_scatter", nbytes, "native", call, async_op, what)
    if scratch is None:
        raise ValueError("the all_to_all reduce-scatter needs a scratch buffer the size of `full`")
    rank, sent, received = comm.rank, full.view(n, -1), scratch.view(n, -1)
    exchange = partial(_tagged_exchange, comm, lambda peer: sent[peer], lambda peer: received[peer])
    pending = _launch(comm, "reduce_scatter", nbytes, "all_to_all+sum", exchange, True, what, pollable=False)
    pending.then(lambda: _sum_chunks(shard, sent[rank], received, rank))
    if not async_op:
        pending.wait()
    return pending


def _sum_chunks(shard: torch.Tensor, own: torch.Tensor, received: torch.Tensor, rank: int) -> None:
    """shard = `torch.sum` over the chunks of every rank (this one's `own`, the others' in `received`).

    Two chunks are one add, the same bits as `torch.sum` over them and about 4x faster on the CPU; more go
    through `torch.sum` itself, whose order of adding (and fp32 accumulation of 16-bit values) an add chain
    would not repeat.
    """
    if len(received) == 2:
        torch.add(own, received[1 - rank], out=shard)
        return
    received[rank].copy_(own)
    torch.sum(received, dim=0, out=shard)


def all_gather(comm: Comm, full: torch.Tensor, async_op: bool = True, what: str = "", encoding: str = "",
               uncompressed: int | None = None, op: str = "all_gather") -> Pending:
    """Fill every chunk of `full` (1-D, N equal chunks) from its rank, in place.

    On entry this rank's chunk holds its shard. Logical bytes: `full`.
    `encoding` names what the chunks hold when they are encoded (quantized
    bytes); it is added to the recorded algorithm, and `uncompressed` is the
    exact gather's bytes. `op`: the name it is recorded under (a check of its own).
    """
    n, rank = comm.world_size, comm.rank
    launch = partial(_launch, comm, op, _nbytes(full), async_op=async_op, what=what,
                     uncompressed=uncompressed)
    if n == 1:
        return launch(_named("local", encoding), _nothing)
    chunk = full.numel() // n
    own = full[rank * chunk : (rank + 1) * chunk]
    if comm.algorithms.all_gather == "native":
        return launch(_named("native", encoding), partial(dist.all_gather_single, full, own, group=comm.group,
                                                          async_op=True))
    chunks = full.view(n, chunk)
    exchange = partial(_tagged_exchange, comm, lambda peer: own, lambda peer: chunks[peer])
    return launch(_named("send_recv", encoding), exchange, pollable=False)


def _tagged_exchange(comm: Comm, to: Callable[[int], torch.Tensor], into: Callable[[int], torch.Tensor]) -> list:
    """Send `to(peer)` to every other rank and receive its message into `into(peer)`, as one batch.

    The tag is the running checksum of this rank's collectives (stall.py), this one's included: ranks that
    ran the same collectives pair their messages; ranks that did not use other tags, so their messages (of
    another size, on which gloo would abort the process) never meet, and the exchange stalls, explained.
    """
    tag, ops = comm.trace.digest & 0x7FFFFFFF, []
    for peer in range(comm.world_size):
        if peer != comm.rank:
            ops.append(dist.P2POp(dist.isend, to(peer), group=comm.group, group_peer=peer, tag=tag))
            ops.append(dist.P2POp(dist.irecv, into(peer), group=comm.group, group_peer=peer, tag=tag))
    return dist.batch_isend_irecv(ops)


def _named(algorithm: str, encoding: str) -> str:
    return f"{algorithm} of {encoding}" if encoding else algorithm


def broadcast(comm: Comm, tensor: torch.Tensor, src: int = 0) -> None:
    """Overwrite `tensor` on every rank with rank `src`'s (rank within the group). Logical bytes: the tensor."""
    if comm.world_size == 1:
        _launch(comm, "broadcast", _nbytes(tensor), "local", _nothing, async_op=False)
        return
    call = partial(dist.broadcast, tensor, group=comm.group, group_src=src, async_op=True)
    _launch(comm, "broadcast", _nbytes(tensor), "native", call, async_op=False)


def all_gather_object(comm: Comm, obj) -> list:
    """Every rank's picklable `obj`, in rank order (used to check ranks agree).

    Recorded as `object_gather`, with the pickled bytes of every rank's object as its logical size.
    """
    out = [None] * comm.world_size
    if comm.world_size == 1:
        out[0] = obj
    else:
        dist.all_gather_object(out, obj, group=comm.group)
    comm.recorder.record("object_gather", sum(len(pickle.dumps(o)) for o in out), "pickle")
    return out
