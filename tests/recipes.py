"""What the tests train: a tiny tied-embedding GPT, its optimizers, its batches, and the references.

The reference is single-process PyTorch on the concatenated global batch
(ranks x micro-steps x micro-batch rows): the update every zeroshard
configuration must reproduce. The mixed-precision reference runs the same
recipe in one process: 16-bit parameters for forward and backward, fp32
master weights for the optimizer, gradients summed over micro-steps in fp32.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from zeroshard.app.demo import data
from zeroshard.app.models import GPT, PRESETS
from zeroshard.dtypes import DTYPES

GPT_CFG = PRESETS["tiny"]
ADAMW1 = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}  # the one-group AdamW


@dataclass(frozen=True)
class Case:
    stage: int = 0
    accumulation: int = 1
    optimizer: str = "adamw"  # "adamw" (two groups) | "adamw1" (one group) | "adamw1_slow" (lr 1e-3) | "sgd"
    clip: float = 0.0
    micro_rows: int = 2  # sequences per rank per micro-step
    reduce_scatter: bool = True
    bucket: int = 4000  # elements: several units per param group
    overlap: bool = True
    schedule: bool = False  # an LR scheduler built on the optimizer before initialize
    freeze: bool = False  # the position embedding frozen (requires_grad=False), still in the optimizer
    variant: str = "plain"  # the model: "plain" | "non_reentrant" | "reentrant" (checkpointing) | "twice"
    wrap: bool = True  # stage 3: each Block is a unit (else the size policy)
    persistence: int = 0  # stage 3: stage3_param_persistence_threshold, elements
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16": the training dtype
    wire: str | None = None  # communication_data_type; None: the training dtype
    offload: str = "none"  # offload_optimizer's device: "none" | "cpu" | "nvme"
    offload_params: str = "none"  # stage 3: offload_param's device
    nvme_path: str = ""  # where "nvme" swap files go
    param_buffer: int | None = None  # offload_param buffer_count 1 x buffer_size this many elements: the shards
    # kept in memory from a step to the next forward (None: the defaults, 5 x 1e8, every shard here)
    ratio: float = 1.0  # offload_optimizer's ratio
    delayed: int | None = None  # offload_optimizer.delayed_update on, with this many warm-up steps
    sub_group: int | None = None  # zero_optimization.sub_group_size; None: the default (one sub-group here)
    codec: str = "none"  # communication_compression.gradients.codec
    feedback: bool = True  # communication_compression.gradients.error_feedback (with a codec)
    weights_codec: str = "none"  # communication_compression.parameters.codec
    overlap_gather: bool | None = None  # zero_optimization.overlap_param_gather; None: its default

    def config(self) -> dict:
        precision = {} if self.dtype == "fp32" else {self.dtype: {"enabled": True}}
        return precision | {"communication_data_type": self.wire} | {
            "train_micro_batch_size_per_gpu": self.micro_rows,
            "gradient_accumulation_steps": self.accumulation,
            "gradient_clipping": self.clip,
            "zero_optimization": {
                "stage": self.stage, "reduce_scatter": self.reduce_scatter,
                "reduce_bucket_size": self.bucket, "allgather_bucket_size": self.bucket,
                "overlap_comm": self.overlap,
            } | ({} if self.overlap_gather is None else {"overlap_param_gather": self.overlap_gather}) | ({
                "stage3_wrap_classes": ["Block"] if self.wrap else [],
                "stage3_param_persistence_threshold": self.persistence,
            } if self.stage == 3 else {}) | self.offload_config(),
        } | self.compression_config()

    def compression_config(self) -> dict:
        blocks = {}
        if self.codec != "none":
            blocks["gradients"] = {"codec": self.codec} | ({} if self.feedback else {"error_feedback": False})
        if self.weights_codec != "none":
            blocks["parameters"] = {"codec": self.weights_codec}
        return {"communication_compression": blocks} if blocks else {}

    def offload_config(self) -> dict:
        blocks = {} if self.sub_group is None else {"sub_group_size": self.sub_group}
        if self.offload != "none":
            blocks["offload_optimizer"] = {"device": self.offload, "ratio": self.ratio} | (
                {"nvme_path": self.nvme_path} if self.offload == "nvme" else {}) | (
                {"delayed_update": True, "delayed_update_warmup": self.delayed} if self.delayed is not None else {})
        if self.offload_params != "none":
            blocks["offload_param"] = {"device": self.offload_params} | (  # every shard on disk, none kept in cpu
                {"nvme_path": self.nvme_path, "max_in_cpu": 0} if self.offload_params == "nvme" else {}) | (
                {} if self.param_buffer is None else {"buffer_count": 1, "buffer_size": self.param_buffer})
        return blocks


class TwiceGPT(GPT):
    """The first block runs twice per forward: one module, two uses of its parameters."""

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return super().run_blocks(self.blocks[0](x))


def make_model(seed: int = 0, device: str | torch.device = "cpu", freeze: bool = False,
               variant: str = "plain") -> GPT:
    torch.manual_seed(seed)
    if variant == "twice":
        model = TwiceGPT(GPT_CFG).to(device)
    else:
        model = GPT(replace(GPT_CFG, checkpointing="" if variant == "plain" else variant)).to(device)
    model.wpe.weight.requires_grad_(not freeze)
    return model


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":  # the usual split: no weight decay on biases and norms
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}],
            lr=1e-2, betas=(0.9, 0.95),
        )
    if kind == "adamw1":
        return torch.optim.AdamW(model.parameters(), **ADAMW1)
    if kind == "adamw1_slow":  # 16-bit runs: at lr 1e-2, one bf16 rounding apart grows to 40% in 50 steps
        return torch.optim.AdamW(model.parameters(), **(ADAMW1 | {"lr": 1e-3}))
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    raise ValueError(kind)


def make_schedule(case: Case, opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if case.schedule else None


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(GPT_CFG.vocab_size, (rows, GPT_CFG.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def micro_batch(step: int, case: Case, world: int, rank: int, micro: int):
    """Rank `rank`'s rows of micro-step `micro`, laid out as the demo lays them out."""
    batch = global_batch(step, case.micro_rows * world * case.accumulation)
    return data.micro_batch(batch, rank, world, micro, case.accumulation)


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy computed in fp32 from the model's logits, whatever their dtype (in fp32: as GPT's own)."""
    return torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def train_reference(case: Case, world: int, steps: int) -> tuple[list[float], torch.Tensor]:
    """Single-process training on the global batch: (loss per step, final weights).

    Cases that differ only in how zeroshard runs the recipe (stage, buckets, offload, ...) or in how the
    global batch is split (ranks x micro-steps x rows) train the same reference: it is trained once.
    """
    losses, weights = _reference(case.freeze, case.variant, case.optimizer, case.schedule, case.clip,
                                 case.micro_rows * world * case.accumulation, steps)
    return list(losses), weights.clone()


@functools.lru_cache(maxsize=None)
def _reference(freeze: bool, variant: str, optimizer: str, schedule: bool, clip: float, rows: int,
               steps: int) -> tuple[tuple[float, ...], torch.Tensor]:
    model = make_model(freeze=freeze, variant=variant)
    opt = make_optimizer(optimizer, model)
    lr_schedule = make_schedule(Case(schedule=schedule), opt)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, rows)
        loss = loss_of(model, x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if lr_schedule is not None:
            lr_schedule.step()
        losses.append(loss.item())
    return tuple(losses), flat_weights(model)


def train_reference_mixed(case: Case, world: int, steps: int) -> tuple[list[float], torch.Tensor]:
    """Single-process mixed precision on the global batch: (loss per step, final fp32 master weights).

    The fp32 model is the master and carries the optimizer; a 16-bit copy runs
    forward and backward, one micro-step (all ranks' rows of it) at a time.
    """
    master = make_model(freeze=case.freeze)
    opt = make_optimizer(case.optimizer, master)
    schedule = make_schedule(case, opt)
    model = copy.deepcopy(master).to(DTYPES[case.dtype])
    losses = []
    for step in range(steps):
        batch = global_batch(step, case.micro_rows * world * case.accumulation)
        step_loss = 0.0
        for micro in range(case.accumulation):
            x, y = data.micro_batch(batch, 0, 1, micro, case.accumulation)
            loss = loss_of(model, x, y)
            loss.backward()
            for p, p16 in zip(master.parameters(), model.parameters()):
                if p16.grad is not None:  # summed in fp32
                    p.grad = p16.grad.float() / case.accumulation + (0 if p.grad is None else p.grad)
                    p16.grad = None
            step_loss += loss.item() / case.accumulation
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, p16 in zip(master.parameters(), model.parameters()):
                p16.copy_(p)
        if schedule is not None:
            schedule.step()
        losses.append(step_loss)
    return losses, flat_weights(master)


ModelSpec = torch.nn.Module | Callable[[], torch.nn.Module] | None
OptimizerSpec = str | Callable[[torch.nn.Module], torch.optim.Optimizer | None] | None


def make_engine_with_schedule(case: Case = Case(), *, model: ModelSpec = None, optimizer: OptimizerSpec = None,
                              config: dict | None = None, seed: int = 0, device: str | torch.device = "cpu",
                              deepspeed: bool = False):
    """`zeroshard.initialize` on a model and an optimizer: (engine, the case's LR schedule or None).

    `model`: a module, a function that builds one (after `torch.manual_seed(seed)`), or None for
    `make_model(seed, device, case.freeze, case.variant)`. `optimizer`: a `make_optimizer` kind, a
    function of the model (returning None: the config's "optimizer" block), or None for
    `case.optimizer`. The schedule is built on the optimizer before `initialize`. `config`: the
    whole config, or None for `case.config()`. `deepspeed`: a `zeroshard.deepspeed.DeepSpeedEngine`, with
    DeepSpeed's methods.
    """
    import zeroshard

    if model is None:
        model = make_model(seed=seed, device=device, freeze=case.freeze, variant=case.variant)
    elif not isinstance(model, torch.nn.Module):
        torch.manual_seed(seed)
        model = model()
    kind = case.optimizer if optimizer is None else optimizer
    opt = make_optimizer(kind, model) if isinstance(kind, str) else kind(model)
    schedule = make_schedule(case, opt)
    engine_class = zeroshard.Engine
    if deepspeed:
        from zeroshard.deepspeed import DeepSpeedEngine as engine_class
    return zeroshard.initialize(model, opt, case.config() if config is None else config,
                                engine_class=engine_class), schedule


def make_engine(case: Case = Case(), **kwargs):
    """The engine of `make_engine_with_schedule` (same arguments), for tests that step no schedule."""
    return make_engine_with_schedule(case, **kwargs)[0]


def run_zeroshard(rank: int, world: int, device, case: Case, steps: int, skip: tuple[int, ...] = ()):
    """One rank's zeroshard run over the steps not in `skip`: (engine, mean loss over its micro-steps per step)."""
    engine, schedule = make_engine_with_schedule(case, device=device)
    return engine, train_steps(engine, schedule, case, world, rank, device, [s for s in range(steps) if s not in skip])


def train_steps(engine, schedule, case: Case, world: int, rank: int, device, steps,
                after_micro=None) -> list[float]:
    """Train the optimizer steps `steps` on this rank: each one's mean loss over its micro-steps;
    `after_micro(step, micro)` after each micro-step's `engine.step()`, when given."""
    losses = []
    for step in steps:
        step_loss = 0.0
        for micro in range(case.accumulation):
            x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / case.accumulation
            if after_micro is not None:
                after_micro(step, micro)
        if schedule is not None:
            schedule.step()
        losses.append(step_loss)
    return losses


def train_zeroshard(rank: int, world: int, device, case: Case, steps: int):
    """One rank's zeroshard run: (mean loss over its micro-steps per step, final weights)."""
    engine, losses = run_zeroshard(rank, world, device, case, steps)
    full = engine.full_state_dict()
    return losses, torch.cat([full[name].reshape(-1).cpu() for name, _ in engine.module.named_parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()



def train_reversal(engine, rank: int, device, steps: int) -> list[float]:
    """Train `engine`'s model of 16 features to map random rows (4 per rank, seeded by step and rank) to
    their reverse, with the mean squared error; the loss of each step."""
    losses = []
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(device)
        loss = torch.nn.functional.mse_loss(engine(x), x.flip(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
