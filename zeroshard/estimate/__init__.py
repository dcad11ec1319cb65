"""The memory and communication model of ZeRO: pure formulas over element counts.

`summarize(numel, gpus)` returns what `zeroshard estimate --json` prints. It knows no model
class: callers (the CLI, the demo) count a model and hand the counts in.
"""

from zeroshard.estimate.formulas import (
    DTYPE_BYTES,
    STAGES,
    comm_bytes_per_step,
    cross_node_bytes,
    largest_model,
    memory_per_gpu,
    model_state_bytes,
    order_check_bytes,
    precision_bytes,
    shard_numel,
    state_bytes_per_element,
    step_check_bytes,
    summarize,
    wire_bytes,
)
from zeroshard.estimate.zeropp import qgz_reduce_scatter_bytes, quantized_bytes, qwz_all_gather_bytes

__all__ = [
    "DTYPE_BYTES", "STAGES", "comm_bytes_per_step", "cross_node_bytes", "largest_model", "memory_per_gpu",
    "model_state_bytes", "order_check_bytes", "precision_bytes", "shard_numel", "state_bytes_per_element",
    "step_check_bytes", "summarize", "wire_bytes", "quantized_bytes", "qwz_all_gather_bytes",
    "qgz_reduce_scatter_bytes",
]
