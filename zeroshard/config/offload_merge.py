"""The offload blocks filled from elsewhere before a config is validated: DeepSpeed's other names, and code.

Two sources write into the raw dict's offload keys (offload.py has the
blocks), each before the key scan, each setting only keys the config leaves
out; a key the config gives with another value is a problem line naming both:

- DeepSpeed's other names (deepspeed_keys.py status "mapped"):
  `zero_optimization.cpu_offload` / `cpu_offload_param` (true = device
  "cpu"), `cpu_offload_use_pin_memory` (pin_memory of each enabled block),
  `aio.intra_op_parallelism` (= `aio.thread_count`). `merge_other_names`.
- `zeroshard.initialize(..., offload=...)`: None; "cpu", "nvme" or "none"
  (the optimizer state's device); or a dict with any of `optimizer` and
  `param` (devices), `nvme_path` (for every block whose device is "nvme")
  and `ratio` (offload_optimizer's). `merge_offload_argument`.

What each wrote goes to `LoadReport.mapped`, which the start-up block lists.
"""

from __future__ import annotations

import copy
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from zeroshard.config.errors import ConfigError
from zeroshard.config.keys import read_json
from zeroshard.config.offload import DEVICES
from zeroshard.config.report import LoadReport
from zeroshard.config.values import show

# The DeepSpeed keys merge_other_names reads (deepspeed_keys.py lists each with status "mapped").
OTHER_NAMES = ("zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
               "zero_optimization.cpu_offload_use_pin_memory", "aio.intra_op_parallelism")
OffloadArg = str | Mapping[str, Any] | None
ARGUMENT_KEYS = ("optimizer", "param", "nvme_path", "ratio")
_BLOCKS = {"optimizer": "offload_optimizer", "param": "offload_param"}
_ARGUMENT = "initialize(offload=...)"
_MISSING = object()


class _Writer:
    """Sets keys of the raw `zero_optimization` section where the config (`given`) leaves them out."""

    def __init__(self, raw: dict, given: dict, source: str, report: LoadReport,
                 fix: str = "give it in one place") -> None:
        self.raw, self.given, self.source, self.report, self.fix = raw, given, source, report, fix
        self.problems: list[str] = []

    def put(self, section: str, block: str, key: str, value: Any) -> None:
        target = _child(_child(self.raw, section, create=True), block, create=True)
        if target is None:
            return  # a section or block that is no object: validation says so
        given = _child(_child(self.given, section), block)
        current = given.get(key, _MISSING) if given is not None else _MISSING
        if key == "device" and current is None:
            current = "none"  # DeepSpeed's null device
        dotted = f"{section}.{block}.{key}"
        if current is _MISSING:
            target[key] = value
            self.report.mapped.append((dotted, value, self.source))
        elif current != value or isinstance(current, bool) != isinstance(value, bool):
            self.problems.append(f"{self.source} sets {dotted} to {show(value)}, but the config has "
                                 f"{show(current)}: {self.fix}")

    def device(self, block: str) -> str | None:
        """The block's device as it stands now ("none" when not set); None where it is no object."""
        zero = _child(self.raw, "zero_optimization")
        if zero is None:
            return None
        value = zero.get(block)
        if value is None:
            return "none"  # no block, or a null one: DeepSpeed's default
        if not isinstance(value, dict):
            return None
        return "none" if value.get("device") is None else value["device"]


def _child(parent: dict | None, key: str, create: bool = False) -> dict | None:
    """parent[key] as a dict (created, or made from null, when `create`); None when it is anything else."""
    if parent is None:
        return None
    if parent.get(key) is None and create:
        parent[key] = {}
    value = parent.get(key)
    return value if isinstance(value, dict) else None


def merge_other_names(raw: dict, report: LoadReport) -> list[str]:
    """Read DeepSpeed's legacy offload switches and aio.intra_op_parallelism into their keys (in place)."""
    problems: list[str] = []
    zero, aio = raw.get("zero_optimization"), raw.get("aio")
    if isinstance(zero, dict):
        problems += _legacy_switches(raw, zero, report)
    if isinstance(aio, dict) and "intra_op_parallelism" in aio:
        value = aio.pop("intra_op_parallelism")
        if "thread_count" in aio and aio["thread_count"] != value:
            problems.append(f"aio.intra_op_parallelism {show(value)} and aio.thread_count {show(aio['thread_count'])} "
                            "disagree (DeepSpeed's newer and older name of one setting): keep one of them")
        else:
            aio["thread_count"] = value
            report.mapped.append(("aio.thread_count", value, "aio.intra_op_parallelism (DeepSpeed's newer name)"))
    return problems


