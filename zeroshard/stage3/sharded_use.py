"""Which sharded parameter a failed forward used: a raw shape error turned into one that names it.

Between uses a stage-3 parameter is a 0-element tensor, so a forward that
reads it while its unit is not gathered fails deep inside PyTorch ("mat2
must be a matrix, got 1-D tensor", "weight of shape [0]"), naming nothing.
That happens when the module whose forward uses a parameter is not the one
whose hooks gather it: a parent that reads a child unit's weight directly
(`F.linear(h, self.wte.weight)` after `wte` ran and was released), or a
module that is never called. After a forward fails, `sharded_use` looks
through the traceback's frames, innermost first, for an empty parameter of
a unit that is not whole: among each frame's local values (a parameter, or
a module's own parameters) and the attribute chains of its failing line
(`self.wte.weight`). It reads only what the frames hold: no tensor is
touched and nothing runs.
"""

from __future__ import annotations

import ast
import linecache
from types import FrameType, TracebackType

import torch.nn as nn

from zeroshard.errors import ModelError


def sharded_use(exc: BaseException, model: nn.Module, units) -> ModelError | None:
    """The error naming the empty sharded parameter `exc`'s forward used, or None if its frames hold none."""
    empty = {id(p): unit for unit in units if not unit.whole for flat in unit.gathered_flats for p in flat.params
             if p.numel() == 0}
    if not empty:
        return None
    for frame in reversed(_frames(exc.__traceback__)):
        for value in _values(frame):
            held = [value] if isinstance(value, nn.Parameter) else (
                list(value.parameters(recurse=False)) if isinstance(value, nn.Module) else [])
            used = next((p for p in held if id(p) in empty), None)
            if used is not None:
                return _error(used, empty[id(used)], frame, model)
    return None


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _values(frame: FrameType) -> list[object]:
    """The frame's local values, after what the attribute chains of its current line reach."""
    local = frame.f_locals
    reached = []
    try:
        tree = ast.parse(linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip())
    except SyntaxError:  # one line of a statement over several: its locals still count
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Attribute):
            value = _resolve(node, local)
            if value is not None:
                reached.append(value)
    return reached + list(local.values())


def _resolve(node: ast.expr, local: dict) -> object | None:
    """`a.b.c` read from the frame's locals (plain attribute reads only), or None."""
    if isinstance(node, ast.Name):
        return local.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, local)
        if isinstance(owner, nn.Module):
            return getattr(owner, node.attr, None)
    return None


def _error(param: nn.Parameter, unit, frame: FrameType, model: nn.Module) -> ModelError:
    name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is param), "?")
    code = frame.f_code
    user = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # a method's self
    modules = {id(m): n or "(root)" for n, m in model.named_modules()}
    where = (f"{code.co_name}() of module '{modules[id(user)]}' ({type(user).__name__})" if id(user) in modules
             else f"{code.co_name}()")
    module = unit.module
    return ModelError(
        f"stage 3: parameter '{name}' of unit '{unit.name}' was used in {where} while sharded (a 0-element tensor "
        f"between uses): a unit is gathered only while its own module ({type(module).__name__}) runs its forward, "
        "and this use came from another module's forward, or from a module that is never called. Make the module "
        "whose forward uses it a unit, or one enclosing both (wrap=[its class], or zero_optimization."
        "stage3_wrap_classes), or read it inside zeroshard.gathered_parameters")
