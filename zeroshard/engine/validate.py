"""Checks on what the user hands to `initialize`, made before anything is changed.

Each failure is an exception that names the cause and the fix; the model and
optimizer are left as they were.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm.group import LaunchError
from zeroshard.config import ConfigError
from zeroshard.core.local import is_dtensor, local
from zeroshard.core.optim import OptimizerError, check_per_tensor, is_elementwise, is_fresh, one_optimizer
from zeroshard.core.optimizers import member_of
from zeroshard.dtypes import NAMES, torch_name
from zeroshard.errors import ModelError
from zeroshard.parallel.mesh import Mesh

_WRAPPED = "_zeroshard_wrapped"  # set on a module once an engine owns its parameters


def check_arguments(model, optimizer, group, wrap, init) -> torch.optim.Optimizer | None:
    """The kinds of `initialize`'s arguments, checked before anything else runs; the optimizer (a list of
    them as one `Optimizers`)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"model must be a torch.nn.Module; got {type(model).__name__} {model!r:.60}")
    optimizer = one_optimizer(model, optimizer)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise LaunchError(f"group must be a torch.distributed.ProcessGroup (or None for the world); "
                          f"got {type(group).__name__}")
    bad = [w for w in wrap or () if not (isinstance(w, type) and issubclass(w, nn.Module))]
    if bad:
        raise ConfigError(f"wrap takes module classes, such as wrap=[Block]; got {bad[0]!r} "
                          "(class names as strings go in zero_optimization.stage3_wrap_classes)")
    if init is not None and not callable(init) and not hasattr(init, "for_model"):
        raise ModelError(f"init must be a function of one module, such as lambda m: m.reset_parameters(); "
                         f"got {type(init).__name__}")
    return optimizer


def device_of(model: nn.Module) -> torch.device:
    """The one device all of the model's parameters are on."""
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ModelError("the model has no parameters; zeroshard shards parameters and their states")
    if len(devices) > 1:
        raise ModelError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                         "move the model to one device (model.to(device)) before zeroshard.initialize")
    return devices.pop()


def check_device_matches_group(device: torch.device, group: dist.ProcessGroup) -> None:
    backend = dist.get_backend(group)
    if device.type == "cuda" and backend != "nccl":
        raise ModelError(f"the model is on {device} but the process group's backend is {backend}; "
                         "use NCCL for CUDA models (init_process_group('nccl'), or let zeroshard start it)")
    if device.type == "cpu" and backend == "nccl":
        raise ModelError("the model is on the CPU but the process group's backend is nccl; "
                         "move the model to this rank's GPU (model.to(f'cuda:{local_rank}')) or use gloo")


