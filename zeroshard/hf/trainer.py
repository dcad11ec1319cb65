"""`zeroshard.hf.Trainer`: transformers' `Trainer`, trained by zeroshard's engine instead of DDP or DeepSpeed.

transformers' training loop runs as it is (its data loading and samplers,
loss, logging, callbacks, evaluation); what DeepSpeed's integration does
inside it, this class does over `zeroshard.deepspeed.initialize`, as
transformers' `deepspeed_init` and accelerate's `DeepSpeedEngineWrapper` do:

- the engine is built when training starts, from the DeepSpeed config with
  its "auto" values filled from the arguments (`arguments.py`). A config
  "optimizer" or "scheduler" block builds them, as DeepSpeed does; without
  one, the Trainer's own (`create_optimizer`, `create_scheduler`) are used.
- each micro-batch's backward is the engine's backward and step: the
  engine reduces, clips (the config's `gradient_clipping`, filled from
  `max_grad_norm`), updates and steps the LR scheduler at the end of the
  accumulation window; the Trainer's own optimizer and scheduler steps are
  then no-ops (`engine/stepped.py`), and the norm it logs is the engine's.
- a run that would reach an epoch's short last window (batches per rank not
  a multiple of the accumulation) is refused before its first step, with the
  settings that avoid it (`window.py`): the engine's windows have a fixed length.
- the logged `learning_rate` is the one the step used, as transformers logs
  it for DDP (the engine's step has already stepped the scheduler when the
  Trainer asks).
- a checkpoint (`save_steps`) is the engine's sharded checkpoint beside the
  Trainer's files, without the frozen parameters for a PEFT model (as
  transformers passes `exclude_frozen_parameters` to DeepSpeed's);
  `resume_from_checkpoint` loads it on any world size and stage. `save_model` writes what `from_pretrained` loads, every rank
  taking part (at stage 3 the weights are gathered unit by unit).
- built, it makes the trainer's frozen reference model (TRL's DPO, GRPO) an
  engine of its own at stage 3 (`frozen_models.py`), lets
  `accelerator.unwrap_model` take the engine to its module (TRL generates
  with it), and refuses TRL's `use_vllm` at stage 3, whose weight sync
  would read empty shards. Any Trainer subclass gets all this through
  `on_zeroshard` (`adapter.py`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import transformers
from transformers.trainer_utils import _is_peft_model, has_length

from zeroshard.deepspeed.initialize import initialize
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.engine import Engine
from zeroshard.engine.stepped import SteppedByEngine
from zeroshard.hf.arguments import carry_config, filled_config
from zeroshard.hf.frozen_models import shard_frozen_models
from zeroshard.hf.window import check_windows


class _ZeroshardTraining:
    """Mixed into transformers' `Trainer` and `Seq2SeqTrainer` (see the module docstring)."""

    engine: DeepSpeedEngine | None = None
    _stepped_lr: float | None = None  # the learning rate of the engine's last optimizer step

    def __init__(self, *args, **kwargs):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_vllm_at_stage_3(given)
        super().__init__(*args, **kwargs)
        carry_config(given, self.args)
        self.accelerator.unwrap_model = _unwrapping(self.accelerator.unwrap_model)
        shard_frozen_models(self, filled_config(self.args), _block_classes, initialize)

    # -- building the engine ---------------------------------------------------

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        args = self.args
        check_windows(len(train_dataloader) if has_length(train_dataloader) else None,
                      args.gradient_accumulation_steps, max_steps, args.world_size, args.per_device_train_batch_size,
                      len(self.train_dataset) if has_length(self.train_dataset) else None)
        if self.engine is None:
            self.engine = self._build_engine(max_steps)
        self.model_wrapped = self.deepspeed = self.engine
        # No `accelerator.no_sync` around the window's first micro-batches (the engine decides when to reduce:
        # every micro-batch at stages 2-3 unless reduce_once_per_window), as transformers skips it for DeepSpeed.
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _build_engine(self, max_steps: int) -> DeepSpeedEngine:
        """As transformers' `deepspeed_init`: the config filled, then the optimizer and scheduler from the config's
        blocks, else the Trainer's own; the engine over the model."""
        config = filled_config(self.args, self.model, max_steps)
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if optimizer is None and "optimizer" not in config:
            optimizer = self.create_optimizer()
        if scheduler is None and "scheduler" not in config:
            def scheduler(opt):  # the Trainer's schedule (lr_scheduler_type, warmup) over the engine's optimizer
                return self.create_scheduler(num_training_steps=max_steps, optimizer=opt)
        zero = config.get("zero_optimization", {})
        if zero.get("stage") == 3 and "stage3_wrap_classes" not in zero:
            zero["stage3_wrap_classes"] = _block_classes(self.model)
        engine, engine_optimizer, _, engine_scheduler = initialize(
            model=self.model, optimizer=optimizer, config=config, lr_scheduler=scheduler)
        self.optimizer, self.lr_scheduler = SteppedByEngine(engine_optimizer), SteppedByEngine(engine_scheduler)
        return engine

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        """The engine once it exists (evaluation and prediction run its forward); before, transformers' own."""
        if self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training, dataloader)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing here: the engine's `load_checkpoint` restores the model with its optimizer state."""

    # -- one micro-batch -------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if model is not self.engine:
            return super().training_step(model, inputs, num_items_in_batch)
        with _backward_through(self.accelerator, self._engine_backward):
            return super().training_step(model, inputs, num_items_in_batch)

    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        """accelerate's `DeepSpeedEngineWrapper.backward`: the engine's backward, then its step.

        transformers' loss is already this window's share (divided by the accumulation steps, or normalised by
        the window's token count); the engine divides by the accumulation steps itself, so the loss it gets is
        multiplied back."""
        engine = self.engine
        if self.accelerator.sync_gradients != engine.is_gradient_accumulation_boundary():  # `check_windows` missed it
            raise UnsupportedError(
                f"the Trainer ends an accumulation window after micro-step {engine.micro_steps + 1}, which is not a "
                f"multiple of gradient_accumulation_steps ({engine.gradient_accumulation_steps}): an epoch's last "
                "window is shorter (a train dataloader whose length changed between epochs?). zeroshard's windows "
                "have a fixed length: give every epoch a multiple of gradient_accumulation_steps batches per rank, "
                "or set max_steps within the first epoch's whole windows")
        engine.backward(loss * engine.gradient_accumulation_steps)
        if engine.is_gradient_accumulation_boundary():
            self._stepped_lr = engine.get_lr()[0]  # before engine.step() steps the scheduler
        engine.step()

    def _get_learning_rate(self) -> float:
        """The learning rate the last optimizer step used, as the Trainer logs it under DDP: it asks after the
        optimizer's step and before the scheduler's, but the engine's step has stepped both."""
        if self.engine is None or self._stepped_lr is None:
            return super()._get_learning_rate()
        return self._stepped_lr

    def _clip_grad_norm(self, model):
        """The engine clipped at its step; this is the norm it measured before clipping."""
        if model is not self.engine:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        if model is not self.engine:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()

    # -- checkpoints and the saved model ---------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's sharded checkpoint (model, optimizer, scheduler, counters) in `output_dir`; of a PEFT model
        the trainable state only, as transformers saves it under DeepSpeed: the resume builds the base again."""
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir, exclude_frozen_parameters=_is_peft_model(self.model))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """What `from_pretrained` loads, written by rank 0 (transformers' `_save`, tokenizer and arguments too).
        Every rank calls it: the weights are gathered from the shards into rank 0's copy."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.engine.pretrained_state()
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)


