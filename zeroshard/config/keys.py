"""The keys of a raw config: JSON reading, unknown keys (with a suggestion) and DeepSpeed keys not supported yet.

Pure functions over dicts; the sections' pydantic models come in as arguments.
"""

from __future__ import annotations

import difflib
import json
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from zeroshard.config.errors import ConfigError, ConfigWarning

# DeepSpeed top-level keys that zeroshard rejects until it implements them.
UNSUPPORTED_TOP_LEVEL_KEYS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "checkpoint",
    "comms_logger", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "disable_allgather",
    "dump_state", "eigenvalue", "elasticity", "flops_profiler",
    "gradient_predivide_factor", "memory_breakdown", "pipeline",
    "prescale_gradients", "progressive_layer_drop", "quantize_training",
    "sparse_attention", "sparse_gradients", "steps_per_print", "tensorboard",
    "wall_clock_breakdown", "wandb", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
})

# DeepSpeed `zero_optimization` keys that zeroshard rejects until it implements them.
UNSUPPORTED_ZERO_KEYS = frozenset({
    "allgather_partitions", "contiguous_gradients", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "elastic_checkpoint", "ignore_unused_parameters",
    "legacy_stage1", "load_from_fp32_weights", "memory_efficient_linear",
    "mics_hierarchical_params_gather", "mics_shard_size", "offload_optimizer",
    "offload_param", "override_module_apply", "pipeline_loading_checkpoint",
    "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
    "sub_group_size", "use_multi_rank_bucket_allreduce", "zero_hpz_partition_size",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
})

# DeepSpeed `fp16` and `bf16` keys that zeroshard rejects until it implements them.
UNSUPPORTED_FP16_KEYS = frozenset({"auto_cast", "fp16_master_weights_and_grads"})
UNSUPPORTED_BF16_KEYS = frozenset({"immediate_grad_update"})


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, or raise `ConfigError` saying what to fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found; check the path "
                          f"(a relative path is resolved from {Path.cwd()})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file '{path}': {error}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config file '{path}' is not valid JSON: {error.msg} at line {error.lineno}, "
            f"column {error.colno}; fix the syntax there (JSON allows no comments or "
            "trailing commas, and strings use double quotes)") from None
    except _DuplicateKey as error:
        # json.loads would keep the last value and silently drop the others.
        raise ConfigError(f"config file '{path}' repeats the key '{error}' in one object; "
                          "keep only one") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object ({{...}}) at the "
                          f"top level; got a JSON {type(raw).__name__}")
    return raw


class _DuplicateKey(Exception):
    """Raised by `_reject_duplicate_keys`; the argument is the repeated key."""


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result




def key_problems(raw: dict[str, Any], model: type[BaseModel],
                 unsupported_by_section: dict[type[BaseModel], frozenset[str]]) -> list[str]:
    """One line per unknown key, then one line listing every unsupported DeepSpeed key.

    Under `"strict": false` the unsupported keys are not problems: each gets a
    warning, and they are removed from `raw` (in place).
    """
    unknown: list[str] = []
    unsupported: list[str] = []
    _scan_keys(raw, model, "", unknown, unsupported, unsupported_by_section)
    if unsupported and raw.get("strict", True) is False and not unknown:
        for dotted in unsupported:
            warnings.warn(f"zeroshard ignores the DeepSpeed key '{dotted}': not supported yet, and the "
                          'config says "strict": false', ConfigWarning, stacklevel=4)
            *parents, key = dotted.split(".")
            section = raw
            for parent in parents:
                section = section[parent]
            del section[key]
    elif unsupported:
        keys = ", ".join(f"'{key}'" for key in unsupported)
        unknown.append(f"DeepSpeed keys not supported yet by zeroshard: {keys}; "
                       'remove them from the config (or set "strict": false to ignore them)')
    return unknown




def _scan_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str, unknown: list[str],
               unsupported: list[str], unsupported_by_section: dict[type[BaseModel], frozenset[str]]) -> None:
    """Walk `raw` against `model`, appending unknown-key messages and unsupported dotted keys."""
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is not None:
            nested = field.annotation  # a section such as ZeroConfig, or a plain type
            is_section = isinstance(nested, type) and issubclass(nested, BaseModel)
            if is_section and isinstance(value, dict):
                _scan_keys(value, nested, f"{dotted}.", unknown, unsupported, unsupported_by_section)
        elif key in unsupported_by_section[model]:
            unsupported.append(dotted)
        else:
            unknown.append(_unknown_key_message(str(key), model, prefix, unsupported_by_section[model]))


def _unknown_key_message(key: str, model: type[BaseModel], prefix: str, unsupported: frozenset[str]) -> str:
    allowed = sorted(model.model_fields)
    # Suggest among DeepSpeed's keys too: a misspelt `fp61` should point at `fp16`.
    close = difflib.get_close_matches(key, allowed + sorted(unsupported), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = f"in '{prefix[:-1]}'" if prefix else "at the top level"
    return f"unknown key '{prefix}{key}'{hint}; allowed keys {where}: {', '.join(allowed)}"
