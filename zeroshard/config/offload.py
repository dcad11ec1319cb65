"""Offload (ZeRO-Offload, ZeRO-Infinity): where a rank's optimizer state and stage-3 parameter shards live.

Three sections with DeepSpeed's names: `zero_optimization.offload_optimizer`
(the fp32 master shard and optimizer state in host memory or on disk, the
step run on the CPU over them), `zero_optimization.offload_param` (stage 3's
parameter shards in host memory or on disk until their gather) and the
top-level `aio` (the disk reads and writes). Each block is disabled with
`"device": "none"` (or null, or no block). The keys DeepSpeed has that
change nothing here are accepted and their descriptions start "No effect:"
(the key scan lists them at start-up). `offload_problems` holds the checks
across keys (stage, disk path, ZeRO++); ZeroConfig raises them all at once.
DeepSpeed's legacy keys and `initialize(offload=...)` are merged into the
raw dict before validation (offload_merge.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, Field
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.values import NonNegativeInt, PositiveInt, StrictBool, finite_number, invalid, strict_bool

DEVICES = ("none", "cpu", "nvme")
Device = Literal["none", "cpu", "nvme"]


def device(value: Any) -> str:
    """An offload device: "none", "cpu" or "nvme"; null means "none" (DeepSpeed's default)."""
    if value is None:
        return "none"
    if not isinstance(value, str) or value not in DEVICES:
        raise invalid('must be "none", "cpu" or "nvme" (null = "none")', value)
    return value


def _path(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise invalid("must be a directory path (a string) or null", value)
    return value


def _ratio(value: Any) -> float:
    note = " (the fraction of the optimizer state offloaded; for none, set device \"none\")"
    ratio = finite_number(value, 0, False, meaning=" and <= 1" + note)
    if ratio > 1:
        raise invalid("must be a finite number > 0 and <= 1" + note, value)
    return ratio


def _no_gds(value: Any) -> bool:
    if strict_bool(value):
        raise invalid("must be false: GPUDirect Storage (disk reads straight into GPU memory) is not supported; "
                      "reads and writes go through host memory. Set it false or remove it", value)
    return False


def section(model: type[BaseModel], example: str) -> Callable[[Any], Any]:
    """A validator for a section DeepSpeed also takes as null (= its defaults): a JSON object, the model, or null."""
    def check(value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, (dict, model)):
            raise invalid(f"must be a JSON object such as {example}, or null", value)
        return value
    return check


_DeviceField = Annotated[Device, BeforeValidator(device)]
_PathField = Annotated[str | None, BeforeValidator(_path)]


class OffloadOptimizerConfig(BaseModel):
    """`zero_optimization.offload_optimizer`: the master shard and optimizer state in host memory or on disk."""

    model_config = _FROZEN_STRICT

    device: _DeviceField = Field("none", description=(
        "Where this rank's fp32 master shard and optimizer state live: \"none\" = the training device, \"cpu\" = "
        "host memory, \"nvme\" = files under nvme_path; with \"cpu\" or \"nvme\" the optimizer step runs on the "
        "CPU. Needs stage >= 1. null = \"none\". DeepSpeed: zero_optimization.offload_optimizer.device "
        "(default \"none\")."))
    nvme_path: _PathField = Field(None, description=(
        "Directory the optimizer state is written to with device \"nvme\" (required then; each rank writes its "
        "own files); read only with \"nvme\". DeepSpeed: zero_optimization.offload_optimizer.nvme_path "
        "(default null)."))
    pin_memory: StrictBool = Field(False, description=(
        "true: the buffers disk reads and writes go through are page-locked (with CUDA; it changes nothing on "
        "CPU-only runs). The host tier's masters, state and gradient shard stay pageable, and their copies to "
        "and from the GPU are synchronous for now. DeepSpeed: zero_optimization.offload_optimizer.pin_memory "
        "(default false)."))
    buffer_count: PositiveInt = Field(4, description=(
        "Disk: buffers in flight (count), reading the next part of the state ahead and writing the last one "
        "behind while the CPU steps the current one (buffer_count - 2 sub-groups read ahead; under 3 counts as "
        "3). DeepSpeed: zero_optimization.offload_optimizer.buffer_count (default 4)."))
    ratio: Annotated[float, BeforeValidator(_ratio)] = Field(1.0, description=(
        "Fraction of the optimizer state offloaded, in (0, 1], by elements (so by bytes: the state is fp32), "
        "the first buckets; the rest stays on the training device "
        "and is stepped there. DeepSpeed: zero_optimization.offload_optimizer.ratio (default 1.0)."))
    fast_init: StrictBool = Field(False, description=(
        "No effect: it chooses DeepSpeed's faster way of setting up the optimizer state on disk; zeroshard has "
        "one way. DeepSpeed: zero_optimization.offload_optimizer.fast_init (default false)."))
    pipeline_read: StrictBool = Field(False, description=(
        "No effect: zeroshard always reads the next part of the state from disk while the CPU steps the current "
        "one. DeepSpeed: zero_optimization.offload_optimizer.pipeline_read (default false)."))
    pipeline_write: StrictBool = Field(False, description=(
        "No effect: zeroshard always writes the last part of the state to disk while the CPU steps the current "
        "one. DeepSpeed: zero_optimization.offload_optimizer.pipeline_write (default false)."))
    # Off by default: it changes the arithmetic (each update uses weights one step stale), which only
    # pays once the CPU step is the bottleneck; the ZeRO-Offload paper turns it on after warm-up.
    delayed_update: StrictBool = Field(False, description=(
        "ZeRO-Offload's one-step delayed parameter update: the CPU step of step k runs on a thread of its own "
        "while step k+1's forward and backward run with the parameters of step k-1; engine.step() at step k+1's "
        "boundary waits for it, puts it into the parameters, then starts step k+1's. Every gradient is applied "
        "once, one step late. Checkpoint saves and loads, save_pretrained and engine.flush_update() apply the "
        "update in flight first. Needs device \"cpu\" or \"nvme\" and ratio 1. DeepSpeed: none (zeroshard "
        "only; the ZeRO-Offload paper's DPU)."))
    # The paper keeps the first steps exact, while the gradients change fast; its authors' code (linked from
    # DeepSpeed issue 1260) delays from the 21st step on.
    delayed_update_warmup: NonNegativeInt = Field(20, description=(
        "With delayed_update: optimizer steps (count, skipped ones included) taken without the delay first; "
        "the update of the step after them is the first applied one step late. DeepSpeed: none (zeroshard "
        "only; the ZeRO-Offload paper's warm-up)."))

    @property
    def enabled(self) -> bool:
        """Whether the optimizer state is offloaded (device "cpu" or "nvme")."""
        return self.device != "none"


class OffloadParamConfig(BaseModel):
    """`zero_optimization.offload_param` (stage 3): parameter shards in host memory or on disk until gathered."""

    model_config = _FROZEN_STRICT

    device: _DeviceField = Field("none", description=(
        "Where stage 3's parameter shards live between their gathers: \"none\" = the training device, \"cpu\" = "
        "host memory, \"nvme\" = files under nvme_path. Needs stage 3. null = \"none\". "
        "DeepSpeed: zero_optimization.offload_param.device (default \"none\")."))
    nvme_path: _PathField = Field(None, description=(
        "Directory the parameter shards are written to with device \"nvme\" (required then); read only with "
        "\"nvme\". DeepSpeed: zero_optimization.offload_param.nvme_path (default null)."))
    pin_memory: StrictBool = Field(False, description=(
        "true: the parameter shards kept in host memory and the buffers disk reads go through are page-locked "
        "(with CUDA; it changes nothing on CPU-only runs). DeepSpeed: zero_optimization.offload_param.pin_memory "
        "(default false)."))
    buffer_count: PositiveInt = Field(5, description=(
        "Device \"nvme\": with buffer_size, the elements of updated parameter shards (buffer_count x "
        "buffer_size) that stay in host memory from the step to the next forward, the step waiting for none of "
        "their writes: each unit's gather there waits for its own and takes them from memory, not from disk (the "
        "first units in build order that "
        "fit; none where host memory is short, under 2x what the ranks would hold without a disk tier). "
        "DeepSpeed: zero_optimization.offload_param.buffer_count (default 5)."))
    buffer_size: PositiveInt = Field(100_000_000, description=(
        "Device \"nvme\": elements per buffer; see buffer_count. "
        "DeepSpeed: zero_optimization.offload_param.buffer_size (default 1e8)."))
    max_in_cpu: NonNegativeInt = Field(1_000_000_000, description=(
        "Device \"nvme\": the first max_in_cpu elements of this rank's parameter shards stay in host memory "
        "instead of going to disk; the rest are read from disk when needed. The default, 1e9, keeps every shard "
        "of a rank with fewer elements on the host (a warning says so): set it lower, 0 for every shard on "
        "disk. DeepSpeed: zero_optimization.offload_param.max_in_cpu (default 1e9)."))

    @property
    def enabled(self) -> bool:
        """Whether the parameter shards are offloaded (device "cpu" or "nvme")."""
        return self.device != "none"


class AioConfig(BaseModel):
    """The top-level `aio` section: how the disk is read and written when an offload device is "nvme"."""

    model_config = _FROZEN_STRICT

    block_size: PositiveInt = Field(1_048_576, description=(
        "Bytes per read or write request: larger reads and writes are split into requests of this size. "
        "DeepSpeed: aio.block_size (default 1048576)."))
    queue_depth: PositiveInt = Field(8, description=(
        "No effect: the requests in flight are the I/O threads' (thread_count + 1 per rank), one each, "
        "served round robin across the reads and writes in flight. DeepSpeed: aio.queue_depth (default 8)."))
    thread_count: PositiveInt = Field(1, description=(
        "Threads that issue the requests (a small pool); DeepSpeed's newer name intra_op_parallelism is read "
        "as this key. DeepSpeed: aio.thread_count (default 1)."))
    single_submit: StrictBool = Field(False, description=(
        "No effect: it chooses how libaio submits a batch of requests, and zeroshard does not use libaio. "
        "DeepSpeed: aio.single_submit (default false)."))
    overlap_events: StrictBool = Field(True, description=(
        "No effect: it overlaps libaio's submissions with its completions, and zeroshard does not use libaio "
        "(its reads and writes always overlap the step). DeepSpeed: aio.overlap_events (default true)."))
    use_gds: Annotated[bool, BeforeValidator(_no_gds)] = Field(False, description=(
        "Must be false: GPUDirect Storage is not supported (disk reads and writes go through host memory). "
        "DeepSpeed: aio.use_gds (default false)."))


Problem = tuple[tuple[str, ...], str]  # (location below zero_optimization, message after the dotted key)


def offload_problems(stage: int, optimizer: OffloadOptimizerConfig, param: OffloadParamConfig,
                     zeropp_weights: dict[str, Any]) -> list[Problem]:
    """Every combination of zero_optimization's keys that offload cannot honour.

    `zeropp_weights`: the ZeRO++ keys that keep or send stage 3's weights
    differently, as set (zero_quantized_weights, zero_hpz_partition_size > 1).
    """
    problems: list[Problem] = []
    if optimizer.enabled and stage == 0:
        problems.append((("offload_optimizer", "device"), (
            f'"{optimizer.device}" needs stage 1, 2 or 3: stage 0 shards nothing, so each rank steps every '
            'parameter on the device; set zero_optimization.stage to 1 or more, or set device "none"')))
    if param.enabled and stage != 3:
        problems.append((("offload_param", "device"), (
            f'"{param.device}" needs stage 3, not stage {stage}: only stage 3 shards the parameters (below it '
            "every rank holds them whole on the device); set zero_optimization.stage to 3, or set device "
            '"none" (offload_optimizer offloads the optimizer state at stages 1 and 2)')))
    for name, block in (("offload_optimizer", optimizer), ("offload_param", param)):
        if block.device == "nvme" and not block.nvme_path:
            problems.append(((name, "nvme_path"), (
                'is required with device "nvme": set it to a directory on the disk to use (each rank writes '
                'its own files there), or use device "cpu"')))
    if optimizer.delayed_update and not optimizer.enabled:
        problems.append((("offload_optimizer", "delayed_update"), (
            "true needs an offloaded optimizer (it overlaps the CPU step with the next forward): set "
            'offload_optimizer.device "cpu" or "nvme", or remove delayed_update')))
    elif optimizer.delayed_update and optimizer.ratio < 1:
        problems.append((("offload_optimizer", "delayed_update"), (
            f"true needs the whole optimizer state offloaded, not ratio {optimizer.ratio}: the part kept on the "
            "device is stepped in place, in the parameters the next forward reads while the delayed step "
            "runs; set offload_optimizer.ratio 1, or remove delayed_update")))
    if param.enabled and zeropp_weights:
        keys = ", ".join(f"{key} {value}".lower() for key, value in zeropp_weights.items())
        why = "; ".join(_ZEROPP_WHY[key] for key in zeropp_weights)
        problems.append((("offload_param", "device"), (
            f'"{param.device}" is not supported together with ZeRO++\'s {keys} ({why}): set offload_param.device '
            '"none", or turn those keys off')))
    return problems


_ZEROPP_WHY = {
    "zero_hpz_partition_size": "hpZ keeps a secondary copy of each unit's parameters on the device after its "
                               "forward, which defeats parameter offload",
    "zero_quantized_weights": "qwZ's quantized gather is not implemented for shards in host memory or on disk",
}


def raise_problems(title: str, problems: list[Problem]) -> None:
    """Raise every problem at once, each at its own key (pydantic reports them as separate lines)."""
    if problems:
        raise ValidationError.from_exception_data(title, [
            InitErrorDetails(type=PydanticCustomError("zeroshard", "{message}", {"message": message}),
                             loc=loc, input=None) for loc, message in problems])
