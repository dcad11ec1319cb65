"""ActivationMeter: the bytes autograd saves for backward in each training forward the engine runs.

The engine runs every forward under `torch.autograd.graph.saved_tensors_hooks`
whose pack hook records the size of each saved tensor's storage, each storage
once (a saved view holds its whole storage), leaving out the storages that
were there before the forward: the model's parameters and buffers (at stage 3
the gathered flat buffers their views live in) and the tensors the forward was
given. Dropout masks, normalization statistics, the inputs a checkpointed
region keeps for its recomputation: whatever the model's code saves is
counted, as `zeroshard.estimate.count_saved` counts it on the meta device.

Cheap by construction: the pack hook looks up one key and adds one size per
saved tensor, and hands the tensor on untouched (to the saved-tensor hooks
that were active around the forward, if any: `torch.autograd.graph.save_on_cpu`
around `engine(...)` keeps working). The storages seen are held only until
the forward returns, so that a freed storage's address cannot be taken for
one seen before.

What autograd saves inside a region checkpointed with `torch.utils.checkpoint`
(non-reentrant) goes to the checkpoint's own hooks, which keep nothing: it is
not counted, rightly. Its recomputation during backward holds one region's
activations for a moment; that is not in the count (`zeroshard estimate`
gives it as `recompute`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from zeroshard.core.local import local
from zeroshard.estimate.activations import tensors_in


class ActivationMeter:
    """Saved bytes of the last training forward and the largest in the current accumulation window, by pool."""

    def __init__(self, owned: Callable[[], Iterable[torch.Tensor]], device: torch.device):
        """`owned`: the tensors whose storages are the model's own (parameters, buffers, the flat buffers
        parameters are views of: at stage 3 gathered into for each use); asked once, at the first forward."""
        self.owned = owned
        # On a GPU, a tensor saved in host memory (cpu_checkpointing) is in the "host" pool; on the CPU
        # every tensor is in the device pool.
        self.host_apart = device.type != "cpu"
        self.last = {"device": 0, "host": 0}  # bytes saved by the last forward with gradients on
        self.window_peak = {"device": 0, "host": 0}  # the largest of the window's forwards
        self._new_window = True
        self._excluded: dict[int, torch.UntypedStorage] | None = None  # the model's own, from the first forward
        self._seen: dict[int, torch.UntypedStorage] = {}
        self._bytes = {"device": 0, "host": 0}

    def end_window(self) -> None:
        """An optimizer step ended the window: the next forward starts the next window's peak."""
        self._new_window = True

    @contextmanager
    def measure(self, args: Any) -> Iterator[None]:
        """Count what the forward run inside saves; `args`: the forward's arguments (not counted)."""
        if not torch.is_grad_enabled() or not torch._C._autograd._saved_tensors_hooks_is_enabled():
            yield  # nothing will be saved (or hooks are refused here): the last count stands
            return
        if self._excluded is None:  # held, so that no activation's storage can take one of their addresses
            self._excluded = {storage._cdata: storage for storage in map(_storage, self.owned())}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = self._pack, (lambda packed: packed)
        if outer is not None:  # hand every tensor on to the hooks around the forward
            outer_pack, unpack = outer
            pack = lambda tensor: outer_pack(self._pack(tensor))  # noqa: E731
        self._seen = {storage._cdata: storage for storage in map(_storage, tensors_in(args))}
        self._bytes = {"device": 0, "host": 0}
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._seen = {}
        self._record()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = local(tensor).untyped_storage()
        key = storage._cdata
        if key not in self._seen and key not in self._excluded:
            self._seen[key] = storage
            pool = "host" if self.host_apart and storage.device.type == "cpu" else "device"
            self._bytes[pool] += storage.nbytes()
        return tensor

    def _record(self) -> None:
        self.last = self._bytes
        if self._new_window:
            self.window_peak, self._new_window = {"device": 0, "host": 0}, False
        self.window_peak = {pool: max(self.window_peak[pool], n) for pool, n in self.last.items()}


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return local(tensor).untyped_storage()
