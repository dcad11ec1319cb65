"""`initialize`, step 7: the engine's parts, made from the checked inputs, the plan and the agreement.

Everything here runs once, on every rank in the same order, after every
check and the agreement (`initialize.py`): the ties across pipeline stages;
a model on the meta device gets its memory (`_materializer`, the one place:
below stage 3 whole, at stage 3 unit by unit); the swap directories open;
the planned parameters are flattened, broadcast from rank 0 and sharded; the
user's optimizer is pointed at the master shards; hooks are installed.

The hooks exist before the engine that answers them: they call through
`EngineCalls`, a holder in the parts whose two callables `Engine.__init__`
sets to its own methods. So the engine receives whole parts and builds
nothing, and nothing built is patched afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm import Comm, broadcast
from zeroshard.comm.compress.powersgd import PowerSgd, QSeeds
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.switches import StageSwitches
from zeroshard.core.bucketing import BucketPlan
from zeroshard.core.faults import agreed
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.optim import shard_optimizer
from zeroshard.core.param_gather import PostStepGather
from zeroshard.core.precision import Precision
from zeroshard.core.reducer import GradReducer
from zeroshard.core.staging import StagingPool
from zeroshard.engine.checks import Checked
from zeroshard.engine.step_update import DelayedUpdate, delayed_update
from zeroshard.engine.join import Joined
from zeroshard.engine.layout import Layout
from zeroshard.engine.load import Loaded
from zeroshard.engine.offload import Offload, OffloadBuild, offload_choice
from zeroshard.engine.wire import Wire, wire
from zeroshard.engine.validate import mark_wrapped
from zeroshard.parallel.activation_checkpointing import ActivationCheckpointing
from zeroshard.parallel.mesh import Mesh
from zeroshard.stage3.gathered import Placement, place
from zeroshard.stage3.gathers import Gathers
from zeroshard.stage3.generation import sync_generation
from zeroshard.stage3.materialize import Materializer, materialize_whole, on_meta
from zeroshard.plan.owners import Owners
from zeroshard.plan.staging import block_numel
from zeroshard.stage3.module_state import ModuleStateHooks
from zeroshard.stage3.resize import refuse_resize
from zeroshard.stage3.schedule import GatherSchedule
from zeroshard.stage3.unit import Unit, build_units
from zeroshard.stage3.wrapping import UnitPlan

log = logging.getLogger("zeroshard.config")

# What a rank that cannot open or fill its swap files was doing, in the error every rank raises.
_SETUP = "setting up offload"
# Devices whose torch optimizers have fused kernels for Adam, AdamW and SGD.
_FUSED_DEVICES = {"cpu", "cuda"}


@dataclass
class EngineCalls:
    """What the hooks call on the engine, which does not exist yet when they are installed: `Engine.__init__`
    sets both to its own methods."""

    on_grad: Callable[[int, int], None] | None = None  # (reducer target, parameter index): a gradient is ready
    on_gather_failure: Callable[[str], None] | None = None  # (why): a wait for a post-step gather failed


@dataclass
class Parts:
    """What an engine is made of, built once."""

    module: nn.Module  # the user's module (inside torch.compile(model): compiled in place)
    optimizer: torch.optim.Optimizer  # the user's (or the config's), pointed at the master shards
    num_params: int  # the model's parameter elements as given (stage 3 then empties them)
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
    delayed: DelayedUpdate | None  # offload_optimizer.delayed_update: the CPU step in the background
    checkpointing: ActivationCheckpointing  # zeroshard.deepspeed.checkpointing.checkpoint's block, over tp
    mesh: Mesh | None = None
    cross: object | None = None  # parallel.cross.CrossParallel on a mesh: ties, tp and pp reductions
    calls: EngineCalls = field(default_factory=EngineCalls)


def build(loaded: Loaded, joined: Joined, checked: Checked, layout: Layout, host_short: bool, mesh: Mesh | None,
          tied: dict[str, str] | None) -> Parts:
    """The parts of an engine over `loaded`'s model and optimizer; `host_short`: the agreement's verdict on
    host memory (`memory_fit.check_states_fit`)."""
    model, optimizer, config, comm, device = loaded.model, loaded.optimizer, loaded.config, joined.comm, joined.device
    num_params = sum(p.numel() for p in model.parameters())
    cross = _cross(mesh, model, tied, config)  # before the flat buffers: ties start from the lowest stage's values
    precision, switches, calls = checked.precision, StageSwitches.for_stage(config.stage), EngineCalls()
    # Opened before the units: each unit's shards go to the host or disk as soon as it is built.
    grads_on_disk = mesh is None and not config.zero_optimization.offload_optimizer.delayed_update
    stream = agreed(comm, lambda: OffloadBuild(config, comm, optimizer, grads_on_disk, host_short), _SETUP, device,
                    undo=OffloadBuild.close)
    with stream.closed_on_error():  # a retry on the same nvme_path finds the swap directories free
        names, units, schedule, buckets, pool = _build_flats(model, optimizer, checked, layout, config, comm,
                                                             switches, device, stream)
        offload = agreed(comm, lambda: stream.finish(optimizer, buckets, units), _SETUP, device)
    reducer = _build_reducer(buckets, units, schedule, comm, pool, config.zero_optimization.overlap_comm, names)
    for t, target in enumerate(reducer.targets):
        for i, p in enumerate(target.params):
            p.register_post_accumulate_grad_hook(lambda _p, t=t, i=i: calls.on_grad(t, i))
    post_step = PostStepGather(buckets, comm, config.zero_optimization.overlap_param_gather,
                               lambda why: calls.on_gather_failure(why))
    post_step.install(model)
    _place_params(model, comm, buckets, units, schedule, post_step)
    refuse_resize(model, config.stage)  # resize_token_embeddings would have to rebuild the flat buffers
    delayed = delayed_update(config, offload.tiers, buckets)
    checkpointing = ActivationCheckpointing(config.activation_checkpointing, cross.tp_comm() if cross else None)
    if loaded.compiled_call is not None:  # compiled in place once built: a failed build leaves the module as it was
        model._compiled_call_impl = loaded.compiled_call
    return Parts(model, optimizer, num_params, comm, device, precision, switches, names, buckets, units, schedule,
                 pool, reducer, offload, post_step, delayed, checkpointing, mesh, cross, calls)


def _cross(mesh: Mesh | None, model: nn.Module, tied: dict[str, str] | None, config: Config):
    """The mesh's reductions across tp and pp (ties agreed over the world); None without a mesh."""
    if mesh is None:
        return None
    from zeroshard.parallel.cross import CrossParallel  # here: `import zeroshard` stays free of DTensor (0.7 s)

    return CrossParallel(mesh, model, tied or {}, config.collective_timeout, config.rank_check_timeout)


