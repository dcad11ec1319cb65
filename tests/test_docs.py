"""The documentation: relative links and #anchors resolve (no network), and every Python block runs.

Every ```python block of README.md and docs/*.md runs as a standalone program
in a temporary working directory, with torchrun's environment for one rank
(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR, MASTER_PORT). The line just
before the fence may say how, as an HTML comment (invisible on GitHub):

- `<!-- doc-test: ranks=2 -->`: run under torchrun on 2 ranks;
- `<!-- doc-test: fragment NAME -->`: a fragment on purpose (it needs names
  the page defines elsewhere, a GPU or several nodes); only its syntax is
  checked, and NAME must be in FRAGMENTS below, so a new fragment is a
  decision a reviewer sees.
"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.distributed import test_device as rank_device

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DIRECTIVE = re.compile(r"^<!-- doc-test: (ranks=(?P<ranks>\d+)|fragment (?P<fragment>[a-z0-9-]+)) -->$")
BLOCK_TIMEOUT_S = 120

# Every fragment, by name: the page it is on and why it is not a whole program.
# Adding one here is choosing not to run a block.
FRAGMENTS = {
    "readme-checkpoints": ("README.md", "save and load calls on the engine of the blocks above"),
    "hf-pretrained": ("docs/hugging-face.md", "a checkpoint directory of the user's, and their ds_config"),
    "hf-config-override": ("docs/deepspeed-config.md", "transformers' ds_config file, model and optimizer"),
    "training-loop-shape": ("docs/training-loop.md", "the loop's shape: loader and engine are the script's"),
    "checkpoints-calls": ("docs/checkpoints.md", "the two calls, on the engine of a training script"),
    "memory-offload-states": ("docs/memory.md", "the two calls' signatures, on the engine of a training script"),
    "checkpoints-rng-states": ("docs/checkpoints.md", "a line of the loop above: samples, engine"),
    "checkpoints-own-schedule": ("docs/checkpoints.md", "elided with ..., the engine of the loop above"),
    "checkpoints-load-consolidated": ("docs/checkpoints.md", "MyModel: the user's model class"),
    "checkpoints-consolidate-api": ("docs/checkpoints.md", "a checkpoint 'ck' and model of the page's commands"),
    "checkpoints-load-module-only": ("docs/checkpoints.md", "a pretraining job's checkpoint"),
    "checkpoints-load-strict-false": ("docs/checkpoints.md", "a pretraining job's checkpoint, model and config"),
    "checkpoints-exclude-frozen": ("docs/checkpoints.md", "a training script's engine; the user's base and adapters"),
}


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


def test_anchor_rule_matches_github():
    # GitHub's anchors for headings of docs/config-reference.md and docs/deepspeed-config.md.
    assert {"optimizer-type-adam--adamw", "zero_optimization"} <= anchors(ROOT / "docs" / "config-reference.md")
    assert "auto" in anchors(ROOT / "docs" / "deepspeed-config.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network)
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_index():
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / "docs" / "index.md")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"} <= linked


# ---- the Python blocks ----

@dataclass(frozen=True)
class Block:
    page: str          # relative to the repository root
    index: int         # 0-based among the page's python blocks
    line: int          # 1-based line of the opening fence
    source: str
    ranks: int = 1
    fragment: str | None = None  # the name, for a fragment on purpose
    directive_error: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.fragment or self.index}"


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, each with the doc-test directive on the line before it."""
    return parse_blocks(str(page.relative_to(ROOT)), page.read_text(encoding="utf-8"))


