"""Speculative decoding with trained draft heads: the target runner, the drafters, the decode loop,
the baselines, ``shape: auto``, and the benchmark with its report."""
