"""The Trainer's accumulation windows against the engine's: checked before the first step.

transformers' Trainer ends an epoch's last window early when the epoch's
batches (per rank) are not a multiple of `gradient_accumulation_steps`, and
steps on the partial window (DDP, or DeepSpeed through
`set_gradient_accumulation_boundary`). zeroshard's engine has windows of a
fixed length, so a run that would reach such a window is refused when
training starts, not at the end of its first epoch, with the settings that
avoid it worked out for this run. `dataloader_drop_last` is not among them:
it drops a partial batch, not a partial window.
"""

from __future__ import annotations

import math

from zeroshard.deepspeed.unsupported import UnsupportedError


def check_windows(batches: int | None, accumulation: int, max_steps: int, world_size: int, per_device: int,
                  samples: int | None) -> None:
    """Raise `UnsupportedError` if training would reach an epoch's short last window.

    `batches`: the train dataloader's batches per epoch on each rank (None: no length, such as an
    IterableDataset, whose epochs transformers counts in whole windows); `max_steps`: the run's optimizer
    steps; `samples`: the training set's size, if it has one.
    """
    if batches is None or batches % accumulation == 0:
        return
    full = batches // accumulation  # optimizer steps of whole windows in an epoch
    if max_steps <= full:
        return  # training stops before the first epoch's last window
    fixes = [f"max_steps={full} or fewer (the epoch's whole windows)" if full else None]
    divisors = [d for d in range(1, batches + 1) if batches % d == 0 and d != accumulation]
    fixes.append(f"gradient_accumulation_steps={min(divisors, key=lambda d: (abs(d - accumulation), -d))} "
                 f"(it must divide {batches})")
    global_batch = per_device * accumulation * world_size
    if samples is not None and samples >= global_batch:
        kept = samples // global_batch * global_batch
        fixes.append(f"a training set of {kept} samples instead of {samples} (a multiple of "
                     f"per_device_train_batch_size x gradient_accumulation_steps x world size = {per_device} x "
                     f"{accumulation} x {world_size}: train_dataset.select(range({kept})), say)")
    raise UnsupportedError(
        f"each epoch has {batches} batches per rank, which is not a multiple of gradient_accumulation_steps "
        f"({accumulation}): its last window would hold {batches % accumulation}, and this run of {max_steps} "
        f"optimizer steps ({math.ceil(batches / accumulation)} an epoch) would reach it. transformers' Trainer "
        "steps on the short window; zeroshard's engine has windows of a fixed length. Set one of: "
        + "; ".join(f for f in fixes if f) + ". (dataloader_drop_last drops a partial batch, not a partial window.) "
        "Nothing was trained")
