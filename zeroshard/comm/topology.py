"""The node topology of the data-parallel group, and its node-local and cross-node process groups (ZeRO++).

hpZ gathers inside a node and qgZ reduces in two hops (inside the node, then
across nodes), so both need to know which data-parallel ranks share a node.
That is a fact of the data-parallel group, not of the global rank order:
with tensor or pipeline parallelism beside it, the data-parallel ranks of a
node are not consecutive global ranks (DeepSpeed's hpZ groups are, and are
wrong there).

A node holds `ranks_per_node` data-parallel ranks, D. It comes from one of:

- an explicit `ranks_per_node` (config): data-parallel ranks i*D .. i*D+D-1,
  in the group's order, form node i. A test may so declare 4 ranks on one
  machine to be 2 nodes x 2.
- torchrun's `LOCAL_WORLD_SIZE` (L): torchrun numbers ranks node by node, so
  global rank g runs on machine g // L; the data-parallel ranks on a machine
  form a node, in the group's order. Every machine must hold the same number.

The node-local group of a rank holds its node; its cross-node group holds the
ranks with the same local index on every node (the peers of qgZ's second
hop). `torch.distributed.new_group` must be entered by every rank of the
default group for every group, in the same order, members or not; so
`build_topology` first gathers every rank's data-parallel group, then every
rank creates the groups of every data-parallel group in one agreed order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from zeroshard.comm.recorder import Scope
from zeroshard.errors import ZeroshardError

Layout = tuple[tuple[int, ...], ...]  # global ranks, node by node, each node in local-index order


class TopologyError(ZeroshardError, ValueError):
    """The data-parallel group cannot be cut into equal nodes, or ranks disagree on how."""


@dataclass(frozen=True)
class Topology:
    """This rank's place in its data-parallel group's nodes, and the groups for each scope of traffic."""

    layout: Layout  # the data-parallel group's global ranks as nodes x local index
    rank: int  # this rank, global
    node_group: dist.ProcessGroup  # this rank's node: hpZ's gathers, qgZ's first hop
    cross_node_group: dist.ProcessGroup  # the ranks with this local index on every node: qgZ's second hop

    @property
    def nodes(self) -> int:
        return len(self.layout)

    @property
    def ranks_per_node(self) -> int:
        return len(self.layout[0])

    @property
    def scope(self) -> Scope:
        """Where traffic over the whole data-parallel group goes (`Comm.scope`): "cross_node" or "node"."""
        return "cross_node" if self.nodes > 1 else "node"

    @property
    def node(self) -> int:
        """This rank's node, 0 .. nodes - 1."""
        return next(i for i, ranks in enumerate(self.layout) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node, 0 .. ranks_per_node - 1."""
        return self.layout[self.node].index(self.rank)

    @property
    def node_ranks(self) -> tuple[int, ...]:
        """The global ranks of `node_group`, in its order."""
        return self.layout[self.node]

    @property
    def cross_node_ranks(self) -> tuple[int, ...]:
        """The global ranks of `cross_node_group`, in its order (by node)."""
        return tuple(ranks[self.local_rank] for ranks in self.layout)


def build_topology(group: dist.ProcessGroup, ranks_per_node: int | None = None) -> Topology:
    """The topology of data-parallel `group`, with its process groups; a collective over the default group.

    Every rank of the default group calls it once, each with its own
    data-parallel group and the same `ranks_per_node` (None: from torchrun's
    `LOCAL_WORLD_SIZE`). Raises `TopologyError` on every rank alike when the
    ranks disagree or a group cannot be cut into equal nodes.
    """
    mine = {
        "ranks": tuple(dist.get_process_group_ranks(group)),
        "ranks_per_node": ranks_per_node,
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "backend": dist.get_backend(group),
    }
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    layouts = _layouts(every)
    rank = dist.get_rank()
    node_group, cross_node_group = _create_groups(layouts, every, rank)
    return Topology(layouts[mine["ranks"]], rank, node_group, cross_node_group)


def declared_scope(group: dist.ProcessGroup, ranks_per_node: int | None = None) -> Scope | None:
    """Where `group`'s traffic goes, from `ranks_per_node` or torchrun's LOCAL_WORLD_SIZE, without communicating.

    For bytes by scope when ZeRO++ builds no topology. None when neither says, or
    when LOCAL_WORLD_SIZE gives machines unequal shares (only hpZ and qgZ need equal nodes).
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks_per_node is not None:
        layout = _explicit_layout(ranks, ranks_per_node)
    elif "LOCAL_WORLD_SIZE" in os.environ:
        try:
            layout = _torchrun_layout(ranks, _positive(os.environ["LOCAL_WORLD_SIZE"]))
        except TopologyError:
            return None
    else:
        return None
    return "cross_node" if len(layout) > 1 else "node"


def _layouts(every: list[dict]) -> dict[tuple[int, ...], Layout]:
    """Each data-parallel group's layout, checked for every group on every rank, so all raise or none."""
    groups = sorted({facts["ranks"] for facts in every})
    if len({r for ranks in groups for r in ranks}) != sum(len(ranks) for ranks in groups):
        by_rank = ", ".join(f"rank {r}: {list(facts['ranks'])}" for r, facts in enumerate(every))
        raise TopologyError(f"the data-parallel groups overlap ({by_rank}); every rank must pass its own "
                            "data-parallel group, and the groups must not share ranks")
    explicit = _agreed(every, "ranks_per_node", "ranks_per_node")
    local_world_size = _agreed(every, "local_world_size", "LOCAL_WORLD_SIZE")
    if explicit is not None:
        layouts = {ranks: _explicit_layout(ranks, explicit) for ranks in groups}
        if local_world_size is not None:
            _check_nodes_fit_machines(layouts, _positive(local_world_size), explicit)
        return layouts
    if local_world_size is None:
        if any(len(ranks) > 1 for ranks in groups):
            raise TopologyError("the ranks per node are unknown: LOCAL_WORLD_SIZE is not set; launch with torchrun "
                                "or set the ranks per node (zero_hpz_partition_size) in the config")
        return {ranks: (ranks,) for ranks in groups}
    return {ranks: _torchrun_layout(ranks, _positive(local_world_size)) for ranks in groups}


def _check_nodes_fit_machines(layouts: dict[tuple[int, ...], Layout], local_world_size: int, explicit: int) -> None:
    """Declared nodes must each lie on one machine (torchrun: global rank g runs on machine g // L)."""
    for layout in layouts.values():
        for node in layout:
            if len({rank // local_world_size for rank in node}) > 1:
                raise TopologyError(
                    f"nodes of {explicit} ranks do not fit machines of LOCAL_WORLD_SIZE {local_world_size} ranks: "
                    f"node {list(node)} spans machines {sorted({r // local_world_size for r in node})}; set the ranks "
                    "per node (zeropp_ranks_per_node, zero_hpz_partition_size) to the data-parallel ranks that share "
                    "a machine, or a divisor of them")


def _agreed(every: list[dict], key: str, name: str):
    """The value of `key` that every rank holds; TopologyError naming each rank's value if they differ."""
    values = [facts[key] for facts in every]
    if len(set(values)) > 1:
        by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise TopologyError(f"ranks disagree on {name} ({by_rank}); every rank must see the same value "
                            "(torchrun's LOCAL_WORLD_SIZE differs when machines run different numbers of ranks: "
                            "give every machine the same --nproc-per-node, or set the ranks per node in the config)")
    return values[0]


def _positive(value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise TopologyError(f"LOCAL_WORLD_SIZE must be a positive integer, not {value!r}")
    return number


def _explicit_layout(ranks: tuple[int, ...], ranks_per_node: int) -> Layout:
    """Consecutive data-parallel ranks, `ranks_per_node` at a time, form a node."""
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or len(ranks) % ranks_per_node:
        raise TopologyError(f"the data-parallel group of {len(ranks)} ranks {list(ranks)} cannot be cut into nodes "
                            f"of {ranks_per_node} ranks; the ranks per node must divide the data-parallel size")
    return tuple(ranks[i : i + ranks_per_node] for i in range(0, len(ranks), ranks_per_node))


def _torchrun_layout(ranks: tuple[int, ...], local_world_size: int) -> Layout:
    """The data-parallel ranks of each machine (torchrun: global rank g runs on machine g // L) form a node."""
    machines: dict[int, list[int]] = {}
    for rank in ranks:
        machines.setdefault(rank // local_world_size, []).append(rank)
    nodes = tuple(tuple(machines[m]) for m in sorted(machines))
    if len({len(node) for node in nodes}) > 1:
        counts = ", ".join(f"machine {m}: {len(machines[m])}" for m in sorted(machines))
        raise TopologyError(f"the data-parallel group {list(ranks)} has different numbers of ranks on its machines "
                            f"({counts}; LOCAL_WORLD_SIZE {local_world_size}); hpZ and qgZ need equal nodes: "
                            "arrange the parallel dimensions so each machine holds as many data-parallel ranks")
    return nodes


def _create_groups(layouts: dict[tuple[int, ...], Layout], every: list[dict], rank: int):
    """Every group of every layout, created by every rank in the same order; returns this rank's two."""
    node_group = cross_node_group = None
    for ranks, layout in sorted(layouts.items()):
        backend = every[ranks[0]]["backend"]
        for node in layout:
            created = dist.new_group(list(node), backend=backend)
            if rank in node:
                node_group = created
        for local in range(len(layout[0])):
            peers = [node[local] for node in layout]
            created = dist.new_group(peers, backend=backend)
            if rank in peers:
                cross_node_group = created
    return node_group, cross_node_group
