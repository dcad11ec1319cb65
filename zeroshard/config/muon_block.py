"""DeepSpeed's `"optimizer": {"type": "Muon"}` block: Muon for the hidden matrices, AdamW for the rest.

As DeepSpeed splits them (deepspeed/__init__.py `set_optimizer_flags`): a
trained parameter with two or more dimensions whose name contains neither
"embed" nor "lm_head" (any case) goes to Muon, every other to AdamW. A
parameter that already has a `use_muon` attribute keeps its own choice
(DeepSpeed overwrites it). torch's Muon takes matrices only, so a tensor of
three or more dimensions goes to AdamW (DeepSpeed reshapes a conv filter to
a matrix). The keys and defaults are DeepSpeed's (runtime/engine.py and
zero/muon/original_muon.py): `muon_lr` and `adam_lr` over `lr`, which both
groups take when they are unset; `weight_decay` for both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, Field

from zeroshard.config.values import FROZEN_STRICT, Betas, NonNegativeFloat, invalid

_MUON_LR, _ADAM_LR = 0.02, 3e-4  # DeepSpeed's MuonWithAuxAdam defaults, by group


def _ns_method(value: Any) -> str:
    if value not in ("gram", "standard"):
        raise invalid('must be "gram" or "standard"', value)
    return value


class MuonParams(BaseModel):
    """`optimizer.params` for type Muon: Muon for the hidden matrices, AdamW for the rest."""

    model_config = FROZEN_STRICT

    lr: NonNegativeFloat | None = Field(None, description=(
        "Learning rate of both groups where muon_lr or adam_lr is unset; null: 0.02 for Muon, 3e-4 for AdamW. "
        "DeepSpeed: optimizer.params.lr."))
    muon_lr: NonNegativeFloat | None = Field(None, description=(
        "Learning rate of the Muon group, over lr. DeepSpeed: optimizer.params.muon_lr."))
    adam_lr: NonNegativeFloat | None = Field(None, description=(
        "Learning rate of the AdamW group, over lr. DeepSpeed: optimizer.params.adam_lr."))
    momentum: NonNegativeFloat = Field(0.95, description=(
        "Muon's momentum (Nesterov). DeepSpeed: optimizer.params.momentum (default 0.95)."))
    weight_decay: NonNegativeFloat = Field(0.0, description=(
        "Decoupled weight decay of both groups. DeepSpeed: optimizer.params.weight_decay (default 0)."))
    betas: Betas = Field((0.9, 0.95), description=(
        "AdamW's coefficients. DeepSpeed: optimizer.params.betas (default [0.9, 0.95])."))
    eps: NonNegativeFloat = Field(1e-10, description=(
        "AdamW's denominator term. DeepSpeed: optimizer.params.eps (default 1e-10)."))
    ns_method: Annotated[Literal["gram", "standard"], BeforeValidator(_ns_method)] = Field("gram", description=(
        "DeepSpeed's Newton-Schulz variant (\"gram\": iterated on X X^T in fp16; \"standard\": in bf16). "
        "zeroshard runs torch.optim.Muon's standard quintic iteration in bf16 for both: the same "
        "coefficients and steps, another rounding (docs/optimizers.md). DeepSpeed: optimizer.params.ns_method "
        "(default \"gram\")."))


def takes_muon(name: str, p: torch.nn.Parameter) -> bool:
    """Whether the block gives parameter `name` to Muon: its own `use_muon`, else DeepSpeed's rule, and a
    matrix (torch's Muon takes no other shape)."""
    wanted = getattr(p, "use_muon", None)
    if wanted is None:
        wanted = p.dim() >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))
    return bool(wanted) and p.dim() == 2


def build_muon(p: MuonParams, parameters: list[torch.nn.Parameter], names: dict[int, str]
               ) -> list[torch.optim.Optimizer]:
    """[Muon over the hidden matrices, AdamW over the rest] of the trained `parameters` (either may be absent
    when it would be empty)."""
    trained = [q for q in parameters if q.requires_grad]
    muon = [q for q in trained if takes_muon(names.get(id(q), ""), q)]
    chosen = {id(q) for q in muon}
    rest = [q for q in trained if id(q) not in chosen]
    muon_lr = p.muon_lr if p.muon_lr is not None else p.lr if p.lr is not None else _MUON_LR
    adam_lr = p.adam_lr if p.adam_lr is not None else p.lr if p.lr is not None else _ADAM_LR
    built = []
    if muon:
        built.append(torch.optim.Muon(muon, lr=muon_lr, momentum=p.momentum, weight_decay=p.weight_decay))
    if rest:
        built.append(torch.optim.AdamW(rest, lr=adam_lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay))
    return built
