"""The peak of a training step of a built-in GPT preset: predicted (`predict`) and measured (`measure`).

`predict` hands the model's counts (Ψ, its buckets and units, built on the
meta device: `model_count`) and its activation count (`activation_count`) to
`zeroshard.estimate.step_peak`. `measure` trains the same model on this rank
(the process group already up) and reads the resident high-water mark of one
step (`resident.ResidentMeter`), after warm-up steps: the first step makes
the optimizer state and the staging blocks, and the peak of a later step is
the steady one. `zeroshard estimate`, benchmarks/step_peak.py and
tests/engine/test_step_peak.py use them.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

import zeroshard
from zeroshard.app.estimate.activation_count import count_activations
from zeroshard.app.estimate.model_count import DEMO_BUCKET_SIZE, DEMO_WRAP, ParamCount, count_model
from zeroshard.app.models import GPT, PRESETS
from zeroshard.app.resident import ResidentMeter, release_freed, status_bytes
from zeroshard.dtypes import DTYPES
from zeroshard.estimate.peak import StepPeak, step_peak

CHECKPOINTING = {"none": "", "full": "non_reentrant"}  # the estimate's name -> GPTConfig.checkpointing
CPU = torch.device("cpu")


@dataclass(frozen=True)
class PeakRun:
    """One training setup of a preset: what both `predict` and `measure` take."""

    model: str = "demo"  # a preset of zeroshard.app.models.PRESETS
    stage: int = 0
    dtype: str = "fp32"  # "fp32" or "bf16"
    micro_batch: int = 8  # sequences per rank
    seq: int = 128  # tokens per sequence
    bucket: int = DEMO_BUCKET_SIZE  # reduce_bucket_size and allgather_bucket_size, elements
    checkpointing: str = "none"  # "none" or "full": every block checkpointed

    def config(self) -> dict:
        """The engine's config: the demo's settings (clipping, stage 3's units) for this setup."""
        return ({"bf16": {"enabled": True}} if self.dtype == "bf16" else {}) | {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.bucket,
                                  "allgather_bucket_size": self.bucket, "stage3_wrap_classes": list(DEMO_WRAP),
                                  "stage3_param_persistence_threshold": 0}}


def predict(run: PeakRun, world_size: int, scratch: bool = True) -> StepPeak:
    """The estimate of the step's peak per rank (`scratch`: gloo's all-to-all reduce-scatter, as on the CPU)."""
    counted = count_model(run.model, persistence_threshold=0, bucket_size=run.bucket)
    saved = count_activations(run.model, run.micro_batch, run.seq, run.checkpointing, run.dtype)
    plain = count_activations(run.model, run.micro_batch, run.seq, "none", run.dtype)  # what a recompute holds
    recompute = 0 if run.checkpointing == "none" else max(plain.per_layer, default=0)
    return peak_of(counted, saved.total, recompute, plain.largest, run.stage, world_size, run.dtype, scratch=scratch)


def peak_of(counted: ParamCount, activations: int, recompute: int, activation_grad: int, stage: int,
            world_size: int, dtype: str, accumulation: int = 1, scratch: bool = True) -> StepPeak:
    """`step_peak` for a counted model: its buckets, units and largest parameter."""
    return step_peak(counted.numel, activations, stage, world_size, dtype, buckets=counted.buckets,
                     units=counted.units, recompute=recompute, largest_param=counted.largest_param,
                     activation_grad=activation_grad, accumulation=accumulation, scratch=scratch)


def measure(run: PeakRun, device: torch.device = CPU, steps: int = 2, seed: int = 0) -> dict:
    """On this rank: the peak of the last of `steps` training steps above what the process held before the
    model was built, bytes (`peak`), beside what `memory_stats()` reports after it. On the CPU the resident
    high-water mark (`ResidentMeter`) after a warm-up (`_warm_up`; `warm_up_kept`: what it left resident);
    on a GPU the caching allocator's peak of allocated bytes (`torch.cuda.max_memory_allocated`)."""
    kept = _warm_up(run, device, seed) if device.type == "cpu" else 0
    meter = ResidentMeter() if device.type == "cpu" else _CudaMeter(device)
    engine, batch = _engine(run, device, seed)
    for _ in range(steps - 1):
        _step(engine, batch)
    measured = meter.peak_of(lambda: _step(engine, batch))
    stats = engine.memory_stats()
    return measured | {"held": stats.held(), "memory_stats": dict(stats), "warm_up_kept": kept}


def _warm_up(run: PeakRun, device: torch.device, seed: int) -> int:
    """Bring in, before the base is read, what the first step of a process leaves resident for good: the code
    and kernels a step runs (a tiny model's step through an engine of the same stage and dtype) and the math
    libraries' buffers sized by the largest product they ran (oneDNN's bf16 GEMMs, MKL's: a plain forward and
    backward of the same model, dtype and batch, without an engine). Returns the bytes they left resident."""
    release_freed()
    before = status_bytes("VmRSS")["VmRSS"]
    _train(replace(run, model="tiny", micro_batch=1, seq=min(run.seq, PRESETS["tiny"].block_size)), device, 1, seed)
    cfg = replace(PRESETS[run.model], checkpointing=CHECKPOINTING[run.checkpointing])
    model = GPT(cfg).to(device, DTYPES[run.dtype])
    tokens = torch.zeros(run.micro_batch, run.seq, dtype=torch.long, device=device)
    model(tokens, tokens).backward()
    del model
    gc.collect()
    release_freed()
    return status_bytes("VmRSS")["VmRSS"] - before


class _CudaMeter:
    """`ResidentMeter`'s interface on a GPU: the allocator's peak of allocated bytes above the start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = torch.cuda.memory_allocated(device)

    def peak_of(self, work) -> dict[str, int]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        work()
        torch.cuda.synchronize(self.device)
        return {"peak": torch.cuda.max_memory_allocated(self.device) - self.base, "file_moved": 0}


def _engine(run: PeakRun, device: torch.device, seed: int):
    torch.manual_seed(seed)
    cfg = replace(PRESETS[run.model], checkpointing=CHECKPOINTING[run.checkpointing])
    model = GPT(cfg).to(device)
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), run.config())
    tokens = torch.randint(cfg.vocab_size, (run.micro_batch, run.seq + 1), generator=torch.Generator().manual_seed(1))
    return engine, (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))


def _step(engine, batch) -> None:
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()


def _train(run: PeakRun, device: torch.device, steps: int, seed: int) -> None:
    engine, batch = _engine(run, device, seed)
    for _ in range(steps):
        _step(engine, batch)
