"""`zeroshard.accelerate.Accelerator`: Accelerate's `Accelerator`, its model trained by zeroshard's engine.

An Accelerate script runs as it is (launch, dataloader sharding, gather,
logging, `accumulate`, `save_state`) with this class in place of
accelerate's and a DeepSpeed-style `config=`; what Accelerate's DeepSpeed
path does with DeepSpeed (which it needs installed), this class does with
`zeroshard.deepspeed.initialize`:

- `prepare` gives the one model, its optimizer and the LR scheduler on it to
  the engine (not to autocast or DDP: the engine casts, shards and reduces)
  and returns the engine and views of the optimizer and scheduler whose own
  `step()` and `zero_grad()` do nothing (`views.py`). Dataloaders and
  everything else go to Accelerate's `prepare`, sharded as always.
- `backward(loss)` is the engine's backward and step, as Accelerate's
  `DeepSpeedEngineWrapper`: the engine divides by the accumulation steps,
  and reduces, clips and steps at the window's end. `accumulate` and
  `no_sync` keep Accelerate's counting (`sync_gradients`) without the
  engine's `no_sync` (the engine reduces where its stage says, and
  `reduce_once_per_window` holds stages 2-3's); the two counts must agree.
- `clip_grad_norm_` returns the norm the engine measured at its step; it
  clips with the config's `gradient_clipping`, so another max_norm is an error.
- `save_state` / `load_state` write the engine's sharded checkpoint (which
  loads on another world size or stage) beside Accelerate's own files
  (`checkpoint.py`); `unwrap_model`, `get_state_dict` and `save_model` take
  the engine to its module and full weights.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import accelerate
import torch
import torch.nn as nn

from zeroshard.accelerate import checkpoint
from zeroshard.accelerate.config import filled_config, precision_of, read_config
from zeroshard.accelerate.views import AcceleratedSteps, EngineOptimizer
from zeroshard.config import ConfigError
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.initialize import initialize
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.engine.stepped import SteppedByEngine

LRScheduler = torch.optim.lr_scheduler.LRScheduler
_PLUGINS = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin")
_LAUNCH_FLAGS = {"ACCELERATE_USE_DEEPSPEED": "--use_deepspeed", "ACCELERATE_USE_FSDP": "--use_fsdp",
                 "ACCELERATE_USE_MEGATRON_LM": "--use_megatron_lm"}


class Accelerator(accelerate.Accelerator):
    """Accelerate's `Accelerator` over zeroshard's engine (see the module docstring).

    `config`: a DeepSpeed-style config dict or JSON path (docs/deepspeed-config.md); its
    `gradient_accumulation_steps`, `gradient_clipping` and bf16/fp16 sections are filled from
    `gradient_accumulation_steps=`, `max_grad_norm=` and `mixed_precision=` when it leaves them out or says
    "auto", and must agree with them otherwise. Every other keyword is Accelerate's.
    """

    engine: DeepSpeedEngine | None = None

    def __init__(self, *, config: dict | str | os.PathLike | None = None, max_grad_norm: float | None = None,
                 **kwargs):
        _refuse_other_engines(kwargs)
        raw = read_config(config)  # before Accelerate sets up its state: a wrong path fails at once
        precision = kwargs.pop("mixed_precision", None)
        if precision is None and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
            precision = os.environ["ACCELERATE_MIXED_PRECISION"]  # `accelerate launch --mixed_precision bf16`
        accumulation_given = "gradient_accumulation_steps" in kwargs or "gradient_accumulation_plugin" in kwargs \
            or "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in os.environ
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and "cpu" not in kwargs and not torch.cuda.is_available():
            kwargs["cpu"] = True  # else Accelerate takes torchrun's CPU processes for one, and shards no data
        # The engine casts to the training dtype and scales fp16 losses: Accelerate must not autocast or scale.
        super().__init__(mixed_precision="no", **kwargs)
        if self.num_processes != world:
            raise UnsupportedError(
                f"the launch started {world} processes but Accelerate counts {self.num_processes}, so it would not "
                "shard the data while the engine averages over every process: launch with accelerate launch "
                "--multi_gpu --num_processes N (or torchrun), and on CPU pass Accelerator(cpu=True)")
        self._accumulation_given = accumulation_given
        accumulation = self.gradient_accumulation_steps if accumulation_given else None
        self.zeroshard_config = filled_config(raw, accumulation, precision, max_grad_norm)
        steps = self.zeroshard_config.get("gradient_accumulation_steps")
        if not accumulation_given and isinstance(steps, int):
            self.gradient_accumulation_steps = steps  # the config's, as Accelerate's DeepSpeed path takes it
        self._precision = precision_of(self.zeroshard_config) or "no"

    @property
    def mixed_precision(self) -> str:
        """The engine's training dtype as Accelerate names it: "bf16", "fp16" or "no"."""
        if self.engine is not None:
            return "bf16" if self.engine.bfloat16_enabled() else "fp16" if self.engine.fp16_enabled() else "no"
        return self._precision

    # -- prepare ---------------------------------------------------------------

    def prepare(self, *args, device_placement=None):
        """The objects in the same order: the engine for the model, views for its optimizer and scheduler, and
        Accelerate's prepared objects for the rest (dataloaders sharded)."""
        if device_placement is not None:
            raise UnsupportedError("prepare(device_placement=...) is not supported with zeroshard (as with "
                                   "DeepSpeed): the engine places the model, Accelerate the batches")
        result = list(args)
        engine_parts = self._engine_parts(args)
        others = [i for i in range(len(args)) if i not in engine_parts]
        if others:
            prepared = super().prepare(*(args[i] for i in others))
            prepared = prepared if len(others) > 1 else (prepared,)
            for i, obj in zip(others, prepared):
                result[i] = obj
        for i, obj in engine_parts.items():
            result[i] = obj
        return tuple(result) if len(result) != 1 else result[0]

    def _engine_parts(self, args: tuple) -> dict[int, object]:
        """Index -> what prepare returns there, for the model, its optimizer and its scheduler."""
        models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module)]
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, torch.optim.Optimizer)]
        schedulers = [i for i, obj in enumerate(args) if isinstance(obj, LRScheduler)]
        if len(models) > 1:
            raise UnsupportedError(f"prepare got {len(models)} models: zeroshard's Accelerator trains one model "
                                   "(one engine), as Accelerate's DeepSpeed path does. Prepare the model you train; "
                                   "evaluate another one without prepare, or with an Accelerator of its own")
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise UnsupportedError("prepare got more than one optimizer or LR scheduler: the engine steps one "
                                   "optimizer (a list of optimizers goes to zeroshard.initialize) and one schedule")
        if models and self.engine is not None:
            raise UnsupportedError("prepare was already given a model, which zeroshard's engine trains; a second "
                                   "model cannot join it. Prepare one model per Accelerator")
        if models:
            return self._build_engine(args, models[0], optimizers, schedulers)
        return self._attach_later(args, optimizers, schedulers)

    def _build_engine(self, args: tuple, model: int, optimizers: list[int], schedulers: list[int]) -> dict:
        module, optimizer = args[model], args[optimizers[0]] if optimizers else None
        scheduler = args[schedulers[0]] if schedulers else None
        trains = any(p.requires_grad for p in module.parameters())
        if optimizer is None and trains and "optimizer" not in self.zeroshard_config:
            raise UnsupportedError(
                f"prepare got the model {type(module).__name__}, which has trainable parameters, without its "
                "optimizer: pass the optimizer in the same prepare call (model, optimizer = accelerator.prepare("
                "model, optimizer)), or add an \"optimizer\" block to the config. A model used for evaluation "
                "only: freeze it first (model.requires_grad_(False)), and it is sharded for its forwards")
        if scheduler is not None and scheduler.optimizer is not optimizer:
            raise UnsupportedError(f"prepare got the LR scheduler {type(scheduler).__name__} on another optimizer "
                                   "than the one it got with the model: build the scheduler on that optimizer")
        engine, _, _, _ = initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                     config=self.zeroshard_config)
        self.engine = engine
        if not self._accumulation_given:  # the config's, or what its batch keys derive
            self.gradient_accumulation_steps = int(engine.gradient_accumulation_steps)
        self._check_accumulation(engine)
        engine._is_accelerate_prepared = True
        self._models.append(engine)
        parts = {model: engine}
        if optimizers:
            parts[optimizers[0]] = self._optimizer_view()
        if scheduler is not None:  # the script's schedule, stepped as Accelerate steps it (a config block's: once)
            engine.lr_scheduler = None
            parts[schedulers[0]] = self._attach_scheduler(scheduler)
        return parts

    def _attach_later(self, args: tuple, optimizers: list[int], schedulers: list[int]) -> dict:
        """A later prepare call with the engine's optimizer, or a scheduler on it: views, the scheduler attached."""
        engine, parts = self.engine, {}
        if engine is None:
            return parts
        if optimizers and args[optimizers[0]] is engine.optimizer:
            parts[optimizers[0]] = self._optimizer_view()
        if schedulers and args[schedulers[0]].optimizer is engine.optimizer:
            parts[schedulers[0]] = self._attach_scheduler(args[schedulers[0]])
        return parts

    def _optimizer_view(self) -> EngineOptimizer:
        view = EngineOptimizer(self.engine)
        if not any(isinstance(o, EngineOptimizer) for o in self._optimizers):
            self._optimizers.append(view)
        return view

    def _attach_scheduler(self, scheduler: LRScheduler) -> SteppedByEngine:
        """The engine steps `scheduler` as Accelerate steps it under DDP (`views.py`)."""
        if self.engine.lr_scheduler is not None:
            raise UnsupportedError("the engine already has an LR scheduler; prepare one scheduler per model")
        if not self.step_scheduler_with_optimizer:
            raise UnsupportedError("Accelerator(step_scheduler_with_optimizer=False) is not supported: the engine "
                                   "steps the schedule with each optimizer step. Step a scheduler of your own "
                                   "without prepare instead")
        self.engine.lr_scheduler = AcceleratedSteps(scheduler, 1 if self.split_batches else self.num_processes)
        view = SteppedByEngine(self.engine.lr_scheduler)
        self._schedulers.append(view)
        return view

    def _check_accumulation(self, engine: DeepSpeedEngine) -> None:
        if int(engine.gradient_accumulation_steps) != self.gradient_accumulation_steps:
            raise ConfigError(
                f"the engine's config gives gradient_accumulation_steps={int(engine.gradient_accumulation_steps)} "
                f"(from its batch sizes) but the Accelerator counts {self.gradient_accumulation_steps}: pass "
                "Accelerator(gradient_accumulation_steps=...) the config's value, or change the batch keys")

    # -- one micro-batch -------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """The engine's backward, then its step (which updates only at the window's end)."""
        engine = self.engine
        if engine is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise UnsupportedError(f"accelerator.backward(loss, {', '.join(kwargs)}=...) is not supported with "
                                   "zeroshard: the engine runs the backward; call accelerator.backward(loss)")
        if self.sync_gradients != engine.is_gradient_accumulation_boundary():
            steps = int(engine.gradient_accumulation_steps)
            raise UnsupportedError(
                f"accelerator.sync_gradients is {self.sync_gradients} at micro-step {engine.micro_steps + 1}, but "
                f"the engine's windows are {steps} micro-batches long and this one "
                f"{'does not end' if self.sync_gradients else 'ends'} here. Run each micro-batch inside `with "
                f"accelerator.accumulate(model):` (which counts them), and give every epoch a multiple of {steps} "
                "batches per rank (Accelerate ends a window early at the end of a dataloader)")
        engine.backward(loss)
        engine.step()

    @contextlib.contextmanager
    def no_sync(self, model) -> Iterator[None]:
        """For the engine, nothing: it reduces where its stage says (`reduce_once_per_window` for once a window);
        `accumulate` keeps counting the window's micro-batches. Other models: Accelerate's."""
        if self._is_engine(model):
            yield
            return
        with super().no_sync(model):
            yield

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """The gradient norm (L2, over every rank, before clipping) the engine measured at its last step.

        The engine clips at its step, inside the `backward` that ends the window, with the config's
        `gradient_clipping`; called after that backward (as `if accelerator.sync_gradients:` does) the norm
        is this window's. None before the first step. A `max_norm` unlike the config's is a `ConfigError`."""
        engine = self.engine
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise UnsupportedError(f"clip_grad_norm_(norm_type={norm_type}) is not supported: the engine clips "
                                   "by the L2 norm over every rank")
        configured = engine.gradient_clipping()
        if float(max_norm) != configured:
            now = "does not clip (gradient_clipping is 0)" if not configured else f"clips to {configured}"
            raise ConfigError(
                f"accelerator.clip_grad_norm_(..., max_norm={max_norm}) but the engine {now}: it clips at its own "
                f"step with the config's gradient_clipping. Pass Accelerator(max_grad_norm={max_norm}) or put "
                f"\"gradient_clipping\": {max_norm} in the config")
        norm = engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(norm)

    def clip_grad_value_(self, parameters, clip_value: float):
        if self.engine is None:
            return super().clip_grad_value_(parameters, clip_value)
        raise UnsupportedError("clip_grad_value_ is not supported with zeroshard: the engine clips by the global "
                               "norm (config gradient_clipping, accelerator.clip_grad_norm_)")

    # -- the model and its weights ---------------------------------------------

    def _is_engine(self, model) -> bool:
        return self.engine is not None and (model is self.engine or model is self.engine.module)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The engine's module for the engine; Accelerate's unwrapping otherwise."""
        if self._is_engine(model):
            return self.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True):
        """The engine's full state dict on the main process ({} on the others), gathered from the shards in the
        training dtype; every rank calls it (at stage 3 each rank takes part in the gathers)."""
        if self._is_engine(model):
            return self.engine.pretrained_state()
        return super().get_state_dict(model, unwrap)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True) -> None:
        """Accelerate's `save_model` over the engine's full state dict; every rank calls it, the main one writes."""
        model = self.engine.module if self._is_engine(model) else model
        return super().save_model(model, save_directory, max_shard_size, safe_serialization)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """The engine's sharded checkpoint in `output_dir/pytorch_model`, beside Accelerate's own state (RNG,
        dataloaders, step, registered objects); keywords go to `engine.save_checkpoint`. Every rank calls it,
        at the end of an accumulation window."""
        if self.engine is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        return checkpoint.save_state(self, super().save_state, output_dir, safe_serialization,
                                     save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        """The engine's checkpoint (from any world size or stage), then Accelerate's own state."""
        if self.engine is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        return checkpoint.load_state(self, super().load_state, input_dir, load_kwargs, load_model_func_kwargs)


def _refuse_other_engines(kwargs: dict) -> None:
    """DeepSpeed, FSDP and Megatron-LM plugins (or `accelerate launch` flags for them) would make Accelerate
    train the model itself, and its DeepSpeed path import the `deepspeed` package."""
    given = [name for name in _PLUGINS if kwargs.get(name) is not None]
    flags = [flag for env, flag in _LAUNCH_FLAGS.items() if os.environ.get(env, "false").lower() == "true"]
    if given or flags:
        what = ", ".join([f"Accelerator({name}=...)" for name in given] + [f"accelerate launch {f}" for f in flags])
        raise UnsupportedError(f"{what} with zeroshard's Accelerator: zeroshard's engine takes the place of "
                               "DeepSpeed and FSDP. Put the ZeRO settings in Accelerator(config=...) and launch "
                               "without those flags (accelerate launch --multi_gpu --num_processes N ...)")
