"""The package's layers (DESIGN.md section 4): imports point only down, no module cycles, small files.

Bottom to top: the leaf modules `zeroshard.errors`, `zeroshard.version` and
`zeroshard.dtypes`, which import nothing of zeroshard (not even each other);
`config`, `plan`, `estimate`, `comm`, `offload`, `core`, `stage3`, `parallel`,
`checkpoint`, `engine`; the public facade (`zeroshard/__init__.py`,
`zeroshard/consolidate.py`); `app`. A module may import its own layer (any
order within a subpackage) or any layer below it. Every import statement
counts, wherever it is: at module level, inside a function, under `if
TYPE_CHECKING:`. The module graph has no cycle at all, inside a subpackage
either.

Edges follow the import statement, as import-linter does: `import a.b` and
`from a.b import name` point at `a.b`; `from a import b` points at `a.b`
when that is a module, else at `a` (`from zeroshard import ConfigError` is
the facade). The parent packages that Python also runs are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeroshard"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# Bottom to top. Leaves import nothing of zeroshard (zeroshard.dtypes: "a leaf: it imports torch only").
# The facade holds the two public modules of the package root.
LEAVES = ("zeroshard.errors", "zeroshard.version", "zeroshard.dtypes")
SUBPACKAGES = ("config", "plan", "estimate", "comm", "offload", "core", "stage3", "parallel", "checkpoint", "engine")
FACADE = ("zeroshard", "zeroshard.consolidate",
          # `import zeroshard.deepspeed as deepspeed`: DeepSpeed's names over the engine, beside the facade
          "zeroshard.deepspeed", "zeroshard.deepspeed.initialize", "zeroshard.deepspeed.launch",
          "zeroshard.deepspeed.unsupported", "zeroshard.deepspeed.zero", "zeroshard.deepspeed.from_pretrained",
          "zeroshard.deepspeed.checkpointing",
          "zeroshard.deepspeed.engine", "zeroshard.deepspeed.utils")
LAYERS = ("leaf", *SUBPACKAGES, "facade", "app")
FRONT_DOORS = ("hf", "lightning", "accelerate")  # other trainers' loops over the facade


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer a `zeroshard` module belongs to; None for a module outside every layer."""
    if module in LEAVES:
        return "leaf"
    if module in FACADE:
        return "facade"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in (*SUBPACKAGES, "app"):
        return parts[1]
    if len(parts) >= 2 and parts[1] in FRONT_DOORS:  # the Trainer, Lightning, Accelerate: front doors, as the app
        return "app"
    return None


