"""What `zeroshard.deepspeed` does not offer: DeepSpeed's names and arguments with what to do instead.

A script that reaches for one gets an error that names it and the way
forward, never a bare `AttributeError` or an argument silently ignored.
"""

from __future__ import annotations

from zeroshard.errors import ZeroshardError

MIGRATE = "docs/migrate-from-deepspeed.md"

# DeepSpeed's module-level names that zeroshard.deepspeed does not provide -> what to do instead.
NOT_PROVIDED = {
    "pipe": "DeepSpeed's pipeline engine is not provided; zeroshard's pipeline parallelism is torch's pipelining "
            "on a mesh: split the model with torch.distributed.pipelining and pass mesh= (docs/parallel.md)",
    "PipelineModule": "DeepSpeed's pipeline engine is not provided; zeroshard's pipeline parallelism is torch's "
                      "pipelining on a mesh: split the model with torch.distributed.pipelining and pass mesh= "
                      "(docs/parallel.md)",
    "init_inference": "inference engines are not provided: evaluate with engine(...) under torch.no_grad(), "
                      "or save with engine.save_16bit_model and load the model on its own",
    "ops": "DeepSpeed's kernels (FusedAdam, DeepSpeedCPUAdam) are not provided: pass a torch optimizer "
           "(torch.optim.AdamW(..., fused=True) on CUDA) or use the config's optimizer block",
    "comm": "use torch.distributed; zeroshard runs on its default group",
    "accelerator": "use torch.cuda and engine.device",
    "moe": "DeepSpeed's MoE layer (expert parallelism) is not supported yet; MoE models train at stage 3 as they "
           "are, experts as modules or as 3-D tensors (docs/stage-3.md)",
    "runtime": "DeepSpeed's runtime modules are not provided: the config's scheduler block builds WarmupLR, "
               "WarmupDecayLR and WarmupCosineLR; any torch scheduler can be passed as lr_scheduler; "
               "runtime.zero.offload_config's OffloadStateTypeEnum and OffloadDeviceEnum are "
               "zeroshard.deepspeed.OffloadStateTypeEnum and OffloadDeviceEnum",
    "add_tuning_arguments": "the autotuner is not provided",
    "profiling": "the FLOPs profiler is not provided: use torch.profiler",
    "tp_model_init": "DeepSpeed's automatic tensor parallelism is not provided; zeroshard's tensor parallelism is "
                     "DTensor's on a mesh: parallelize the model with torch's parallelize_module and pass mesh= "
                     "(docs/parallel.md)",
    "module_inject": "kernel injection is not provided (it is an inference feature)",
    "compression": "DeepSpeed's compression library is not provided",
}

# Names of deepspeed.utils that zeroshard.deepspeed.utils does not provide (it has the stage-3 leaf modules).
_UTILS = ("DeepSpeed's other utilities are not provided: `zeroshard consolidate` replaces zero_to_fp32, logging "
          "replaces deepspeed.utils.logger")
UTILS_NOT_PROVIDED = {name: _UTILS for name in ("logger", "zero_to_fp32", "safe_get_full_fp32_param",
                                                 "safe_get_full_grad", "log_dist")}

# Names of deepspeed.zero that zeroshard.deepspeed.zero does not provide.
ZERO_NOT_PROVIDED = {
    "register_external_parameter": "not needed: a stage-3 unit's parameters are gathered for the whole unit's "
                                   "forward; use zeroshard's wrap= (or stage3_wrap_classes) to choose units",
    "TiledLinear": "not provided: stage 3's units are modules; choose them with wrap= or stage3_wrap_classes",
    "MiCS_Init": "MiCS (hierarchical partitioning) is not supported yet",
    "ZeroParamStatus": "zeroshard's stage-3 state lives in units, not parameters: read values inside "
                       "zero.GatheredParameters(params)",
}


class UnsupportedError(ZeroshardError, NotImplementedError):
    """A DeepSpeed argument or feature that zeroshard does not implement yet; the message says what to do."""


class MissingAPIError(ZeroshardError, AttributeError):
    """A DeepSpeed name that zeroshard.deepspeed does not provide; the message says what to do."""


def missing(module: str, name: str, table: dict[str, str]) -> AttributeError:
    """The error for `module.name`: from `table`, or a general one for a name not listed."""
    if name.startswith("__"):  # Python's own probing (__path__, __wrapped__): a plain AttributeError
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    why = table.get(name, f"DeepSpeed's {name} is not provided")
    return MissingAPIError(f"{module}.{name} is not available: {why}. See {MIGRATE}")
