"""Which parameters form which unit at stage 3: modules of the classes the user names, or by size.

A unit is a module whose parameters are gathered together before its forward
and backward. Units nest: the root module is always a unit and takes what no
inner unit holds. A parameter used by several modules (a tied embedding and
output head) belongs to the innermost unit that contains all of its users,
so it is gathered whenever any of them runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from zeroshard.errors import ModelError


@dataclass
class UnitPlan:
    name: str  # the module's qualified name; "(root)" for the model itself
    module: nn.Module
    params: list[nn.Parameter]  # registration order; each parameter is in exactly one plan
    owners: list[nn.Module]  # the modules that hold these parameters directly (for initialisation)


def unit_modules(model: nn.Module, wrap: tuple[str, ...], min_numel: int) -> dict[str, nn.Module]:
    """Qualified name -> module for every unit module, the root ("") included.

    `wrap`: class names (as `type(m).__name__`); empty means the size policy:
    a module becomes a unit when the parameters it holds outside inner units
    number at least `min_numel` elements.
    """
    if wrap:
        found = {type(m).__name__ for m in model.modules()}
        missing = [c for c in wrap if c not in found]
        if missing:
            raise ModelError(f"stage 3 wrap classes {missing} match no module of the model; classes present: "
                             f"{', '.join(sorted(found))}")
        units = {name: m for name, m in model.named_modules() if type(m).__name__ in wrap}
    else:
        units = {}
        _pick_by_size(model, "", min_numel, units)
    units[""] = model
    return units


def _pick_by_size(module: nn.Module, name: str, min_numel: int, units: dict[str, nn.Module]) -> int:
    """Post-order: returns the elements of `module`'s subtree not yet in a unit."""
    free = sum(p.numel() for p in module.parameters(recurse=False))
    for child_name, child in module.named_children():
        free += _pick_by_size(child, f"{name}.{child_name}" if name else child_name, min_numel, units)
    if name and free >= min_numel:
        units[name] = module
        return 0
    return free


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
