"""ZeroshardStrategy: Lightning's Trainer trained by zeroshard's engine, as `strategy="deepspeed"` is by DeepSpeed's.

The strategy is Lightning's DDP strategy (process group, samplers, barriers,
`all_gather`, `reduce`) with the engine in place of `DistributedDataParallel`:

- at `fit`, the LightningModule and the optimizer of `configure_optimizers`
  become an engine (`zeroshard.deepspeed.initialize`), its config the one
  given with the Trainer's flags written in (`config.py`). The engine
  updates the optimizer passed, so the LR scheduler of `configure_optimizers`
  is stepped by Lightning on its interval, as under DDP.
- each micro-batch's backward and step are the engine's (`precision.py`);
  the engine ends the accumulation window, so `trainer.global_step` counts
  its optimizer steps.
- validation, test and predict after or during `fit` run through the
  engine (stage 3 gathers each unit); without a fit they run the module as
  DDP does.
- a checkpoint is the engine's sharded one, in a directory at the path
  Lightning names, with Lightning's own state (loops, callbacks, LR
  schedulers) as its client state; `ckpt_path=` loads it on any world size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from zeroshard.checkpoint import CheckpointError
from zeroshard.config import ConfigError
from zeroshard.deepspeed import DeepSpeedEngine, initialize, zero
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.lightning.config import eval_config, fit_config, strategy_config
from zeroshard.lightning.precision import ZeroshardPrecision

TAG = "checkpoint"  # the engine's tag inside the directory Lightning names, as Lightning's DeepSpeedStrategy writes


class ZeroshardStrategy(DDPStrategy):
    """`L.Trainer(strategy=ZeroshardStrategy(stage=3))`, or with `config=` a DeepSpeed config dict or JSON file."""

    strategy_name = "zeroshard"

    def __init__(self, stage: int | None = None, config: dict | str | Path | None = None, accelerator=None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment=None, checkpoint_io=None,
                 process_group_backend: str | None = None, timeout=default_pg_timeout,
                 exclude_frozen_parameters: bool = False):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.config = strategy_config(config, stage)
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.engine: DeepSpeedEngine | None = None
        self._trains = False  # whether the engine was built by a fit (with the optimizer)

    @property
    def stage(self) -> int:
        return self.config["zero_optimization"]["stage"]

    @property
    def precision_plugin(self) -> ZeroshardPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroshardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning's plugin for `Trainer(precision=...)` becomes the engine's (the flag is checked at fit)."""
        self._precision_plugin = None if plugin is None else ZeroshardPrecision(plugin.precision)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its shards

    # -- setup -----------------------------------------------------------------

    def setup(self, trainer) -> None:
        if self.engine is not None and self.engine.module is not self.lightning_module:
            self.engine = None  # another LightningModule: a new engine
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is None and not fitting:  # evaluation before any fit: the module whole on each rank, as
            return super().setup(trainer)        # DDP's; a checkpoint to load makes the engine (`load_checkpoint`)
        self.accelerator.setup(trainer)
        if fitting:
            self._check_fit()
        if self.engine is None:
            self.engine, self._trains = self._build_engine(trainer, fitting), fitting
        elif fitting and not self._trains:
            raise UnsupportedError(
                "trainer.fit after an evaluation that loaded a checkpoint (ckpt_path=) on this ZeroshardStrategy: "
                "that engine holds no optimizer. Pass ckpt_path= to trainer.fit instead, which resumes training")
        if fitting:
            self.optimizers = [self.engine.optimizer]
        self.model = self.engine
        self.barrier()

    def _check_fit(self) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise UnsupportedError(
                "ZeroshardStrategy trains with automatic optimization only (training_step returns the loss): "
                "manual optimization's backward and step calls would bypass the engine's accumulation window; "
                "set self.automatic_optimization = True, or drive zeroshard.initialize's engine yourself")
        if self._layer_sync is not None:
            raise UnsupportedError("Trainer(sync_batchnorm=True) is not supported by ZeroshardStrategy: the engine "
                                   "broadcasts rank 0's buffers before each forward instead; leave it out")

    def _build_engine(self, trainer, fitting: bool) -> DeepSpeedEngine:
        """The engine over the LightningModule. Fitting: with the optimizer of the config's block, else of
        `configure_optimizers` (its LR scheduler stays Lightning's, stepped on its interval). Evaluating a
        checkpoint: with no optimizer and the module frozen, to load the shards into."""
        if not fitting:  # nothing trains: the parameters frozen, so the engine keeps no gradients or states
            self.lightning_module.requires_grad_(False)
            engine, *_ = initialize(model=self.lightning_module, model_parameters=[],
                                   config=eval_config(self.config, self.precision_plugin.precision))
            return engine
        config = fit_config(self.config, trainer.accumulate_grad_batches, trainer.gradient_clip_val,
                            trainer.gradient_clip_algorithm, self.precision_plugin.precision)
        optimizer = None if "optimizer" in config else self._configured_optimizer()
        engine, *_ = initialize(model=self.lightning_module, optimizer=optimizer, config=config)
        return engine

    def _configured_optimizer(self):
        try:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        except RuntimeError as exc:  # Lightning's refusal of several optimizers in automatic optimization
            if "multiple optimizers" not in str(exc):
                raise
            raise UnsupportedError("configure_optimizers returned several optimizers; ZeroshardStrategy takes one "
                                   "(automatic optimization steps one). For parameter sets with optimizers of their "
                                   "own, return zeroshard.Optimizers([opt1, opt2]), which the engine steps as one") from exc
        if isinstance(optimizers[0], _MockOptimizer):
            raise ConfigError("configure_optimizers returned no optimizer: return one, or put an \"optimizer\" "
                              "block in ZeroshardStrategy's config")
        self.lr_scheduler_configs = schedulers
        return optimizers[0]

    def on_train_start(self) -> None:
        """Refuse, before the first step, a run that would reach an epoch's short last window: Lightning steps on
        it under DDP, while the engine's windows have a fixed length (its window would run on into the next
        epoch, a silent change of the batches each step averages)."""
        trainer = self.lightning_module.trainer
        batches, k = trainer.num_training_batches, trainer.accumulate_grad_batches
        if math.isinf(batches) or batches % k == 0:
            return
        whole = batches // k  # an epoch's optimizer steps of whole windows
        if 0 < trainer.max_steps <= whole:
            return  # the run ends inside the first epoch's whole windows
        raise UnsupportedError(
            f"each epoch has {batches} batches per rank, not a multiple of accumulate_grad_batches ({k}): its last "
            f"window would hold {batches % k}, on which Lightning steps under DDP but zeroshard's engine, whose "
            f"windows have a fixed length, cannot. Set limit_train_batches={whole * k}, an accumulate_grad_batches "
            f"that divides {batches}, or max_steps={whole} or fewer" if whole else
            f"each epoch has {batches} batches per rank, fewer than accumulate_grad_batches ({k}): lower it")

    def setup_optimizers(self, trainer) -> None:
        """The optimizer is built with the engine, at `setup`."""

    def model_sharded_context(self):
        """`configure_model` builds its parameters on the meta device at stage 3 (`zeroshard.deepspeed.zero.Init`),
        to be materialized shard by shard when the engine is built; below stage 3, as DDP."""
        return zero.Init(enabled=self.stage == 3, config_dict_or_path=self.config)

    def teardown(self) -> None:
        """As DDP's, but the module stays where the engine keeps it: moving it to the CPU would detach its
        parameters from the engine's buffers, which a later validate, predict or save still reads."""
        if self.engine is None:
            return super().teardown()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints -----------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds the model (its shards, not a gathered copy)."""
        return {} if self.engine is not None else super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """The engine's sharded checkpoint in the directory `filepath`, every rank writing its shards; Lightning's
        state (loops, callbacks, LR schedulers, hyperparameters) is its client state."""
        if self.engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(storage_options=...) is not supported by ZeroshardStrategy: "
                            "the engine writes its own files")
        filepath = self.broadcast(filepath)
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=TAG, client_state=client_state,
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The engine loads its shards (any world size and stage); Lightning gets back its own state."""
        checkpoint_path = self.broadcast(checkpoint_path)
        if self.engine is None:  # validate, test or predict from a checkpoint, with no fit before
            self.engine, self._trains = self._build_engine(self.lightning_module.trainer, fitting=False), False
            self.model = self.engine
        if not Path(checkpoint_path, TAG).is_dir():
            raise CheckpointError(
                f"{checkpoint_path} is not a ZeroshardStrategy checkpoint (no '{TAG}' directory in it): a file saved "
                "by another strategy holds whole weights; load its 'state_dict' into the module before fit instead")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(checkpoint_path, tag=TAG, load_optimizer_states=fitting,
                                                      load_module_strict=self.lightning_module.strict_loading)
        return client_state

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine loaded the optimizer's shards; Lightning restores the LR schedulers itself

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """The engine loaded the weights in `load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """The engine loaded the optimizer state in `load_checkpoint`."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zeroshard", cls, description="ZeRO by zeroshard, stage 2")
        for stage in (1, 2, 3):
            strategy_registry.register(f"zeroshard_stage_{stage}", cls, description=f"ZeRO stage {stage} by zeroshard",
                                       stage=stage)
