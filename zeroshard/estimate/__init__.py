"""The memory and communication model of ZeRO: pure formulas over element counts.

`summarize(numel, gpus)` returns what `zeroshard estimate --json` prints;
`offload_pool_bytes` is the memory of ZeRO-Offload and ZeRO-Infinity in three
pools (device, host, disk); `powersgd_bytes` and `powersgd_state_bytes` are
PowerSGD's bytes sent and kept per bucket. It knows no model class: callers (the CLI, the
demo) count a model and hand the counts in.
"""

from zeroshard.estimate.formulas import (
    DTYPE_BYTES,
    STAGES,
    comm_bytes_per_step,
    cross_node_bytes,
    fault_check_bytes,
    largest_model,
    memory_per_gpu,
    model_state_bytes,
    precision_bytes,
    shard_numel,
    state_bytes_per_element,
    step_check_bytes,
    wire_bytes,
)
from zeroshard.estimate.offload import (
    OffloadSetup,
    UnboundedError,
    largest_model_offload,
    offload_pool_bytes,
    offload_summary,
    pool_totals,
    ratio_numel,
)
from zeroshard.estimate.break_even import (
    BACKWARD_SHARE,
    StepBytes,
    break_even_bandwidth,
    compression_summary,
    step_bytes,
    step_seconds,
)
from zeroshard.estimate.compression import compressed_reduction_bytes, error_feedback_bytes
from zeroshard.estimate.powersgd import LowRank, low_rank_plan, powersgd_bytes, powersgd_sizes, powersgd_state_bytes
from zeroshard.estimate.summary import summarize
from zeroshard.estimate.peak import StepPeak, step_peak
from zeroshard.plan.flats import FROZEN, PERSISTENT, SHARDED, Flat  # the plan's flat buffers, priced here
from zeroshard.estimate.zeropp import (
    ZeroPP,
    by_scope,
    hpz_secondary_bytes,
    qgz_reduce_scatter_bytes,
    quantized_bytes,
    qwz_all_gather_bytes,
    stage3_comm_bytes,
    stage3_comm_calls,
)

__all__ = [
    "BACKWARD_SHARE",
    "DTYPE_BYTES",
    "FROZEN",
    "PERSISTENT",
    "SHARDED",
    "STAGES",
    "Flat",
    "LowRank",
    "OffloadSetup",
    "StepBytes",
    "StepPeak",
    "UnboundedError",
    "ZeroPP",
    "break_even_bandwidth",
    "by_scope",
    "comm_bytes_per_step",
    "compressed_reduction_bytes",
    "compression_summary",
    "cross_node_bytes",
    "error_feedback_bytes",
    "fault_check_bytes",
    "hpz_secondary_bytes",
    "largest_model",
    "largest_model_offload",
    "low_rank_plan",
    "memory_per_gpu",
    "model_state_bytes",
    "offload_pool_bytes",
    "offload_summary",
    "pool_totals",
    "powersgd_bytes",
    "powersgd_sizes",
    "powersgd_state_bytes",
    "precision_bytes",
    "qgz_reduce_scatter_bytes",
    "quantized_bytes",
    "qwz_all_gather_bytes",
    "ratio_numel",
    "shard_numel",
    "stage3_comm_bytes",
    "stage3_comm_calls",
    "state_bytes_per_element",
    "step_bytes",
    "step_check_bytes",
    "step_peak",
    "step_seconds",
    "summarize",
    "wire_bytes",
]
