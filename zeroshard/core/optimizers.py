"""Several optimizers over disjoint parameters, stepped as one (torchtitan's optimizer container).

The standard Muon recipe is two optimizers: Muon for the hidden matrices,
AdamW for embeddings, head, norms and biases. `initialize(model, [muon,
adamw], config)` wraps them in `Optimizers`, a `torch.optim.Optimizer` whose
param groups are the very group dicts of its members (an LR scheduler built
on the container drives them all) and whose state is one dict the members
share: each reads only its own tensors' entries, so the engine and the
checkpoints see one optimizer.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class Optimizers(torch.optim.Optimizer):
    """The members' param groups in order, one shared state, one `step`."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        state: defaultdict = defaultdict(dict)
        for member in self.optimizers:
            state.update(member.state)  # Adagrad's constructor makes state
        self.__setstate__({"defaults": {}, "state": state, "param_groups": []})
        self._link()

    def _link(self) -> None:
        """Point the members at the container's state, and the container at the members' groups."""
        self.param_groups = [group for member in self.optimizers for group in member.param_groups]
        for member in self.optimizers:
            member.state = self.state

    def optimizer_of(self, group: dict) -> torch.optim.Optimizer:
        """The member that owns param group `group` (one of `param_groups`)."""
        return next(m for m in self.optimizers if any(g is group for g in m.param_groups))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise TypeError("Optimizers.step takes no closure: each member steps on the gradients already there")
        for member in self.optimizers:
            member.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.optimizers:
            member.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load over all groups, then the members take the loaded groups and state back."""
        super().load_state_dict(state_dict)
        groups = iter(self.param_groups)
        for member in self.optimizers:
            member.param_groups = [next(groups) for _ in member.param_groups]
        self._link()

    def __repr__(self) -> str:
        return "Optimizers(" + ", ".join(type(m).__name__ for m in self.optimizers) + ")"


def member_of(optimizer: torch.optim.Optimizer, group: dict) -> torch.optim.Optimizer:
    """The torch optimizer whose class and settings step `group`: a member of `Optimizers`, else `optimizer`."""
    return optimizer.optimizer_of(group) if isinstance(optimizer, Optimizers) else optimizer


def members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers an optimizer is made of: the members of `Optimizers`, else itself."""
    return optimizer.optimizers if isinstance(optimizer, Optimizers) else [optimizer]


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class name; several optimizers' names joined: "Optimizers(Muon, AdamW)"."""
    return repr(optimizer) if isinstance(optimizer, Optimizers) else type(optimizer).__name__
