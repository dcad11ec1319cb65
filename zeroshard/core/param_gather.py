"""PostStepGather: stages 1-2's all-gather of the updated parameter shards after each optimizer step.

After the step each rank holds its bucket shards updated (in the
parameters' dtype); one all-gather per bucket makes every rank's flat
buffer whole again (`Bucket.gather_params`, quantized with the parameter
codec of `communication_compression`). The gathers are launched in the
order the next forward meets the buckets: buckets are built in backward
order, so the last bucket first. The order depends only on the model, so
every rank launches the same collectives in the same order.

With `overlap_param_gather` off, the step waits for them all. With it on
(Megatron-LM's distributed optimizer has the same switch), the step
returns with them in flight and each bucket's gather is waited for at its
first use: a forward pre-hook on every module that holds parameters waits
for the buckets of that module's own parameters (`parameters(recurse=
False)`, and those of a child without a forward of its own, such as a
`ParameterList`, which the forward above it reads), so the gathers of later
layers land while earlier layers compute.
A wait changes only when values arrive, never which: training is bitwise
the same either way.

Everything else that reads or writes the parameters waits for every gather
in flight first (`wait`): the engine's backward and step, its checkpoint,
export and state-dict methods, `engine.parameters()`, `gathered_parameters`,
and `state_dict()` / `load_state_dict()` of any module that holds
parameters (hooks beside the forward ones). Code that reads a parameter's
values itself between `engine.step()` and the next forward, or a forward
that uses a module's parameters without calling that module, must call
`engine.wait_for_params()` first (Megatron-LM: `disable_forward_pre_hook()`).

A wait that fails (a rank that died or ran other collectives: the comm's
watched waits raise `CollectiveError` within `collective_timeout`) calls
`on_failure` first, so the engine is FAILED wherever the wait happened.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from zeroshard.comm import CollectiveError, Comm, Pending, wait_all
from zeroshard.core.bucket import Bucket


class PostStepGather:
    """The post-step all-gathers of the buckets that have one (stages 1-2), and the hooks that wait for them."""

    def __init__(self, buckets: list[Bucket], comm: Comm, overlap: bool, on_failure: Callable[[str], None]):
        self.buckets = [b for b in buckets if b.gathers_after_step]
        self.comm = comm
        self.overlap = overlap and bool(self.buckets)  # whether the step leaves the gathers in flight
        self._on_failure = on_failure
        self._pending: dict[int, Pending] = {}  # index into `buckets` -> its gather in flight
        self._hooks: list = []  # the handles of the hooks `install` registered

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def start(self, wait: bool = False) -> None:
        """All-gather every bucket's updated shard, in forward order; waited now unless the gathers overlap
        the next forward (and `wait` is not asked)."""
        self.wait()  # a gather still in flight writes the buffer the next one reads from
        for i in reversed(range(len(self.buckets))):
            self._pending[i] = self.buckets[i].gather_params(self.comm)
        if wait or not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Wait for every gather in flight, in launch order."""
        self.wait_for(list(self._pending))

    def wait_for(self, indices) -> None:
        """Wait for the gathers in flight of the buckets `indices` (indices into `buckets`)."""
        indices = [i for i in indices if i in self._pending]
        try:
            wait_all([self._pending[i] for i in indices])
        except CollectiveError as exc:
            self._on_failure(f"the all-gather of the parameters after the step failed ({exc})")
            raise
        for i in indices:
            del self._pending[i]

    def install(self, model: nn.Module) -> None:
        """Hook every module that holds bucket parameters: its forward waits for its own parameters' buckets,
        its `state_dict()` and `load_state_dict()` for every bucket. Nothing to hook without overlap."""
        if not self.overlap:
            return
        index = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        for module, params in _users(model).values():
            own = sorted({index[id(p)] for p in params if id(p) in index}, reverse=True)  # in launch order
            if own:
                self._hooks += [module.register_forward_pre_hook(_Wait(self, tuple(own))),
                                module.register_state_dict_pre_hook(_Wait(self)),
                                module.register_load_state_dict_pre_hook(_Wait(self))]

    def stop_overlap(self) -> None:
        """Wait for the gathers in flight, remove the hooks, and wait in the step from now on (a compiled
        forward: each hook would be a graph break)."""
        self.wait()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.overlap = [], False


def _users(model: nn.Module) -> dict[int, tuple[nn.Module, list[nn.Parameter]]]:
    """id(module) -> (a module whose forward first uses them, parameters): each module's own parameters, and
    those of a child that has no forward (`ModuleList`, `ParameterList`: the forward above it reads them) with
    the nearest module above that has one."""
    users: dict[int, tuple[nn.Module, list[nn.Parameter]]] = {}

    def walk(module: nn.Module, runner: nn.Module | None) -> None:
        if runner is None or type(module).forward is not nn.Module.forward:
            runner = module
        users.setdefault(id(runner), (runner, []))[1].extend(module.parameters(recurse=False))
        for child in module.children():
            walk(child, runner)

    walk(model, None)
    return users


class _Wait:
    """A hook that waits for some buckets' gathers (`buckets`), or all of them (None).

    A copy of the module (`copy.deepcopy`, pickling) gets a hook that does nothing: the copy's parameters
    are tensors of their own, which no gather writes.
    """

    def __init__(self, gather: PostStepGather | None, buckets: tuple[int, ...] | None = None):
        self.gather, self.buckets = gather, buckets
        self._eager = None  # the wait, run eagerly under torch.compile (made at the first wait)

    def __call__(self, module: nn.Module, *args) -> None:
        if self.gather is None or not self.gather.in_flight:
            return
        if self._eager is None:
            self._eager = torch.compiler.disable(self._wait, reason="zeroshard: a collective's wait runs eagerly")
        self._eager()

    def _wait(self) -> None:
        if self.buckets is None:
            self.gather.wait()
        else:
            self.gather.wait_for(self.buckets)

    def __reduce__(self):
        return _Wait, (None,)
