"""Count a Hugging Face model's parameters Ψ, and its largest unit, from its `config.json` alone.

No model is built and nothing is allocated: the counts are closed forms of
the configuration's sizes, for the common decoder families (llama, mistral,
qwen2, gpt2, gpt_neox, opt). The largest unit is one transformer layer, the
block that stage 3 gathers whole while it computes. Models that can be built
(the demo's presets) are counted by their owner, which hands the numbers in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class ParamCount:
    """Ψ and the largest unit, in elements (parameters), for a named model."""

    name: str
    numel: int  # Ψ: every parameter once (tied weights count once)
    largest_unit: int  # elements of one transformer layer


def count_config_file(path: str | Path) -> ParamCount:
    """Ψ and one layer of the model a Hugging Face `config.json` file describes.

    Raises ValueError naming the cause: an unreadable file, a model type not
    covered here, or a missing size key.
    """
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read '{path}' as a JSON config ({error})") from None
    numel, layer = hf_count(config)
    return ParamCount(str(path), numel, layer)


def hf_count(config: dict[str, Any]) -> tuple[int, int]:
    """(Ψ, one layer) of a Hugging Face model from its `config.json` contents."""
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type {json.dumps(model_type)} is not one zeroshard can count "
                         f"(it knows {', '.join(sorted(_FAMILIES))}); give the count with --params")
    return _FAMILIES[model_type](_Keys(config, model_type))


class _Keys:
    """A config's values, with an error naming the key when a required one is missing."""

    def __init__(self, config: dict[str, Any], model_type: str):
        self.config, self.model_type = config, model_type

    def __call__(self, key: str, default: Any = ...) -> Any:
        value = self.config.get(key)
        if value is None:
            if default is ...:
                raise ValueError(f"the {self.model_type} config has no '{key}', which its parameter "
                                 "count needs")
            return default
        return value


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _layer_norm(d: int) -> int:
    return 2 * d  # weight and bias


def _llama(key: _Keys) -> tuple[int, int]:
    """llama, mistral, qwen2: RMSNorm (weight only), grouped-query attention, gated MLP."""
    d, heads = key("hidden_size"), key("num_attention_heads")
    head_dim = key("head_dim", d // heads)
    kv = key("num_key_value_heads", heads) * head_dim
    qkv_bias = key("attention_bias", key.model_type == "qwen2")  # qwen2 always has q/k/v biases
    mlp_bias = key("mlp_bias", False)
    ffn = key("intermediate_size")
    attention = (_linear(d, heads * head_dim, qkv_bias) + 2 * _linear(d, kv, qkv_bias)
                 + _linear(heads * head_dim, d, key("attention_bias", False)))
    mlp = 2 * _linear(d, ffn, mlp_bias) + _linear(ffn, d, mlp_bias)
    layer = attention + mlp + 2 * d
    embeddings = key("vocab_size") * d * (1 if key("tie_word_embeddings", False) else 2)
    return embeddings + key("num_hidden_layers") * layer + d, layer


def _gpt2(key: _Keys) -> tuple[int, int]:
    """gpt2: learned positions, LayerNorm, fused qkv, head tied to the token embedding."""
    d = key("n_embd")
    ffn = key("n_inner", 4 * d)
    layer = 2 * _layer_norm(d) + _linear(d, 3 * d) + _linear(d, d) + _linear(d, ffn) + _linear(ffn, d)
    return (key("vocab_size") + key("n_positions")) * d + key("n_layer") * layer + _layer_norm(d), layer


def _gpt_neox(key: _Keys) -> tuple[int, int]:
    """gpt_neox (Pythia): rotary positions, LayerNorm, fused qkv, untied output embedding."""
    d, ffn = key("hidden_size"), key("intermediate_size")
    bias = key("attention_bias", True)
    layer = (2 * _layer_norm(d) + _linear(d, 3 * d, bias) + _linear(d, d, bias)
             + _linear(d, ffn) + _linear(ffn, d))
    embeddings = key("vocab_size") * d * (1 if key("tie_word_embeddings", False) else 2)
    return embeddings + key("num_hidden_layers") * layer + _layer_norm(d), layer


def _opt(key: _Keys) -> tuple[int, int]:
    """opt: learned positions with an offset of 2, optional embedding projections, tied head."""
    d, ffn = key("hidden_size"), key("ffn_dim")
    bias = key("enable_bias", True)
    norm = _layer_norm(d) if key("layer_norm_elementwise_affine", True) else 0
    layer = 4 * _linear(d, d, bias) + 2 * norm + _linear(d, ffn, bias) + _linear(ffn, d, bias)
    embed_dim = key("word_embed_proj_dim", d)
    projections = 0 if embed_dim == d else 2 * embed_dim * d  # project_in and project_out, no bias
    final_norm = key("do_layer_norm_before", True) and not key("_remove_final_layer_norm", False)
    total = (key("vocab_size") * embed_dim + (key("max_position_embeddings") + 2) * d + projections
             + key("num_hidden_layers") * layer + (norm if final_norm else 0))
    return total, layer


_FAMILIES: dict[str, Callable[[_Keys], tuple[int, int]]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _llama,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt,
}
