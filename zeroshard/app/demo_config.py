"""The demo's engine settings, shared by `zeroshard train` and `zeroshard estimate` (its units)."""

# The demo's settings where neither --config nor a flag gives one.
DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    # Small buckets: reductions overlap with the rest of backward, and stage 2's staging
    # buffers (a few buckets in flight) stay small next to the gradient shard it saves.
    "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 50_000, "allgather_bucket_size": 50_000,
        # Stage 3: each transformer block is a unit, and every parameter is sharded, so the
        # report's memory rows are exactly the formula's 4Ψ/N.
        "stage3_wrap_classes": ["Block"], "stage3_param_persistence_threshold": 0,
    },
}
