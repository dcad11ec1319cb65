"""offload/ sits beside comm/ and knows no collective: it imports only the leaves and itself."""

from __future__ import annotations

from tests.test_layers import graph

ALLOWED = {"zeroshard.errors", "zeroshard.dtypes"}


def test_offload_imports_only_the_leaves_and_itself():
    edges = graph()
    offload = {m: targets for m, targets in edges.items() if m == "zeroshard.offload" or
               m.startswith("zeroshard.offload.")}
    assert len(offload) >= 8
    outside = sorted(f"{m} imports {t}" for m, targets in offload.items() for t in targets
                     if t not in ALLOWED and t != "zeroshard.offload" and not t.startswith("zeroshard.offload."))
    assert not outside, outside