def _legacy_switches(raw: dict, zero: dict, report: LoadReport) -> list[str]:
    switches = {key: zero.pop(key) for key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
                if key in zero}
    problems = [f"zero_optimization.{key} must be true or false (a JSON boolean); got {show(value)}"
                for key, value in switches.items() if not isinstance(value, bool)]
    if problems:
        return problems
    given = copy.deepcopy(raw)
    for key, block in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if key in switches:
            writer = _Writer(raw, given, f"zero_optimization.{key} {show(switches[key])}", report,
                             f"keep {block} (DeepSpeed's current key) and remove zero_optimization.{key}")
            writer.put("zero_optimization", block, "device", "cpu" if switches[key] else "none")
            problems += writer.problems
    if "cpu_offload_use_pin_memory" in switches:
        pin = switches["cpu_offload_use_pin_memory"]
        writer = _Writer(raw, given, f"zero_optimization.cpu_offload_use_pin_memory {show(pin)}", report,
                         "keep the block's pin_memory and remove zero_optimization.cpu_offload_use_pin_memory")
        enabled = [block for block in _BLOCKS.values() if writer.device(block) not in ("none", None)]
        for block in enabled:
            writer.put("zero_optimization", block, "pin_memory", pin)
        problems += writer.problems
        if not enabled:
            report.no_effect.append(("zero_optimization.cpu_offload_use_pin_memory",
                                     "no offload block is enabled, so there is no host memory to pin"))
    return problems


def merge_offload_argument(raw: dict, offload: OffloadArg, report: LoadReport, given: dict | None = None) -> list[str]:
    """Write `initialize(offload=...)` into the raw config's offload blocks (in place); the problem lines.

    `given`: the keys the config sets explicitly (default: `raw`); a key it
    sets to another value is a problem, a key it leaves out is written.
    """
    if offload is None:
        return []
    if isinstance(offload, str):
        offload = {"optimizer": offload}
    problems = _argument_problems(offload)
    if problems or not isinstance(raw.get("zero_optimization", {}), dict):
        return problems  # a zero_optimization that is no object: validation says so
    writer = _Writer(raw, raw if given is None else given, _ARGUMENT, report)
    for key, block in _BLOCKS.items():
        if key in offload:
            writer.put("zero_optimization", block, "device", offload[key])
    if "ratio" in offload:
        if writer.device("offload_optimizer") == "none":
            writer.problems.append(f"{_ARGUMENT} gives ratio, but the optimizer state is not offloaded: add "
                                   '"optimizer": "cpu" (or "nvme"), or drop ratio')
        else:
            writer.put("zero_optimization", "offload_optimizer", "ratio", offload["ratio"])
    if "nvme_path" in offload:
        on_disk = [block for block in _BLOCKS.values() if writer.device(block) == "nvme"]
        if not on_disk:
            writer.problems.append(f'{_ARGUMENT} gives nvme_path, but no offload block has device "nvme": add '
                                   '"optimizer": "nvme" or "param": "nvme", or drop nvme_path')
        for block in on_disk:
            writer.put("zero_optimization", block, "nvme_path", offload["nvme_path"])
    return writer.problems


def _argument_problems(offload: Any) -> list[str]:
    devices = ", ".join(f'"{device}"' for device in DEVICES)
    if not isinstance(offload, Mapping):
        return [f"{_ARGUMENT} must be None, one of {devices} (the optimizer state's device) or a dict with keys "
                f"{', '.join(ARGUMENT_KEYS)}; got {type(offload).__name__}"]
    problems = [f"{_ARGUMENT} has no key {show(key)}; its keys are {', '.join(ARGUMENT_KEYS)}"
                for key in offload if key not in ARGUMENT_KEYS]
    problems += [f"{_ARGUMENT}'s {key} must be one of {devices}; got {show(offload[key])}"
                 for key in _BLOCKS if key in offload and offload[key] not in DEVICES]
    if "nvme_path" in offload and not (isinstance(offload["nvme_path"], str) and offload["nvme_path"]):
        problems.append(f"{_ARGUMENT}'s nvme_path must be a directory path (a non-empty string); got "
                        f"{show(offload['nvme_path'])}")
    ratio = offload.get("ratio", 1.0)  # its range is the config key's check
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        problems.append(f"{_ARGUMENT}'s ratio must be a number in (0, 1]; got {show(ratio)}")
    return problems


def declared_param_device(source: Mapping[str, Any] | str | Path | BaseModel) -> str:
    """Where a config puts stage 3's parameter shards (offload_param.device, legacy keys read), without loading it.

    For `zero.Init(remote_device=...)`, which must agree: it reads the config
    before the model exists, when its "auto" values cannot be resolved yet.
    """
    zero_section = getattr(source, "zero_optimization", None)
    if isinstance(source, BaseModel) and zero_section is not None:
        return zero_section.offload_param.device
    if isinstance(source, (str, Path)):
        raw: Any = read_json(Path(source))
    elif isinstance(source, Mapping):
        raw = copy.deepcopy(dict(source))
    else:
        raise ConfigError(f"a config must be a dict, a path to a JSON file or a Config; got {type(source).__name__}")
    merge_other_names(raw, LoadReport())  # a conflict is initialize's to report
    block = _child(_child(raw, "zero_optimization"), "offload_param")
    device = block.get("device") if block is not None else None
    return "none" if device is None else device
