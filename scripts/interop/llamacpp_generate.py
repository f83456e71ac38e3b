"""Greedy generation with llama.cpp (the xllamacpp wheel) for specdraft's llama.cpp tier. Runs in
llama.cpp's OWN virtual environment (``make llamacpp`` builds .venv-llamacpp); imports xllamacpp
only, never specdraft.

    python llamacpp_generate.py job.json result.json

job.json: {model (the target's GGUF), speculative: "none" | "eagle3", draft (the EAGLE-3
GGUF, for "eagle3"), n_max (draft tokens per step), threads, n_ctx, max_tokens, prompts: [[token
ids]]}. result.json: {outputs: [[token ids]], timings: [llama.cpp's per-request timings: predicted_n,
predicted_ms, draft_n, draft_n_accepted, …], speculation: [per request, the server's counters:
num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos/<i>], seconds:
{load, generate}}. Speculation is a property
of the server, not of a request: one job, one server, one process.
"""

import json
import re
import sys
import time

SPECULATIVE_TYPES = {"none": "NONE", "eagle3": "DRAFT_EAGLE3"}
# llama.cpp's Prometheus counters (``endpoint_metrics``); read before and after each request.
COUNTER = re.compile(r'^llamacpp:spec_decode_(\w+?)_total(?:\{position="(\d+)"\})?\s+([0-9.e+]+)$', re.M)


def build_server(job: dict):
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = job["model"]
    params.n_ctx = job["n_ctx"]
    params.n_parallel = 1  # one request at a time: batch-1 decoding, as specdraft's decoder
    params.n_gpu_layers = 0
    params.cpuparams.n_threads = job["threads"]
    params.cpuparams_batch.n_threads = job["threads"]
    params.endpoint_metrics = True
    kind = getattr(
        xlc.common_speculative_type, "COMMON_SPECULATIVE_TYPE_" + SPECULATIVE_TYPES[job["speculative"]]
    )
    params.speculative.types = [kind]
    if job["speculative"] == "eagle3":
        params.speculative.draft.mparams.path = job["draft"]
        params.speculative.draft.n_max = job["n_max"]
        params.speculative.draft.n_min = 0
        params.speculative.draft.p_min = 0.0  # draft every position: the chain the tier compares
        params.speculative.draft.n_gpu_layers = 0
    return xlc.Server(params)


def counters(server) -> dict[str, float]:
    """The speculative counters: num_drafts, num_draft_tokens, num_accepted_tokens, and
    num_accepted_tokens_per_pos/<i> for each draft position i."""
    text = server.handle_metrics()
    if not isinstance(text, str):
        text = json.dumps(text)
    found = COUNTER.findall(text)
    return {name + (f"/{position}" if position else ""): float(value) for name, position, value in found}


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as handle:
        job = json.load(handle)
    started = time.perf_counter()
    server = build_server(job)
    loaded = time.perf_counter()
    outputs, timings, speculation = [], [], []
    for ids in job["prompts"]:
        before = counters(server)
        response = server.handle_completions(
            {
                "prompt": ids,
                "max_tokens": job["max_tokens"],
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "verbose": True,
            }
        )
        if isinstance(response, str):
            response = json.loads(response)
        if "error" in response:
            raise RuntimeError(f"llama.cpp: {response['error']}")
        after = counters(server)
        verbose = response.get("__verbose", response)
        outputs.append(list(verbose["tokens"]))
        timings.append(response.get("timings", verbose.get("timings", {})))
        speculation.append({name: int(value - before.get(name, 0.0)) for name, value in after.items()})
    result = {
        "outputs": outputs,
        "timings": timings,
        "speculation": speculation,
        "seconds": {"load": loaded - started, "generate": time.perf_counter() - loaded},
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
