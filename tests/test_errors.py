"""One error base: every exception class zeroshard defines derives from `ZeroshardError`, and the docs list each.

References: the classes themselves, found by importing every module of the package (`pkgutil.walk_packages`,
nothing skipped: an import that fails fails the test), and the error tables of docs/architecture.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import zeroshard
from zeroshard.errors import ZeroshardError

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `(\w+)` \| (?:`(\w+)`)? *\| `(zeroshard/[\w/]+\.py)` \|", re.MULTILINE)


@functools.cache
def _defined_errors() -> dict[str, type]:
    """Every exception class defined in a zeroshard module (warnings aside), by module and name."""
    names = [m.name for m in pkgutil.walk_packages(zeroshard.__path__, "zeroshard.")]
    for name in names:
        importlib.import_module(name)
    found = {}
    for name in names:
        for obj in vars(sys.modules[name]).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
                    and obj.__module__ == name):
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def _documented() -> dict[str, tuple[str | None, str]]:
    """The errors the tables of docs/architecture.md's Errors section list: name -> (builtin, file)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Errors\n"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    return {name: (builtin or None, path) for name, builtin, path in ROW.findall(section)}


def _builtin_base(cls: type) -> str | None:
    """The builtin error `cls` derives from beside ZeroshardError (Exception for the root), None if none."""
    if cls is ZeroshardError:
        return "Exception"
    bases = [b.__name__ for b in cls.__mro__
             if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
    return bases[0] if bases else None


def test_every_error_derives_from_zeroshard_error():
    errors = _defined_errors()
    assert len(errors) > 20, sorted(errors)  # the walk found the package's errors, not a few of them
    outside = sorted(name for name, cls in errors.items() if not issubclass(cls, ZeroshardError))
    assert not outside, f"error classes that `except zeroshard.ZeroshardError` would miss: {outside}"


def test_the_docs_list_every_public_error_with_its_builtin_and_file():
    public = {cls.__name__: cls for cls in _defined_errors().values() if not cls.__name__.startswith("_")}
    documented = _documented()
    assert sorted(documented) == sorted(public), "docs/architecture.md's error tables and the code differ"
    for name, (builtin, path) in documented.items():
        cls = public[name]
        assert path == cls.__module__.replace(".", "/") + ".py", (name, path, cls.__module__)
        assert builtin == _builtin_base(cls), (name, builtin, _builtin_base(cls))


def test_exported_errors_are_the_first_table():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    first = text[text.index("\n## Errors\n"):text.index("Not exported from `zeroshard`")]
    listed = {name for name, _, _ in ROW.findall(first)}
    exported = {n for n in zeroshard.__all__ if inspect.isclass(getattr(zeroshard, n))
                and issubclass(getattr(zeroshard, n), BaseException) and not issubclass(getattr(zeroshard, n), Warning)}
    assert listed == exported, (sorted(listed ^ exported))
