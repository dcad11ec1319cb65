"""docs/migrate-from-deepspeed.md's API table against the code: every row's name exists (supported, no effect)
or raises a zeroshard error with a message (error, not yet), every named test exists and mentions the name
(and each keyword) its row names, and every DeepSpeed name that zeroshard.deepspeed refuses in code has its row."""

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed.unsupported import NOT_PROVIDED, ZERO_NOT_PROVIDED

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "migrate-from-deepspeed.md"
STATUSES = {"supported", "no effect", "error", "not yet"}
ROW = re.compile(r"^\| `(?P<api>[^`]+)`(?P<rest>[^|]*) \| (?P<status>[^|]+) \| (?P<what>[^|]+) \| `(?P<test>\w+)` \|$")


def rows() -> list[dict]:
    out = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `deepspeed.") or line.startswith("| `engine."):
            match = ROW.match(line)
            assert match, f"a row of {PAGE.name} that is not | `api` | status | zeroshard | `test` |: {line}"
            out.append(match.groupdict())
    return out


def _name(api: str) -> str:
    """`deepspeed.zero.Init(remote_device=...)` -> `deepspeed.zero.Init`; `engine.no_sync()` -> `engine.no_sync`."""
    return api.split("(")[0]


def _engine(stage=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    return deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                     "zero_optimization": {"stage": stage}})[0]


def _enter(context):
    with context:
        pass


# What each error or not-yet row that is not a missing name does, called.
CALLS = {
    "deepspeed.initialize(mpu=...)": lambda: deepspeed.initialize(model=nn.Linear(2, 2), config={}, mpu=object()),
    "deepspeed.initialize(mesh_param=...)": lambda: deepspeed.initialize(model=nn.Linear(2, 2), config={},
                                                                          mesh_param=(1, 1)),
    "deepspeed.init_distributed(init_method=..., rank=..., world_size=...)":
        lambda: deepspeed.init_distributed(init_method="tcp://localhost:1", rank=0, world_size=1),
    "deepspeed.zero.Init(param_swapper=...)": lambda: deepspeed.zero.Init(param_swapper=object()),
    "engine.set_train_batch_size": lambda: _engine().set_train_batch_size(8),
    "engine.load_checkpoint(load_module_strict=False)": lambda: _engine().load_checkpoint("unused", None, False),
    "engine.load_checkpoint(custom_load_fn=...)": lambda: _engine().load_checkpoint("unused", custom_load_fn=print),
}


def _key(row) -> str:
    return row["api"] + row["rest"]


def test_the_table_is_well_formed_and_complete():
    table = rows()
    assert len(table) > 60
    assert {r["status"] for r in table} <= STATUSES, {r["status"] for r in table} - STATUSES
    keys = [_key(r) for r in table]
    assert len(keys) == len(set(keys)), "a row is listed twice"
    listed = {_name(r["api"]) for r in table}
    in_code = {f"deepspeed.{n}" for n in NOT_PROVIDED} | {f"deepspeed.zero.{n}" for n in ZERO_NOT_PROVIDED}
    assert in_code <= listed, f"refused in code but not in the table: {sorted(in_code - listed)}"
    public = {f"deepspeed.{n}" for n in deepspeed.__all__
              if n not in ("MissingAPIError", "UnsupportedError", "zero", "checkpointing", "utils")}
    public |= {f"deepspeed.checkpointing.{n}" for n in deepspeed.checkpointing.__all__}  # its names one by one
    public.add("deepspeed.utils.set_z3_leaf_modules")  # its row names the leaf modules' other three
    assert public <= listed, f"provided but not in the table: {sorted(public - listed)}"
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py"))
    missing = sorted({r["test"] for r in table if f"def {r['test']}(" not in tests})
    assert not missing, f"tests named in {PAGE.name} that do not exist: {missing}"


def _mentioned(api: str) -> list[str]:
    """What a row's test must mention: the name's last part and each keyword the row names.
    `deepspeed.initialize(training_data=..., collate_fn=...)` -> initialize, training_data, collate_fn."""
    name, _, arguments = api.partition("(")
    return [name.split(".")[-1]] + re.findall(r"(\w+)=", arguments)


def _test_sources() -> dict[str, str]:
    """Each test function -> its source and that of the helpers it uses: the functions and classes it names,
    in its file or imported from a tests module (the getting-started loop is in getting_started.py), and theirs."""
    modules = {}
    for path in (ROOT / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = tree, path.read_text(encoding="utf-8")
    sources = {}
    for module, (tree, text) in modules.items():
        if not module.rsplit(".", 1)[-1].startswith("test_"):
            continue
        scope = {node.name: (node, text) for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        for node in tree.body:  # from tests.x import helper
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                other_tree, other_text = modules[node.module]
                defined = {d.name: d for d in other_tree.body if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
                scope.update({a.asname or a.name: (defined[a.name], other_text) for a in node.names
                              if a.name in defined})
        for name, (node, _) in list(scope.items()):
            if name.startswith("test_"):
                sources[name] = _with_helpers(node, scope)
    return sources


def _with_helpers(node: ast.AST, scope: dict) -> str:
    seen, todo, parts = set(), [node], []
    while todo:
        current = todo.pop()
        parts.append(ast.unparse(current))
        for used in ast.walk(current):
            if isinstance(used, ast.Name) and used.id in scope and used.id not in seen:
                seen.add(used.id)
                todo.append(scope[used.id][0])
    return "\n".join(parts)


def test_each_rows_test_mentions_what_the_row_names():
    # test_error_rows_raise calls every error and not-yet row itself (CALLS, or the name's lookup)
    sources = _test_sources()
    unmentioned = [f"{r['api']} in {r['test']}: {word}" for r in rows() if r["test"] != "test_error_rows_raise"
                   for word in _mentioned(r["api"]) if not re.search(rf"\b{word}\b", sources[r["test"]])]
    assert not unmentioned, f"rows whose test does not use what they name: {unmentioned}"


def test_supported_rows_name_what_exists():
    engine = _engine()
    absent = []
    for row in rows():
        if row["status"] not in ("supported", "no effect"):
            continue
        owner, _, attr = _name(row["api"]).partition(".")
        target = deepspeed if owner == "deepspeed" else engine
        obj = target
        for part in attr.split("."):
            obj = getattr(obj, part, absent)
        if obj is absent:
            absent.append(row["api"])
    assert not absent, f"rows that say supported but name nothing: {absent}"


def test_error_rows_raise():
    for row in rows():
        if row["status"] not in ("error", "not yet"):
            continue
        key = _key(row)
        call = CALLS.get(key)
        if call is None:  # a name zeroshard.deepspeed does not provide
            owner, _, attr = key.partition(".")
            prefix = next((p for p in ("zero.", "utils.") if attr.startswith(p)), "")
            module = getattr(deepspeed, prefix[:-1]) if prefix else deepspeed
            call = (lambda m=module, a=attr.removeprefix(prefix): getattr(m, a))
        with pytest.raises(zeroshard.ZeroshardError) as info:
            call()
        assert len(str(info.value)) > 30, f"{key}: {info.value}"
