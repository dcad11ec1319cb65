"""ZeRO++'s bytes: exact sizes of the quantized collectives (comm/compress/qwz.py, comm/compress/qgz.py), scales included.

Pure arithmetic over element counts, here below `comm/` so that the estimator
and the recorded `comm_stats()` share one formula and agree to the byte.
Sizes are logical, in the recorder's convention (nccl-tests' "size"): the
gathered buffer of an all-gather, the input of each all-to-all, per rank.

A message of m elements travels as ceil(m / block) blocks, each
block * bits / 8 bytes of payload and one fp32 scale. Every message is one
rank's shard, S = ceil(numel / N) elements, padded on its own, so blocks
never straddle two shards (the error bound of a shard then involves only its
own blocks; see comm/compress/qgz.py).

`stage3_comm_bytes` adds these up over stage 3's flat buffers for one
optimizer step, by op and scope, with any of qwZ, hpZ and qgZ: the
recording convention the engine implements, written in its docstring.
`hpz_secondary_bytes` is hpZ's memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from zeroshard.plan.defaults import ZEROPP_BLOCK_SIZE, ZEROPP_GRADIENT_BITS
from zeroshard.plan.flats import FROZEN, KINDS, PERSISTENT, Flat, padded_numel, shard_numel

SCALE_BYTES = 4  # one fp32 scale per block travels with the payload


def quantized_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one quantized message of `numel` elements: padded payload plus one fp32 scale per block."""
    blocks = -(-numel // block_size)
    return blocks * (block_size * bits // 8 + SCALE_BYTES)


def qwz_all_gather_bytes(numel: int, world_size: int, bits: int = 8, block_size: int = ZEROPP_BLOCK_SIZE) -> int:
    """qwZ: logical bytes of the quantized all-gather of a flat buffer of `numel` elements over N ranks,
    N quantized shards. Its scope is the data-parallel group's: across nodes when it spans several."""
    return world_size * quantized_bytes(shard_numel(numel, world_size), bits, block_size)


def qgz_reduce_scatter_bytes(numel: int, world_size: int, ranks_per_node: int, bits: int = 4,
                             block_size: int = ZEROPP_BLOCK_SIZE) -> dict[str, int]:
    """qgZ: logical bytes per rank of its two hops, by scope, for a buffer of `numel` elements.

    Hop 1 (inside the node, D = `ranks_per_node` ranks) sends all N shards of
    this rank's gradient: N quantized shards. Hop 2 (across the K = N / D
    nodes) sends the K shards this rank reduced inside its node. A hop over
    one rank sends nothing and is skipped: hop 1 when D = 1, hop 2 when K = 1.
    Per rank, hop 2 is about 1/D of a quantized buffer; the node's D ranks
    together send one quantized buffer across (the paper's 0.25M at int4).
    """
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node must divide world_size {world_size}; got {ranks_per_node}")
    nodes = world_size // ranks_per_node
    message = quantized_bytes(shard_numel(numel, world_size), bits, block_size)
    return {"node": world_size * message if ranks_per_node > 1 else 0,
            "cross_node": nodes * message if nodes > 1 else 0}


# -- stage 3's collectives per optimizer step, by op and scope, as the engine records them ---------------

@dataclass(frozen=True)
class ZeroPP:
    """Which parts of ZeRO++ run, and their codecs (config: zero_quantized_weights, zero_hpz_partition_size > 1,
    zero_quantized_gradients, zeropp_block_size, zeropp_gradient_bits)."""

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    block_size: int = ZEROPP_BLOCK_SIZE
    gradient_bits: int = ZEROPP_GRADIENT_BITS  # the config's default; the paper's is 4
    weight_bits: int = 8  # qwZ's int8; communication_compression.parameters may choose int4

    @property
    def on(self) -> bool:
        return self.qwz or self.hpz or self.qgz


def stage3_comm_bytes(flats: Iterable[Flat], world_size: int, ranks_per_node: int, param_bytes: int,
                      reduce_bytes: int | None = None, accumulation: int = 1,
                      zeropp: ZeroPP = ZeroPP()) -> dict[str, dict[str, int]]:
    """Logical bytes per optimizer step at stage 3, {op: {scope: bytes}}, exactly as `comm_stats()` records them.

    The convention the engine implements. Per flat of `numel` elements,
    S = ceil(numel / N) (`shard_numel`) and P = S * N, its padded size; K =
    N / D nodes of D = `ranks_per_node` ranks; the data-parallel scope "dp"
    is "cross_node" when K > 1, else "node". e = `param_bytes`, r =
    `reduce_bytes` (default e), A = `accumulation` micro-steps per step.

    - sharded and frozen flats, all_gather: the first forward of the window
      gathers over the whole group: N * quantized_bytes(S, w, B) with qwZ (w: weight_bits),
      else P * e; scope dp. With hpZ that gather leaves a secondary shard,
      and every later gather until the step (forwards 2..A, backwards 1..A)
      is an all-gather inside the node of P * e bytes, scope "node": one dp
      gather and 2A - 1 node gathers per step. Without hpZ each of the A
      forwards and A backwards is a dp gather: 2A of them.
    - sharded flats, reduce_scatter, every micro-step: with qgZ two hops,
      N * quantized_bytes(S, b, B) in scope "node" if D > 1 and K *
      quantized_bytes(S, b, B) in scope "cross_node" if K > 1 (a hop over one
      rank is skipped; per rank, hop 2 carries 1/D of the node's quantized
      buffer); without qgZ one reduce-scatter of P * r bytes, scope dp.
    - persistent flats: every micro-step a reduce_scatter of P * r, scope dp,
      and after the step an all_gather of P * e, scope dp; never quantized.
    - frozen flats are never reduced.

    Ops with no call map to {}; see `stage3_comm_calls` for the calls.
    """
    return _stage3_sum(flats, world_size, ranks_per_node, param_bytes, reduce_bytes, accumulation, zeropp, True)


def stage3_comm_calls(flats: Iterable[Flat], world_size: int, ranks_per_node: int, param_bytes: int,
                      reduce_bytes: int | None = None, accumulation: int = 1,
                      zeropp: ZeroPP = ZeroPP()) -> dict[str, dict[str, int]]:
    """Calls per optimizer step at stage 3, {op: {scope: calls}}: one per term of `stage3_comm_bytes`."""
    return _stage3_sum(flats, world_size, ranks_per_node, param_bytes, reduce_bytes, accumulation, zeropp, False)


def by_scope(per_op: dict[str, dict[str, int]]) -> dict[str, int]:
    """{scope: total over ops} of a `stage3_comm_bytes` result."""
    out: dict[str, int] = {}
    for scopes in per_op.values():
        for scope, value in scopes.items():
            out[scope] = out.get(scope, 0) + value
    return out


def hpz_secondary_bytes(flats: Iterable[Flat], world_size: int, ranks_per_node: int, param_bytes: int) -> int:
    """hpZ's memory: bytes of the secondary shards a rank holds from the first forward of a window to
    the step, part 1/D of every gathered (sharded or frozen) flat's padded buffer: sum of (P / D) * e."""
    _topology(world_size, ranks_per_node, whole_nodes=True)
    return sum(padded_numel(f.numel, world_size) // ranks_per_node * param_bytes
               for f in _checked(flats) if f.kind != PERSISTENT)


def _stage3_sum(flats, world_size, ranks_per_node, param_bytes, reduce_bytes, accumulation, zeropp,
                want_bytes) -> dict[str, dict[str, int]]:
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1 micro-step; got {accumulation}")
    if zeropp.hpz and ranks_per_node < 2:
        raise ValueError("hpZ needs nodes of at least 2 ranks (zero_hpz_partition_size > 1)")
    nodes = _topology(world_size, ranks_per_node, whole_nodes=zeropp.hpz or zeropp.qgz)
    out: dict[str, dict[str, int]] = {"all_gather": {}, "reduce_scatter": {}}
    for flat in _checked(flats):
        for op, scope, nbytes, calls in _flat_terms(flat, world_size, ranks_per_node, nodes, param_bytes,
                                                    reduce_bytes or param_bytes, accumulation, zeropp):
            out[op][scope] = out[op].get(scope, 0) + (nbytes * calls if want_bytes else calls)
    return out


def _flat_terms(flat: Flat, n: int, d: int, k: int, e: int, r: int, a: int, zeropp: ZeroPP):
    """(op, scope, bytes per call, calls per step) of one flat buffer."""
    shard = shard_numel(flat.numel, n)
    padded, dp = shard * n, "cross_node" if k > 1 else "node"
    if flat.kind == PERSISTENT:  # stays whole: reduced as at stage 2, gathered once after the step
        return [("reduce_scatter", dp, padded * r, a), ("all_gather", dp, padded * e, 1)]
    # qwZ quantizes only what travels: with one rank it is off (engine/build.py's zeropp).
    first = n * quantized_bytes(shard, zeropp.weight_bits, zeropp.block_size) if zeropp.qwz and n > 1 else padded * e
    # hpZ: only the window's first gather crosses the group; the other 2A - 1 stay in the node.
    terms = [("all_gather", dp, first, 1), ("all_gather", "node", padded * e, 2 * a - 1)] if zeropp.hpz \
        else [("all_gather", dp, first, 2 * a)]
    if flat.kind == FROZEN:
        return terms
    if not zeropp.qgz:
        return [*terms, ("reduce_scatter", dp, padded * r, a)]
    message = quantized_bytes(shard, zeropp.gradient_bits, zeropp.block_size)
    terms += [("reduce_scatter", "node", n * message, a)] * (d > 1)
    return terms + [("reduce_scatter", "cross_node", k * message, a)] * (k > 1)


def _topology(world_size: int, ranks_per_node: int, whole_nodes: bool) -> int:
    """K, the nodes; `whole_nodes`: D must divide N (hpZ's and qgZ's groups are whole nodes)."""
    if world_size < 1 or ranks_per_node < 1:
        raise ValueError(f"world_size and ranks_per_node must be >= 1; got {world_size} and {ranks_per_node}")
    if whole_nodes and world_size % ranks_per_node:
        raise ValueError(f"hpZ and qgZ need whole nodes: ranks_per_node {ranks_per_node} must divide "
                         f"world_size {world_size}")
    return -(-world_size // ranks_per_node)


def _checked(flats: Iterable[Flat]) -> list[Flat]:
    flats = [Flat(*f) for f in flats]
    for f in flats:
        if f.kind not in KINDS or f.numel < 1:
            raise ValueError(f"a flat is (numel >= 1, kind in {', '.join(KINDS)}); got {tuple(f)}")
    return flats