def check_mesh_arguments(mesh, group, tied) -> None:
    """`mesh` and `tied` of `initialize`: a mesh replaces `group`; ties need a mesh."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise LaunchError(f"mesh must be a zeroshard.parallel.Mesh (zeroshard.parallel.build_mesh); "
                          f"got {type(mesh).__name__}")
    if mesh is not None and group is not None:
        raise LaunchError("give mesh or group, not both: with a mesh ZeRO runs over its dp dimension")
    if tied and mesh is None:
        raise LaunchError("tied names copies of a parameter held by several pipeline stages; it needs the "
                          "mesh (mesh=zeroshard.parallel.build_mesh(pp=...))")
    if tied is not None and not (isinstance(tied, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in tied.items())):
        raise LaunchError(f"tied maps a tie's name to this stage's parameter name, such as "
                          f"{{'embedding': 'wte.weight'}}; got {tied!r:.80}")


def check_mesh_config(mesh, config, init, model: nn.Module) -> None:
    """DTensor parameters need the mesh their tp is part of; what does not compose with tp or pp yet is refused."""
    foreign = [n for n, p in model.named_parameters() if is_dtensor(p)
               and (mesh is None or p.device_mesh != mesh.device_mesh["tp"])]
    if foreign:
        raise ModelError(f"parameters {foreign[:3]} are DTensors{' of another device mesh' if mesh else ''}: tensor "
                         "parallelism needs zeroshard to know its mesh, to sum and count gradients over tp. Build "
                         "one with zeroshard.parallel.build_mesh, parallelize over mesh.device_mesh['tp'] and pass "
                         "mesh= to initialize")
    if mesh is None or mesh.tp * mesh.pp == 1:
        return
    if config.zero_optimization.zeropp:
        raise ConfigError(f"ZeRO++ (zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients) on "
                          f"the mesh {mesh.describe()} is not supported yet: drop the ZeRO++ keys, or run ZeRO++ "
                          "without tp and pp")
    if init is not None:
        raise ModelError("init= (a model built on the meta device) on a mesh with tp or pp is not supported yet: "
                         "build this rank's part on the CPU or GPU, then parallelize it")


def check_model(model: nn.Module, param_dtype: torch.dtype = torch.float32) -> None:
    """Trainable parameters in fp32 or `param_dtype`, each with storage of its own, in no other engine."""
    if getattr(model, _WRAPPED, False):
        raise ModelError("this model is already wrapped by a zeroshard engine; build a fresh model "
                         "(and optimizer) for a new engine")
    allowed = {torch.float32, param_dtype}
    wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype not in allowed]
    if wrong:
        names = f"{[n for n, _ in wrong[:3]]}{' ...' if len(wrong) > 3 else ''}"
        dtype = torch_name(wrong[0][1])
        if param_dtype == torch.float32:
            raise ModelError(f"parameters {names} are {dtype} and are not float32, but the config trains "
                             "in fp32: keep the model in fp32 (model.float(), or from_pretrained(path, "
                             "dtype=torch.float32)), or enable mixed precision in the config "
                             '("bf16": {"enabled": true} or "fp16": {"enabled": true})')
        name, section = torch_name(param_dtype), NAMES[param_dtype]
        raise ModelError(f"parameters {names} are {dtype} but the config enables {section} ({name}): build "
                         f"the model in float32 (zeroshard casts it to {name}) or in {name}, or enable the "
                         "config section that matches the model's dtype")
    owners: dict[int, str] = {}
    for name, p in model.named_parameters():
        if p.is_meta:  # no storage yet: materialised unit by unit at stage 3
            continue
        ptr = local(p).untyped_storage().data_ptr()
        if ptr in owners:
            raise ModelError(f"parameters '{owners[ptr]}' and '{name}' share storage but are different "
                             "Parameter objects; flattening would untie them. Tie them as one Parameter "
                             "(b.weight = a.weight) or give each its own storage")
        owners[ptr] = name


def mark_wrapped(model: nn.Module) -> None:
    setattr(model, _WRAPPED, True)


def trainable_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """The optimizer's param groups, checked against the model; frozen parameters left out."""
    if not is_fresh(optimizer):  # Adagrad's constructor makes state: that is fresh
        raise OptimizerError("the optimizer already has state; pass a freshly built optimizer to "
                             "zeroshard.initialize")
    names = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise OptimizerError(f"the optimizer holds a tensor of shape {list(p.shape)} that is not a "
                                     "parameter of the model; build it from model.parameters()")
            seen.add(id(p))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise OptimizerError(f"parameters {missing} require grad but are in no param group of the optimizer; "
                             "add them to the optimizer or set requires_grad=False")
    return [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]


def whole_groups(optimizer: torch.optim.Optimizer) -> list[bool]:
    """For each param group, whether its optimizer needs tensors whole (each owned by one rank), checked to
    update each tensor from that tensor alone; element-wise ones (False) run on flat shards."""
    whole = []
    for group in optimizer.param_groups:
        whole.append(not is_elementwise(member_of(optimizer, group), group))
        if whole[-1]:
            check_per_tensor(member_of(optimizer, group), group)
    return whole
