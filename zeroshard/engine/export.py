"""The engine's exports of whole weights: Hugging Face's `save_pretrained` and DeepSpeed's `save_16bit_model`.

`Engine` inherits `ExportMethods`.
"""

from __future__ import annotations


class ExportMethods:
    """Mixed into `Engine`."""
