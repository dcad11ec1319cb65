"""The module tree of docs/architecture.md, generated from each module's first docstring line.

    python scripts/module_map.py            # print the tree
    python scripts/module_map.py --write    # replace the tree in docs/architecture.md

tests/test_module_map.py fails when the page's tree is not what this prints, so the map cannot drift from
the code: a module added, moved or removed, or a first line changed, is one command away from the page.
"""

from __future__ import annotations

import argparse
import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zeroshard"
PAGE = ROOT / "docs" / "architecture.md"
HEADING = "## The package tree"
WIDTH, COLUMN = 120, 23  # the page's lines, and where a description starts


def summary(path: Path) -> str:
    """The docstring's first sentence (its first paragraph when that holds no sentence end)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    return re.split(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\. ", paragraph, maxsplit=1)[0].removesuffix(".")


def entry(name: str, text: str, depth: int) -> list[str]:
    head = "  " * depth + name
    head = head + "  " if len(head) >= COLUMN - 1 else head.ljust(COLUMN)
    return textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * COLUMN) or [head.rstrip()]


def tree(folder: Path, depth: int = 0) -> list[str]:
    lines = entry(folder.name + "/", summary(folder / "__init__.py"), depth)
    for path in sorted(p for p in folder.glob("*.py") if p.name != "__init__.py"):
        lines += entry(path.name, summary(path), depth + 1)
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        lines += tree(sub, depth + 1)
    return lines


def render() -> str:
    return "```\n" + "\n".join(tree(PACKAGE)) + "\n```"


def page_with(tree_block: str, page: str) -> str:
    """The page with the code block after HEADING replaced."""
    start = page.index("```", page.index(HEADING))
    end = page.index("```", start + 3) + 3
    return page[:start] + tree_block + page[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tree in {PAGE.relative_to(ROOT)}")
    args = parser.parse_args()
    if args.write:
        PAGE.write_text(page_with(render(), PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(render())


if __name__ == "__main__":
    main()
