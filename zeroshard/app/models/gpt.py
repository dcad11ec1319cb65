"""A small GPT (decoder-only transformer) with a tied token embedding.

The output head reuses the token embedding matrix, so one parameter is used
twice per forward: the case every sharding scheme must get right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 128  # context length, tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # kept at 0 so ranks and references are deterministic
    # Activation checkpointing of each block: "" (off), "reentrant" or "non_reentrant"
    # (torch.utils.checkpoint's use_reentrant=True / False), or "deepspeed"
    # (zeroshard.deepspeed.checkpointing.checkpoint: the engine's activation_checkpointing block applies).
    checkpointing: str = ""


# Named sizes used by the demo, the tests and the benchmarks.
PRESETS = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "demo": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "4m": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=288),
    "100m": GPTConfig(block_size=128, n_layer=12, n_head=12, n_embd=816),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

        self.head_dim = cfg.n_embd // cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qkv's output features are laid out head by head (q, k, v of one head together), so a
        # column split over tp ranks (zeroshard.parallel.gpt_tp_plan) gives each rank whole heads.
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)  # -1: the heads this rank holds
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """One transformer block: the natural unit of parameter sharding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the mean cross-entropy loss when `targets` is given, else the logits."""
        t = idx.shape[1]
        x = self.run_blocks(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, x, self.cfg.checkpointing if self.training else "")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpointing: str) -> torch.Tensor:
    """`x` through each block in turn, each checkpointed as `checkpointing` says (GPTConfig.checkpointing)."""
    for block in blocks:
        if checkpointing == "deepspeed":
            from zeroshard.deepspeed import checkpointing as deepspeed_checkpointing  # the facade, when asked for

            x = deepspeed_checkpointing.checkpoint(block, x)
        elif checkpointing:
            x = checkpoint(block, x, use_reentrant=checkpointing == "reentrant")
        else:
            x = block(x)
    return x
