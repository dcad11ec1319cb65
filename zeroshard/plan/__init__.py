"""The plan: what a model gets, by sizes only: its flat buffers, the staging blocks, the prefetch and reuse rules.

Pure arithmetic over element counts: nothing here allocates a tensor or
runs a collective. The engine's build reads these rules (core/staging.py,
core/reducer.py, stage3/schedule.py, engine/build.py) and the estimator
prices the same plan (estimate/peak.py), so a rule has one implementation
and the estimate cannot drift from what the engine holds.
"""
