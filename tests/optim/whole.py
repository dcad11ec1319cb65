"""Shared pieces of the whole-tensor optimizer tests: a small GPT, the optimizer mixes, one-process references.

A mix is built on a model by name: "muon" (torch's Muon on the blocks' matrices, AdamW on embeddings, head,
norms and biases: a list of two), "adafactor" (torch's Adafactor on everything), "lamb" (a trust-ratio
optimizer written here: torch has none). The reference is the same mix on one process over the global batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from zeroshard.app.models.gpt import GPT, Block, GPTConfig

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2): Adam's update scaled by a trust ratio ||w|| / ||update|| per tensor."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = state["exp_avg"] / (1 - b1 ** state["step"])
                v = state["exp_avg_sq"] / (1 - b2 ** state["step"])
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update, alpha=-group["lr"] * float(trust))


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalisation (torch/optim/_muon.py) with its arithmetic in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class Muon32(torch.optim.Muon):
    """torch.optim.Muon, its Newton-Schulz run in fp32. torch's runs in bf16, which turns a last-bit difference
    of a gradient (the ranks' sum in another order than one process's) into a bf16 step of the update: an
    exact comparison needs the fp32 arithmetic; `torch.optim.Muon` itself is compared at bf16's tolerance."""

    @torch.no_grad()
    def step(self, closure=None):
        import torch.optim._muon as muon

        plain, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, _newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            muon._zeropower_via_newtonschulz = plain


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    return p.dim() >= 2 and name.startswith("blocks.")


def make_optimizers(kind: str, model: nn.Module):
    if kind in ("muon", "torch_muon"):
        named = list(model.named_parameters())
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        rest = [p for n, p in named if not is_hidden_matrix(n, p)]
        muon = Muon32 if kind == "muon" else torch.optim.Muon
        return [muon(hidden, lr=2e-2, momentum=0.95, weight_decay=0.01),
                torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)]
    if kind == "adamw_sgd":  # two element-wise optimizers with different state keys
        named = list(model.named_parameters())
        return [torch.optim.AdamW([p for n, p in named if is_hidden_matrix(n, p)], lr=3e-3),
                torch.optim.SGD([p for n, p in named if not is_hidden_matrix(n, p)], lr=0.1, momentum=0.9)]
    if kind == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    if kind == "lamb":
        return Lamb(model.parameters(), lr=1e-2)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3)
    raise ValueError(kind)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(CFG.vocab_size, (rows, CFG.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def step_all(optimizers) -> None:
    for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
        opt.step()
        opt.zero_grad()


def reference(kind: str, steps: int, rows: int, accumulation: int, clip: float) -> tuple[list[float], torch.Tensor]:
    """One process over the global batch of `rows`: (loss per step, final weights)."""
    model = make_model()
    return _plain_loop(model, model, kind, steps, rows, accumulation, clip,
                       lambda x, micro: x.chunk(accumulation)[micro], lambda micro: contextlib.nullcontext())


def _plain_loop(model, call, kind: str, steps: int, rows: int, accumulation: int, clip: float, rows_of,
                sync_of) -> tuple[list[float], torch.Tensor]:
    """Plain PyTorch: `call` (the model, or DDP around it) on `rows_of(x, micro)` of each step's batch, under
    `sync_of(micro)`, then clipping and the optimizers' steps."""
    opts = make_optimizers(kind, model)
    losses = []
    for step in range(steps):
        x, y = batch(step, rows)
        total = 0.0
        for micro in range(accumulation):
            with sync_of(micro):
                loss = loss_of(call, rows_of(x, micro), rows_of(y, micro))
                (loss / accumulation).backward()
            total += loss.item() / accumulation
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        step_all(opts)
        losses.append(total)
    return losses, torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def rank_rows(x: torch.Tensor, rank: int, world: int, accumulation: int, micro: int) -> torch.Tensor:
    """Rank `rank`'s rows of micro-step `micro`: the global batch in accumulation chunks, each split by rank."""
    return x.chunk(accumulation)[micro].chunk(world)[rank]


def train(rank: int, world: int, device, kind: str, stage: int, steps: int, rows: int, accumulation: int,
          clip: float, dtype: str = "fp32", zero: dict | None = None, save_dir: str | None = None,
          load_dir: str | None = None) -> tuple[list[float], torch.Tensor]:
    """Steps `start`..`steps` of the mix on this rank's rows (`start`: 0, or the step a `load_dir` checkpoint
    was saved at); with `save_dir`, a checkpoint after the last; `zero`: more zero_optimization keys. Returns (this rank's loss per step, weights)."""
    import zeroshard

    model = make_model().to(device)
    config = {"train_micro_batch_size_per_gpu": rows // world // accumulation,
              "gradient_accumulation_steps": accumulation, "gradient_clipping": clip,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0,
                                    **(zero or {})},
              **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}
    engine = zeroshard.initialize(model, make_optimizers(kind, model), config,
                                  wrap=[Block] if stage == 3 else None)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    losses = []
    for step in range(engine.global_steps, steps):
        x, y = batch(step, rows)
        total = 0.0
        for micro in range(accumulation):
            xm, ym = rank_rows(x, rank, world, accumulation, micro), rank_rows(y, rank, world, accumulation, micro)
            loss = loss_of(engine, xm.to(device), ym.to(device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / accumulation
        losses.append(total)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    with zeroshard.gathered_parameters(list(model.parameters())):
        weights = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    return losses, weights


def train_ddp(rank: int, world: int, device, kind: str, steps: int, rows: int, accumulation: int,
              clip: float) -> tuple[list[float], torch.Tensor]:
    """The peer: torch's DistributedDataParallel with the same optimizers, on the same rows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model().to(device)
    ddp = DDP(model)
    return _plain_loop(model, ddp, kind, steps, rows, accumulation, clip,
                       lambda x, micro: rank_rows(x, rank, world, accumulation, micro).to(device),
                       lambda micro: ddp.no_sync() if micro < accumulation - 1 else contextlib.nullcontext())
