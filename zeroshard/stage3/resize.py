"""transformers' `resize_token_embeddings` on a model zeroshard holds on the meta device or shards.

Before `initialize`, on a model built under `meta_init` (DeepSpeed's
`zero.Init`): the resize runs on real values. The model's own method runs
with the embeddings and the output head gathered as
`gathered_parameters(..., modifier_rank=0)` gathers them (`meta_edits.py`),
so the old rows are the model's initialisation (or the files' weights under
`from_pretrained`), transformers initialises the new rows from them (`mean_resizing`) on the CPU, and rank 0's resized values are
what `initialize` gives every rank. A new output head transformers builds
is a real module among meta ones: `initialize` keeps its values.

After `initialize` (any stage) the embedding's parameters live in
zeroshard's flat buffers (at stage 3 their unit's, sharded) and the
optimizer's shard, which a resize would have to rebuild: the call is a
`ModelError` saying to resize before `initialize`.

Both replace the method on that model instance only, as
`stage3/generation.py` does for `generate`.
"""

from __future__ import annotations

import sys
import types
from functools import partial

import torch.nn as nn

from zeroshard.errors import ModelError
from zeroshard.stage3.meta_edits import whole_before_initialize


def _resizable(model: nn.Module):
    """The class's `resize_token_embeddings` of a transformers model; else None."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return type(model).resize_token_embeddings


def resize_on_materialised(model: nn.Module) -> None:
    """A `meta_init` model's `resize_token_embeddings` runs on its materialised embeddings."""
    resize = _resizable(model)
    if resize is not None:
        model.resize_token_embeddings = types.MethodType(partial(_resize_gathered, resize), model)


def _resize_gathered(resize, model: nn.Module, *args, **kwargs):
    heads = [model.get_input_embeddings(), model.get_output_embeddings()]
    params = list({id(p): p for head in heads if head is not None for p in head.parameters(recurse=False)}.values())
    with whole_before_initialize(params, modifier_rank=0):
        return resize(model, *args, **kwargs)


def refuse_resize(model: nn.Module, stage: int) -> None:
    """After `initialize`: `resize_token_embeddings` is a `ModelError` naming the fix."""
    if _resizable(model) is not None:
        model.resize_token_embeddings = types.MethodType(partial(_refused, stage), model)


def _refused(stage: int, model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
             *args, **kwargs):
    if new_num_tokens is None and pad_to_multiple_of is None:  # transformers' getter form: nothing changes
        return model.get_input_embeddings()
    where = "sharded over the ranks in their unit" if stage == 3 else "in zeroshard's flat buffers"
    raise ModelError(
        f"{type(model).__name__}.resize_token_embeddings() after zeroshard.initialize at ZeRO stage {stage}: the "
        f"embedding's parameters are {where} and in the optimizer's shard, which a resize would have to "
        f"rebuild. Resize before initialize: on the plain model, or under zeroshard.meta_init() / "
        f"deepspeed.zero.Init (it runs on the materialised embeddings), then build the optimizer and call "
        f"initialize")
