"""The batch-size triple: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x N.

DeepSpeed's rule: with all three given the product is checked; with one
left out (or "auto") it is derived from the other two; with only
train_batch_size, accumulation is 1; with only the micro-batch, accumulation
is 1 and train_batch_size follows. "auto" on all three (or on the two that
set the sample count) is an error naming train_micro_batch_size_per_gpu:
nothing zeroshard sees decides how many samples a rank takes.
"""

from __future__ import annotations

from zeroshard.config.report import LoadReport

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_MICRO_AUTO = (
    'train_micro_batch_size_per_gpu is "auto" and train_batch_size is "auto" or left out, which zeroshard '
    "cannot work out: nothing it is given decides the samples per rank; put a number, such as "
    '"train_micro_batch_size_per_gpu": 8 (Hugging Face\'s Trainer takes it from --per_device_train_batch_size), '
    "and the other batch keys are derived")


def resolve_batch(raw: dict, world_size: int | None, autos: list[str], report: LoadReport) -> list[str]:
    """Derive the batch keys left out (or "auto", already removed and named in `autos`), or check all three.

    Changes `raw` in place, records each derived key in `report`; returns the
    problems. Without a world size, a train_batch_size that needs it to
    derive another key is an error, and the check waits until `initialize`
    knows the world size.
    """
    values = [raw.get(key) for key in BATCH_KEYS]
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in values):
        return []  # a bad value: validation reports it
    train, micro, accum = values
    if autos and train is None and micro is None:
        return [_MICRO_AUTO]
    before = dict(zip(BATCH_KEYS, values))
    problems = _derive(raw, world_size, train, micro, accum)
    if not problems:
        _record(raw, before, autos, world_size, report)
    return problems


def _derive(raw: dict, world_size: int | None, train: int | None, micro: int | None,
            accum: int | None) -> list[str]:
    if train is None:
        if micro is not None and world_size is not None:
            raw["gradient_accumulation_steps"] = accum = accum or 1
            raw["train_batch_size"] = micro * accum * world_size
        return []
    if world_size is None:
        if micro is None or accum is None:
            return ["train_batch_size needs the world size to derive "
                    f"{'train_micro_batch_size_per_gpu' if micro is None else 'gradient_accumulation_steps'}; "
                    "let zeroshard.initialize load the config, or give `zeroshard config check "
                    "--world-size N`"]
        return []
    derived, given = None, None  # the key derived from train_batch_size, and the one it is divided by
    if micro is None:
        accum = accum or 1
        micro = train // (accum * world_size)
        derived, given = "train_micro_batch_size_per_gpu", ("gradient_accumulation_steps", accum)
    elif accum is None:
        accum = train // (micro * world_size)
        derived, given = "gradient_accumulation_steps", ("train_micro_batch_size_per_gpu", micro)
    if derived and (micro * accum * world_size != train or micro == 0 or accum == 0):
        return [f"train_batch_size {train} is not divisible by {given[0]} {given[1]} x world size {world_size} "
                f"(= {given[1] * world_size}), so {derived} cannot be derived from it; make train_batch_size a "
                f"multiple of {given[1] * world_size}, or give {derived} and change the others to agree"]
    if micro * accum * world_size != train:  # all three given
        return [f"train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x world size {world_size} (= {micro * accum * world_size}); "
                "change one of them, or leave one of the three out (or \"auto\") to have it derived"]
    raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"] = micro, accum
    return []


def _record(raw: dict, before: dict, autos: list[str], world_size: int | None, report: LoadReport) -> None:
    rule = ("train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size "
            f"{world_size}, as DeepSpeed")
    for key in BATCH_KEYS:
        if before[key] is None and raw.get(key) is not None:
            how = "1 when train_batch_size is derived, as DeepSpeed" if (
                key == "gradient_accumulation_steps" and before["train_batch_size"] is None) else rule
            was = ' (was "auto")' if key in autos else ""
            report.resolved.append((key, raw[key], f"derived: {how}{was}"))
        elif key in autos:
            report.resolved.append((key, "(left out)", "\"auto\" with nothing to derive it from yet"))
