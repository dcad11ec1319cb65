"""`deepspeed.zero` for DeepSpeed scripts: `Init` and `GatheredParameters` over zeroshard's own.

`zero.Init()` builds the model with its parameters on the meta device and
its buffers real (`zeroshard.stage3.meta.meta_init`); `initialize` then
materialises it unit by unit with the model's own initialisation.
`zero.GatheredParameters` is `zeroshard.gathered_parameters`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from zeroshard.deepspeed.unsupported import ZERO_NOT_PROVIDED, UnsupportedError, missing
from zeroshard.stage3.gathered import gathered_parameters
from zeroshard.stage3.meta import meta_init


class Init:
    """Build the model inside this block: parameters on the meta device, buffers real.

    DeepSpeed's keyword arguments are accepted. `enabled=False` does nothing;
    `mem_efficient_linear`, `pin_memory`, `config_dict_or_path` and `config` have
    no effect (the config is the one `initialize` reads); the others that ask
    for something zeroshard lacks or takes from the config (offload, other
    groups, ZeRO++'s switches, a dtype other than fp32, an already built
    module) raise `UnsupportedError` naming what to do.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None):
        refused = {
            "module": (module is not None, "build the model inside the block instead of passing it"),
            "remote_device": (remote_device not in (None, "none"),
                              "offload is not supported yet; leave remote_device out"),
            "dtype": (dtype not in (None, torch.float32),
                      "build in fp32; the config's bf16 or fp16 section casts the parameters"),
            "data_parallel_group": (data_parallel_group is not None, "zeroshard.deepspeed uses the default group"),
            "mpu": (mpu is not None, "model parallelism is not supported yet"),
            "zero_param_parallel_group": (zero_param_parallel_group is not None,
                                          "hpZ's groups are the nodes: set zero_optimization.zero_hpz_partition_size "
                                          "in the config"),
            "sequence_data_parallel_group": (sequence_data_parallel_group is not None,
                                             "sequence parallelism is not supported yet"),
            "zero_quantized_weights": (bool(zero_quantized_weights),
                                       "set zero_optimization.zero_quantized_weights (ZeRO++ qwZ) in the config"),
            "zero_quantized_nontrainable_weights": (bool(zero_quantized_nontrainable_weights),
                                                    "quantized frozen weights are not supported yet"),
            "param_swapper": (param_swapper is not None, "NVMe offload is not supported yet"),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise UnsupportedError(f"zero.Init({name}=...) is not supported: {fix}")
        self._block = meta_init(enabled=True) if enabled else nullcontext()

    def __enter__(self) -> Init:
        self._block.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._block.__exit__(*exc)


def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
    """`zeroshard.gathered_parameters(params, modifier_rank)`; `enabled=False` does nothing. `fwd_module` has no
    effect: zeroshard gathers a unit's parameters for its whole forward, external ones included."""
    if not enabled:
        return nullcontext()
    return gathered_parameters(params, modifier_rank=modifier_rank)


def __getattr__(name: str):
    raise missing("zeroshard.deepspeed.zero", name, ZERO_NOT_PROVIDED)
