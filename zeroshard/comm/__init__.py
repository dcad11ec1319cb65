"""Communication: process groups, recorded collectives, and (later) ZeRO++ quantized ones."""

from zeroshard.comm.collectives import (
    Algorithms,
    Comm,
    Pending,
    PendingGroup,
    all_gather,
    all_gather_object,
    all_reduce,
    broadcast,
    reduce_scatter,
    step_check,
    wait_all,
)
from zeroshard.comm.group import ensure_process_group
from zeroshard.comm.recorder import OPS, CommRecorder, OpStats
from zeroshard.comm.stall import CollectiveError

__all__ = [
    "OPS", "Algorithms", "CollectiveError", "Comm", "CommRecorder", "OpStats", "Pending", "PendingGroup", "all_gather",
    "all_gather_object", "all_reduce", "broadcast", "ensure_process_group", "reduce_scatter", "step_check",
    "wait_all",
]
