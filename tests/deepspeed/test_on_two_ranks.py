"""What `zeroshard.deepspeed` does per rank, on 2 ranks (one spawn), against DeepSpeed's documented rules:

- `initialize(training_data=...)`: each rank's DataLoader is its DistributedSampler share in micro-batches,
  the last incomplete one dropped when the config's `dataloader_drop_last` is true (10 rows, 2 ranks, 3 a
  batch: 5 rows a rank, so batches of [3, 2], or [3] with drop_last), the same rows as torch's own
  DataLoader over that sampler.
- `save_checkpoint` with a different tag on each rank (DeepSpeed's getting-started passes `loss.item()`):
  config `checkpoint.tag_validation` "Warn" (default) writes rank 0's tag and warns on rank 0, "Ignore"
  writes it silently, "Fail" raises the same CheckpointError on every rank, naming each rank's tag, and
  writes nothing. Ranks that agree save under their tag whatever the mode.
"""

import logging
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zeroshard
import zeroshard.deepspeed as deepspeed
from tests.distributed import run_ranks

MICRO = 3
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.1}}
FAIL_MESSAGE = ("the ranks asked for different checkpoint tags (rank 0: 'loss0', rank 1: 'loss1') and the config's "
                "checkpoint.tag_validation is \"Fail\": pass the same tag on every rank (or none: global_step<N>); "
                "nothing was written")


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _engine(extra: dict):
    torch.manual_seed(0)
    return deepspeed.initialize(model=nn.Linear(2, 1), config={"train_micro_batch_size_per_gpu": MICRO,
                                                               "optimizer": OPTIMIZER, **extra})[0]


def _loader_rows(loader) -> list[list[int]]:
    return [batch[0].reshape(-1).tolist() for batch in loader]


def _loaders(rank, world):
    data = TensorDataset(torch.arange(10))
    out = {}
    for drop_last in (False, True):
        _, _, loader, _ = deepspeed.initialize(model=nn.Linear(2, 1), training_data=data, config={
            "train_micro_batch_size_per_gpu": MICRO, "optimizer": OPTIMIZER, "dataloader_drop_last": drop_last})
        sampler = DistributedSampler(data, num_replicas=world, rank=rank)
        reference = DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=drop_last)
        out[drop_last] = (_loader_rows(loader), _loader_rows(reference))
    return out


def _saves(rank, root: Path):
    out = {}
    for mode in ("Warn", "Ignore", "Fail"):
        engine = _engine({"checkpoint": {"tag_validation": mode}})
        warnings, logger = _Warnings(), logging.getLogger("zeroshard.checkpoint.saving")
        logger.addHandler(warnings)  # on the logger itself: whatever zeroshard's logging set-up propagates
        try:
            try:
                written = engine.save_checkpoint(root / mode, tag=f"loss{rank}")
                result = ("saved", written.name)
            except zeroshard.CheckpointError as exc:
                result = ("error", str(exc))
            same = engine.save_checkpoint(root / mode, tag="same").name
        finally:
            logger.removeHandler(warnings)
        out[mode] = (result, same, warnings.messages,
                     sorted(p.name for p in (root / mode).iterdir() if not p.name.startswith(".")))
    return out


def _checks(rank, world, device, root):
    return {"loaders": _loaders(rank, world), "saves": _saves(rank, Path(root))}


def test_dataloader_drop_last_and_tag_validation_per_rank(tmp_path):
    ranks = run_ranks(_checks, 2, str(tmp_path))
    for rank, result in enumerate(ranks):
        kept, kept_reference = result["loaders"][False]
        dropped, dropped_reference = result["loaders"][True]
        assert [len(b) for b in kept] == [3, 2] and kept == kept_reference, (rank, kept, kept_reference)
        assert [len(b) for b in dropped] == [3] and dropped == dropped_reference, (rank, dropped)
        saves = result["saves"]
        warn, ignore, fail = saves["Warn"], saves["Ignore"], saves["Fail"]
        assert warn[0] == ("saved", "loss0") and ignore[0] == ("saved", "loss0")
        assert warn[3] == ignore[3] == ["latest", "loss0", "same"] and fail[3] == ["latest", "same"]
        assert fail[0] == ("error", FAIL_MESSAGE)
        assert warn[1] == ignore[1] == fail[1] == "same"
        assert ignore[2] == [] and fail[2] == []
        if rank == 0:
            assert len(warn[2]) == 1 and warn[2][0].startswith(
                "the ranks asked for different checkpoint tags (rank 0: 'loss0', rank 1: 'loss1'); every rank "
                "writes rank 0's, 'loss0'"), warn[2]
        else:
            assert warn[2] == []

