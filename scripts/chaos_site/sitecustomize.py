"""Loaded by every Python process of a chaos run (scripts/chaos.py puts this folder on PYTHONPATH).

In the rank that the plan in ZEROSHARD_CHAOS names for the next kill (the
kills so far are the lines of its log: a generation of ranks that failed for
another reason leaves the kill to the next one) it installs that kill point
(`chaos_points.py`); in the launcher, and in every other rank, it does nothing.
"""

import json
import os


def _kill_of_this_rank() -> dict | None:
    if "RANK" not in os.environ or "ZEROSHARD_CHAOS" not in os.environ:  # the launcher, or no chaos run
        return None
    plan = json.loads(os.environ["ZEROSHARD_CHAOS"])
    try:
        with open(plan["log"]) as log:
            done = len(log.read().splitlines())
    except FileNotFoundError:
        done = 0
    kill = plan["kills"][done] if done < len(plan["kills"]) else None
    return kill if kill is not None and kill["rank"] == int(os.environ["RANK"]) else None


_kill = _kill_of_this_rank()
if _kill is not None:
    import chaos_points

    chaos_points.install(_kill, json.loads(os.environ["ZEROSHARD_CHAOS"])["log"])
