"""Greedy generation with llama.cpp (the xllamacpp wheel) for specdraft's llama.cpp tier and bench. Runs in
llama.cpp's OWN virtual environment (``make llamacpp`` builds .venv-llamacpp); imports xllamacpp
only, never specdraft.

    python llamacpp_generate.py job.json result.json

job.json: {model (the target's GGUF), speculative: "none" | "eagle3" | "dflash" | "ngram", draft
(the draft's GGUF, for "eagle3" and "dflash"), n_max (draft tokens per step, for those two; a
DFlash block's drafts at most), ngram: {size_n, size_m}
(for "ngram", llama.cpp's prompt lookup ``--spec-type ngram-simple``: the last size_n tokens looked
up, at most size_m drafted; absent: llama.cpp's defaults), trace (optional: llama.cpp logs at trace
level, which puts its speculative statistics — draft time included, ``dur(b,g,a)`` — on stderr),
threads, n_ctx, max_tokens, prompts: [[token ids]]; with forward_sizes: [k, …] the job times the
target's forward of k new tokens instead (forward_costs)}. result.json: {outputs: [[token ids]],
timings: [llama.cpp's per-request timings: prompt_n, prompt_ms, predicted_n, predicted_ms,
draft_n, draft_n_accepted, …], speculation: [per request, the server's counters: num_drafts,
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos/<i>], seconds: {load,
run}}. Speculation is a property of the server, not of a request: one job, one server, one
process.
"""

import json
import re
import sys
import time

SPECULATIVE_TYPES = {
    "none": "NONE",
    "eagle3": "DRAFT_EAGLE3",
    "dflash": "DRAFT_DFLASH",
    "ngram": "NGRAM_SIMPLE",
}
DRAFT_MODELS = ("eagle3", "dflash")  # the types that load a draft GGUF (job["draft"])
TRACE_VERBOSITY = 4  # common/log.h LOG_LEVEL_TRACE: the level of the speculative statistics
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
    if job.get("trace"):
        params.verbosity = TRACE_VERBOSITY
    kind = getattr(
        xlc.common_speculative_type, "COMMON_SPECULATIVE_TYPE_" + SPECULATIVE_TYPES[job["speculative"]]
    )
    params.speculative.types = [kind]
    if job["speculative"] in DRAFT_MODELS:
        params.speculative.draft.mparams.path = job["draft"]
        params.speculative.draft.n_max = job["n_max"]
        params.speculative.draft.n_min = 0
        params.speculative.draft.p_min = 0.0  # draft every position: the chain the tier compares
        params.speculative.draft.n_gpu_layers = 0
    if job["speculative"] == "ngram":
        for name, value in job.get("ngram", {}).items():
            setattr(params.speculative.ngram_simple, name, value)
    return xlc.Server(params)


def counters(server) -> dict[str, float]:
    """The speculative counters: num_drafts, num_draft_tokens, num_accepted_tokens, and
    num_accepted_tokens_per_pos/<i> for each draft position i."""
    text = server.handle_metrics()
    if not isinstance(text, str):
        text = json.dumps(text)
    found = COUNTER.findall(text)
    return {name + (f"/{position}" if position else ""): float(value) for name, position, value in found}


def complete(server, ids: list[int], max_tokens: int, cache_prompt: bool) -> dict:
    """One greedy completion request; llama.cpp's error as an exception."""
    response = server.handle_completions(
        {
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "verbose": True,
        }
    )
    if isinstance(response, str):
        response = json.loads(response)
    if "error" in response:
        raise RuntimeError(f"llama.cpp: {response['error']}")
    return response


def generate(server, job: dict) -> dict:
    """Each prompt answered greedily, with its timings and speculative counters."""
    outputs, timings, speculation = [], [], []
    for ids in job["prompts"]:
        before = counters(server)
        response = complete(server, ids, job["max_tokens"], cache_prompt=False)
        after = counters(server)
        verbose = response.get("__verbose", response)
        outputs.append(list(verbose["tokens"]))
        timings.append(response.get("timings", verbose.get("timings", {})))
        speculation.append({name: int(value - before.get(name, 0.0)) for name, value in after.items()})
    return {"outputs": outputs, "timings": timings, "speculation": speculation}


def forward_costs(server, job: dict) -> dict:
    """{forward_ms: {k: [ms per prompt]}}: the time llama.cpp takes to run k new tokens through the
    target right after a cached prompt, for each k in job["forward_sizes"] — about what verifying
    k − 1 drafted tokens costs (prompt processing computes the last position's logits only, a
    verification every position's)."""
    costs: dict[str, list[float]] = {str(k): [] for k in job["forward_sizes"]}
    for ids in job["prompts"]:
        for k in job["forward_sizes"]:
            complete(server, ids, 1, cache_prompt=True)  # the prompt, now cached
            timings = complete(server, ids + ids[:k], 1, cache_prompt=True)["timings"]
            if timings["prompt_n"] != k:
                raise RuntimeError(f"llama.cpp processed {timings['prompt_n']} new tokens, not {k}")
            costs[str(k)].append(timings["prompt_ms"])
    return {"forward_ms": costs}


def main(job_path: str, result_path: str) -> None:
    """job.json with "forward_sizes": forward_costs; otherwise generate."""
    with open(job_path) as handle:
        job = json.load(handle)
    started = time.perf_counter()
    server = build_server(job)
    loaded = time.perf_counter()
    result = forward_costs(server, job) if "forward_sizes" in job else generate(server, job)
    result["seconds"] = {"load": loaded - started, "run": time.perf_counter() - loaded}
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
