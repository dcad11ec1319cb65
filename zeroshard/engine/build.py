"""Building an engine's parts: buckets or stage-3 units, staging memory, the reducer and hooks.

Everything here runs once, in `Engine.__init__`, on every rank in the same
order: parameters are flattened, broadcast from rank 0 and sharded; the
user's optimizer is pointed at the master shards; hooks are installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm import Comm, CommRecorder, all_gather_object, broadcast, ensure_process_group
from zeroshard.comm.topology import declared_scope
from zeroshard.comm.compress.powersgd import PowerSgd, QSeeds
from zeroshard.config import Config, ConfigError
from zeroshard.core.bucket import Bucket, StageSwitches
from zeroshard.core.bucketing import bucket_params
from zeroshard.core.faults import agreed
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.optim import shard_optimizer
from zeroshard.core.param_gather import PostStepGather
from zeroshard.core.precision import Precision
from zeroshard.core.reducer import GradReducer
from zeroshard.core.staging import StagingPool
from zeroshard.engine.agreement import check_ranks_agree, error_everywhere
from zeroshard.engine.memory_fit import check_states_fit
from zeroshard.engine.offload import Offload, OffloadBuild, offload_choice
from zeroshard.engine.wire import Wire, wire
from zeroshard.engine.validate import check_device_matches_group, check_model, device_of, mark_wrapped, trainable_groups
from zeroshard.stage3.gathered import Placement, place
from zeroshard.stage3.gathers import Gathers
from zeroshard.stage3.generation import sync_generation
from zeroshard.stage3.materialize import (
    Materializer,
    check_materializable,
    default_device,
    materialize_whole,
    on_meta,
)
from zeroshard.stage3.meta import recorded_init
from zeroshard.errors import ModelError
from zeroshard.plan.staging import block_numel
from zeroshard.stage3.module_state import ModuleStateHooks
from zeroshard.stage3.resize import refuse_resize
from zeroshard.stage3.schedule import GatherSchedule
from zeroshard.stage3.unit import Unit, build_units
from zeroshard.stage3.wrapping import plan_units, unit_modules

log = logging.getLogger("zeroshard.config")

# What a rank that cannot open or fill its swap files was doing, in the error every rank raises.
_SETUP = "setting up offload"
# Devices whose torch optimizers have fused kernels for Adam, AdamW and SGD.
_FUSED_DEVICES = {"cpu", "cuda"}


@dataclass
class Parts:
    """What an engine is made of, built once."""

    comm: Comm
    device: torch.device
    precision: Precision
    switches: StageSwitches
    names: dict[int, str]  # id(parameter) -> its name in the model, for messages and checkpoints
    buckets: list[Bucket]  # every trained flat buffer; at stage 3 the buckets of all units
    units: list[Unit]  # stage 3's module units; empty below stage 3
    schedule: GatherSchedule | None  # stage 3's gathers; None below stage 3
    pool: StagingPool
    reducer: GradReducer
    offload: Offload  # where masters, optimizer state and stage 3's shards live (all on the device by default)
    post_step: PostStepGather  # stages 1-2: the all-gathers after each step, and the hooks that wait for them


def build(model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, group: dist.ProcessGroup | None,
          init: Callable[[nn.Module], None] | None, on_grad: Callable[[int, int], None],
          on_gather_failure: Callable[[str], None], grads_on_disk: bool = True) -> Parts:
    """Check the inputs, join the group, and build the parts; `on_grad(target, param)` is the gradient hook,
    `on_gather_failure(why)` what a failed wait for a post-step gather calls first (`PostStepGather`);
    `grads_on_disk`: whether offload to disk may keep the gradient shards there (not on a tp/pp mesh)."""
    if init is None and on_meta(model):
        init = recorded_init(model)  # zero.Init + from_pretrained: the files' weights
    precision = Precision.from_config(config)
    try:  # this rank's own checks, before the group: a failure here reaches every rank (one rank's edit)
        check_materializable(model, init)
        if on_meta(model) and config.stage != 3:  # one script for every stage: meta_init and init= work below 3
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.info("stage %d: the model built on the meta device is materialised whole on every rank "
                         "(only stage 3 materialises it shard by shard)", config.stage)
            materialize_whole(model, init, default_device())
        check_model(model, precision.param_dtype)
    except ModelError as error:
        error_everywhere(error, model, group)
    device = default_device() if on_meta(model) else device_of(model)
    group = group or ensure_process_group(device, timedelta(seconds=config.collective_timeout))
    check_device_matches_group(device, group)
    if device.type == "cuda":  # NCCL's object collectives run on the current device
        torch.cuda.set_device(device)
    comm = Comm.create(group, CommRecorder(), config.collective_timeout, config.rank_check_timeout,
                       scope=declared_scope(group, config.zero_optimization.ranks_per_node))
    switches = StageSwitches.for_stage(config.stage)
    groups = trainable_groups(model, optimizer)  # before any change: a failure leaves all as it was
    check_ranks_agree(comm, model, optimizer, config.to_dict())
    host_short = check_states_fit(comm, config, optimizer, device, [local(p) for g in groups for p in g])
    # Opened before the units: each unit's shards go to the host or disk as soon as it is built.
    stream = agreed(comm, lambda: OffloadBuild(config, comm, optimizer, grads_on_disk, host_short), _SETUP, device,
                    undo=OffloadBuild.close)
    with stream.closed_on_error():  # a retry on the same nvme_path finds the swap directories free
        names, units, schedule, buckets, pool = _build_flats(model, optimizer, groups, config, comm, precision,
                                                             switches, init, device, stream)
        offload = agreed(comm, lambda: stream.finish(optimizer, buckets, units), _SETUP, device)
    reducer = _build_reducer(buckets, units, schedule, comm, pool, config.zero_optimization.overlap_comm, names)
    for t, target in enumerate(reducer.targets):
        for i, p in enumerate(target.params):
            p.register_post_accumulate_grad_hook(lambda _p, t=t, i=i: on_grad(t, i))
    post_step = PostStepGather(buckets, comm, config.zero_optimization.overlap_param_gather, on_gather_failure)
    post_step.install(model)
    _place_params(model, comm, buckets, units, schedule, post_step)
    refuse_resize(model, config.stage)  # resize_token_embeddings would have to rebuild the flat buffers
    return Parts(comm, device, precision, switches, names, buckets, units, schedule, pool, reducer, offload,
                 post_step)


def _build_flats(model: nn.Module, optimizer: torch.optim.Optimizer, groups: list[list[nn.Parameter]],
                 config: Config, comm: Comm, precision: Precision, switches: StageSwitches,
                 init: Callable[[nn.Module], None] | None, device: torch.device, stream: OffloadBuild):
    """The flat buffers (stage 3: the units and their schedule), staging, the optimizer pointed at the masters:
    (names, units, schedule, buckets, pool)."""
    # Before mark_wrapped: its checks (zeroshard.pretrained's keys and shapes) fail with the model still free
    # for the retry their message suggests.
    materialize = Materializer.for_model(model, init, device) if on_meta(model) else None
    mark_wrapped(model)
    names = {id(p): name for name, p in model.named_parameters()}
    units, schedule = [], None
    choose = offload_choice(config, sum(local(p).numel() for g in groups for p in g))
    codecs = wire(comm, config, device)
    if switches.shard_params:
        built = ((lambda unit: agreed(comm, lambda: stream.unit_built(unit), _SETUP, device))
                 if stream.streams else None)
        units, schedule = _build_units(model, groups, config, comm, codecs, precision, materialize, choose, built)
        buckets = [b for unit in units for b in unit.buckets]
    else:
        buckets = _build_buckets(model, groups, config, comm, codecs, precision, switches, choose)
    if precision.mixed:  # frozen parameters and buffers; the buckets' parameters already are (left untouched:
        dtype = precision.param_dtype  # a DTensor's .to() would replace even a tensor of the right dtype)
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
    pool = StagingPool(block_numel((b.flat.padded_numel for b in buckets), per_unit=schedule is not None))
    shard_optimizer(optimizer, [[b for b in buckets if b.param_group == i] for i in range(len(groups))],
                    fuse=device.type in _FUSED_DEVICES)
    return names, units, schedule, buckets, pool


def _build_buckets(model: nn.Module, groups: list[list[nn.Parameter]], config: Config, comm: Comm, codecs: Wire,
                   precision: Precision, switches: StageSwitches, offload: Callable[[int], bool]) -> list[Bucket]:
    """Stages 0-2: size buckets in backward order, started from rank 0's values."""
    zero = config.zero_optimization
    buckets = bucket_params(model, groups, min(zero.reduce_bucket_size, zero.allgather_bucket_size))
    flats = [FlatParams(b.params, comm.world_size, comm.rank) for b in buckets]
    broadcast_from_rank0(comm, model, flats)  # in the model's dtype: masters start from these values
    # Quantized gathers after the step dequantize into the parameters: the master must be a copy of its own.
    weights = codecs.weights if switches.shard_optimizer else None
    built = [Bucket(flat, switches, zero.reduce_scatter, b.group, f"bucket {i}", precision,
                    config.gradient_accumulation_steps, codecs.gradients, weights, offload=offload(flat.numel),
                    own_master=weights is not None)
             for i, (flat, b) in enumerate(zip(flats, buckets))]
    _low_rank(config, precision, built)
    return built


