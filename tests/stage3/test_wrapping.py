"""Stage 3's units: which modules are units (by class or by size) and which unit holds each parameter.

References: small models built here whose units and parameter homes are
worked out by hand in each test (the innermost unit enclosing every module
that holds a parameter; post-order element counts for the size policy),
and, for the tiny GPT, the model's own parameter list.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.recipes import make_model
from zeroshard.errors import ModelError
from zeroshard.stage3.wrapping import plan_units, unit_modules


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.emb(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


class TiedSeq2Seq(nn.Module):
    """The embedding and the output head share one weight, in two different units."""

    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.dec = Decoder()
        self.dec.head.weight = self.enc.emb.weight


class Half(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


class Pair(nn.Module):
    """Two child units sharing one weight; the pair's own parameter sits beside them."""

    def __init__(self):
        super().__init__()
        self.left = Half()
        self.right = Half()
        self.right.lin.weight = self.left.lin.weight
        self.gate = nn.Linear(3, 1)

    def forward(self, x):
        return self.gate(self.right(self.left(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.pairs = nn.ModuleList([Pair(), Pair()])
        self.out = nn.Linear(3, 2)


def _homes(plans) -> dict[int, str]:
    """id(parameter) -> the plan holding it; fails if a parameter is in two plans."""
    homes: dict[int, str] = {}
    for plan in plans:
        for p in plan.params:
            assert id(p) not in homes, f"a parameter is in both {homes[id(p)]} and {plan.name}"
            homes[id(p)] = plan.name
    return homes


def _check_partition(model: nn.Module, plans) -> dict[int, str]:
    homes = _homes(plans)
    assert set(homes) == {id(p) for p in model.parameters()}
    return homes


def test_a_tied_weight_in_two_units_belongs_to_the_innermost_unit_enclosing_both():
    model = TiedSeq2Seq()
    plans = plan_units(model, unit_modules(model, ("Encoder", "Decoder"), 1))
    homes = _check_partition(model, plans)
    assert homes[id(model.enc.emb.weight)] == "(root)"  # enc and dec meet only at the root
    assert homes[id(model.enc.proj.weight)] == homes[id(model.enc.proj.bias)] == "enc"
    assert homes[id(model.dec.norm.weight)] == homes[id(model.dec.norm.bias)] == "dec"
    # Registration order of the units; each plan lists what it holds in registration order.
    assert [p.name for p in plans] == ["(root)", "enc", "dec"]
    assert [p.params for p in plans] == [[model.enc.emb.weight], [model.enc.proj.weight, model.enc.proj.bias],
                                         [model.dec.norm.weight, model.dec.norm.bias]]
    # Both owners of the tied weight are initialised with the root's unit.
    root = plans[0]
    assert root.module is model and len(root.owners) == 2
    assert root.owners[0] is model.enc.emb and root.owners[1] is model.dec.head


def test_a_weight_shared_by_two_child_units_belongs_to_their_parent_unit():
    model = Stack()
    plans = plan_units(model, unit_modules(model, ("Pair", "Half"), 1))
    homes = _check_partition(model, plans)
    for i, pair in enumerate(model.pairs):
        assert homes[id(pair.left.lin.weight)] == f"pairs.{i}"  # not a Half, not the root
        assert homes[id(pair.gate.weight)] == homes[id(pair.gate.bias)] == f"pairs.{i}"
        assert homes[id(pair.left.lin.bias)] == f"pairs.{i}.left"
        assert homes[id(pair.right.lin.bias)] == f"pairs.{i}.right"
    assert homes[id(model.out.weight)] == homes[id(model.out.bias)] == "(root)"
    assert [p.name for p in plans] == ["(root)", "pairs.0", "pairs.0.left", "pairs.0.right",
                                       "pairs.1", "pairs.1.left", "pairs.1.right"]
    plan = next(p for p in plans if p.name == "pairs.0")
    assert plan.params == [model.pairs[0].left.lin.weight, model.pairs[0].gate.weight, model.pairs[0].gate.bias]


def test_a_unit_left_with_no_parameters_is_no_unit():
    model = TiedSeq2Seq()
    model.dec.norm = nn.Identity()  # dec now holds only the tied head, which goes to the root
    plans = plan_units(model, unit_modules(model, ("Encoder", "Decoder"), 1))
    _check_partition(model, plans)
    assert [p.name for p in plans] == ["(root)", "enc"]


class Marked(nn.Linear):
    """A Linear of its own class, to make a unit of one module among its siblings."""


def test_unit_names_are_matched_whole_not_as_prefixes():
    """blocks.1 is a unit; blocks.10 and blocks.11 are not, and do not fall inside it."""
    model = nn.Module()
    model.blocks = nn.ModuleList(Marked(2, 2) if i == 1 else nn.Linear(2, 2) for i in range(12))
    plans = plan_units(model, unit_modules(model, ("Marked",), 1))
    homes = _check_partition(model, plans)
    for i, block in enumerate(model.blocks):
        assert homes[id(block.weight)] == homes[id(block.bias)] == ("blocks.1" if i == 1 else "(root)"), i
    assert [p.name for p in plans] == ["(root)", "blocks.1"]
    assert len(plans[0].params) == 2 * 11


class Sized(nn.Module):
    """Elements: a 110, b.0 20, b.1 20 (b: 40 together), c 6, root's own 5."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.c = nn.Linear(2, 2)
        self.own = nn.Parameter(torch.zeros(5))


@pytest.mark.parametrize("min_numel, units", [
    (20, {"", "a", "b.0", "b.1"}),  # each small Linear reaches 20 on its own; c (6) does not
    (21, {"", "a", "b"}),  # b.0 and b.1 (20 each) fall short alone; b gathers their 40
    (40, {"", "a", "b"}),  # exactly 40: still a unit
    (41, {"", "a"}),  # b's 40 go up to the root
    (111, {""}),  # nothing below the root reaches 111: the root takes all 161
    (1, {"", "a", "b.0", "b.1", "c"}),  # every leaf with parameters; b is left with none
])
def test_size_policy_makes_a_unit_of_each_subtree_reaching_the_threshold(min_numel, units):
    model = Sized()
    found = unit_modules(model, (), min_numel)
    assert set(found) == units
    assert all(found[name] is model.get_submodule(name) for name in found)
    plans = plan_units(model, found)
    homes = _check_partition(model, plans)
    # Each parameter's home is the nearest unit above its module.
    for name, p in model.named_parameters():
        path = name.rsplit(".", 1)[0] if "." in name else ""
        while path not in units:
            path = path.rsplit(".", 1)[0] if "." in path else ""
        assert homes[id(p)] == (path or "(root)"), name
    assert sum(p.numel() for plan in plans for p in plan.params) == 161


def test_the_gpt_splits_into_blocks_and_a_root_holding_the_tied_embedding():
    from zeroshard.app.models.gpt import Block

    model = make_model()
    plans = plan_units(model, unit_modules(model, (Block.__name__,), 1))
    homes = _check_partition(model, plans)
    assert [p.name for p in plans] == ["(root)", "blocks.0", "blocks.1"]
    for name, p in model.named_parameters():
        assert homes[id(p)] == (".".join(name.split(".")[:2]) if name.startswith("blocks.") else "(root)")
    assert homes[id(model.head.weight)] == "(root)" and model.head.weight is model.wte.weight


def test_wrap_classes_that_match_no_module_are_an_error_naming_them_and_the_classes_present():
    model = TiedSeq2Seq()
    with pytest.raises(ValueError) as error:
        unit_modules(model, ("Encoder", "Block", "Layer"), 1)
    message = str(error.value)
    assert "['Block', 'Layer'] match no module" in message
    assert "classes present: Decoder, Embedding, Encoder, LayerNorm, Linear, TiedSeq2Seq" in message
    with pytest.raises(ValueError, match=r"\['Block'\] match no module"):
        unit_modules(model, ("Block",), 1)


class Leaf(nn.Module):
    """10 x 10 + 10 = 110 elements."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, x):
        return self.lin(x)


class Containers(nn.Module):
    """A ModuleList of leaves (330), a ModuleList of ModuleDicts of leaves (440), a ParameterList (7), own (5)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Leaf() for _ in range(3))
        self.nested = nn.ModuleList(nn.ModuleDict({"a": Leaf(), "b": Leaf()}) for _ in range(2))
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(7))])
        self.own = nn.Parameter(torch.zeros(5))


@pytest.mark.parametrize("min_numel, units", [
    # Each container reaches 200 while no leaf does: their leaves that run are units, the ParameterList's 7 and
    # the root's 5 stay with the root.
    (200, {"", "blocks.0", "blocks.1", "blocks.2", "nested.0.a", "nested.0.b", "nested.1.a", "nested.1.b"}),
    # Only nested (440) reaches 400: its ModuleDicts (220 each) do not run either, so their leaves are units.
    (400, {"", "nested.0.a", "nested.0.b", "nested.1.a", "nested.1.b"}),
    # Each Linear (110) reaches 100 on its own: the innermost subtree is the unit, as before.
    (100, {"", "blocks.0.lin", "blocks.1.lin", "blocks.2.lin", "nested.0.a.lin", "nested.0.b.lin", "nested.1.a.lin",
           "nested.1.b.lin"}),
    (441, {""}),  # no container reaches it: the root takes all 782
])
def test_a_container_that_reaches_the_size_makes_units_of_its_children_that_run(min_numel, units):
    model = Containers()
    assert set(unit_modules(model, (), min_numel)) == units
    homes = _check_partition(model, plan_units(model, unit_modules(model, (), min_numel)))
    assert homes[id(model.extra[0])] == homes[id(model.own)] == "(root)"


def test_wrap_classes_that_never_run_are_refused():
    with pytest.raises(ModelError, match=r"\['ModuleList'\] have no forward of their own"):
        unit_modules(Containers(), ("ModuleList", "Leaf"), 1)