def _materializer(model: nn.Module, init: Callable[[nn.Module], None] | None, stage: int,
                  device: torch.device) -> Materializer | None:
    """Memory for a model built on the meta device: below stage 3, where every rank holds the whole model, all
    at once; at stage 3 the `Materializer` that initialises each unit as it is built. None for a real model."""
    if not on_meta(model):
        return None
    if stage == 3:
        return Materializer.for_model(model, init, device)
    if dist.get_rank() == 0:  # one script for every stage: meta_init and init= work below 3
        log.info("stage %d: the model built on the meta device is materialised whole on every rank "
                 "(only stage 3 materialises it shard by shard)", stage)
    materialize_whole(model, init, device)
    return None


def _build_flats(model: nn.Module, optimizer: torch.optim.Optimizer, checked: Checked, layout: Layout,
                 config: Config, comm: Comm, switches: StageSwitches, device: torch.device, stream: OffloadBuild):
    """The flat buffers (stage 3: the units and their schedule), staging, the optimizer pointed at the masters:
    (names, units, schedule, buckets, pool)."""
    # Before mark_wrapped: its checks (zeroshard.pretrained's keys and shapes) fail with the model still free
    # for the retry their message suggests.
    materialize = _materializer(model, checked.init, config.stage, device)
    mark_wrapped(model)
    names = {id(p): name for name, p in model.named_parameters()}
    units, schedule, groups, precision = [], None, checked.groups, checked.precision
    choose = offload_choice(config, sum(local(p).numel() for g in groups for p in g))
    owned = _owners(checked.whole, comm.world_size, switches.shard_optimizer)
    codecs = wire(comm, config, device)
    if switches.shard_params:
        built = ((lambda unit: agreed(comm, lambda: stream.unit_built(unit), _SETUP, device))
                 if stream.streams else None)
        units, schedule = _build_units(model, layout.units, groups, config, comm, codecs, precision, materialize,
                                       choose, built, owned)
        buckets = [b for unit in units for b in unit.buckets]
    else:
        buckets = _build_buckets(model, layout.buckets, config, comm, codecs, precision, switches, choose, owned)
    if precision.mixed:  # frozen parameters and buffers; the buckets' parameters already are (left untouched:
        dtype = precision.param_dtype  # a DTensor's .to() would replace even a tensor of the right dtype)
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
    pool = StagingPool(block_numel((b.flat.padded_numel for b in buckets), per_unit=schedule is not None))
    shard_optimizer(optimizer, [[b for b in buckets if b.param_group == i] for i in range(len(groups))],
                    checked.whole, fuse=device.type in _FUSED_DEVICES)
    return names, units, schedule, buckets, pool


