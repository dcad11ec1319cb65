"""Which parameters form which unit at stage 3: modules of the classes the user names, or by size.

A unit is a module whose parameters are gathered together before its forward
and backward. Units nest: the root module is always a unit and takes what no
inner unit holds. A parameter used by several modules (a tied embedding and
output head) belongs to the innermost unit that contains all of its users,
so it is gathered whenever any of them runs.

A unit must be a module that runs: its forward hooks gather it. A container
without a forward of its own (`nn.ModuleList`, `nn.ModuleDict`,
`nn.ParameterList`) is never called, so it is never a unit: the size policy
makes units of its children that run instead, and what it holds directly
goes to the nearest enclosing unit.

A leaf module (`zero_optimization.leaf_module`, or DeepSpeed's
`set_z3_leaf_modules`, which marks the module `_z3_leaf`) is a unit that
holds everything inside it: no unit is made inside a leaf, so an MoE block
gathers all its experts at once, whichever of them run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from zeroshard.config.zero import LeafModules
from zeroshard.errors import ModelError


@dataclass
class UnitPlan:
    name: str  # the module's qualified name; "(root)" for the model itself
    module: nn.Module
    params: list[nn.Parameter]  # registration order; each parameter is in exactly one plan
    owners: list[nn.Module]  # the modules that hold these parameters directly (for initialisation)


def unit_modules(model: nn.Module, wrap: tuple[str, ...], min_numel: int,
                 leaves: LeafModules = LeafModules()) -> dict[str, nn.Module]:
    """Qualified name -> module for every unit module, the root ("") included.

    `wrap`: class names (as `type(m).__name__`); empty means the size policy:
    a module that runs becomes a unit when the parameters it holds outside inner
    units number at least `min_numel` elements; a container that reaches it
    makes units of its children that run and hold elements outside inner units.
    """
    if wrap:
        found = {type(m).__name__ for m in model.modules()}
        missing = [c for c in wrap if c not in found]
        if missing:
            raise ModelError(f"stage 3 wrap classes {missing} match no module of the model; classes present: "
                             f"{', '.join(sorted(found))}")
        containers = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in wrap and not runs(m)})
        if containers:
            raise ModelError(f"stage 3 wrap classes {containers} have no forward of their own (containers): they "
                             "are never called, so their parameters would never be gathered; name the classes of "
                             "the modules inside them that run (the blocks), or leave wrap out")
        units = {name: m for name, m in model.named_modules() if type(m).__name__ in wrap}
    else:
        units = {}
        _pick_by_size(model, "", min_numel, units)
    leaf = leaf_modules(model, leaves)
    units = {name: m for name, m in units.items() if not any(_inside(name, lf) and name != lf for lf in leaf)}
    units |= leaf
    units[""] = model
    return units


def leaf_modules(model: nn.Module, leaves: LeafModules) -> dict[str, nn.Module]:
    """The leaf modules by qualified name (the outermost where leaves nest); each entry must match one."""
    found = {name: m for name, m in model.named_modules() if name and (
        getattr(m, "_z3_leaf", False) or _class_matches(m, leaves.classes) or name in leaves.names
        or any(name == s or name.endswith("." + s) for s in leaves.name_suffixes))}
    classes = {n for m in model.modules() for n in (type(m).__name__, _path(type(m)))}
    unknown = [*(c for c in leaves.classes if c not in classes), *(n for n in leaves.names if n not in found),
               *(s for s in leaves.name_suffixes if not any(n == s or n.endswith("." + s) for n in found))]
    if unknown:
        raise ModelError(f"zero_optimization.leaf_module entries {unknown} match no module of the model; classes "
                         f"present: {', '.join(sorted({type(m).__name__ for m in model.modules()}))}")
    containers = sorted(name for name, m in found.items() if not runs(m))
    if containers:
        raise ModelError(f"leaf modules {containers} have no forward of their own (containers): they are never "
                         "called, so they cannot be gathered whole; name the module that calls them")
    return {name: m for name, m in found.items() if not any(_inside(name, o) and name != o for o in found if o)}


def _class_matches(module: nn.Module, classes: tuple[str, ...]) -> bool:
    return type(module).__name__ in classes or _path(type(module)) in classes


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def runs(module: nn.Module) -> bool:
    """Whether calling `module` runs a forward of its own (a container's is nn.Module's, which raises)."""
    return type(module).forward is not nn.Module.forward


def _pick_by_size(module: nn.Module, name: str, min_numel: int, units: dict[str, nn.Module],
                  free: dict[str, int] | None = None) -> int:
    """Post-order: returns the elements of `module`'s subtree not yet in a unit (`free`: the same, by name)."""
    free = {} if free is None else free
    children = {f"{name}.{child_name}" if name else child_name: child for child_name, child in module.named_children()}
    total = sum(p.numel() for p in module.parameters(recurse=False))
    total += sum(_pick_by_size(child, qualified, min_numel, units, free) for qualified, child in children.items())
    if name and total >= min_numel:
        if runs(module):
            units[name] = module
            total = 0
        else:
            total -= _split(children, free, units)
    free[name] = total
    return total


def _split(children: dict[str, nn.Module], free: dict[str, int], units: dict[str, nn.Module]) -> int:
    """A container's hooks would never fire: its children that run become units instead, the children of a
    container inside it in turn. Returns the elements they took."""
    taken = 0
    for qualified, child in children.items():
        if not free[qualified]:
            continue
        if runs(child):
            units[qualified] = child
            taken += free[qualified]
        else:
            grandchildren = {f"{qualified}.{n}": c for n, c in child.named_children()}
            taken += _split(grandchildren, free, units)
    return taken


def plan_units(model: nn.Module, units: dict[str, nn.Module]) -> list[UnitPlan]:
    """Assign every parameter to the innermost unit enclosing all modules that own it."""
    owners: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for mod_name, module in modules.items():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod_name)
            params[id(p)] = p
    plans = {name: UnitPlan(name or "(root)", m, [], []) for name, m in units.items()}
    for pid, names in owners.items():
        enclosing = [u for u in units if all(_inside(n, u) for n in names)]
        plan = plans[max(enclosing, key=len)]
        plan.params.append(params[pid])
        plan.owners.extend(modules[n] for n in names if all(modules[n] is not m for m in plan.owners))
    # Registration order of the unit modules: the order forward usually meets them.
    order = [name for name, _ in model.named_modules() if name in plans]
    return [plans[name] for name in order if plans[name].params]


def _inside(module_name: str, unit_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def flat_parts(params: list[nn.Parameter], group_of: dict[int, int], groups: int,
               persistence_threshold: int) -> list[tuple[int | None, bool, list[nn.Parameter]]]:
    """How a unit's `params` split into flat buffers: (param group, persistent, parameters) each.

    One flat per optimizer param group (`group_of`: id -> group, of `groups`), dtype and persistence
    (under `persistence_threshold` elements: whole on every rank), then the frozen ones (group None,
    not in `group_of`); small frozen parameters stay as they are, never flattened nor communicated.
    """
    parts = []
    for g in [*range(groups), None]:
        mine = [p for p in params if group_of.get(id(p)) == g]
        for dtype in dict.fromkeys(p.dtype for p in mine):
            for persistent in (False, True):
                chosen = [p for p in mine if p.dtype == dtype and (p.numel() < persistence_threshold) == persistent]
                if chosen and not (g is None and persistent):
                    parts.append((g, persistent, chosen))
    return parts
