"""DeepSpeedEngine: the engine with DeepSpeed's methods, what `zeroshard.deepspeed.initialize` returns.

Each method here is DeepSpeed's name and signature over the native engine's
state (`zeroshard.Engine`); nothing below this package reads them. What
zeroshard cannot honour raises an error that says so
(docs/migrate-from-deepspeed.md has the whole table).
"""

from __future__ import annotations

import os
from pathlib import Path


from zeroshard.engine import Engine, EngineStateError

_MIGRATE = "see docs/migrate-from-deepspeed.md"


class AccumulationSteps(int):
    """`engine.gradient_accumulation_steps`: an int that can also be called.

    DeepSpeed's is a method (`engine.gradient_accumulation_steps()`); zeroshard's
    was an int attribute. Both spellings give the same number: `steps()` returns
    a plain int, and `steps` itself is one in arithmetic and comparisons.
    """

    def __call__(self) -> int:
        return int(self)


class DeepSpeedEngine(Engine):
    """`zeroshard.Engine` answering a DeepSpeed training script's calls on its engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_applied = False  # cleared by every step(), set when it updated the weights: was_step_applied()

    # -- the loop, with DeepSpeed's checks -----------------------------------------

    def step(self) -> None:
        """`Engine.step`, remembering whether it updated the weights (`was_step_applied`)."""
        applied = self.global_steps - self.skipped_steps
        self._step_applied = False
        super().step()
        self._step_applied = self.global_steps - self.skipped_steps > applied

    def forward(self, *args, **kwargs):
        """`engine(*args, **kwargs)`, by DeepSpeed's other name for it."""
        return self(*args, **kwargs)

    # -- batch sizes and steps ---------------------------------------------------

    @property
    def gradient_accumulation_steps(self) -> AccumulationSteps:
        """Micro-steps per optimizer step; an int, and callable as DeepSpeed's method."""
        return AccumulationSteps(self.config.gradient_accumulation_steps)

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per rank per micro-step, as configured (None if the config leaves it out)."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks: micro-batch x accumulation steps x N."""
        micro = self.config.train_micro_batch_size_per_gpu
        return None if micro is None else micro * self.config.gradient_accumulation_steps * self.comm.world_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Not yet: the accumulation steps are fixed at `initialize` (stage 0-1 buffers are sized by them)."""
        raise EngineStateError(f"set_train_batch_size({train_batch_size}) is not supported yet: the batch size "
                               "and gradient_accumulation_steps are fixed by the config at zeroshard.initialize; "
                               f"build a new engine with the new config ({_MIGRATE})")

    @property
    def global_samples(self) -> int | None:
        """Samples over all ranks in the optimizer steps so far (skipped ones included, as DeepSpeed counts)."""
        batch = self.train_batch_size()
        return None if batch is None else self.global_steps * batch

    def gradient_clipping(self) -> float:
        """The config's `gradient_clipping` (0: none)."""
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self.config.stage

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is on."""
        return self.config.stage > 0

    def fp16_enabled(self) -> bool:
        """Whether the config's fp16 block is on."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether the config's bf16 block is on."""
        return self.config.bf16.enabled

    # -- the optimizer's values --------------------------------------------------

    def get_lr(self) -> list[float]:
        """The learning rate of each param group, now (after the scheduler's last step)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each param group's momentum: Adam's `betas`, or SGD's `momentum`."""
        return [group["betas"] if "betas" in group else group.get("momentum") for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient L2 norm (before clipping, unscaled), as one process's
        `torch.nn.utils.clip_grad_norm_` returns it; inf if inf or nan, None before the first step."""
        return self.global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last `engine.step()` updated the weights, as DeepSpeed's: False before the first, after a
        micro-step inside an accumulation window, and after a step skipped for inf or nan gradients."""
        return self._step_applied

    # -- where the engine runs ---------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This process's rank in the engine's group."""
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: torchrun's LOCAL_RANK (0 when launched without torchrun)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        """Ranks in the engine's group (DeepSpeed's data-parallel world size)."""
        return self.comm.world_size

    # -- the engine as DeepSpeed's nn.Module around the model --------------------

    def train(self, mode: bool = True):
        """The model's `train(mode)`; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self):
        """The model's `eval()`; returns the engine."""
        return self.train(False)

    def parameters(self, recurse: bool = True):
        """The model's parameters, as DeepSpeed's engine (an `nn.Module` around the model) gives them, holding the
        last step's values (`wait_for_params`)."""
        self.wait_for_params()
        return self.module.parameters(recurse)

    # -- gradients ---------------------------------------------------------------

    def zero_grad(self) -> None:
        """No effect, as for ZeRO in DeepSpeed: the window's gradients live in the engine's flat buffers
        (not in `param.grad`) and are cleared by the `engine.step()` that ends the window."""

    # -- whole weights -----------------------------------------------------------

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: `torch.save` the full state dict, in the training dtype (16-bit with bf16 or fp16),
        to `save_dir/save_filename` on rank 0; returns True. Every rank calls it (stage 3 gathers).
        `exclude_frozen_parameters`: leave out parameters that do not require grad."""
        return self._exports.save_16bit(Path(save_dir) / save_filename, exclude_frozen_parameters)
