"""Greedy generation with vLLM for specdraft's interop tier. Runs in vLLM's OWN virtual
environment (``make interop`` builds .venv-vllm); imports vllm only, never specdraft.

    python vllm_generate.py job.json result.json

job.json: {model, dtype, max_model_len, max_tokens, prompts: [[token ids]], speculative_config
(null: plain decoding)}. result.json: {outputs: [[token ids]], metrics: {vllm:spec_decode_*},
seconds}. One engine per process: vLLM does not release an engine's memory in-process.
"""

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as handle:
        job = json.load(handle)
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=1,  # one request at a time: the same numerics as specdraft's batch-1 decoder
        enforce_eager=True,  # compiling costs minutes here and changes nothing we measure
        speculative_config=job.get("speculative_config"),
        disable_log_stats=False,  # the acceptance counters of llm.get_metrics()
        seed=0,
    )
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    metrics = {
        metric.name: getattr(metric, "values", getattr(metric, "value", None))
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode")
    }
    result = {
        "outputs": [list(output.outputs[0].token_ids) for output in outputs],
        "metrics": metrics,
        "seconds": {"load": loaded - started, "generate": time.perf_counter() - loaded},
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main(*sys.argv[1:])
