"""`from zeroshard.hf import Trainer, TrainingArguments`: transformers' Trainer on zeroshard, by changing one import.

The same `TrainingArguments`, `deepspeed=` a DeepSpeed config file or dict
(transformers' ds_config_zero2.json and ds_config_zero3.json as they are);
the `deepspeed` package is neither needed nor imitated. `on_zeroshard(cls)`
does the same for any Trainer or TrainingArguments subclass, and
`zeroshard.hf.trl` for TRL's. docs/hugging-face.md.
"""

from zeroshard.hf.adapter import on_zeroshard
from zeroshard.hf.arguments import Seq2SeqTrainingArguments, TrainingArguments
from zeroshard.hf.trainer import Seq2SeqTrainer, Trainer

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments", "Trainer", "TrainingArguments", "on_zeroshard"]
