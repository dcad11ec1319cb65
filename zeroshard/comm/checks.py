"""The ranks' checks: all-gathers of a few figures per rank, recorded as ops of their own.

`step_check`: the one collective before each optimizer step (core/grad_norm.py).
`FaultFlags`: after work that can fail on one rank alone (core/faults.py).
`unit_check`: at stage 3, the ranks' round on the units of a step (stage3/agreement.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Comm, Pending, _launch, _nbytes, _nothing, all_gather


def step_check(comm: Comm, values: torch.Tensor) -> torch.Tensor:
    """Every rank's `values` (1-D, the same length and dtype on every rank) as rows, (N, len), in rank order.

    The one collective before each optimizer step (the gradient norm, the
    non-finite flag, the step counters): recorded as its own op, `step_check`,
    with the gathered tensor as its logical size (N x `values` bytes).
    """
    return _rows(comm, "step_check", values)


def unit_check(comm: Comm, values: torch.Tensor) -> torch.Tensor:
    """Every rank's `values` (1-D uint8, the same length on every rank) as rows (N, len), in rank order.

    Through the all-gather's own algorithm (on gloo the tagged exchange, a third of the latency of gloo's
    all-gather of a few bytes), recorded as `unit_check` with N x `values` bytes.
    """
    n = comm.world_size
    rows = torch.empty(n * values.numel(), dtype=values.dtype, device=values.device)
    rows.view(n, -1)[comm.rank].copy_(values)
    all_gather(comm, rows, async_op=False, what="the units of the step", op="unit_check")
    return rows.view(n, -1)


class FaultFlags:
    """Which ranks' own work just failed (`failed` on this rank): an all-gather of one int64 flag per rank,
    on `device` (where the backend's collectives run), started now; `failed()` waits and names them.

    Work that can fail on one rank alone (a disk read or write of offload) is
    checked so, so that every rank learns of a failure and none waits in a
    collective the failed rank will never join. Collectives every rank posts
    in between run meanwhile (a failed rank takes part in them all the same).
    Recorded as its own op, `fault_check` (8N bytes a call).
    """

    def __init__(self, comm: Comm, failed: bool, device: torch.device, what: str = ""):
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
        self._pending, self._rows = _start_rows(comm, "fault_check", flag, what)

    def failed(self) -> list[int]:
        self._pending.wait()
        return [rank for rank, f in enumerate(self._rows.reshape(-1).tolist()) if f]


def _rows(comm: Comm, op: str, values: torch.Tensor, what: str = "") -> torch.Tensor:
    """Every rank's `values` as rows (N, len), by one all-gather recorded as `op`."""
    pending, rows = _start_rows(comm, op, values, what)
    pending.wait()
    return rows


def _start_rows(comm: Comm, op: str, values: torch.Tensor, what: str = "") -> tuple[Pending, torch.Tensor]:
    n = comm.world_size
    rows = torch.empty(n * values.numel(), dtype=values.dtype, device=values.device)
    if n == 1:
        rows.copy_(values)
        pending = _launch(comm, op, _nbytes(rows), "local", _nothing, async_op=True, what=what)
    else:
        call = partial(dist.all_gather_single, rows, values, group=comm.group, async_op=True)
        pending = _launch(comm, op, _nbytes(rows), "native", call, async_op=True, what=what)
    return pending, rows.view(n, -1)
