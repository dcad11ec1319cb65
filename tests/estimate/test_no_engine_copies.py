"""estimate/ prices the plan and repeats none of the engine's rules or the config's defaults.

The rules the engine's build reads live in zeroshard/plan/ (the staging
pool's blocks and best fit, the in-flight limit, the prefetch and reuse
rules, how a flat buffer splits); the defaults are the config schema's,
read through plan/defaults.py. Here the estimate's source is searched for
the copies it once held: a pool class, an in-flight constant, the prefetch
and staging replays, a flat buffer's split, and any literal equal to a
config default the plan reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zeroshard.plan import defaults

ESTIMATE = Path(__file__).resolve().parents[2] / "zeroshard" / "estimate"
# Functions and classes whose one implementation is in plan/ (the estimate imports them).
PLAN_NAMES = {"staging_numel", "gathered_numel", "kept_units", "following", "_following", "next_to_gather",
              "may_prefetch", "block_numel", "shard_numel", "padded_numel", "Flat", "Blocks"}
# Config defaults the plan reads from the schema; small values (0, 4, 5, 8) are too common to search for.
DEFAULTS = {name: value for name, value in vars(defaults).items() if name.isupper()}
LARGE_DEFAULTS = {value for value in DEFAULTS.values() if isinstance(value, int) and value >= 100}


def _trees() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(ESTIMATE.glob("*.py"))]


def _assigned(node: ast.AST) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def test_the_tree_has_modules():
    assert len(_trees()) > 5


@pytest.mark.parametrize("name, tree", _trees())
def test_no_pool_class_and_no_rule_defined_again(name, tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert "pool" not in node.name.lower(), f"estimate/{name}: {node.name} (a staging pool: plan/staging.py)"
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            assert node.name not in PLAN_NAMES, f"estimate/{name}: {node.name} is plan/'s; import it"


@pytest.mark.parametrize("name, tree", _trees())
def test_no_in_flight_limit_and_no_default_assigned(name, tree):
    for node in ast.walk(tree):
        for target in _assigned(node):
            assert "IN_FLIGHT" not in target, f"estimate/{name}: {target} (core/reducer.py reads plan/staging.py's)"
            assert target not in DEFAULTS, f"estimate/{name}: {target} is plan/defaults.py's (the schema's)"


@pytest.mark.parametrize("name, tree", _trees())
def test_no_literal_copy_of_a_config_default(name, tree):
    """Every numeric literal that is a value (assigned, a field's or an argument's default) and equals a config
    default: the schema's value copied."""
    for node in ast.walk(tree):
        values = []
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values.append(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            values += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        for value in values:
            if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) \
                    and not isinstance(value.value, bool):
                assert value.value not in LARGE_DEFAULTS, \
                    f"estimate/{name}:{value.lineno}: {value.value} is a config default; read plan/defaults.py"


def test_the_search_finds_the_copies_it_looks_for():
    """The checks fail on the copies the estimate once held."""
    copies = ast.parse("MAX_IN_FLIGHT = 1\nMAX_LIVE_NUMEL = 1_000_000_000\nclass _Pool: ...\n"
                       "def gathered_numel(units, n, max_live=1_000_000_000, prefetch=50_000_000): ...\n")
    for check in (test_no_pool_class_and_no_rule_defined_again, test_no_in_flight_limit_and_no_default_assigned,
                  test_no_literal_copy_of_a_config_default):
        with pytest.raises(AssertionError):
            check("copies.py", copies)
    assert {1_000_000_000, 50_000_000, 100_000_000, 128} <= LARGE_DEFAULTS
