"""Tree-attention speculative decoding, baselines and benchmarks (not yet built)."""
