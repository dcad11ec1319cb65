"""A small mixture-of-experts model whose ranks run different modules, as MoE and multimodal code does.

- each expert is a module of its own, called only with the tokens routed to it (top-1 or top-2): an
  expert with no tokens on a rank is not called there;
- a side tower (an image encoder, say) runs only for batches that carry its input;
- `repeats` runs the last block that many times (weights shared): ranks may call a unit a different
  number of times;
- the loss adds the router's load-balancing auxiliary loss (Switch Transformer's: E x sum f_e p_e).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, EXPERTS, SIDE = 64, 32, 48, 4, 12
AUX = 0.01


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, top: int):
        super().__init__()
        self.top = top
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        tokens = x.reshape(-1, DIM)
        probs = self.router(tokens).float().softmax(-1)
        weights, chosen = probs.topk(self.top, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():  # an expert with no tokens here is not called
                out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None].to(x.dtype))
        share = F.one_hot(chosen[:, 0], EXPERTS).float().mean(0)
        aux = EXPERTS * (share * probs.mean(0)).sum()
        return out.reshape(x.shape), aux


class Block(nn.Module):
    def __init__(self, top: int):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE(top)

    def forward(self, x):
        out, aux = self.moe(self.norm(x))
        return x + out, aux


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(SIDE, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, image):
        return self.out(torch.tanh(self.proj(image)))


class MoENet(nn.Module):
    def __init__(self, top: int = 1, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.tower = Tower()
        self.blocks = nn.ModuleList(Block(top) for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets, image=None, repeats: int = 1):
        h = self.embed(tokens)
        if image is not None:  # only batches with an image run the tower
            h = h + self.tower(image)[:, None, :].to(h.dtype)
        aux = 0.0
        for i, block in enumerate(self.blocks):
            for _ in range(repeats if i == len(self.blocks) - 1 else 1):
                h, a = block(h)
                aux = aux + a
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX * aux


def batch(step: int, micro: int, rank: int, rows: int = 2, length: int = 4) -> dict:
    """Rank `rank`'s micro-batch: the tower runs on every other (rank + step + micro), the last block twice
    on every third: the ranks of one step differ in both."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    tokens = torch.randint(VOCAB, (rows, length + 1), generator=g)
    turn = rank + step + micro
    image = torch.randn(rows, SIDE, generator=g) if turn % 2 == 0 else None
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "image": image, "repeats": 2 if turn % 3 == 0 else 1}


UNITS = (Expert, Block, Tower)  # each expert, block and the tower a unit