def _low_rank(config: Config, precision: Precision, buckets: list[Bucket]) -> None:
    """PowerSGD's state for each bucket (stages 0-1; the config refuses it at 2-3), one seed sequence for all."""
    settings = config.communication_compression.gradients
    if settings.codec != "powersgd":
        return
    if precision.param_dtype == torch.float16:
        raise ConfigError("communication_compression.gradients.codec \"powersgd\" cannot run with fp16.enabled: "
                          "its error feedback carries each step's loss-scaled gradients into the next, whose loss "
                          "scale may differ, so what it adds back would be off by their ratio. Train in bf16 "
                          "(\"bf16\": {\"enabled\": true}) or fp32 with powersgd, or use another codec")
    seeds = QSeeds()
    for bucket in buckets:
        bucket.powersgd = PowerSgd(bucket.flat.shapes, settings, seeds, bucket.flat.device)


def _build_units(model: nn.Module, groups: list[list[nn.Parameter]], config: Config, comm: Comm, codecs: Wire,
                 precision: Precision, materialize: Materializer | None,
                 offload: Callable[[int], bool], built: Callable[[Unit], None] | None = None,
                 ) -> tuple[list[Unit], GatherSchedule]:
    """Stage 3: plan the units, then flatten, broadcast and shard them one by one (`built(unit)` after each)."""
    zero, gathers = config.zero_optimization, Gathers(comm, codecs.weights, codecs.node)
    plans = plan_units(model, unit_modules(model, zero.stage3_wrap_classes, zero.stage3_auto_wrap_min_params))
    units = build_units(plans, groups, comm, zero.stage3_param_persistence_threshold, materialize, precision,
                        config.gradient_accumulation_steps, zero.reduce_scatter, codecs.gradients, offload,
                        own_master=zero.offload_param.device != "none", built=built)
    if materialize:  # modules that hold buffers but no parameters
        materialize([m for m in model.modules() if any(b.is_meta for b in m.buffers(recurse=False))], [])
    # The units' flat buffers were broadcast before sharding, one by one.
    broadcast_from_rank0(comm, model, [], [f for u in units for f in u.flats])
    schedule = GatherSchedule(units, gathers, zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size,
                              zero.stage3_max_reuse_distance)
    schedule.install(model)
    ModuleStateHooks(model, schedule).install()  # module.state_dict() gives full tensors, never empty ones
    sync_generation(model, comm)  # ranks that stop generating at different lengths keep gathering together
    return units, schedule


