"""`zeroshard tune`'s candidates: the configurations worth trying, each one's peak memory per rank, and why one
does not fit.

A candidate is a ZeRO stage (0-3), a micro-batch with the gradient
accumulation that keeps the global batch, activation checkpointing (none, or
every block), offload (only where the candidate does not fit without it and
a pool for it is given) and ZeRO++ (stage 3, where the ranks span several
nodes: inside one node it changes nothing that crosses one).

Its peak per rank (`predict_peak`, the one place it is computed) is the
memory of a step at its fullest, end of forward: what the rank's process
holds before any model (measured by the calibration: Python, torch, the
process group, the corpus), the model states in the rank's memory
(`zeroshard.estimate.offload_pool_bytes`: the per-rank formulas of stages
0-3, a gathered unit at stage 3, the pools with offload), the declared
staging buffers, one micro-batch's activations counted on the meta device
(`zeroshard estimate --micro-batch --seq`), with checkpointing one block's
recompute, and the workspace of the forward and backward beside the saved
activations (their temporaries: the calibration measures them as a fraction
of the saved activations). On a machine without a GPU the device is host
memory, so the host pool counts there too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroshard.app.estimate.activation_count import count_activations
from zeroshard.app.estimate.model_count import DEMO_BUCKET_SIZE, REDUCE_BUCKET_SIZE, count_model
from zeroshard.app.units import human_bytes
from zeroshard.estimate import Flat, offload_pool_bytes, state_bytes_per_element
from zeroshard.estimate.zeropp import PERSISTENT

STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "full")
_STAGING_BUCKETS = 2  # a bucket's gradients staged for its reduction, and the reduction's scratch
_BUCKETS = 16  # about this many gradient buckets: reductions overlap backward, and each call's cost stays small


@dataclass(frozen=True)
class Setup:
    """What the user gives tune: the model, the ranks and the memory they have."""

    model: str  # a demo preset, a transformers model type, a config.json or a save_pretrained directory
    ranks: int  # data-parallel ranks in all (world size)
    nodes: int  # nodes the ranks span (declared, as `zeroshard train --nodes`)
    dtype: str  # training dtype: fp32, bf16, fp16
    seq: int  # tokens per sequence
    device_mem: int  # bytes per rank: a GPU's memory, or a rank's share of host memory without GPUs
    micro_batches: tuple[int, ...]
    global_batch: int | None = None  # rows per optimizer step to keep (None: accumulation 1)
    host_mem: int | None = None  # bytes per node, for offload to "cpu" (a GPU machine)
    disk_mem: int | None = None  # bytes per node, for offload to "nvme" (needs nvme_path)
    nvme_path: str | None = None
    on_gpu: bool = False

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True)
class Candidate:
    """One configuration: what the written DeepSpeed config says (tune/config.py writes it)."""

    stage: int
    micro_batch: int
    accumulation: int
    checkpointing: str = "none"  # "full": every block checkpointed
    offload_optimizer: str = "none"  # "cpu" or "nvme": the fp32 master shard and Adam state there
    offload_params: str = "none"  # stage 3: the parameter shards there too
    zeropp: bool = False
    bucket_size: int = DEMO_BUCKET_SIZE  # reduce and all-gather bucket, elements: the same for every candidate

    def label(self) -> str:
        """The candidate in the user's words: "stage 2, micro-batch 8, accumulation 2, checkpointing"."""
        words = [f"stage {self.stage}", f"micro-batch {self.micro_batch}"]
        words += [f"accumulation {self.accumulation}"] * (self.accumulation > 1)
        words += ["checkpointing"] * (self.checkpointing == "full")
        if self.offload_optimizer != "none":
            words.append(f"optimizer on {self.offload_optimizer}"
                         + " with the parameters" * (self.offload_params != "none"))
        words += ["ZeRO++"] * self.zeropp
        return ", ".join(words)


