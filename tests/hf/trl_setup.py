"""What the TRL tests share: a word-level tokenizer built here, its datasets, tiny models and a reward.

No download: the tokenizer is `tokenizers`' WordLevel over a vocabulary of
words written below (fewer than tests/hf/models.py's VOCAB), wrapped as
transformers' fast tokenizer with pad and end-of-sequence tokens.
"""

from __future__ import annotations

import torch

from tests.hf.models import VOCAB, config_of

SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = ("the a one two red blue green cat dog bird sees eats runs jumps over under big small fast slow "
         "good bad yes no sun moon tree house river stone sky sea").split()


def tokenizer():
    import tokenizers
    import transformers as tf

    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    assert len(vocab) <= VOCAB
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>",
                                      unk_token="<unk>")


def sentence(rng: torch.Generator, words: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=rng).tolist())


def sft_dataset(samples: int):
    import datasets

    rng = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"text": sentence(rng, 6 + i % 5)} for i in range(samples)])


def preference_dataset(samples: int):
    import datasets

    rng = torch.Generator().manual_seed(2)
    rows = [{"prompt": sentence(rng, 3), "chosen": sentence(rng, 3 + i % 3), "rejected": sentence(rng, 2 + i % 4)}
            for i in range(samples)]
    return datasets.Dataset.from_list(rows)


def prompt_dataset(samples: int):
    import datasets

    rng = torch.Generator().manual_seed(3)
    return datasets.Dataset.from_list([{"prompt": sentence(rng, 2 + i % 3)} for i in range(samples)])


def completion_dataset(samples: int):
    import datasets

    rng = torch.Generator().manual_seed(5)
    return datasets.Dataset.from_list([{"prompt": sentence(rng, 3), "completion": sentence(rng, 2 + i % 4)}
                                       for i in range(samples)])


def colour_reward(completions, **kwargs) -> list[float]:
    """A reward of the test's own: the share of colour words in each completion."""
    colours = {"red", "blue", "green"}
    return [sum(w in colours for w in text.split()) / max(1, len(text.split())) for text in completions]


def model(kind: str, tok, seed: int = 0):
    """A tiny causal LM from a config, dropout off, its pad and eos tokens the tokenizer's."""
    import transformers as tf

    config = config_of(kind)
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    built = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    built.generation_config.pad_token_id, built.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return built
