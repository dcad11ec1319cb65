"""Communication: process groups, recorded collectives, and quantized ones (compressed reductions, qwZ, qgZ)."""

from zeroshard.comm.collectives import (
    Algorithms,
    Comm,
    Pending,
    PendingGroup,
    all_gather,
    all_gather_object,
    all_reduce,
    broadcast,
    divergence,
    reduce_scatter,
    wait_all,
)
from zeroshard.comm.checks import FaultFlags, step_check, unit_check
from zeroshard.comm.group import ensure_process_group
from zeroshard.comm.compress.reduce import CompressedReduction, ErrorFeedback
from zeroshard.comm.compress.qgz import Hops, HopsPending, qgz_reduce_scatter
from zeroshard.comm.compress.quantize import BlockCodec
from zeroshard.comm.compress.qwz import qwz_all_gather
from zeroshard.comm.recorder import OPS, CommRecorder, OpStats
from zeroshard.comm.watch.stall import CollectiveError

__all__ = [
    "OPS", "Algorithms", "BlockCodec", "CollectiveError", "Comm", "CommRecorder", "CompressedReduction",
    "ErrorFeedback", "FaultFlags", "Hops", "HopsPending", "OpStats", "Pending", "PendingGroup", "all_gather", "all_gather_object", "all_reduce", "broadcast", "divergence",
    "ensure_process_group", "qgz_reduce_scatter", "qwz_all_gather", "reduce_scatter", "step_check", "unit_check", "wait_all",
]
