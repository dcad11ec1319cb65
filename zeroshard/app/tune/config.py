"""`zeroshard tune`'s configs: a candidate as the DeepSpeed-style JSON that `zeroshard train --config` and
`deepspeed.initialize` (through `zeroshard.deepspeed`) run as it is, and the demo's command line of a trial.

For a demo preset the config starts from the demo's own settings (stage 3's
units, gradient clipping); for another model from the engine's defaults.
Both get the bucket size tune chose for the model (`tune_candidates.bucket_size`). `train_batch_size` is written out, so the file says the
global batch it was tuned for and a run on another number of ranks is told
so at start. Checkpointing writes an `activation_checkpointing` block: the
demo checkpoints its blocks when its config has one (app/demo/config.py); a
model of your own checkpoints itself (docs/memory.md).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from zeroshard.app.demo.config import DEMO_CONFIG
from zeroshard.app.models import PRESETS
from zeroshard.app.tune.candidates import Candidate, Setup


def ds_config(candidate: Candidate, setup: Setup) -> dict:
    """The DeepSpeed-style config of `candidate` on `setup`'s ranks."""
    config = copy.deepcopy(DEMO_CONFIG) if setup.model in PRESETS else {"zero_optimization": {}}
    config |= {"train_batch_size": candidate.micro_batch * candidate.accumulation * setup.ranks,
               "train_micro_batch_size_per_gpu": candidate.micro_batch,
               "gradient_accumulation_steps": candidate.accumulation}
    if setup.dtype != "fp32":
        config[setup.dtype] = {"enabled": True}
    zero = config["zero_optimization"]
    zero |= {"stage": candidate.stage, "reduce_bucket_size": candidate.bucket_size,
             "allgather_bucket_size": candidate.bucket_size}
    offload = (("offload_optimizer", candidate.offload_optimizer), ("offload_param", candidate.offload_params))
    for key, device in offload:
        if device != "none":
            zero[key] = {"device": device} | ({"nvme_path": setup.nvme_path} if device == "nvme" else {})
    if candidate.offload_params == "nvme":
        zero["offload_param"]["max_in_cpu"] = 0  # every shard on disk, as `zeroshard train --offload-params` does
    if setup.nodes > 1:
        zero["zeropp_ranks_per_node"] = setup.ranks_per_node
    if candidate.zeropp:  # the parts `zeroshard train --zeropp` turns on
        zero |= {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        if setup.ranks_per_node > 1:
            zero["zero_hpz_partition_size"] = setup.ranks_per_node
    if candidate.checkpointing == "full":
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
    return config


def write_config(path: Path, config: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def trial_argv(setup: Setup, config: Path, steps: int, steps_csv: Path) -> list[str]:
    """`python -m` arguments of one rank of a trial: the demo's training program on `config`, `steps` steps, its
    seconds per step in `steps_csv`, no sample written at the end (it is not timed, and takes long on a big model)."""
    if setup.model not in PRESETS:
        raise ValueError(f"trials train the demo's GPT (zeroshard train), and '{setup.model}' is not one of its "
                         f"presets ({', '.join(sorted(PRESETS))}): give --top 0 to rank by the estimate alone")
    return ["zeroshard.app.demo.train", "--config", str(config), "--model", setup.model, "--steps", str(steps),
            "--log-csv", str(steps_csv), "--log-every", str(steps), "--sample", "0"]