def _build_reducer(buckets: list[Bucket], units: list[Unit], schedule: GatherSchedule | None, comm: Comm,
                   pool: StagingPool, overlap: bool, names: dict[int, str]) -> GradReducer:
    if schedule is None:
        return GradReducer(buckets, comm, pool, overlap, names)
    # Stage 3 reduces per unit, as soon as one is ready, and releases its parameters.
    reduced = [i for i, unit in enumerate(units) if unit.params]
    return GradReducer([units[i] for i in reduced], comm, pool, overlap, names,
                       ordered=False, on_launch=lambda k: schedule.on_reduced(reduced[k]))


def broadcast_from_rank0(comm: Comm, model: nn.Module, flats: list[FlatParams],
                         broadcast_already: list[FlatParams] = ()) -> None:
    """Start every rank from rank 0's values: `flats`, the parameters in no flat buffer, module buffers."""
    in_flats = {id(p) for f in [*flats, *broadcast_already] for p in f.params}
    others = [local(p).data for p in model.parameters() if id(p) not in in_flats]
    with torch.no_grad():
        for tensor in [f.data for f in flats] + others:
            broadcast(comm, tensor, src=0)
    broadcast_buffers(comm, model)


def broadcast_buffers(comm: Comm, model: nn.Module) -> None:
    """Keep module buffers (BatchNorm statistics, say) equal to rank 0's, as DDP does each forward."""
    if comm.world_size > 1:
        with torch.no_grad():
            for buffer in model.buffers():
                broadcast(comm, buffer, src=0)


def _place_params(model: nn.Module, comm: Comm, buckets: list[Bucket], units: list[Unit],
                  schedule: GatherSchedule | None, post_step: PostStepGather) -> None:
    """Tell each parameter where it lives, for `zeroshard.gathered_parameters`."""
    unit_of = {id(p): i for i, unit in enumerate(units) for f in unit.gathered_flats for p in f.params}
    owner_of = {id(p): b for b in buckets for p in b.params}
    for p in model.parameters():
        place(p, Placement(comm, owner_of.get(id(p)), schedule, unit_of.get(id(p)), post_step))
