"""One rank of test_memory_fit.py's runs under a memory cgroup: started by that test (never by hand).

argv: the GPT's fields as JSON, the zeroshard config as JSON, the result file. The rank builds the GPT
under `zeroshard.meta_init()` (nothing allocated yet), initializes the engine and, if that succeeds,
trains one step beside a plain PyTorch copy of the same model on the same rows; it writes what happened.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.models.gpt import GPT, GPTConfig


def _init(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    GPT._init_weights(module)


def main(model_json: str, config_json: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(**json.loads(model_json))
    config = json.loads(config_json)
    big = config.pop("meta", False)
    with zeroshard.meta_init() if big else torch.device("cpu"):
        model = GPT(cfg)
    reference = None if big else copy.deepcopy(model)
    try:
        engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), config,
                                      init=_init if big else None)
    except zeroshard.ZeroshardError as exc:
        result = {"error": type(exc).__name__, "is_memory_error": isinstance(exc, MemoryError), "message": str(exc)}
    else:
        rows = torch.randint(cfg.vocab_size, (1, cfg.block_size + 1), generator=torch.Generator().manual_seed(1))
        loss = engine(rows[:, :-1], rows[:, 1:])
        result = {"loss": loss.item(), "reference": reference(rows[:, :-1], rows[:, 1:]).item()}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
