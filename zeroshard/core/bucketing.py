"""Which parameters form which bucket at stages 0-2: size buckets in backward order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass
class BucketPlan:
    group: int  # index of the optimizer param group
    params: list[nn.Parameter] = field(default_factory=list)
    numel: int = 0  # elements so far
    completes_at: int = 0  # position, in backward order, of its last parameter


def bucket_params(model: nn.Module, groups: list[list[nn.Parameter]], max_numel: int) -> list[BucketPlan]:
    """Split trainable parameters into buckets of at most `max_numel` elements.

    Parameters are taken in reverse registration order, roughly the order
    backward produces their gradients, so the first bucket is ready first.
    A bucket holds one param group, dtype and device only (one optimizer
    tensor each); a single parameter larger than `max_numel` gets a bucket
    of its own.

    Buckets are returned in the order they complete, by their last
    parameter: with two groups (say decayed weights and undecayed biases)
    the biases' bucket spans the whole model and is ready last, and it
    must not hold up the weights' buckets behind it.
    """
    group_of = {id(p): g for g, params in enumerate(groups) for p in params if p.requires_grad}
    open_buckets: dict[tuple, BucketPlan] = {}
    buckets: list[BucketPlan] = []
    for position, p in enumerate(reversed(list(model.parameters()))):
        g = group_of.get(id(p))
        if g is None:
            continue
        key = (g, p.dtype, p.device)
        bucket = open_buckets.get(key)
        if bucket is None or (bucket.params and bucket.numel + p.numel() > max_numel):
            bucket = BucketPlan(g)
            buckets.append(bucket)
            open_buckets[key] = bucket
        bucket.params.append(p)
        bucket.numel += p.numel()
        bucket.completes_at = position
    return sorted(buckets, key=lambda b: b.completes_at)
