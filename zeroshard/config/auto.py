"""Resolving `"auto"` values and the batch-size triple, before a config is validated.

Hugging Face's Trainer fills DeepSpeed's `"auto"` values from its own
arguments. zeroshard fills them from what `zeroshard.initialize` is given,
summarised as `ConfigFacts`, and where nothing given decides a value, from
the key's default (DeepSpeed's where zeroshard follows it). A value that
cannot be worked out is an error naming the dotted key and what to put.

Plugging in a key: add one entry to `AUTO_RESOLVERS`, dotted key -> function
(raw config dict, facts) -> value, `USE_DEFAULT`, or raise `AutoError(what
to put instead)`. "section.params.*" covers every key of that object. Stage
3's size keys could use `facts.hidden_size` as Hugging Face does (0.9 x
hidden^2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from zeroshard.dtypes import DTYPES, torch_name

AUTO = "auto"


@dataclass(frozen=True)
class ConfigFacts:
    """What `initialize` knows when it loads the config; None where it is not known."""

    world_size: int | None = None  # ranks in the data-parallel group
    param_dtype: str | None = None  # the trainable parameters' dtype, torch's name: "float32", "bfloat16", ...
    hidden_size: int | None = None  # the model's hidden size, for size autos that scale with it


class AutoError(Exception):
    """An "auto" value zeroshard cannot work out; the argument says what to put instead."""


USE_DEFAULT = object()  # drop the key, so the field's default applies
Resolver = Callable[[dict, ConfigFacts], Any]


def _use_default(raw: dict, facts: ConfigFacts) -> Any:
    return USE_DEFAULT


def _warmup_max_lr(raw: dict, facts: ConfigFacts) -> Any:
    return None  # null = the optimizer's lr, read when the schedule is built (given or from the block)


def _precision_enabled(section: str) -> Resolver:
    """`bf16.enabled` / `fp16.enabled`: whether the model was built in that dtype."""
    def resolve(raw: dict, facts: ConfigFacts) -> Any:
        if facts.param_dtype is None:
            raise AutoError("put true or false (from the model's dtype, which is not known here)")
        return facts.param_dtype == torch_name(DTYPES[section])
    return resolve


def _total_num_steps(raw: dict, facts: ConfigFacts) -> Any:
    raise AutoError("put the number of optimizer steps of the run (Hugging Face's Trainer computes "
                    "it from epochs and data, which zeroshard.initialize does not see)")


AUTO_RESOLVERS: dict[str, Resolver] = {
    # Batch sizes: "auto" is as if the key were left out; `resolve_batch` derives
    # it from the other two and the world size, as DeepSpeed does for a missing key.
    "train_batch_size": _use_default,
    "train_micro_batch_size_per_gpu": _use_default,
    "gradient_accumulation_steps": _use_default,
    "gradient_clipping": _use_default,  # 0.0: clipping off
    "zero_optimization.reduce_bucket_size": _use_default,
    "zero_optimization.allgather_bucket_size": _use_default,
    # Hugging Face scales these with the hidden size (0.9 h^2, 10 h); zeroshard's defaults
    # until a facts.hidden_size rule is wanted.
    "zero_optimization.stage3_prefetch_bucket_size": _use_default,
    "zero_optimization.stage3_param_persistence_threshold": _use_default,
    # Mixed precision follows the dtype the model was built in (Hugging Face: its --bf16/--fp16).
    "bf16.enabled": _precision_enabled("bf16"),
    "fp16.enabled": _precision_enabled("fp16"),
    "optimizer.params.*": _use_default,  # lr, betas, eps, weight_decay, ...: the type's defaults
    "scheduler.params.warmup_max_lr": _warmup_max_lr,
    "scheduler.params.total_num_steps": _total_num_steps,
    "scheduler.params.*": _use_default,
}


def resolve_autos(raw: dict, facts: ConfigFacts) -> tuple[dict, list[str]]:
    """A copy of `raw` with every "auto" resolved and the batch sizes derived; and the problems."""
    resolved = copy.deepcopy(raw)
    problems: list[str] = []
    for path in _auto_paths(resolved):
        dotted = ".".join(path)
        resolver = AUTO_RESOLVERS.get(dotted) or AUTO_RESOLVERS.get(".".join(path[:-1]) + ".*")
        parent = _parent(resolved, path)
        try:
            if resolver is None:
                raise AutoError("put a value (the keys with an \"auto\" rule are listed in "
                                "docs/deepspeed-config.md)")
            value = resolver(resolved, facts)
        except AutoError as error:
            problems.append(f'{dotted} is "auto", which zeroshard cannot work out here; {error}')
            value = USE_DEFAULT  # reported once, not again as a bad value
        if value is USE_DEFAULT:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    problems += resolve_batch(resolved, facts.world_size)
    return resolved, problems


def _auto_paths(raw: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in raw.items():
        if isinstance(value, dict):
            paths += _auto_paths(value, (*prefix, str(key)))
        elif value == AUTO:
            paths.append((*prefix, str(key)))
    return paths


def _parent(raw: dict, path: tuple[str, ...]) -> dict:
    for key in path[:-1]:
        raw = raw[key]
    return raw


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch(raw: dict, world_size: int | None) -> list[str]:
    """Derive the batch key left out, or check all three, as DeepSpeed does: train = micro x accum x N.

    Changes `raw` in place; returns the problems. Without a world size, a
    train_batch_size that needs it to derive another key is an error, and
    the check waits until `initialize` knows the world size.
    """
    values = [raw.get(key) for key in BATCH_KEYS]
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in values):
        return []  # a bad value: validation reports it
    train, micro, accum = values
    if train is None:
        if micro is not None and world_size is not None:
            raw["train_batch_size"] = micro * (accum or 1) * world_size
        return []
    if world_size is None:
        if micro is None or accum is None:
            return ["train_batch_size needs the world size to derive "
                    f"{'train_micro_batch_size_per_gpu' if micro is None else 'gradient_accumulation_steps'}; "
                    "let zeroshard.initialize load the config, or give `zeroshard config check "
                    "--world-size N`"]
        return []
    derived = {key for key, value in zip(BATCH_KEYS[1:], (micro, accum)) if value is None}
    if micro is None:
        accum = accum or 1
        micro = train // (accum * world_size)
    elif accum is None:
        accum = train // (micro * world_size)
    if micro * accum * world_size != train or micro == 0 or accum == 0:
        def shown(key: str, value: int) -> str:
            return f"{key} {value}{' (derived)' if key in derived else ''}"
        return [f"train_batch_size {train} is not {shown('train_micro_batch_size_per_gpu', micro)} x "
                f"{shown('gradient_accumulation_steps', accum)} x world size {world_size} "
                f"(= {micro * accum * world_size}); change one of them, or leave one of the three "
                "out (or \"auto\") to have it derived"]
    raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"] = micro, accum
    return []