def _build_buckets(model: nn.Module, plans: list[BucketPlan], config: Config, comm: Comm, codecs: Wire,
                   precision: Precision, switches: StageSwitches, offload: Callable[[int], bool],
                   owned: Callable[[int, list[nn.Parameter]], list[int] | None]) -> list[Bucket]:
    """Stages 0-2: the planned buckets, started from rank 0's values."""
    zero = config.zero_optimization
    flats = [FlatParams(b.params, comm.world_size, comm.rank, owners=owned(b.group, b.params)) for b in plans]
    broadcast_from_rank0(comm, model, flats)  # in the model's dtype: masters start from these values
    # Quantized gathers after the step dequantize into the parameters: the master must be a copy of its own.
    weights = codecs.weights if switches.shard_optimizer else None
    low_rank = _low_rank(config)
    return [Bucket(flat, switches, zero.reduce_scatter, b.group, f"bucket {i}", precision,
                   config.gradient_accumulation_steps, codecs.gradients, weights, offload=offload(flat.numel),
                   own_master=weights is not None, powersgd=low_rank(flat))
            for i, (flat, b) in enumerate(zip(flats, plans))]


def _owners(whole: list[bool], world_size: int, sharded: bool
            ) -> Callable[[int | None, list[nn.Parameter]], list[int] | None]:
    """The owning rank of each parameter of a flat buffer whose group's optimizer needs tensors whole (None:
    split as usual), one count of owned elements per param group over the whole model (`plan/owners.py`;
    `estimate/owned.py` prices a group so)."""
    owners = [Owners(world_size) for _ in whole]

    def owned(group: int | None, params: list[nn.Parameter]) -> list[int] | None:
        if not sharded or group is None or not whole[group]:
            return None
        return owners[group].assign([local(p).numel() for p in params])
    return owned


def _low_rank(config: Config) -> Callable[[FlatParams], PowerSgd | None]:
    """PowerSGD's state for each bucket's flat buffer (stages 0-1; the config refuses it at 2-3, and fp16 is
    refused by `checks.check_low_rank`), one seed sequence for all; None without it."""
    settings = config.communication_compression.gradients
    if settings.codec != "powersgd":
        return lambda flat: None
    seeds = QSeeds()
    return lambda flat: PowerSgd(flat.shapes, settings, seeds, flat.device)


def _build_units(model: nn.Module, plans: list[UnitPlan], groups: list[list[nn.Parameter]], config: Config,
                 comm: Comm, codecs: Wire, precision: Precision, materialize: Materializer | None,
                 offload: Callable[[int], bool], built: Callable[[Unit], None] | None = None,
                 owned: Callable[[int | None, list[nn.Parameter]], list[int] | None] = lambda group, params: None,
                 ) -> tuple[list[Unit], GatherSchedule]:
    """Stage 3: flatten, broadcast and shard the planned units one by one (`built(unit)` after each)."""
    zero, gathers = config.zero_optimization, Gathers(comm, codecs.weights, codecs.node)
    units = build_units(plans, groups, comm, zero.stage3_param_persistence_threshold, materialize, precision,
                        config.gradient_accumulation_steps, zero.reduce_scatter, codecs.gradients, offload,
                        own_master=zero.offload_param.device != "none", built=built, owned=owned)
    if materialize:  # modules that hold buffers but no parameters
        materialize([m for m in model.modules() if any(b.is_meta for b in m.buffers(recurse=False))], [])
    # The units' flat buffers were broadcast before sharding, one by one.
    broadcast_from_rank0(comm, model, [], [f for u in units for f in u.flats])
    schedule = GatherSchedule(units, gathers, zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size,
                              zero.stage3_max_reuse_distance, next((f.device for u in units for f in u.flats),
                                                                   None))
    schedule.install(model)
    ModuleStateHooks(model, schedule).install()  # module.state_dict() gives full tensors, never empty ones
    sync_generation(model, comm)  # ranks that stop generating at different lengths keep gathering together
    return units, schedule


def _build_reducer(buckets: list[Bucket], units: list[Unit], schedule: GatherSchedule | None, comm: Comm,
                   pool: StagingPool, overlap: bool, names: dict[int, str]) -> GradReducer:
    if schedule is None:
        return GradReducer(buckets, comm, pool, overlap, names)
    # Stage 3 reduces per unit, once every rank has it ready: the schedule's rounds launch it.
    reduced = [i for i, unit in enumerate(units) if unit.params]
    reducer = GradReducer([units[i] for i in reduced], comm, pool, overlap, names,
                          ordered=False, on_launch=lambda k: schedule.on_reduced(reduced[k]))
    schedule.attach(reducer, reduced)
    return reducer


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
