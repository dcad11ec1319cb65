"""`deepspeed.zero` for DeepSpeed scripts: `Init` and `GatheredParameters` over zeroshard's own.

`zero.Init()` builds the model with its parameters on the meta device and
its buffers real (`zeroshard.stage3.meta_block.meta_init`); `initialize` then
materialises it unit by unit with the model's own initialisation, or, for a
model from `from_pretrained(path, dtype=...)` inside the block, with the
weights of `path` (`from_pretrained.py`: in the dtype transformers' own
`from_pretrained` gives, "auto" included; each rank reads only its units'
tensors). `zero.Init(dtype=torch.bfloat16)` builds every floating-point
parameter in that dtype. Below stage 3 the model is materialised whole, as
DeepSpeed's `zero.Init` does nothing there.

The dtype meets the config at `initialize`, as for any model: trainable
bf16 (fp16) parameters need the config's `bf16` (`fp16`) section, which
trains in them with fp32 masters made from their values; fp32 ones are cast
to the section's dtype; any other pairing is a `ModelError` naming the fix.
`zero.GatheredParameters` is `zeroshard.gathered_parameters`.
"""

from __future__ import annotations

from contextlib import nullcontext

from zeroshard.config.offload_merge import declared_param_device
from zeroshard.deepspeed.from_pretrained import from_pretrained_on_meta
from zeroshard.deepspeed.unsupported import ZERO_NOT_PROVIDED, UnsupportedError, missing
from zeroshard.dtypes import DTYPES
from zeroshard.stage3.gathered import gathered_parameters
from zeroshard.stage3.meta_block import meta_init


class Init:
    """Build the model inside this block: parameters on the meta device, buffers real.

    DeepSpeed's keyword arguments are accepted. `enabled=False` does nothing;
    `mem_efficient_linear`, `pin_memory`, `config_dict_or_path` and `config` have
    no effect (the config is the one `initialize` reads). `remote_device`
    ("cpu", "nvme") must agree with the config passed here, whose
    `zero_optimization.offload_param.device` decides where stage 3's
    parameters live (DeepSpeed, too, takes the config's over the argument).
    `dtype` (torch.float32, torch.bfloat16 or torch.float16) is the dtype every
    floating-point parameter is built in; `from_pretrained` inside the block
    then loads in it. The others that ask for something zeroshard lacks or
    takes from the config (other groups, ZeRO++'s switches, an already built
    module, a parameter swapper) raise `UnsupportedError` naming what to do.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None):
        _check_remote_device(remote_device, config_dict_or_path if config_dict_or_path is not None else config)
        refused = {
            "module": (module is not None, "build the model inside the block instead of passing it"),
            "dtype": (dtype not in (None, *DTYPES.values()),
                      "give torch.float32, torch.bfloat16 or torch.float16 (or leave it out)"),
            "data_parallel_group": (data_parallel_group is not None, "zeroshard.deepspeed uses the default group"),
            "mpu": (mpu is not None, "DeepSpeed's mpu object is not read; zeroshard's tensor and pipeline "
                                   "parallelism come from a mesh passed to initialize (docs/parallel.md)"),
            "zero_param_parallel_group": (zero_param_parallel_group is not None,
                                          "hpZ's groups are the nodes: set zero_optimization.zero_hpz_partition_size "
                                          "in the config"),
            "sequence_data_parallel_group": (sequence_data_parallel_group is not None,
                                             "DeepSpeed's Ulysses sequence parallelism is not supported yet "
                                             "(tensor-parallel SequenceParallel layers work on a mesh: "
                                             "docs/parallel.md)"),
            "zero_quantized_weights": (bool(zero_quantized_weights),
                                       "set zero_optimization.zero_quantized_weights (ZeRO++ qwZ) in the config"),
            "zero_quantized_nontrainable_weights": (bool(zero_quantized_nontrainable_weights),
                                                    "quantized frozen weights are not supported yet"),
            "param_swapper": (param_swapper is not None,
                              "zeroshard's disk offload reads and writes the parameters itself: set "
                              'zero_optimization.offload_param.device "nvme" and its nvme_path in the config'),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise UnsupportedError(f"zero.Init({name}=...) is not supported: {fix}")
        self._block = meta_init(enabled=True, dtype=dtype) if enabled else nullcontext()
        self._loading = from_pretrained_on_meta(dtype) if enabled else nullcontext()

    def __enter__(self) -> Init:
        self._block.__enter__()
        self._loading.__enter__()  # after meta_init, which refuses from_pretrained: this one replaces it
        return self

    def __exit__(self, *exc) -> None:
        self._loading.__exit__(*exc)
        self._block.__exit__(*exc)


def _check_remote_device(remote_device, config) -> None:
    """`remote_device` asks for what the config's offload_param.device says, or raises `UnsupportedError`."""
    wanted = getattr(remote_device, "value", remote_device)  # DeepSpeed's OffloadDeviceEnum, or its string
    if wanted is None or (wanted == "none" and config is None):
        return
    if wanted not in ("none", "cpu", "nvme"):
        raise UnsupportedError(f'zero.Init(remote_device={wanted!r}) is not supported: DeepSpeed\'s values are '
                               '"none", "cpu" and "nvme"')
    key = "zero_optimization.offload_param.device"
    if config is None:
        raise UnsupportedError(
            f"zero.Init(remote_device={wanted!r}) needs the config beside it: zeroshard reads where stage 3's "
            f'parameters live (offload) from the config key {key}; set it to "{wanted}" there and pass the '
            "config as config_dict_or_path, or leave remote_device out")
    declared = declared_param_device(config)
    if declared != wanted:
        raise UnsupportedError(
            f'zero.Init(remote_device={wanted!r}) disagrees with the config\'s {key} "{declared}": zeroshard '
            f'reads where stage 3\'s parameters live (offload) from the config; set {key} to "{wanted}" there, '
            "or leave remote_device out")


def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
    """`zeroshard.gathered_parameters(params, modifier_rank)`; `enabled=False` does nothing. `fwd_module` has no
    effect: zeroshard gathers a unit's parameters for its whole forward, external ones included."""
    if not enabled:
        return nullcontext()
    return gathered_parameters(params, modifier_rank=modifier_rank)


def __getattr__(name: str):
    raise missing("zeroshard.deepspeed.zero", name, ZERO_NOT_PROVIDED)
