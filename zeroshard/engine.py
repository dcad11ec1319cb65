"""Engine: wraps the model and optimizer; forward, backward and step for ZeRO stages 0-3.

Precision follows the config. In fp32 the parameters are their own master
copy. With `bf16` or `fp16` enabled, the parameters the optimizer trains are
cast to 16 bits (frozen parameters and floating-point buffers too, as
DeepSpeed does), floating-point inputs are cast to that dtype (outputs are
returned as the model produces them), and each rank's optimizer updates an
fp32 master (its shard at stage >= 1) created from the model's original
values. Gradients are reduced in `communication_data_type` and summed over
micro-steps in fp32. A step is: fp16 overflow check (one all-reduce of a
flag), unscale, clip, optimizer step on the fp32 master, cast to 16 bits,
all-gather (stages 1-2).

fp16 scales the loss in `backward`; a step whose gradients hold inf or nan
on any rank is skipped on every rank (weights and optimizer state untouched,
gradients dropped, `global_steps` and `skipped_steps` advance, the loss scale
is lowered as DeepSpeed's dynamic scaler does) and logged with the step and
the new scale; `engine.global_grad_norm` is then inf.
"""

from __future__ import annotations

import logging
import math
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard import checkpoint
from zeroshard.agreement import check_ranks_agree
from zeroshard.bucketing import bucket_params
from zeroshard.buffers import BufferPool
from zeroshard.comm import (
    CollectiveError, Comm, CommRecorder, OpStats, all_reduce, broadcast, ensure_process_group,
)
from zeroshard.config import Config
from zeroshard.flat import FlatParams
from zeroshard.from_config import choose_optimizer, config_facts, schedule_for
from zeroshard.gather_schedule import GatherSchedule
from zeroshard.gathered import Placement, place
from zeroshard.materialize import Materializer, check_materializable, default_device, on_meta
from zeroshard.memory import model_state_bytes
from zeroshard.module_unit import ModuleUnit, build_module_units
from zeroshard.optim import shard_optimizer
from zeroshard.precision import LossScaler, Precision, cast_inputs
from zeroshard.reducer import GradReducer
from zeroshard.unit import ShardedUnit, StageSwitches
from zeroshard.validate import (
    check_device_matches_group, check_model, device_of, mark_wrapped, trainable_groups,
)
from zeroshard.wrapping import plan_units, unit_modules

log = logging.getLogger(__name__)

# Devices whose torch optimizers have fused kernels for Adam, AdamW and SGD.
_FUSED_DEVICES = {"cpu", "cuda"}


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | dict | str | Path | None = None,
    group: dist.ProcessGroup | None = None,
    wrap: list[type[nn.Module]] | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> "Engine":
    """Wrap `model` and `optimizer` for ZeRO training on `group` (default: the world).

    The default process group is initialized from torchrun's environment if
    it is not yet. Rank 0's parameter values are broadcast to every rank.
    `wrap` (stage 3): module classes whose instances each form a unit, as
    the config key `zero_optimization.stage3_wrap_classes`.
    `init` (stage 3, a model built under `torch.device("meta")`): `init(module)`
    initialises the parameters a module holds directly; the model is
    materialised unit by unit on this rank's device, keeping only shards.
    Without `optimizer`, the config's "optimizer" block builds one; its
    "scheduler" block builds `engine.lr_scheduler`, stepped by `engine.step()`
    after each optimizer step, as DeepSpeed does.
    """
    config = Config.load(config if config is not None else {}, config_facts(model, group))
    if wrap:
        config = _with_wrap_classes(config, wrap)
    engine = Engine(model, choose_optimizer(model, optimizer, config), config, group, init)
    engine.lr_scheduler = schedule_for(config, engine.optimizer)
    return engine


