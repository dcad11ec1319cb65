"""`zeroshard.initialize`: one descent from what the user passes to a working engine.

Each step is one call into one module, made once, in this order; no step
calls back into a module an earlier step has left (`tests/engine/test_descent.py`):

1. `validate.py`: the kinds of the arguments.
2. `load.py`: the module (out of `torch.compile`), the config (every
   "auto" resolved, `wrap=`'s classes merged before validation) and the
   optimizer (the one passed, or the config's block's).
3. `join.py`: this rank's device and the process group, joined here only.
4. `checks.py`: every check of the model, optimizer and config.
5. `layout.py`: the plan: the buckets (stages 0-2) or units (stage 3).
6. `agreement.py`: one exchange, in which every rank learns that every
   other passed its checks, holds the same model and config, and fits in
   memory, or every rank raises the same error. Nothing is allocated
   before it.
7. `build.py`: the parts (flat buffers, broadcasts, shards, hooks).
8. `config/build.py`: the LR schedule on the built optimizer.
9. `engine.py`: `Engine(parts, config, lr_scheduler)`, which builds nothing.

A failure before the agreement that only this rank meets (its config file,
a meta parameter it edited) is carried down to the agreement, so every rank
raises it; in one process it is raised where it is found.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.config import Config
from zeroshard.config.build import SchedulerArg, schedule_for
from zeroshard.config.offload_merge import OffloadArg
from zeroshard.engine.agreement import agree
from zeroshard.engine.build import build
from zeroshard.engine.checks import check
from zeroshard.engine.engine import Engine
from zeroshard.engine.join import join
from zeroshard.engine.layout import make_plan
from zeroshard.engine.load import load
from zeroshard.engine.validate import check_arguments, check_mesh_arguments
from zeroshard.parallel.mesh import Mesh

log = logging.getLogger("zeroshard.config")


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    config: Config | dict | str | Path | None = None,
    group: dist.ProcessGroup | None = None,
    wrap: list[type[nn.Module]] | None = None,
    init: Callable[[nn.Module], None] | None = None,
    *,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: SchedulerArg = None,
    mesh: Mesh | None = None, tied: dict[str, str] | None = None,
    offload: OffloadArg = None, engine_class: type[Engine] = Engine,
) -> Engine:
    """Wrap `model` and `optimizer` for ZeRO training on `group` (default: the world).

    The default process group is initialized from torchrun's environment if it is not yet. Rank 0's parameter
    values are broadcast to every rank. `optimizer`: a torch optimizer, or a list of them over disjoint parameters
    (Muon for the matrices, AdamW for the rest), stepped as one `zeroshard.Optimizers`. `wrap` (stage 3):
    module classes whose instances each form a unit, as the config key `zero_optimization.stage3_wrap_classes`.
    `init` (stage 3, a model built under `torch.device("meta")`): `init(module)` initialises the parameters a
    module holds directly; the model is materialised unit by unit on this rank's device, keeping only shards.
    Without `optimizer`, the config's "optimizer" block builds one, over `model_parameters` when given
    (parameters or param-group dicts, as DeepSpeed's; a trainable parameter left out of them is an error naming
    it: freeze it with requires_grad_(False) or list it); a model that trains nothing (every parameter frozen: a
    reference or teacher model) needs neither, and is sharded and gathered for its forwards. With `optimizer`, an "optimizer" block must agree with
    it ("auto" takes its values), and `model_parameters`, if given, must hold the same trainable parameters.
    `mesh`, `tied`: ZeRO over the mesh's `dp`, the model being this rank's part (its pipeline stage, over
    `tp`); tie name -> this stage's copy (docs/parallel.md).
    `lr_scheduler`: a torch LR scheduler built on `optimizer`, or a function optimizer -> scheduler (called on
    `engine.optimizer`; needed when the block builds the optimizer); else the config's "scheduler" block.
    Either becomes `engine.lr_scheduler`, stepped by `engine.step()` after each applied optimizer step, as
    DeepSpeed does.
    `offload`: the config's offload blocks from code: "cpu" or "nvme" (the optimizer state's device,
    `zero_optimization.offload_optimizer.device`), or a dict with any of "optimizer" and "param" (devices
    "none", "cpu", "nvme"), "nvme_path" (for each block on "nvme") and "ratio" (of the optimizer state), such
    as {"optimizer": "nvme", "param": "cpu", "nvme_path": "/local_nvme"}. It fills the keys the config leaves
    out; a key the config sets to another value is a `ConfigError` (docs/deepspeed-config.md).
    `engine_class`: what is built, `Engine` or a subclass (zeroshard.deepspeed.initialize's `DeepSpeedEngine`).

    Rank 0 logs one block: every "auto" resolved, every batch key derived, every DeepSpeed key with no effect
    (zeroshard.config.logs makes it visible). A config that fails on one rank only (a typo in that rank's
    file) raises `ConfigError` on every rank, naming the rank, instead of leaving the others waiting for it.
    """
    optimizer = check_arguments(model, optimizer, group, wrap, init)
    check_mesh_arguments(mesh, group, tied)
    loaded = load(model, optimizer, config, group, wrap, model_parameters, lr_scheduler, offload)
    joined = join(loaded.model, mesh.group("dp") if mesh is not None else group, loaded)
    checked = check(loaded, init, mesh)
    layout = make_plan(loaded.model, loaded.config, checked)
    host_short = agree(joined, loaded, checked)
    parts = build(loaded, joined, checked, layout, host_short, mesh, tied)
    engine = engine_class(parts, loaded.config, schedule_for(loaded.config, parts.optimizer, lr_scheduler))
    if joined.comm.rank == 0 and loaded.report:
        log.info("%s", loaded.report)
    return engine
