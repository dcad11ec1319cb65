"""The house in figures: lines per package, the Engine's public names, the classes one step meets.

    python benchmarks/house.py [--stage 3]

Run from a checkout's root: it reads `zeroshard/` there. The classes counted are those of zeroshard whose
methods run during one `zeroshard.initialize` and one forward, backward and step of a small model on one gloo
rank (a profile hook on every Python call): what a newcomer following that path reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def lines_per_package(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        key = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        out[key] = out.get(key, 0) + len(path.read_text(encoding="utf-8").splitlines())
    out["total"] = sum(out.values())
    return out


def public_names(engine) -> tuple[list[str], list[str]]:
    """The Engine class's public names, and the public attributes an instance adds."""
    cls = sorted(n for n in dir(type(engine)) if not n.startswith("_"))
    inst = sorted(n for n in vars(engine) if not n.startswith("_") and n not in cls)
    return cls, inst


def classes_met(stage: int) -> tuple[dict[str, list[str]], object]:
    import torch
    import torch.distributed as dist

    import zeroshard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    met: dict[str, set[str]] = {"initialize": set(), "step": set()}
    phase = "initialize"

    def profile(frame, event, arg):
        if event != "call" or not frame.f_globals.get("__name__", "").startswith("zeroshard"):
            return
        owner = frame.f_code.co_qualname.split(".")[0]
        if isinstance(frame.f_globals.get(owner), type):  # a method (or a nested function) of a class
            met[phase].add(f"{frame.f_globals['__name__']}.{owner}")

    sys.setprofile(profile)
    engine = zeroshard.initialize(model, config=config)
    phase = "step"
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
    sys.setprofile(None)
    return {k: sorted(v) for k, v in met.items()}, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    met, engine = classes_met(args.stage)
    cls, inst = public_names(engine)
    both = sorted(set(met["initialize"]) | set(met["step"]))
    print(json.dumps({
        "lines": lines_per_package(Path("zeroshard")),
        "engine_public_class_names": len(cls), "engine_public_instance_attributes": len(inst),
        "classes_met": {"initialize": len(met["initialize"]), "step": len(met["step"]), "both": len(both)},
        "class_names": cls, "instance_attributes": inst, "classes": both,
    }, indent=1))


if __name__ == "__main__":
    main()