def _with_wrap_classes(config: Config, wrap: list[type[nn.Module]]) -> Config:
    zero = config.zero_optimization
    names = tuple(cls.__name__ for cls in wrap)
    if zero.stage != 3:
        raise ValueError(f"wrap={list(names)} chooses stage 3's units, but the config's "
                         f"zero_optimization.stage is {zero.stage}; set it to 3 or drop wrap")
    if zero.stage3_wrap_classes and zero.stage3_wrap_classes != names:
        raise ValueError(f"wrap={list(names)} and zero_optimization.stage3_wrap_classes="
                         f"{list(zero.stage3_wrap_classes)} disagree; give the units in one place")
    return config.model_copy(update={"zero_optimization": zero.model_copy(update={"stage3_wrap_classes": names})})


class Engine:
    """The training loop's handle: `loss = engine(*batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
                 group: dist.ProcessGroup | None = None, init: Callable[[nn.Module], None] | None = None):
        check_materializable(model, init, config.stage)
        device = default_device() if on_meta(model) else device_of(model)
        materialize = Materializer(init, device) if on_meta(model) else None
        self.precision = Precision.from_config(config)
        check_model(model, self.precision.param_dtype)
        group = group or ensure_process_group(device, timedelta(seconds=config.collective_timeout))
        check_device_matches_group(device, group)
        if device.type == "cuda":  # NCCL's object collectives run on the current device
            torch.cuda.set_device(device)
        self.module, self.optimizer, self.config = model, optimizer, config
        self.num_params = sum(p.numel() for p in model.parameters())  # as built; stage 3 empties them
        self.comm = Comm.create(group, CommRecorder(), config.collective_timeout)
        # Ranks running different units would make gloo abort on a message size: check first.
        self.comm.check_order = config.stage == 3 and dist.get_backend(group) == "gloo"
        self.switches = StageSwitches.for_stage(config.stage)
        self.micro_steps = 0  # backward passes so far
        self.global_steps = 0  # optimizer steps so far
        self.global_grad_norm: float | None = None  # of the last step when clipping is on; inf if skipped
        self.skipped_steps = 0  # optimizer steps skipped for fp16 overflow
        self.scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self._device = device
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None  # from the config's block
        self._backward_pending = False
        self._failed: str | None = None  # why this engine can no longer train, after a failed backward

        groups = trainable_groups(model, optimizer)  # before any change: a failure leaves all as it was
        check_ranks_agree(self.comm, model, optimizer, config.to_dict())
        mark_wrapped(model)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.module_units: list[ModuleUnit] = []
        self.schedule: GatherSchedule | None = None
        if self.switches.shard_params:
            self.module_units = self._build_module_units(model, groups, materialize)
            self.units = [s for mu in self.module_units for s in mu.segments]
        else:
            self.units = self._build_units(model, groups)
        if self.precision.mixed:  # frozen parameters and buffers; the units' parameters already are
            model.to(self.precision.param_dtype)
        # Stage 3 stages each segment of a unit at once, small ones (biases, norms) too:
        # blocks of exactly the size asked for, reused by the next unit of the same shape.
        block = 0 if self.switches.shard_params else max((u.flat.padded_numel for u in self.units), default=0)
        self.pool = BufferPool(block_numel=block)
        units_of_group = [[u for u in self.units if u.param_group == i] for i in range(len(groups))]
        shard_optimizer(optimizer, units_of_group, fuse=device.type in _FUSED_DEVICES)
        self.reducer = self._build_reducer()
        self._register_hooks()
        self._place_params(model)
        if self.comm.rank == 0:
            log.info("zeroshard stage %d on %d ranks: %d units, %d elements",
                     config.stage, self.comm.world_size, len(self.units),
                     sum(u.flat.numel for u in self.units))

    # -- construction -------------------------------------------------------

    def _build_units(self, model: nn.Module, groups: list[list[nn.Parameter]]) -> list[ShardedUnit]:
        zero = self.config.zero_optimization
        max_numel = min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        n, rank = self.comm.world_size, self.comm.rank
        buckets = bucket_params(model, groups, max_numel)
        flats = [FlatParams(b.params, n, rank) for b in buckets]
        self._broadcast_from_rank0(model, flats)  # in the model's dtype: masters start from these values
        return [ShardedUnit(flat, self.switches, zero.reduce_scatter, b.group, f"bucket {i}", self.precision,
                            self.config.gradient_accumulation_steps) for i, (flat, b) in enumerate(zip(flats, buckets))]

    def _build_module_units(self, model: nn.Module, groups: list[list[nn.Parameter]],
                            materialize: Materializer | None) -> list[ModuleUnit]:
        """Stage 3: plan the units, then flatten, broadcast and shard them one by one."""
        zero = self.config.zero_optimization
        plans = plan_units(model, unit_modules(model, zero.stage3_wrap_classes, zero.stage3_auto_wrap_min_params))
        units = build_module_units(plans, groups, self.comm, zero.stage3_param_persistence_threshold,
                                   materialize, self.precision, self.config.gradient_accumulation_steps)
        if materialize:  # modules that hold buffers but no parameters
            materialize([m for m in model.modules() if any(b.is_meta for b in m.buffers(recurse=False))], [])
        # The units' flat buffers were broadcast before sharding, one by one.
        self._broadcast_from_rank0(model, [], [f for u in units for f in u.flats])
        self.schedule = GatherSchedule(units, self.comm, zero.stage3_max_live_parameters,
                                       zero.stage3_prefetch_bucket_size)
        self.schedule.install(model)
        return units

    def _build_reducer(self) -> GradReducer:
        overlap = self.config.zero_optimization.overlap_comm
        if self.schedule is None:
            return GradReducer(self.units, self.comm, self.pool, overlap, self._names)
        # Stage 3 reduces per module unit, as soon as one is ready, and releases its parameters.
        reduced = [i for i, mu in enumerate(self.module_units) if mu.params]
        return GradReducer([self.module_units[i] for i in reduced], self.comm, self.pool, overlap, self._names,
                           ordered=False, on_launch=lambda k: self.schedule.on_reduced(reduced[k]))

    def _broadcast_from_rank0(self, model: nn.Module, flats: list[FlatParams],
                              broadcast_already: list[FlatParams] = ()) -> None:
        """Start every rank from rank 0's values: `flats`, the parameters in no flat buffer, module buffers."""
        in_flats = {id(p) for f in [*flats, *broadcast_already] for p in f.params}
        others = [p.data for p in model.parameters() if id(p) not in in_flats]
        with torch.no_grad():
            for tensor in [f.data for f in flats] + others:
                broadcast(self.comm, tensor, src=0)
        self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        """Keep module buffers (BatchNorm statistics, say) equal to rank 0's, as DDP does each forward."""
        if self.comm.world_size > 1:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    broadcast(self.comm, buffer, src=0)

    def _place_params(self, model: nn.Module) -> None:
        """Tell each parameter where it lives, for `zeroshard.gathered_parameters`."""
        unit_of = {id(p): i for i, mu in enumerate(self.module_units) for f in mu.gathered_flats for p in f.params}
        owner_of = {id(p): u for u in self.units for p in u.params}
        for p in model.parameters():
            place(p, Placement(self.comm, owner_of.get(id(p)), self.schedule, unit_of.get(id(p))))

    def _register_hooks(self) -> None:
        for ui, unit in enumerate(self.reducer.units):
            for pi, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(lambda _p, ui=ui, pi=pi: self._on_grad(ui, pi))

    def _on_grad(self, unit_index: int, param_index: int) -> None:
        if not self.reducer.active:
            raise RuntimeError(
                "a gradient was accumulated outside engine.backward(loss); call "
                "engine.backward(loss) instead of loss.backward() so zeroshard can reduce it"
            )
        self.reducer.on_grad(unit_index, param_index)

    # -- training loop ------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._check_usable()
        self.comm.trace.begin(self.micro_steps)
        if self.precision.mixed:
            args, kwargs = cast_inputs(args, self.precision.param_dtype), cast_inputs(kwargs, self.precision.param_dtype)
        try:
            self._broadcast_buffers()
            return self.module(*args, **kwargs)
        except CollectiveError as exc:  # a stage-3 gather failed: ranks are out of step
            self._fail(f"a collective failed in forward ({exc})")
            raise

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per rank per micro-step, as configured (None if the config leaves it out)."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks: micro-batch x accumulation steps x N."""
        micro = self.config.train_micro_batch_size_per_gpu
        return None if micro is None else micro * self.gradient_accumulation_steps * self.comm.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (this rank's mean over its micro-batch) and reduce as the stage says.

        Stages 0 and 1 communicate only in the last micro-step of the window;
        stage 2 reduce-scatters in every micro-step, so full gradients never
        outlive one backward. With fp16 the loss is multiplied by the loss
        scale first (in fp32).
        """
        self._check_usable()
        if self._backward_pending:
            raise RuntimeError("engine.backward() was called twice without engine.step() in between; "
                               "call engine.step() after every backward, as DeepSpeed does")
        reduce_now = self.is_gradient_accumulation_boundary() or self.switches.shard_grads
        scale = 1.0 / (self.comm.world_size * self.gradient_accumulation_steps)
        self.reducer.begin(reduce_now, scale)
        if self.schedule is not None:
            self.schedule.in_backward = True
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        try:
            loss.backward()
            self.reducer.finish()
        except BaseException as exc:
            self._fail(f"a backward failed on this rank ({type(exc).__name__}: {exc})")
            raise
        finally:
            if self.schedule is not None:
                self.schedule.in_backward = False
        if self.schedule is not None:
            self.schedule.end_backward()
        if not reduce_now:
            for unit in self.units:
                unit.accumulate_micro_step()
        self._backward_pending = True

    def _fail(self, why: str) -> None:
        """Drop this window's partial gradients; the engine refuses to go on (ranks may be out of step)."""
        self._failed = why
        try:
            self.reducer.abandon()
        except CollectiveError:  # the stuck collective itself: nothing more to learn from it
            pass
        for unit in self.units:
            unit.zero_grad(self.pool)
        if self.schedule is not None:
            self.schedule.forget()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"this engine cannot continue: {self._failed}. Its collectives may be out of "
                               "step with the other ranks; restart the job (from a checkpoint)")
        for unit in self.units:
            if unit.switches.shard_params:  # its parameters are empty between uses
                continue
            if unit.params[0].data_ptr() != unit.flat.data.data_ptr():
                raise RuntimeError(f"parameter '{self._names[id(unit.params[0])]}' no longer lives in "
                                   "zeroshard's flat buffer (model.to(), .half() or .cuda() after initialize "
                                   "replaces parameters); move and cast the model before zeroshard.initialize")

    def step(self) -> None:
        """End a micro-step; at the accumulation boundary unscale, clip, update and all-gather.

        fp16: if any rank's gradients overflowed, the step is skipped on every rank.
        """
        self._check_usable()
        if not self._backward_pending:
            raise RuntimeError("engine.step() was called without engine.backward(loss) since the last step")
        self._backward_pending = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.scaler is not None and self._overflowed():
            self._skip_step()
            return
        # fp32 gradients for the optimizer: new tensors, freed after the step, when gradients are 16-bit.
        grads = [unit.master_grad() for unit in self.units]
        if self.loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        if self.config.gradient_clipping > 0:
            self._clip_gradients(grads, self.config.gradient_clipping)
        # The optimizer sees gradients only during its step, so the user's optimizer.zero_grad()
        # between micro-steps cannot touch the window's accumulating gradients.
        for unit, grad in zip(self.units, grads):
            unit.master.grad = grad
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for unit in self.units:
            unit.master.grad = None
            unit.cast_master_to_params()
        for pending in [unit.gather_params(self.comm) for unit in self.units if unit.gathers_after_step]:
            pending.wait()
        self._end_step(overflow=False)

    def _end_step(self, overflow: bool) -> None:
        for unit in self.units:
            unit.zero_grad(self.pool)
        step = self.global_steps
        self.global_steps += 1
        if self.scaler is not None:
            self.scaler.update(overflow, step)

    def _overflowed(self) -> bool:
        """Whether any rank's reduced gradients hold inf or nan (one all-reduce of a flag)."""
        flag = torch.zeros((), device=self._device)
        for unit in self.units:
            flag += torch.isfinite(unit.grad_shard).logical_not().any()
        all_reduce(self.comm, flag, async_op=False)
        return flag.item() > 0

    def _skip_step(self) -> None:
        """fp16 overflow: drop this window's gradients, leave weights and optimizer state as they are."""
        step, old_scale = self.global_steps, self.loss_scale
        self.skipped_steps += 1
        self.global_grad_norm = math.inf
        self._end_step(overflow=True)
        if self.comm.rank == 0:
            log.warning("fp16 gradients overflowed at step %d: step skipped, loss scale %g -> %g",
                        step, old_scale, self.loss_scale)

    def _clip_gradients(self, grads: list[torch.Tensor], max_norm: float) -> None:
        """Scale `grads` so that their global L2 norm (over all shards) is at most `max_norm`."""
        if not grads:
            return
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        if self.switches.shard_optimizer:  # each rank holds only its shard: sum over ranks
            all_reduce(self.comm, squares, async_op=False)
        norm = math.sqrt(squares.item())
        self.global_grad_norm = norm
        coef = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)

    # -- checkpoints --------------------------------------------------------

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> Path:
        """Write a sharded checkpoint to `save_dir/tag` (default tag `global_step<N>`) and point
        `save_dir/latest` at it (unless `save_latest` is false); returns the tag's directory. Every rank must call it, at an
        accumulation boundary. `client_state`: your own plain data (tensors, numbers, strings,
        lists, dicts), given back by `load_checkpoint`; rank 0's is the one stored.
        See `zeroshard/checkpoint.py`."""
        return checkpoint.save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, *, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[Path, dict]:
        """Load a checkpoint written by any world size, stage or dtype; returns (its directory, client_state).

        `tag` None: the one `load_dir/latest` names (or `load_dir` itself if it is a tag's directory).
        The flags are keyword-only: DeepSpeed's third positional argument is `load_module_strict`.
        As DeepSpeed's: `load_optimizer_states=False` keeps this engine's optimizer state,
        `load_lr_scheduler_states=False` its LR scheduler; `load_module_only=True` loads the
        weights alone (no counters, loss scale, optimizer or scheduler), to fine-tune from them.
        Every rank must call it; on error every rank raises `CheckpointError` and the engine is
        unchanged.
        """
        return checkpoint.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                               load_module_only)

    # -- reports ------------------------------------------------------------

    def comm_stats(self) -> dict[str, OpStats]:
        """Per logical collective: calls, bytes (logical full buffer), blocked seconds, algorithms."""
        return self.comm.recorder.snapshot()

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model states this rank holds: params, grads, master, optimizer, buffers."""
        frozen = [f for mu in self.module_units for f in mu.frozen]
        return model_state_bytes(self.module, self.units, self.optimizer, self.pool, frozen)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete model state dict (full tensors, copies): on every rank, or on rank 0 only.

        At stage 3 every rank must call it: the units are gathered one at a time.
        """
        keep = not rank0_only or self.comm.rank == 0
        if self.schedule is None:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()} if keep else {}
        state = self.module.state_dict(keep_vars=True)
        keys_of: dict[int, list[str]] = {}
        for key, tensor in state.items():
            keys_of.setdefault(id(tensor), []).append(key)
        full: dict[str, torch.Tensor] = {}
        for i, unit in enumerate(self.module_units):
            self.schedule.need(i)
            for p in (p for flat in unit.gathered_flats for p in flat.params):
                for key in keys_of.get(id(p), []) if keep else []:
                    full[key] = p.detach().clone()
            self.schedule.release(i)
        if not keep:
            return {}
        return {key: full[key] if key in full else tensor.detach().clone() for key, tensor in state.items()}
