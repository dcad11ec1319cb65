"""Stage 3's module units: planning, gather-on-demand schedule, prefetch, meta-device
materialization and `gathered_parameters`."""
