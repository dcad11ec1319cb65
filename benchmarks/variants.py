"""One builder per benchmarked variant: wrap the model, make the optimizer,
and return a step function.

A step function runs one training step on this rank's micro batch
(forward, backward, optimizer step, gradients cleared) and returns the loss.
It carries what it trains for callers that need more than steps (the
checkpoint benchmark, the worker's memory report): `step.model` and
`step.optimizer` for the torch wrappers, `step.engine` for DeepSpeed and
zeroshard.
Every builder receives the same freshly initialized model and the same
`Settings`, so the variants differ only in how they parallelize.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Settings:
    mode: str  # "plain": Adam as users call it; "fused": Adam(fused=True)
    lr: float
    micro_batch: int  # sequences per rank per step
    bucket_elems: int  # gradient bucket, in elements, given to every variant that has one
    dtype: str = "fp32"  # "bf16": zeroshard enables bf16 (fp32 master); peers train the model cast to bf16


def make_adam(params: Iterable, s: Settings) -> torch.optim.Optimizer:
    # plain mode passes no `fused`/`foreach`, so torch picks its own default.
    extra = {"fused": True} if s.mode == "fused" else {}
    return torch.optim.Adam(params, lr=s.lr, **extra)


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer) -> StepFn:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.model, step.optimizer = model, opt
    return step


def _ddp(model: nn.Module, s: Settings) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, bucket_cap_mb=s.bucket_elems * 4 / 2**20)


def build_ddp(model: nn.Module, s: Settings) -> StepFn:
    ddp = _ddp(model, s)
    return _torch_step(ddp, make_adam(ddp.parameters(), s))


def build_zero_redundancy(model: nn.Module, s: Settings) -> StepFn:
    """ZeroRedundancyOptimizer over DDP, as the torch documentation shows it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model, s)
    extra = {"fused": True} if s.mode == "fused" else {}
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=s.lr, **extra)
    return _torch_step(ddp, opt)


def build_fsdp1(strategy: str) -> Callable[[nn.Module, Settings], StepFn]:
    """FSDP1 with each Block a unit: SHARD_GRAD_OP is ZeRO-2, FULL_SHARD ZeRO-3."""
    def build(model: nn.Module, s: Settings) -> StepFn:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        fsdp = FSDP(
            model,
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        return _torch_step(fsdp, make_adam(fsdp.parameters(), s))

    return build


def build_fsdp2(reshard_after_forward: bool) -> Callable[[nn.Module, Settings], StepFn]:
    """FSDP2 with each Block a unit: reshard_after_forward=False is ZeRO-2, True ZeRO-3."""
    def build(model: nn.Module, s: Settings) -> StepFn:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        return _torch_step(model, make_adam(model.parameters(), s))

    return build


def _engine_step(engine) -> StepFn:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()  # also clears the gradients
        return loss.detach()

    step.engine = engine
    return step


def build_deepspeed(stage: int) -> Callable[[nn.Module, Settings], StepFn]:
    def build(model: nn.Module, s: Settings) -> StepFn:
        import deepspeed  # needs DS_ACCELERATOR=cpu, set by the launcher

        config = {
            "train_micro_batch_size_per_gpu": s.micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": s.bucket_elems,
                "allgather_bucket_size": s.bucket_elems,
                "overlap_comm": True,  # as zeroshard is configured (DeepSpeed's own default: False)
            },
            # a torch optimizer is "untested" for DeepSpeed's ZeRO; this accepts it
            "zero_allow_untested_optimizer": True,
            # DeepSpeed clips the gradient norm to 1.0 unless told otherwise; no other variant clips
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,  # keep the rank logs quiet
        }
        opt = make_adam(model.parameters(), s)
        # the gloo group already exists, so DeepSpeed must not create another
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        return _engine_step(engine)

    return build


def build_zeroshard(stage: int, overlap_param_gather: bool | None = None, reuse_distance: int | None = None,
                    optimizer: Callable[[nn.Module, Settings], torch.optim.Optimizer | list] | None = None,
                    ) -> Callable[[nn.Module, Settings], StepFn]:
    """`overlap_param_gather` (stages 1-2), `reuse_distance` (stage 3's stage3_max_reuse_distance): those keys
    set; None: their defaults. `optimizer(model, settings)`: what the engine steps (a torch optimizer, or a list
    of them over disjoint parameters); None: `make_adam` over all parameters."""
    def build(model: nn.Module, s: Settings) -> StepFn:
        import zeroshard

        zero = {"stage": stage, "reduce_bucket_size": s.bucket_elems, "overlap_comm": True}
        if overlap_param_gather is not None:
            zero["overlap_param_gather"] = overlap_param_gather
        if reuse_distance is not None:
            zero["stage3_max_reuse_distance"] = reuse_distance
        config = ({} if s.dtype == "fp32" else {s.dtype: {"enabled": True}}) | {
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": s.micro_batch,
            "gradient_accumulation_steps": 1,
        }
        wrap = [type(model.blocks[0])] if stage == 3 else None  # the same units as the FSDP peers
        opt = optimizer(model, s) if optimizer is not None else make_adam(model.parameters(), s)
        engine = zeroshard.initialize(model, opt, config, wrap=wrap)
        return _engine_step(engine)

    return build


def build_single(model: nn.Module, s: Settings) -> StepFn:
    """No communication: each rank trains the model alone on its own micro batch (the same model and per-rank
    batch as every other variant, the ranks side by side as theirs are): the step the others add to."""
    return _torch_step(model, make_adam(model.parameters(), s))


def cast_for_peer(model: nn.Module, s: Settings) -> nn.Module:
    """Peers have no bf16 mode with fp32 master weights here: they train the model cast to bf16."""
    return model.to(torch.bfloat16) if s.dtype == "bf16" else model


BUILDERS: dict[str, Callable[[nn.Module, Settings], StepFn]] = {
    "single": build_single,
    "ddp": build_ddp,
    "zero_redundancy": build_zero_redundancy,
    "fsdp1_shard_grad_op": build_fsdp1("SHARD_GRAD_OP"),
    "fsdp2": build_fsdp2(reshard_after_forward=False),
    "fsdp1_full_shard": build_fsdp1("FULL_SHARD"),
    "fsdp2_reshard": build_fsdp2(reshard_after_forward=True),
    **{f"deepspeed_z{stage}": build_deepspeed(stage) for stage in range(4)},
    **{f"zeroshard_s{stage}": build_zeroshard(stage) for stage in range(4)},
    **{f"zeroshard_s{stage}_overlap": build_zeroshard(stage, overlap_param_gather=True) for stage in (1, 2)},
    "zeroshard_s3_reuse1": build_zeroshard(3, reuse_distance=1),  # the units backward needs first stay whole
    "zeroshard_s3_reuse": build_zeroshard(3, reuse_distance=10**9),  # DeepSpeed's default reuse distance
}
# The library each variant imports, so a rank can import it before its baseline RSS reading.
LIBRARY = {name: "torch.distributed.fsdp" for name in BUILDERS if name.startswith("fsdp")}
LIBRARY |= {"single": "torch.optim", "ddp": "torch.nn.parallel", "zero_redundancy": "torch.distributed.optim"}
LIBRARY |= {f"deepspeed_z{s}": "deepspeed" for s in range(4)}
LIBRARY |= {name: "zeroshard" for name in BUILDERS if name.startswith("zeroshard_")}
PEERS = [name for name in BUILDERS if not name.startswith("zeroshard_")]
ZEROSHARD = [name for name in BUILDERS if name.startswith("zeroshard_")]
