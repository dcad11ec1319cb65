"""What loading a config decided besides the values: resolutions, keys with no effect, keys ignored.

`Config.load_with_report` returns a `LoadReport` with the config;
`zeroshard.initialize` logs its `block()` once on rank 0, and `zeroshard
config check` prints it, so a user sees in one place every "auto" resolved
(key -> value, and from what), every batch key derived, every offload key
set from DeepSpeed's other names or `initialize(offload=...)`
(offload_merge.py), and every DeepSpeed key accepted with no effect (and why).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadReport:
    resolved: list[tuple[str, Any, str]] = field(default_factory=list)  # dotted key, value, from what
    deferred: list[tuple[str, str]] = field(default_factory=list)  # key, what initialize resolves it from
    mapped: list[tuple[str, Any, str]] = field(default_factory=list)  # dotted key set, value, from what
    no_effect: list[tuple[str, str]] = field(default_factory=list)  # key, why it has none here
    ignored: list[tuple[str, str]] = field(default_factory=list)  # "strict": false: key, why it is rejected

    def block(self) -> str:
        """The report as one multi-line text, or "" when there is nothing to say."""
        sections = [
            ("resolved (\"auto\" values and derived batch keys)",
             [f"{key} = {_shown(value)}  ({source})" for key, value, source in self.resolved]),
            ("\"auto\" left to zeroshard.initialize", [f"{key}: {source}" for key, source in self.deferred]),
            ("set from DeepSpeed's other names or initialize(offload=...)",
             [f"{key} = {_shown(value)}  ({source})" for key, value, source in self.mapped]),
            ("accepted with no effect in zeroshard", [f"{key}: {why}" for key, why in self.no_effect]),
            ("ignored because the config says \"strict\": false",
             [f"{key}: {why}" for key, why in self.ignored]),
        ]
        lines = []
        for title, entries in sections:
            if entries:
                lines += [f"  {title}:"] + [f"    {entry}" for entry in entries]
        return "zeroshard config:\n" + "\n".join(lines) if lines else ""


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