@dataclass(frozen=True)
class Counts:
    """The model's counts, on the meta device: Ψ, stage 3's largest unit and flats, the largest gradient bucket,
    and one micro-batch's activations per (micro-batch, checkpointing): (forward's bytes, recompute's bytes)."""

    numel: int
    largest_unit: int
    flats: tuple[Flat, ...]
    bucket_size: int  # the gradient bucket tune writes (`bucket_size`), elements
    largest_bucket: int  # elements of the largest bucket the engine builds of it
    activations: dict[tuple[int, str], tuple[int, int]]

    @property
    def persistent(self) -> int:
        return sum(f.numel for f in self.flats if f.kind == PERSISTENT)


def bucket_size(numel: int) -> int:
    """The reduce and all-gather bucket tune writes for a model of `numel` elements: about `_BUCKETS` buckets,
    at least the demo's 50,000 elements and at most the engine's default (25,000,000)."""
    return min(REDUCE_BUCKET_SIZE, max(DEMO_BUCKET_SIZE, -(-numel // _BUCKETS)))


def count(setup: Setup) -> Counts:
    """Count the model and its activations at every micro-batch, with and without checkpointing.

    Raises ValueError (from model_count/activation_count) naming what is wrong with the model or --seq."""
    bucket = bucket_size(count_model(setup.model).numel)
    counted = count_model(setup.model, bucket_size=bucket)
    saved = {}
    for micro_batch in setup.micro_batches:
        plain = count_activations(setup.model, micro_batch, setup.seq, "none", setup.dtype)
        full = count_activations(setup.model, micro_batch, setup.seq, "full", setup.dtype)
        saved[micro_batch, "none"] = (plain.total, 0)
        saved[micro_batch, "full"] = (full.total, max(plain.per_layer, default=0))  # one block recomputed at once
    return Counts(counted.numel, counted.largest_unit, counted.flats, bucket,
                  max(counted.buckets, default=counted.numel), saved)


def grid(setup: Setup, counts: Counts) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The candidates without offload, and (label, reason) for each micro-batch that cannot make the global batch."""
    out, skipped = [], []
    for micro_batch in setup.micro_batches:
        rows = micro_batch * setup.ranks
        if setup.global_batch is not None and setup.global_batch % rows:
            skipped.append((f"micro-batch {micro_batch}",
                            f"{micro_batch} rows x {setup.ranks} ranks = {rows} does not divide the global batch "
                            f"of {setup.global_batch} rows"))
            continue
        accumulation = 1 if setup.global_batch is None else setup.global_batch // rows
        for stage in STAGES:
            for checkpointing in CHECKPOINTING:
                base = Candidate(stage, micro_batch, accumulation, checkpointing, bucket_size=counts.bucket_size)
                out.append(base)
                if stage == 3 and setup.nodes > 1:
                    out.append(replace(base, zeropp=True))
    return out, skipped


def offload_variants(candidate: Candidate, setup: Setup) -> list[Candidate]:
    """The offloaded forms of `candidate` that the given pools allow: the optimizer state (stages 1-3) and at
    stage 3 also the parameters, to host memory ("cpu": with a GPU and --host-mem; without a GPU the device is
    host memory already) or to disk ("nvme": --disk-mem and --nvme-path). ZeRO++'s hpZ is not offloaded."""
    if candidate.stage == 0 or candidate.zeropp:
        return []
    devices = ["cpu"] * (setup.on_gpu and setup.host_mem is not None)
    devices += ["nvme"] * (setup.disk_mem is not None and setup.nvme_path is not None)
    out = []
    for device in devices:
        out.append(replace(candidate, offload_optimizer=device))
        if candidate.stage == 3:
            out.append(replace(candidate, offload_optimizer=device, offload_params=device))
    return out


@dataclass(frozen=True)
class Peak:
    """A candidate's predicted memory per rank at the peak of a step, bytes, by part."""

    runtime: int  # what the rank's process holds before any model (measured)
    states: int  # model states in the device pool (params, grads, master, optimizer; hpZ's secondary shards)
    buffers: int  # declared staging buffers in the device pool
    activations: int  # one micro-batch's forward
    recompute: int  # one block's activations while its recompute runs (checkpointing)
    workspace: int  # the temporaries of the forward and backward beside those (measured ratio, see predict_peak)
    host: int  # the host pool (offload), per rank
    disk: int  # the disk pool (offload), per rank
    on_gpu: bool

    @property
    def fixed(self) -> int:
        """Everything but the activations, in the rank's device memory."""
        return self.runtime + self.states + self.buffers + (0 if self.on_gpu else self.host)

    @property
    def device(self) -> int:
        """The peak in the rank's device memory (host memory without a GPU)."""
        return self.fixed + self.activations + self.recompute + self.workspace

    def as_dict(self) -> dict:
        return {"runtime": self.runtime, "states": self.states, "buffers": self.buffers,
                "activations": self.activations, "recompute": self.recompute, "workspace": self.workspace,
                "host": self.host,
                "disk": self.disk, "device": self.device}


def predict_peak(candidate: Candidate, setup: Setup, counts: Counts, runtime: int, workspace: float = 0.0) -> Peak:
    """The peak memory of one rank of `candidate` in a step: runtime + model states + buffers + activations
    (+ recompute) + workspace, and the host and disk pools. The one place tune predicts memory.

    `runtime`: bytes a rank holds without a model; `workspace`: the temporaries of a forward and backward as a
    fraction of the saved activations (both measured by the calibration).
    """
    per_element = state_bytes_per_element(setup.dtype, None, candidate.accumulation, candidate.stage)
    pools = offload_pool_bytes(
        counts.numel, setup.ranks, candidate.stage, **per_element, offload_optimizer=candidate.offload_optimizer,
        offload_param=candidate.offload_params, reduce_bucket_size=counts.largest_bucket,
        largest_unit=counts.largest_unit, persistent_numel=counts.persistent,
        hpz_partition_size=setup.ranks_per_node if candidate.zeropp and setup.ranks_per_node > 1 else 1)
    device = pools["device"]
    bucket = counts.largest_unit if candidate.stage == 3 else counts.largest_bucket
    buffers = device.pop("staging") + (_STAGING_BUCKETS * bucket * per_element["grad_bytes"]
                                       if candidate.stage > 0 and setup.ranks > 1 else 0)
    activations, recompute = counts.activations[candidate.micro_batch, candidate.checkpointing]
    return Peak(runtime, sum(device.values()), buffers, activations, recompute,
                round(workspace * (activations + recompute)), sum(pools["host"].values()),
                sum(pools["disk"].values()), setup.on_gpu)


def rejection(candidate: Candidate, peak: Peak, setup: Setup) -> str | None:
    """Why `candidate` does not fit, in one line of the user's words; None when it fits."""
    limit = setup.device_mem
    if peak.fixed > limit:
        states = peak.states + (0 if setup.on_gpu else peak.host)
        return (f"{candidate.label()}: model states {human_bytes(states)} and buffers {human_bytes(peak.buffers)} "
                f"over {human_bytes(max(0, limit - peak.runtime))} free ({human_bytes(limit)} per rank less "
                f"{human_bytes(peak.runtime)} runtime)")
    if peak.device > limit:
        recompute = f" + recompute {human_bytes(peak.recompute)}" * (peak.recompute > 0)
        workspace = f" + workspace {human_bytes(peak.workspace)}" * (peak.workspace > 0)
        return (f"{candidate.label()}: activations {human_bytes(peak.activations)}{recompute}{workspace} over "
                f"{human_bytes(limit - peak.fixed)} free")
    for pool, need, have in (("host memory", peak.host, setup.host_mem if setup.on_gpu else None),
                             ("disk", peak.disk, setup.disk_mem)):
        if have is not None and need * setup.ranks_per_node > have:
            return (f"{candidate.label()}: {pool} {human_bytes(need * setup.ranks_per_node)} per node over "
                    f"{human_bytes(have)}")
    return None
