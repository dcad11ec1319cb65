"""GPTStage: the built-in GPT split into pipeline stages, Megatron's way.

Blocks are divided into contiguous runs, the earlier stages taking one more
when they do not divide evenly. The first stage also holds the embeddings,
the last the final norm and the output head. The head is tied to the token
embedding: on one stage it stays one parameter; on several, the last stage
holds a copy, declared with `tied()` so that zeroshard sums the two copies'
gradients across the stages and they stay equal.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeroshard.app.models.gpt import GPT, run_blocks

TIE = "embedding"


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss, as a pipeline schedule's `loss_fn`: cross-entropy of the logits, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def stage_layers(n_layer: int, index: int, stages: int) -> range:
    """The blocks stage `index` of `stages` holds."""
    if not 0 <= index < stages or stages > n_layer:
        raise ValueError(f"stage {index} of {stages}: a GPT of {n_layer} blocks splits into 1 to {n_layer} stages")
    base, extra = divmod(n_layer, stages)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


class GPTStage(nn.Module):
    """Stage `index` of `stages` of `gpt` (its modules are moved in, not copied; the head copy excepted)."""

    def __init__(self, gpt: GPT, index: int, stages: int):
        super().__init__()
        self.cfg, self.first, self.last = gpt.cfg, index == 0, index == stages - 1
        self.layers = stage_layers(gpt.cfg.n_layer, index, stages)
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in self.layers)
        if self.last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.cfg.n_embd, gpt.cfg.vocab_size, bias=False)
            self.head.weight = gpt.head.weight if self.first else nn.Parameter(gpt.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids on the first stage, activations on the others; logits from the last."""
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        x = run_blocks(self.blocks, x, self.cfg.checkpointing if self.training else "")
        return self.head(self.ln_f(x)) if self.last else x

    def tied(self) -> dict[str, str]:
        """The tie this stage declares to zeroshard.initialize(tied=...): the embedding and the head's copy."""
        if self.first and not self.last:
            return {TIE: "wte.weight"}
        if self.last and not self.first:
            return {TIE: "head.weight"}
        return {}

    def full_name(self, name: str) -> str:
        """The parameter's name in the whole GPT ("blocks.0.ln1.weight" of stage 1 -> "blocks.2.ln1.weight")."""
        if name.startswith("blocks."):
            _, local_index, rest = name.split(".", 2)
            return f"blocks.{self.layers[int(local_index)]}.{rest}"
        return "wte.weight" if name == "head.weight" else name