def rank_of(module: str) -> int:
    return LAYERS.index(layer_of(module))


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported zeroshard module, line) for every import statement in the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return [(name, line) for name, line in found if name == "zeroshard" or name.startswith("zeroshard.")]


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported zeroshard module: first line importing it}."""
    found = modules(root)
    known = set(found)
    edges: dict[str, dict[str, int]] = {}
    for module, path in found.items():
        targets: dict[str, int] = {}
        for target, line in imports_of(module, path, known):
            resolved = _known_prefix(target, known)
            if resolved != module:
                targets.setdefault(resolved, line)
        edges[module] = targets
    return edges


def _known_prefix(target: str, known: set[str]) -> str:
    """`import zeroshard.core.bucket.Bucket` is not valid Python, but a dotted name may overshoot."""
    parts = target.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else target


def upward_edges(edges: dict[str, dict[str, int]], root: Path = PACKAGE) -> list[str]:
    out = []
    for module, targets in edges.items():
        for target, line in targets.items():
            if layer_of(module) is None or layer_of(target) is None:
                continue  # test_every_module_has_a_layer names it
            if layer_of(module) == "leaf" or rank_of(target) > rank_of(module):
                path = module_name_to_path(module, root)
                out.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)}) at {path}:{line}")
    return out


def module_name_to_path(module: str, root: Path = PACKAGE) -> str:
    return str(modules(root)[module].relative_to(root.parent))


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt) and nxt in edges:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


# -- the real package --------------------------------------------------------


@pytest.fixture(scope="module")
def edges():
    return graph()


def test_the_walker_finds_known_edges(edges):
    """Not vacuous: edges known to exist, module to module and layer to layer, are found."""
    assert len(edges) > 40
    assert "zeroshard.core.bucket" in edges["zeroshard.engine.build"]
    assert "zeroshard.engine.state" in edges["zeroshard.engine.engine"]
    assert "zeroshard.checkpoint" in edges["zeroshard.engine.checkpoints"]  # from zeroshard import checkpoint
    assert "zeroshard.comm" in edges["zeroshard.core.bucket"]
    assert "zeroshard.errors" in edges["zeroshard.config.errors"]
    assert "zeroshard.checkpoint.consolidate" in edges["zeroshard.consolidate"]
    assert "zeroshard.consolidate" in edges["zeroshard"]  # from zeroshard import consolidate: the module
    layer_edges = {(layer_of(m), layer_of(t)) for m, targets in edges.items() for t in targets}
    assert layer_edges >= {("engine", "core"), ("engine", "stage3"), ("engine", "checkpoint"), ("core", "comm"),
                           ("stage3", "core"), ("checkpoint", "comm"), ("config", "leaf"), ("facade", "engine"),
                           ("facade", "checkpoint"), ("app", "facade")}
    inside_functions = [(m, t) for m, path in modules().items() for t, line in imports_of(m, path, set(edges))
                        if line not in _module_level_lines(path)]
    assert inside_functions, "the walker finds no import inside a function, where the app has several"


def _module_level_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.lineno for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}


def test_every_module_has_a_layer(edges):
    unplaced = sorted(m for m in edges if layer_of(m) is None)
    assert not unplaced, (f"modules in no layer of DESIGN.md section 4: {unplaced}; place each in a subpackage, "
                          "or add it to LEAVES or FACADE in tests/test_layers.py along with the design")


def test_imports_point_down(edges):
    upward = upward_edges(edges)
    assert not upward, "imports that point up the layers of DESIGN.md section 4:\n" + "\n".join(upward)


def test_no_import_cycle(edges):
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_files_are_small():
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


# -- the checker itself, on a synthetic package --------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "zeroshard"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_an_upward_import_is_named(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "from zeroshard.engine import run\n",
        "errors.py": "",
        "core/__init__.py": "",
        "core/bucket.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zeroshard.engine import run\n",
        "core/flat.py": "def f():\n    from ..checkpoint import save\n",  # relative, inside a function
        "config/__init__.py": "from zeroshard import ConfigError\n",  # a name of the facade
        "checkpoint/__init__.py": "save = 1\n",
        "engine/__init__.py": "from zeroshard.core import bucket\nrun = 1\n",
        "app/cli.py": "import zeroshard\n",
    })
    edges = graph(pkg)
    assert edges["zeroshard.engine"] == {"zeroshard.core.bucket": 1}
    upward = upward_edges(edges, pkg)
    assert upward == [
        "zeroshard.config (config) imports zeroshard (facade) at zeroshard/config/__init__.py:1",
        "zeroshard.core.bucket (core) imports zeroshard.engine (engine) at zeroshard/core/bucket.py:3",
        "zeroshard.core.flat (core) imports zeroshard.checkpoint (checkpoint) at zeroshard/core/flat.py:2",
    ]
    assert find_cycle(edges) == ["zeroshard.engine", "zeroshard.core.bucket", "zeroshard.engine"]


def test_a_leaf_imports_nothing_and_a_clean_package_passes(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "from zeroshard.engine import run\nfrom zeroshard.version import v\n",
        "errors.py": "",
        "version.py": "import zeroshard.errors\nv = 1\n",
        "engine/__init__.py": "from zeroshard.errors import E\nrun = 1\n",
    })
    edges = graph(pkg)
    assert upward_edges(edges, pkg) == [
        "zeroshard.version (leaf) imports zeroshard.errors (leaf) at zeroshard/version.py:1"]
    assert find_cycle(edges) is None
    (pkg / "version.py").write_text("v = 1\n")
    assert upward_edges(graph(pkg), pkg) == []
