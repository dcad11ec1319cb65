"""The data-parallel group's nodes: members of the node-local and cross-node groups, and sums inside them.

All cases run in one spawn of 4 ranks (every topology creates its groups on
every rank, so they may follow each other); the tests read its results.
"""

import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from zeroshard.comm.topology import TopologyError, build_topology

WORLD = 4


def _describe(topology, device) -> dict:
    """What the tests compare: the layout, this rank's place, and a sum of 2**rank over each group."""
    sums = {}
    for scope, group in (("node", topology.node_group), ("cross_node", topology.cross_node_group)):
        value = torch.tensor([2.0 ** dist.get_rank()], device=device)
        dist.all_reduce(value, group=group)
        sums[scope + "_sum"] = int(value.item())
        sums[scope + "_members"] = tuple(dist.get_process_group_ranks(group))
    return {"layout": topology.layout, "nodes": topology.nodes, "ranks_per_node": topology.ranks_per_node,
            "node": topology.node, "local_rank": topology.local_rank, "node_ranks": topology.node_ranks,
            "cross_node_ranks": topology.cross_node_ranks, **sums}


def _error(fn) -> str | None:
    try:
        fn()
    except TopologyError as error:
        return str(error)
    return None


def _cases(rank, world, device):
    out = {}
    for ranks_per_node in (2, 1, 4):
        out[f"explicit {ranks_per_node}"] = _describe(build_topology(dist.group.WORLD, ranks_per_node), device)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["torchrun 2"] = _describe(build_topology(dist.group.WORLD), device)
    # Two data-parallel groups beside a second dimension of size 2: {0, 2} and {1, 3}.
    data_parallel = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    out["subset torchrun 2"] = _describe(build_topology(data_parallel), device)
    # {0, 2} as one node would span machines {0, 1} and {2, 3}.
    out["error subset spans machines"] = _error(lambda: build_topology(data_parallel, ranks_per_node=2))
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    out["subset explicit 2"] = _describe(build_topology(data_parallel, ranks_per_node=2), device)
    out["subset torchrun 4"] = _describe(build_topology(data_parallel), device)
    out["error not a multiple"] = _error(lambda: build_topology(dist.group.WORLD, ranks_per_node=3))
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    out["error unequal machines"] = _error(lambda: build_topology(dist.group.WORLD))
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "4"
    out["error local world size"] = _error(lambda: build_topology(dist.group.WORLD))
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    out["error spans machines"] = _error(lambda: build_topology(dist.group.WORLD, ranks_per_node=2))
    del os.environ["LOCAL_WORLD_SIZE"]
    out["error unknown"] = _error(lambda: build_topology(dist.group.WORLD))
    out["error explicit differs"] = _error(lambda: build_topology(dist.group.WORLD, ranks_per_node=1 + rank % 2))
    out["after errors"] = _describe(build_topology(dist.group.WORLD, ranks_per_node=2), device)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, WORLD)


def _check(results, case, layouts):
    """Every rank's groups hold the expected ranks, in order, and sum exactly over them.

    `layouts`: the nodes of each data-parallel group (one group: the world).
    """
    for rank, result in enumerate(results):
        got = result[case]
        layout = next(layout for layout in layouts if any(rank in ranks for ranks in layout))
        node = next(i for i, ranks in enumerate(layout) if rank in ranks)
        local = layout[node].index(rank)
        cross = tuple(ranks[local] for ranks in layout)
        assert got["layout"] == layout, (case, rank)
        assert (got["nodes"], got["ranks_per_node"]) == (len(layout), len(layout[0])), (case, rank)
        assert (got["node"], got["local_rank"]) == (node, local), (case, rank)
        assert got["node_ranks"] == got["node_members"] == layout[node], (case, rank)
        assert got["cross_node_ranks"] == got["cross_node_members"] == cross, (case, rank)
        assert got["node_sum"] == sum(2 ** r for r in layout[node]), (case, rank)
        assert got["cross_node_sum"] == sum(2 ** r for r in cross), (case, rank)


@pytest.mark.parametrize("case, layout", [
    ("explicit 2", ((0, 1), (2, 3))),
    ("explicit 1", ((0,), (1,), (2,), (3,))),
    ("explicit 4", ((0, 1, 2, 3),)),
    ("torchrun 2", ((0, 1), (2, 3))),  # LOCAL_WORLD_SIZE 2: machines {0, 1} and {2, 3}
    ("after errors", ((0, 1), (2, 3))),  # a refused topology left nothing behind that breaks the next
])
def test_the_world_as_nodes(results, case, layout):
    _check(results, case, [layout])


@pytest.mark.parametrize("case, layouts", [
    # Machines {0, 1} and {2, 3}: each data-parallel group has one rank on each, so 2 nodes x 1,
    # and its second hop crosses machines. The global rank order would pair 0 with 1 instead.
    ("subset torchrun 2", [((0,), (2,)), ((1,), (3,))]),
    # Declared 2 ranks a node: {0, 2} is one node, not {0, 1}.
    ("subset explicit 2", [((0, 2),), ((1, 3),)]),
    # One machine: each data-parallel group is one node of two.
    ("subset torchrun 4", [((0, 2),), ((1, 3),)]),
])
def test_a_data_parallel_subgroup_forms_nodes_from_its_own_ranks(results, case, layouts):
    _check(results, case, layouts)


@pytest.mark.parametrize("case, words", [
    ("error not a multiple", "cannot be cut into nodes of 3 ranks"),
    ("error unequal machines", r"machine 0: 3, machine 1: 1"),
    ("error local world size", r"disagree on LOCAL_WORLD_SIZE \(rank 0: 2, rank 1: 2, rank 2: 4, rank 3: 4\)"),
    ("error unknown", "LOCAL_WORLD_SIZE is not set"),
    ("error spans machines", "nodes of 2 ranks do not fit machines of LOCAL_WORLD_SIZE 1 ranks"),
    ("error subset spans machines", r"node \[0, 2\] spans machines \[0, 1\]|node \[1, 3\] spans machines \[0, 1\]"),
    ("error explicit differs", r"disagree on ranks_per_node \(rank 0: 1, rank 1: 2"),
])
def test_errors_are_raised_alike_on_every_rank(results, case, words):
    messages = [result[case] for result in results]
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert re.search(words, messages[0]), messages[0]
