"""Tiny transformers models built from config, for the Hugging Face tests (hidden 32, 2 layers)."""

from __future__ import annotations

import torch

VOCAB = 96
STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # norms sharded too


def config_of(kind: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 4}
    if kind == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    if kind == "bert":
        return tf.BertConfig(**common, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[kind]
    return cls(**common, hidden_size=32, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64)


def auto_class(kind: str):
    import transformers as tf

    return tf.AutoModelForMaskedLM if kind == "bert" else tf.AutoModelForCausalLM


def layer_class(model) -> type:
    """The class of the model's repeated layer: one stage-3 unit each."""
    return next(type(m) for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block", "BertLayer")))


def batch(seed: int, rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def train_lm(engine, rank: int, device, steps: int) -> list[float]:
    """`steps` steps of a causal LM through `engine` on rank `rank`'s batches (`batch(10 * step + rank)`, the
    ids their own labels); returns the losses."""
    losses = []
    for step in range(steps):
        ids = batch(10 * step + rank).to(device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
