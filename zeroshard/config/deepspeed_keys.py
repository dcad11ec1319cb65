"""Every key of DeepSpeed's config documentation that is not a field of zeroshard's schema, with its status.

The keys that are fields of the schema (schema.py, blocks.py) are
implemented; each other key DeepSpeed documents (docs/_pages/config-json.md,
https://www.deepspeed.ai/docs/config-json/) has one `Rule` here:

- no effect: accepted; `why` says why it changes nothing in zeroshard.
  Listed once at start-up.
- error: rejected; `why` says what to do instead.
- not yet: rejected until zeroshard implements it; `why` says what to do now.
- mapped: another DeepSpeed name for what a schema field holds (`cpu_offload`
  for offload_optimizer's device); `why` says which. offload_merge.py reads it
  into that field before the key scan, so the scan never meets it.

An error or not-yet rule may name the values that ask for nothing (`idle`,
such as a monitor with enabled false): those load as no effect. A dotted key with keys of its own listed
below it is a section whose keys are checked one by one; any other key is
one rule for its whole value. docs/deepspeed-config.md's key table is
generated from this registry (keys_table.py), and a test keeps it so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


class Status(enum.Enum):
    IMPLEMENTED = "implemented"
    NO_EFFECT = "no effect"
    ERROR = "error"
    NOT_YET = "not yet"
    MAPPED = "mapped"


@dataclass(frozen=True)
class Rule:
    status: Status
    why: str  # no effect: why it has none here; error / not yet: what to do instead
    idle: Callable[[Any], bool] | None = None  # error / not yet: whether a value asks for nothing
    idle_values: str = ""  # those values, for people: 'device "none"', "enabled false"


def no_effect(why: str) -> Rule:
    return Rule(Status.NO_EFFECT, why)


def error(why: str, idle: Callable[[Any], bool] | None = None, idle_values: str = "") -> Rule:
    return Rule(Status.ERROR, why, idle, idle_values)


def not_yet(why: str, idle: Callable[[Any], bool] | None = None, idle_values: str = "") -> Rule:
    return Rule(Status.NOT_YET, why, idle, idle_values)


def mapped(why: str) -> Rule:
    return Rule(Status.MAPPED, why)


def _is(expected: Any) -> Callable[[Any], bool]:
    # `is` for booleans: 0 and false are different JSON values
    if isinstance(expected, bool):
        return lambda value: value is expected
    return lambda value: value == expected and not isinstance(value, bool)


def _disabled(value: Any) -> bool:
    """A section such as {"enabled": false, ...}, or {} (DeepSpeed's default is disabled)."""
    return isinstance(value, dict) and value.get("enabled", False) is False


FALSE, DISABLED = "false", "enabled false"
_MONITOR = ("zeroshard has no built-in monitor: log engine.get_lr(), the loss and engine.get_global_grad_norm() "
            'with your own tool, and remove the section (or set "enabled": false)')
_ZERO_PP = ("this part of ZeRO++ is not implemented yet (qwZ, hpZ and qgZ are: zero_quantized_weights, "
            "zero_hpz_partition_size, zero_quantized_gradients; docs/zeropp.md): remove the key")

RULES: dict[str, Rule] = {
    # ---- batch, optimizer, communication ----
    "managed_gradient_accumulation": error(
        "zeroshard always tracks micro-steps and steps the optimizer at the accumulation boundary; "
        "remove the key (false, a step() called by the script at its own boundary, is not supported)",
        _is(True), "true"),
    "prescale_gradients": error(
        "zeroshard reduces gradients in communication_data_type and divides once; remove the key",
        _is(False), FALSE),
    "gradient_predivide_factor": error(
        "zeroshard divides once by the world size; remove the key", _is(1.0), "1.0"),
    "fp32_allreduce": error(
        'DeepSpeed\'s old name, replaced by communication_data_type in 2021: use "communication_data_type": "fp32" '
        "for true, and remove the key", _is(False), FALSE),
    "sparse_gradients": error(
        "sparse embedding gradients are not supported: remove the key (gradients are dense)", _is(False), FALSE),
    # ---- precision ----
    "amp": error('Apex AMP is not supported: use the "bf16" or "fp16" section', _disabled, DISABLED),
    "torch_autocast": error(
        'use the "bf16" or "fp16" section, or torch.autocast in your forward, and remove the section',
        _disabled, DISABLED),
    "fp16.auto_cast": error(
        "zeroshard casts floating-point inputs to the training dtype itself; remove the key", _is(False), FALSE),
    "fp16.fp16_master_weights_and_grads": error(
        "master weights are always fp32; remove the key", _is(False), FALSE),
    "bf16.bf16_master_weights_and_grads": error(
        "master weights are always fp32; remove the key", _is(False), FALSE),
    "bf16.bf16_optimizer_states": error(
        "optimizer states are always fp32; remove the key", _is(False), FALSE),
    "bf16.check_grad_overflow": no_effect("every step checks the gradients for inf and nan (see non_finite)"),
    "bfloat16": error('the old name of the "bf16" section: rename it "bf16" (same keys)'),
    "bf16.immediate_grad_update": no_effect("gradients are summed over micro-steps in fp32 either way"),
    "graph_harvesting": no_effect("the optimizer step captures no CUDA graphs; it computes the same values"),
    "vocabulary_size": no_effect("DeepSpeed only warns when it is not a multiple of 8; zeroshard reads no vocabulary"),
    "data_types.grad_accum_dtype": error(
        "gradients are always accumulated in fp32; remove the key", lambda v: v in (None, "fp32"), '"fp32" or null'),
    # ---- zero_optimization ----
    "zero_optimization.allgather_partitions": no_effect(
        "updated shards are always all-gathered (the broadcast variant gives the same values)"),
    "zero_optimization.contiguous_gradients": no_effect("gradient buckets are always contiguous"),
    "zero_optimization.load_from_fp32_weights": no_effect(
        "a checkpoint always restores the fp32 master weights it holds"),
    "zero_optimization.grad_hooks": no_effect("gradients are always reduced from backward hooks"),
    "zero_optimization.round_robin_gradients": no_effect(
        "it spreads DeepSpeed's stage 1-2 gradient copies to host memory over the ranks; the copied values are "
        "the same, and zeroshard's offload orders its own copies"),
    "zero_optimization.cpu_offload": mapped(
        'DeepSpeed\'s legacy switch: true is offload_optimizer.device "cpu", false is "none"'),
    "zero_optimization.cpu_offload_param": mapped(
        'DeepSpeed\'s legacy switch: true is offload_param.device "cpu", false is "none"'),
    "zero_optimization.cpu_offload_use_pin_memory": mapped(
        "DeepSpeed's legacy switch: pin_memory of each offload block that is enabled (no effect without one)"),
    "zero_optimization.offload_optimizer.super_offload": not_yet(
        "SuperOffload (DeepSpeed's offload for CPU-GPU superchips) is not implemented yet: remove the key; "
        "offload_optimizer offloads as ZeRO-Offload does (docs/offload.md)", _is(False), FALSE),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": no_effect(
        "it sets the CPU cores of SuperOffload's CPU Adam, which zeroshard has not"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": no_effect(
        "engine.save_16bit_model and engine.save_pretrained always gather the full weights"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": no_effect(
        "engine.save_16bit_model and engine.save_pretrained always gather the full weights"),
    "zero_optimization.stage3_module_granularity_threshold": no_effect(
        "units come from stage3_wrap_classes or stage3_auto_wrap_min_params"),
    "zero_optimization.stage3_model_persistence_threshold": no_effect(
        "every parameter under stage3_param_persistence_threshold stays whole, without a total cap"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": error(
        "units are gathered with all-gather; remove the key", _is(False), FALSE),
    "zero_optimization.elastic_checkpoint": no_effect("checkpoints always reshard to any world size and stage"),
    "zero_optimization.ignore_unused_parameters": no_effect(
        "a parameter that gets no gradient is reduced as zeros at the end of backward"),
    "zero_optimization.legacy_stage1": error("remove the key (there is one stage 1)", _is(False), FALSE),
    "zero_optimization.memory_efficient_linear": no_effect("stage 3 gathers a unit again in backward; no linear is replaced"),
    "zero_optimization.override_module_apply": no_effect("zeroshard does not patch Module.apply"),
    "zero_optimization.pipeline_loading_checkpoint": no_effect("there is no pipeline engine"),
    "zero_optimization.use_multi_rank_bucket_allreduce": no_effect("buckets are reduced one collective each"),
    "zero_optimization.log_trace_cache_warnings": no_effect("stage 3 keeps no trace cache"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": no_effect(
        "it keeps DeepSpeed's Muon momentum off the disk; zeroshard keeps a tensor owned whole in memory "
        "(host memory with offload_optimizer \"cpu\"), and refuses offload_optimizer \"nvme\" for it"),
    "zero_optimization.zero_quantized_nontrainable_weights": not_yet(_ZERO_PP, _is(False), FALSE),
    "zero_optimization.mics_shard_size": not_yet("MiCS is not implemented yet: remove the key", _is(-1), "-1"),
    "zero_optimization.mics_hierarchical_params_gather": not_yet(
        "MiCS is not implemented yet: remove the key", _is(False), FALSE),
    "zero_optimization.zeropp_loco_param": not_yet(_ZERO_PP, lambda v: v is None, "null"),
    "zero_optimization.zenflow": not_yet("ZenFlow (offloaded optimizer steps) is not implemented yet: remove the "
                                         "section"),
    "zero_optimization.allgather_sequential": no_effect("updated shards are gathered by one all-gather per bucket"),
    "zero_optimization.enable_sanity_checks": no_effect("zeroshard always checks the ranks agree at start-up"),
    "zero_allow_untested_optimizer": no_effect(
        "zeroshard probes every optimizer itself: element-wise ones run on flat shards, the others on whole tensors"),
    "zero_force_ds_cpu_optimizer": no_effect(
        "with offload, zeroshard steps the optimizer it is given (or the optimizer block builds) on the CPU; "
        "there is no DeepSpeed CPU optimizer to insist on"),
    "aio.intra_op_parallelism": mapped("DeepSpeed's newer name for aio.thread_count"),
    # ---- parallelism and engines ----
    "tensor_parallel": not_yet(
        "DeepSpeed's automatic tensor parallelism (AutoTP) is not implemented yet: remove the section (or set "
        "autotp_size 1); zeroshard's tensor parallelism is DTensor's on a mesh passed in code (docs/parallel.md)",
        lambda v: isinstance(v, dict) and v.get("autotp_size", 1) in (0, 1), "autotp_size 1"),
    "hybrid_engine": error("DeepSpeed's inference kernels are not part of zeroshard: remove the section",
                           _disabled, DISABLED),
    "expert_parallel": not_yet("expert parallelism is not implemented yet: remove the section", _disabled, DISABLED),
    "seq_parallel_communication_data_type": no_effect("there is no sequence parallelism"),
    "use_data_before_expert_parallelism": no_effect("there is no expert parallelism"),
    "pipeline": no_effect("it configures DeepSpeed's PipelineModule, which zeroshard does not take"),
    "compile": error("DeepCompile is not part of zeroshard: use torch.compile on the model, and remove the section",
                     lambda v: isinstance(v, dict) and v.get("deepcompile", False) is False, "deepcompile false"),
    "sparse_attention": error("DeepSpeed's sparse attention kernels are not part of zeroshard: remove the section"),
    # ---- logging, profiling, monitors ----
    "steps_per_print": no_effect("zeroshard prints no periodic progress; log engine.get_lr() and the loss yourself"),
    "wall_clock_breakdown": no_effect("zeroshard logs no timings; engine.comm_stats() and torch.profiler measure"),
    "timers": no_effect("zeroshard keeps no throughput timers; time the loop yourself, engine.comm_stats() counts "
                        "the collectives"),
    "log_level": no_effect('zeroshard\'s level is ZEROSHARD_LOG_LEVEL or logging.getLogger("zeroshard").setLevel'),
    "dump_state": no_effect("zeroshard logs its resolved config at start-up instead"),
    "memory_breakdown": no_effect("engine.memory_stats() reports the memory per rank"),
    "flops_profiler": error("use torch.profiler or torch.utils.flop_counter, and remove the section",
                            _disabled, DISABLED),
    "autotuning": error("autotuning runs under DeepSpeed's launcher only: remove the section", _disabled, DISABLED),
    "comms_logger": error("engine.comm_stats() counts every collective: use it, and remove the section",
                          _disabled, DISABLED),
    "tensorboard": error(_MONITOR, _disabled, DISABLED),
    "wandb": error(_MONITOR, _disabled, DISABLED),
    "comet": error(_MONITOR, _disabled, DISABLED),
    "csv_monitor": error(_MONITOR, _disabled, DISABLED),
    "eigenvalue": error("eigenvalue computation is not part of zeroshard: remove the section", _disabled, DISABLED),
    # ---- data, training methods ----
    "data_efficiency": error("DeepSpeed's data efficiency library is not part of zeroshard: remove the section",
                             _disabled, DISABLED),
    "curriculum_learning": error("curriculum learning is not part of zeroshard: order your data yourself, and "
                                 "remove the section", _disabled, DISABLED),
    "progressive_layer_drop": error("progressive layer drop is not part of zeroshard: remove the section",
                                    _disabled, DISABLED),
    "compression_training": error("DeepSpeed's compression library is not part of zeroshard: remove the section"),
    "quantize_training": error("quantization-aware training is not part of zeroshard: remove the section",
                               _disabled, DISABLED),
    "elasticity": error("elastic batch sizes are not supported: set the batch keys, and remove the section",
                        _disabled, DISABLED),
    "disable_allgather": error("updated shards are always all-gathered; remove the key", _is(False), FALSE),
    # ---- checkpoints ----
    "checkpoint.load_universal": no_effect("checkpoints always reshard to any world size and stage"),
    "checkpoint.use_node_local_storage": error(
        "checkpoints are written to one shared directory; remove the key", _is(False), FALSE),
    "checkpoint.parallel_write.pipeline_stage": no_effect("there is no pipeline engine"),
}


def is_section(dotted: str) -> bool:
    """Whether the registry lists keys below `dotted` (then they are checked one by one)."""
    return any(key.startswith(dotted + ".") for key in RULES)


def keys_below(prefix: str) -> list[str]:
    """The registry's keys one level below `prefix` ("" = the top level, else "section.")."""
    names = {key[len(prefix):].split(".")[0] for key in RULES if key.startswith(prefix)}
    return sorted(names)
