"""Model states per rank on a pp x dp x tp mesh: ZeRO's formulas over one model part's local elements.

On a mesh (zeroshard/parallel/) a rank holds one model part, named by its
`pp` and `tp` coordinates ("pp1-tp0"): its pipeline stage's parameters, as
this tp rank's local tensors. ZeRO shards over `dp` only: the engine flattens
the part's local tensors and applies the per-rank formula of
`formulas.model_state_bytes` to them with N = dp. What TP and PP add is in
the local element count (Megatron-LM, Shoeybi et al. 2019, section 3;
Narayanan et al. 2021 for the tied embedding across stages):

- a split parameter holds one chunk per tp rank (`tp_shard_numel`);
- a replicated parameter (norms, embeddings, row-parallel biases) is held
  whole on every tp rank;
- a parameter tied across pipeline stages (the output head's copy of the
  token embedding on the last stage) is a real parameter on each stage that
  holds it, with its own gradient, master and optimizer state.

Pure functions over counts: which parameters a model splits is the caller's
(app/estimate/model_count.py counts the built-in GPT). Every figure is in bytes per
rank, or elements where named so.
"""

from __future__ import annotations

from zeroshard.estimate.formulas import STAGES, model_state_bytes, precision_bytes


def part_name(pp_rank: int, tp_rank: int) -> str:
    """A model part's name, as `Mesh.model_part` and the checkpoint's part directories spell it."""
    return f"pp{pp_rank}-tp{tp_rank}"


def dp_size(world_size: int, pp: int = 1, tp: int = 1) -> int:
    """The data-parallel size of a mesh of `world_size` ranks: world / (pp × tp), which must be whole."""
    for name, size in (("world size", world_size), ("pp", pp), ("tp", tp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1; got {size}")
    if world_size % (pp * tp):
        raise ValueError(f"{world_size} ranks do not divide into pp={pp} x tp={tp} = {pp * tp} ranks per "
                         f"data-parallel replica; give a world size that is a multiple of {pp * tp}, or "
                         "change pp or tp")
    return world_size // (pp * tp)


def tp_shard_numel(size: int, tp: int, tp_rank: int) -> int:
    """Elements along one dimension of `size` that tp rank `tp_rank` of `tp` holds when it is split.

    DTensor's `Shard` rule, torch.chunk's: chunks of ceil(size / tp), the
    last ones shorter or empty when tp does not divide size.
    """
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp rank {tp_rank} is outside 0..{tp - 1}")
    chunk = -(-size // tp)
    return max(0, min(size, chunk * (tp_rank + 1)) - chunk * tp_rank)


def part_state_bytes(local_numel: int, dp: int, stage: int, **per_element: int) -> dict[str, int]:
    """Bytes of model states one rank of a model part holds: `model_state_bytes` over the part's
    local elements (every trained local tensor once, tied copies on this stage included) with N = dp.

    `per_element` are `model_state_bytes`'s keyword arguments (bytes per
    element, `optimizer_scalar_bytes`, `largest_unit` in local elements).
    The engine pads each flat buffer to a multiple of dp: give the padded
    count for the exact bytes of several buckets.
    """
    return model_state_bytes(local_numel, dp, stage, **per_element)


def replica_numel(split_numel: int, replicated_numel: int, tp: int, stage_copies_numel: int = 0) -> int:
    """Elements one data-parallel replica holds over all its parts (pp × tp ranks), each part once.

    `split_numel`: the parameters split over tp, held once in all (their
    chunks add up); `replicated_numel`: those every tp rank holds whole;
    `stage_copies_numel`: the extra copies of parameters tied across
    pipeline stages (replicated over tp as well). Ψ is split + replicated.
    """
    return split_numel + tp * (replicated_numel + stage_copies_numel)


def mesh_summary(parts: dict[tuple[int, int], tuple[int, int]], world_size: int, pp: int, tp: int,
                 dtype: str = "bf16", optimizer_bytes: int | None = None) -> dict:
    """Model-state bytes per rank of each part, JSON-ready: what `zeroshard estimate --tp --pp --json` prints.

    `parts`: (pp_rank, tp_rank) -> (local elements, largest stage-3 unit in
    local elements). Keys: "gpus", "pp", "dp", "tp", "dtype",
    "optimizer_bytes" (K), "replica_numel" (elements over one replica's
    parts) and "parts": {part name: {"pp_rank", "tp_rank", "numel",
    "largest_unit", "memory_bytes": {stage: bytes}, "memory_by_state":
    {stage: {"params", "grads", "master", "optimizer"}}}}.
    """
    dp = dp_size(world_size, pp, tp)
    expected = {(p, t) for p in range(pp) for t in range(tp)}
    if set(parts) != expected:
        raise ValueError(f"parts must name every (pp_rank, tp_rank) of pp={pp} x tp={tp} once; got {sorted(parts)}")
    per_element = precision_bytes(dtype, optimizer_bytes)
    out = {}
    for (p, t), (numel, largest_unit) in sorted(parts.items()):
        by_state = {str(s): part_state_bytes(numel, dp, s, largest_unit=largest_unit, **per_element)
                    for s in STAGES}
        out[part_name(p, t)] = {
            "pp_rank": p, "tp_rank": t, "numel": numel, "largest_unit": largest_unit,
            "memory_bytes": {s: sum(states.values()) for s, states in by_state.items()},
            "memory_by_state": by_state,
        }
    return {"gpus": world_size, "pp": pp, "dp": dp, "tp": tp, "dtype": dtype,
            "optimizer_bytes": per_element["master_bytes"] + per_element["optimizer_bytes"],
            "replica_numel": sum(numel for numel, _ in parts.values()), "parts": out}
