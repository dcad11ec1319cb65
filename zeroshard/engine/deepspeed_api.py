"""The engine's DeepSpeed surface: the methods and attributes a DeepSpeed training script calls.

`Engine` inherits `DeepSpeedMethods`; each method here is DeepSpeed's name and
signature over the engine's own state.
"""

from __future__ import annotations


class DeepSpeedMethods:
    """Mixed into `Engine`."""
