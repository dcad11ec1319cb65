"""`deepspeed.zero` for DeepSpeed scripts: `Init` and `GatheredParameters` over zeroshard's own.

`zero.Init()` builds the model with its parameters on the meta device and
its buffers real (`zeroshard.stage3.meta_block.meta_init`); `initialize` then
materialises it unit by unit with the model's own initialisation, or, for a
model from `from_pretrained(path)` inside the block, with the weights of
`path` (`zeroshard.pretrained(path)`: each rank reads only its units'
tensors). Below stage 3 it is materialised whole, as DeepSpeed's
`zero.Init` does nothing there.
`zero.GatheredParameters` is `zeroshard.gathered_parameters`.
"""

from __future__ import annotations

from contextlib import nullcontext

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from zeroshard.checkpoint.pretrained import pretrained
from zeroshard.config.offload_merge import declared_param_device
from zeroshard.deepspeed.unsupported import ZERO_NOT_PROVIDED, UnsupportedError, missing
from zeroshard.stage3.gathered import gathered_parameters
from zeroshard.stage3.meta import record_init
from zeroshard.stage3.meta_block import meta_init


class Init:
    """Build the model inside this block: parameters on the meta device, buffers real.

    DeepSpeed's keyword arguments are accepted. `enabled=False` does nothing;
    `mem_efficient_linear`, `pin_memory`, `config_dict_or_path` and `config` have
    no effect (the config is the one `initialize` reads). `remote_device`
    ("cpu", "nvme") must agree with the config passed here, whose
    `zero_optimization.offload_param.device` decides where stage 3's
    parameters live (DeepSpeed, too, takes the config's over the argument).
    The others that ask for something zeroshard lacks or takes from the config
    (other groups, ZeRO++'s switches, a dtype other than fp32, an already
    built module, a parameter swapper) raise `UnsupportedError` naming what to do.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None):
        _check_remote_device(remote_device, config_dict_or_path if config_dict_or_path is not None else config)
        refused = {
            "module": (module is not None, "build the model inside the block instead of passing it"),
            "dtype": (dtype not in (None, torch.float32),
                      "build in fp32; the config's bf16 or fp16 section casts the parameters"),
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
        self._block = meta_init(enabled=True) if enabled else nullcontext()
        self._loading = _from_pretrained_on_meta() if enabled else nullcontext()

    def __enter__(self) -> Init:
        self._block.__enter__()
        self._loading.__enter__()  # after meta_init, which refuses from_pretrained: this one replaces it
        return self

    def __exit__(self, *exc) -> None:
        self._loading.__exit__(*exc)
        self._block.__exit__(*exc)


# from_pretrained's keyword arguments about fetching from the Hub, which a local directory does not need
# (AutoModel*.from_pretrained passes them on to the model class's).
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
               "trust_remote_code", "code_revision", "_commit_hash", "_from_auto", "_from_pipeline", "adapter_kwargs")


@contextmanager
def _from_pretrained_on_meta() -> Iterator[None]:
    """`from_pretrained(path)` inside `zero.Init`: the model from its config, on meta, and the weights of `path`
    recorded as its init, read unit by unit by `initialize` (no rank holds the whole model)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        yield
        return
    model_class = transformers.PreTrainedModel
    refusing = model_class.__dict__["from_pretrained"]  # meta_init's, restored on the way out

    def load(cls, path, *model_args, config=None, **kwargs):
        dtype = kwargs.pop("torch_dtype", kwargs.pop("dtype", None))
        for key in _HUB_KWARGS:
            kwargs.pop(key, None)
        if model_args or dtype not in (None, "auto", torch.float32):
            raise UnsupportedError(f"{cls.__name__}.from_pretrained inside zero.Init takes the path and config "
                                   "keyword arguments; build in fp32 (the config's bf16 or fp16 section casts the "
                                   "parameters) and pass no positional model arguments")
        if config is None:
            config, kwargs = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        if kwargs:
            raise UnsupportedError(f"{cls.__name__}.from_pretrained({', '.join(sorted(kwargs))}=...) inside "
                                   "zero.Init is not supported: only the path, config= and the config's own "
                                   "keys are; load the model outside zero.Init for the others")
        model = cls._from_config(config)
        record_init(model, pretrained(path))
        return model

    model_class.from_pretrained = classmethod(load)
    try:
        yield
    finally:
        model_class.from_pretrained = refusing


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
