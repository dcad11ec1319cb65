"""Flat buffers and their shards, buckets and their gradients, the reducer, staging memory,
precision and loss scaling, and the optimizer run over master shards."""