def parse_blocks(label: str, text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        before = lines[start - 1].strip() if start else ""
        ranks, fragment, error = 1, None, None
        if before.startswith("<!-- doc-test"):
            found = DIRECTIVE.match(before)
            if found is None:
                error = f"unreadable directive {before!r}: write ranks=N or fragment NAME"
            elif found["ranks"]:
                ranks = int(found["ranks"])
            else:
                fragment = found["fragment"]
        blocks.append(Block(label, len(blocks), start + 1,
                            "\n".join(lines[start + 1:end]) + "\n", ranks, fragment, error))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in python_blocks(page)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_block(source: str, workdir: Path, ranks: int = 1) -> subprocess.CompletedProcess:
    """Run `source` as a program in `workdir`, as `python x.py` under torchrun's env, or torchrun on `ranks`."""
    script = workdir / "doc_block.py"
    script.write_text(source, encoding="utf-8")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if rank_device(ranks).type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # fewer GPUs than ranks: the block runs on CPU, gloo
    port = str(free_port())
    if ranks == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, str(script)]
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={port}", str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path):
    assert block.directive_error is None, f"{block.page} line {block.line}: {block.directive_error}"
    if block.fragment:
        compile(block.source, f"{block.page}:{block.line}", "exec")  # a fragment still parses
        page, why = FRAGMENTS.get(block.fragment, (None, None))
        assert page == block.page, (
            f"{block.page} line {block.line}: fragment {block.fragment!r} is not in FRAGMENTS of tests/test_docs.py "
            "(add it there, or make the block run)")
        pytest.skip(f"fragment {block.fragment} on purpose, not a whole program: {why}")
    done = run_block(block.source, tmp_path, block.ranks)
    assert done.returncode == 0, (
        f"{block.page} line {block.line} (block {block.index}, {block.ranks} rank(s)) exited {done.returncode}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def test_directives_are_read():
    page = ("text\n```python\na = 1\n```\n<!-- doc-test: ranks=2 -->\n```python\nb = 2\n```\n"
            "<!-- doc-test: fragment two-words -->\n```python\nc\n```\n<!-- doc-test: rank=2 -->\n```python\n```\n"
            "```bash\nls\n```\n")
    blocks = parse_blocks("page.md", page)
    assert [(b.index, b.line, b.source, b.ranks, b.fragment) for b in blocks[:3]] == [
        (0, 2, "a = 1\n", 1, None), (1, 6, "b = 2\n", 2, None), (2, 10, "c\n", 1, "two-words")]
    assert blocks[3].directive_error.startswith("unreadable directive") and len(blocks) == 4


def test_every_directive_precedes_a_python_block():
    orphans = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        orphans += [f"{page.relative_to(ROOT)} line {i + 1}" for i, line in enumerate(lines)
                    if line.strip().startswith("<!-- doc-test") and lines[i + 1:i + 2] != ["```python"]]
    assert not orphans, f"doc-test directives not on the line just before a ```python fence: {orphans}"


def test_fragments_are_the_expected_ones():
    found = {}
    for b in BLOCKS:
        if b.fragment:
            assert b.fragment not in found, f"fragment name {b.fragment!r} used twice: {found[b.fragment]} and {b.page}"
            found[b.fragment] = b.page
    expected = {name: page for name, (page, _) in FRAGMENTS.items()}
    assert found == expected, "fragments in the docs differ from FRAGMENTS in tests/test_docs.py"


def readme_quickstart() -> str:
    """The first python block under the README's "## Quickstart" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quickstart\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def quickstart_reference(world_size: int) -> list[float]:
    """Each rank's last micro-batch loss in the quickstart, trained in one process on the global batches.

    Independent of zeroshard: torch's DistributedSampler split, AdamW, and
    DeepSpeed's WarmupLR written out (log warmup from 0 over 10 steps, the
    first optimizer step at warmup_min_lr); the gradient of a step is the
    mean over every rank's micro-batches of the accumulation window.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    x = torch.randn(1280, 32)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    orders = [list(torch.utils.data.DistributedSampler(range(1280), world_size, r)) for r in range(world_size)]
    micro = [[order[i:i + 16] for i in range(0, len(order), 16)] for order in orders]
    steps = len(micro[0]) // 2
    for k in range(1, steps + 1):
        window = [micro[r][m] for m in (2 * k - 2, 2 * k - 1) for r in range(world_size)]
        if k == steps:  # the printed loss: the last micro-batch, before the last step
            with torch.no_grad():
                return [torch.nn.functional.mse_loss(model(x[micro[r][-1]]), y[micro[r][-1]]).item()
                        for r in range(world_size)]
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x[idx]), y[idx]) for idx in window).div(len(window)).backward()
        it = k - 2
        for group in opt.param_groups:
            group["lr"] = 0.0 if it < 0 else 1e-2 * min(1.0, math.log(it + 1) / math.log(10))
        opt.step()
    raise AssertionError("unreachable")


def test_readme_quickstart_gives_each_rank_its_own_data(tmp_path):
    done = run_block(readme_quickstart(), tmp_path, ranks=2)
    assert done.returncode == 0, done.stderr
    # 1280 samples over 2 ranks, micro-batches of 16, 2 accumulation steps: 20 optimizer steps.
    lines = re.findall(r"loss (\d+\.\d{3}) after 20 optimizer steps", done.stdout)  # the ranks' lines may interleave
    assert len(lines) == 2, done.stdout
    expected = quickstart_reference(2)
    assert expected[0] != pytest.approx(expected[1], abs=0.01)  # the ranks' batches differ
    assert sorted(float(v) for v in lines) == pytest.approx(sorted(expected), abs=1.5e-3), (lines, expected)