def _block_classes(model: nn.Module) -> list[str]:
    """Stage 3's units: the model's repeated blocks, the classes transformers declares in `_no_split_modules` (as
    accelerate's FSDP wrapping takes them) that the model holds; none (units by size) when it declares none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return sorted({type(module).__name__ for module in model.modules()} & names)


def _refuse_vllm_at_stage_3(args) -> None:
    """TRL's vLLM weight sync reads `param.data` whole unless DeepSpeed's ZeRO-3 is live; at zeroshard's stage 3
    the parameters outside a forward are empty shards, so vLLM would be loaded with nothing."""
    if args is None or not getattr(args, "use_vllm", False):
        return
    if filled_config(args).get("zero_optimization", {}).get("stage") == 3:
        raise UnsupportedError(
            f"{type(args).__name__}(use_vllm=True) at ZeRO stage 3 is not supported: TRL's vLLM weight sync would "
            "send vLLM the empty shards zeroshard's stage 3 leaves outside a forward. Generate in the process "
            "(use_vllm=False: every rank takes part, one unit gathered at a time), train at stage 2, or sync a "
            "generator of your own from engine.iter_full_parameters(max_bytes=...) (docs/hugging-face.md)")


def _unwrapping(unwrap):
    """accelerate's `unwrap_model`, which also takes an engine to the module it trains: TRL generates with, and
    reads the weights of, `accelerator.unwrap_model(trainer.model_wrapped)`, which is the engine."""
    def unwrap_model(model, *args, **kwargs):
        return unwrap(model.module if isinstance(model, Engine) else model, *args, **kwargs)
    return unwrap_model


@contextlib.contextmanager
def _backward_through(accelerator, backward):
    """`accelerator.backward` is `backward` inside: transformers' `training_step` calls it after the loss."""
    accelerator.backward = backward
    try:
        yield
    finally:
        del accelerator.backward  # the class's method again


class Trainer(_ZeroshardTraining, transformers.Trainer):
    """transformers' `Trainer`, trained by zeroshard (see the module docstring); the same arguments."""


class Seq2SeqTrainer(_ZeroshardTraining, transformers.Seq2SeqTrainer):
    """transformers' `Seq2SeqTrainer`, trained by zeroshard; the same arguments."""
