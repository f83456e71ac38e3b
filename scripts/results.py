#!/usr/bin/env python
"""docs/results.md, regenerated from measured runs: ``python scripts/results.py`` (after
``make quickstart``; every stage resumes, so re-running only redoes what is missing).

Stages (``--stages`` picks some):

* ``ablation``  — the equal-token ablation: EAGLE, HASS (both at β = 0.5, Top-K only, alignment
  only, both at β = 1), EAGLE-3 and HASS on EAGLE-3 trained one after the other (``--parallel N``:
  N side by side) for the same ``--steps`` over the same batches of the quickstart's cached
  features (its self-distilled SmolLM2 answers; ``--features`` another cache pair) and one
  ``ABLATION_VOCAB``-token vocabulary;
* ``export``    — each trained ablation head's final weights as a native export in its run dir
  (``--export-dtype``), which the bench then reads: how heads trained on a GPU travel;
* ``depth``     — ``specdraft-depth-acceptance`` over the trained ablation heads: greedy chain
  acceptance per depth on the held-out cache, own features vs the target's;
* ``bench``     — ONE ``specdraft-bench`` run over the ablation heads' final weights as the same
  EAGLE-2 dynamic tree and plain decoding, interleaved per question, at T=0 and T=1 on 40
  MT-bench first turns and 40 HumanEval problems (``--max-minutes``: a time box; it resumes);
* ``sweep``     — the HASS loss-weight sweep as users run one offline: ONE Hydra multirun of HASS
  heads on the ablation's data and budget (``--sweep KEY=V1,V2 …``, default ``SWEEP_GRID``;
  ``--sweep-steps``), W&B logging offline, then ``specdraft-sweep-report``;
* ``curve``     — every ``CURVE_EVERY``-th step's checkpoint of the quickstart runs in ``CURVE_RUNS``
  (256, 512 and 768 regenerated conversations), benched together at T=0: τ against training time,
  at three amounts of data;
* ``decoder``   — the decoder's own speed: ONE ``specdraft-bench methods=decoder`` run (plain
  decoding, HF generate, HF prompt lookup, a head as a 3-chain, as the 12-node EAGLE-2 tree and
  with ``shape: auto``) on 16 MT-bench first turns, 128 new tokens, T=0, with draft / verify /
  bookkeeping ms per step (``--decoder-checkpoint``: the head; ``--decoder-provenance``: how it
  was trained, written into the snapshot);
* ``lookahead`` — speculation with and without a draft model: ONE ``specdraft-bench
  methods=lookahead`` run (plain decoding, lookahead decoding at two window sizes, HF prompt
  lookup, the head with ``shape: auto``; ``--lookahead-checkpoint``, default the committed
  quickstart head) on MT-bench first turns alternating with HumanEval problems
  (``--per-category``, ``--humaneval``), 128 new tokens, T=0;
* ``batch``     — throughput against batch size: ONE ``specdraft-bench methods=batch
  batch_sizes=[1,2,4,8,16]`` run (plain decoding, the head as a 3-chain and as the 12-node
  EAGLE-2 tree; ``--batch-checkpoint``, default the committed quickstart head) on 16 MT-bench first
  turns, 128 new tokens, T=0: tokens/s over all rows, per-row latency and the crossover batch size;
* ``train_speed`` — training-step throughput per head kind of successive checkouts on the same
  cached features, from ``scripts/bench_train_step.py`` outputs (``--train-speed OLDEST … NEWEST``),
  with regeneration tokens/s from two ``specdraft-regen`` logs (``--regen-logs BEFORE AFTER``)
  and the acceptance of full- vs reduced-vocabulary training (``--vocab-acceptance``): snapshotted
  as they are into docs/results/train_speed.json (a regeneration or acceptance measurement not
  given again is kept);
* ``regen_speed`` — a regeneration measurement alone (``--regen-logs BEFORE AFTER
  --regen-commits OLD NEW``, ``--train-speed-command`` saying how), added to the same snapshot
  (the earlier ones kept);
* ``recipe``    — the quickstart head's recipe variants (RECIPE_RUNS, outputs/recipe-gpu) into
  docs/results/recipe_gpu.json;
* ``gpu_regen`` — ``specdraft-regen`` logs of one GPU session (``--gpu-regen LABEL:COMMIT:LOG …``,
  oldest code last; ``--gpu-regen-compare``: the captured features against a forward) into
  docs/results/regen_gpu.json;
* ``gpu_tests`` — a ``pytest -m gpu -v --durations=N`` log of a GPU session (``--gpu-log LOG
  --gpu-commit SHA --gpu-machine TEXT``) into docs/results/gpu_tests.json, one run per commit;
* ``doc``       — docs/results.md and its plots from the JSON the stages wrote (the ablation's
  paired-bootstrap intervals are computed from its bench's records when it is snapshotted).

On a GPU every stage loads the target there (``--device cuda``; training with ``trainer=gpu``), and
the ablation and sweep heads may share another precision and batch size: e.g. ``--stages ablation
export --device cuda --precision bf16-mixed --batch-tokens 20480 --steps 300 --parallel 7`` trained
every head on 5.93M tokens on an H200 (2026-11-26), whose exports were then benched on a CPU.

The stages write JSON (and CSV training logs); ``doc`` snapshots what the doc needs from them into
docs/results/ and renders the doc from those snapshots only. ``--stages`` defaults to the
equal-token ablation: ablation depth bench doc.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from specdraft.eval.bench import machine_info, read_records
from specdraft.eval.report import CONFIDENCE, metrics, paired_bootstrap, summarize
from specdraft.recipes.budget import clock
from specdraft.recipes.depth_acceptance import paired_chain_bootstrap
from specdraft.recipes.sweep_report import plot as plot_sweep
from specdraft.system.files import write_bytes_atomic, write_json_atomic
from specdraft.system.hardware import detect_hardware

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path(os.environ.get("SPECDRAFT_LOG_DIR", ROOT / "outputs"))
QUICKSTART = LOG_DIR / "quickstart"
RESULTS = LOG_DIR / "results"
QUICKSTART_HEAD = ROOT / "assets" / "heads" / "smollm2-135m-eagle"  # committed, trained on a GPU
DOCS = ROOT / "docs"
SNAPSHOTS = DOCS / "results"  # the measured numbers the doc is rendered from (committed)
MT_BENCH = os.environ.get("SPECDRAFT_SPEC_BENCH", str(ROOT.parent / "shared" / "bench" / "spec_bench.jsonl"))

# quickstart runs shown (run name -> (its quickstart dir under LOG_DIR, the command that made it)).
# RUN_CONDITIONS: what a reader must know about how a run's wall times were obtained.
# Runs made with older defaults name the commit whose defaults they used.
OLD_DEFAULTS = (
    "with the defaults of commit 0691bb6: regen by HF generate at batch 16, validation every 25 steps"
)
QUICKSTART_RUNS = {
    "qs-mtbench-epyc": (
        "qs-mtbench-epyc",
        "make run (fresh clone of 6157abe beside shared/, so on MT-bench: install + "
        "specdraft-quickstart, budget_minutes=45; the code of qs-prefill-epyc) on an AMD EPYC with "
        "AVX-512-bf16 but no AMX, in a slow spell",
    ),
    "qs-prefill-epyc": (
        "qs-prefill-epyc",
        "make run (fresh clone of df8510c: install + specdraft-quickstart, budget_minutes=45; a "
        "prefill's captured features sent to the host in one transfer; no MT-bench file, so "
        "evaluated on held-out ShareGPT) on an AMD EPYC with AVX-512-bf16 but no AMX, in a slow spell",
    ),
    "qs-slowday-epyc": (
        "qs-slowday-epyc",
        "make run (fresh clone of 337793e: install + specdraft-quickstart, budget_minutes=45; feature "
        "shards streamed to their files; no MT-bench file, so evaluated on held-out ShareGPT) on an "
        "AMD EPYC with AVX-512-bf16 but no AMX, in a slow spell",
    ),
    "qs-capture2-epyc": (
        "qs-capture2-epyc",
        "make run (fresh clone of 0138e28: install + specdraft-quickstart, budget_minutes=45; features "
        "captured during regeneration, its prefills probed without the capture's extra step) on an AMD "
        "EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-capture-epyc": (
        "qs-capture-epyc",
        "make run (fresh clone of 62c44c2: install + specdraft-quickstart, budget_minutes=45; the "
        "features captured while regeneration answers, no cache stages) on an AMD EPYC with "
        "AVX-512-bf16 but no AMX",
    ),
    "qs-gqa-epyc": (
        "qs-gqa-epyc",
        "make run (fresh clone of c25cd4d: install + specdraft-quickstart, budget_minutes=45; answers "
        "cut at 128 tokens by default, plain decoding's one-token attention on stacked query rows) on "
        "an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-a128b-epyc": (
        "qs-a128b-epyc",
        "make install-assets && specdraft-quickstart regen.max_new_tokens=128 budget.answer_tokens=109 "
        "(fresh clone of 8606097, budget_minutes=45; answers cut at 128 tokens, a second run) on an AMD "
        "EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-a128-epyc": (
        "qs-a128-epyc",
        "make install-assets && specdraft-quickstart regen.max_new_tokens=128 budget.answer_tokens=109 "
        "(fresh clone of 896d82e, budget_minutes=45; answers cut at 128 tokens) on an AMD EPYC with "
        "AVX-512-bf16 but no AMX",
    ),
    "qs-rows128-epyc": (
        "qs-rows128-epyc",
        "make run (fresh clone of 8f157b8: install + specdraft-quickstart, budget_minutes=45; "
        "regeneration at 128 rows on a CPU) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-slots2-epyc": (
        "qs-slots2-epyc",
        "make run (fresh clone of cc41a23: install + specdraft-quickstart, budget_minutes=45; the "
        "defaults of qs-slots-epyc, a second run) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-slots-epyc": (
        "qs-slots-epyc",
        "make run (fresh clone of 990da36: install + specdraft-quickstart, budget_minutes=45; "
        "regeneration on contiguous KV buffers with its own one-token attention, features without "
        "the mask of right padding) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-answered-epyc": (
        "qs-answered-epyc",
        "make run (fresh clone of d6e6022: install + specdraft-quickstart, budget_minutes=45; the "
        "probe sampling the first turns regeneration answers) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-share60-epyc": (
        "qs-share60-epyc",
        "make install-assets && specdraft-quickstart budget.data_share=0.6 (fresh clone of ba16eed, "
        "budget_minutes=45) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-padprobe-epyc": (
        "qs-padprobe-epyc",
        "make run (fresh clone of ba16eed: install + specdraft-quickstart, budget_minutes=45; the "
        "defaults of qs-epyc-bf16, the cache probe timing padded positions) on an AMD EPYC with "
        "AVX-512-bf16 but no AMX",
    ),
    "qs-epyc-bf16": (
        "qs-epyc-bf16",
        "make run (fresh clone of 12c8e88: install + specdraft-quickstart, budget_minutes=45; the "
        "defaults of qs-workers-amx) on an AMD EPYC with AVX-512-bf16 but no AMX",
    ),
    "qs-workers-amx": (
        "qs-workers-amx",
        "make run (fresh clone of 041203b: install + specdraft-quickstart, budget_minutes=45; the "
        "defaults of qs-topk-amx, no loader workers on a CPU) on an AMX-bf16 CPU",
    ),
    "qs-topk-amx": (
        "qs-topk-amx",
        "make run (fresh clone of d2746bd: install + specdraft-quickstart, budget_minutes=45; the "
        "head distilled through the target's cached top-10, AdamW fused) on an AMX-bf16 CPU",
    ),
    "qs-softce-amx": (
        "qs-softce-amx",
        "make run (fresh clone of 9f0c805: install + specdraft-quickstart, budget_minutes=45; the "
        "head's soft CE weighed 0.02, a 2 % budget margin) on an AMX-bf16 CPU",
    ),
    "qs-deadline2-amx": (
        "qs-deadline2-amx",
        "make run (fresh clone of b713b1a: install + specdraft-quickstart, budget_minutes=45; the "
        "defaults of qs-deadline-amx, a second run) on an AMX-bf16 CPU",
    ),
    "qs-deadline-amx": (
        "qs-deadline-amx",
        "make run (fresh clone of 698ee4f: install + specdraft-quickstart, budget_minutes=45; today's "
        "defaults: training ends at its planned time, its steps resized by the pace it measures) on "
        "an AMX-bf16 CPU",
    ),
    "qs-evalbox-amx": (
        "qs-evalbox-amx",
        "make run (fresh clone of 9670f69: install + specdraft-quickstart, budget_minutes=45; today's "
        "defaults: the eval's time box sized by the probe) on an AMX-bf16 CPU",
    ),
    "qs-fast-amx": (
        "qs-fast-amx",
        "make run (fresh clone of a783fe9: install + specdraft-quickstart, budget_minutes=45; today's "
        "defaults: cheaper fused loss steps, training resized by what the stages before it saved) "
        "on an AMX-bf16 CPU",
    ),
    "qs-probe-amx": (
        "qs-probe-amx",
        "make run (fresh clone of 08419f4: install + specdraft-quickstart, budget_minutes=45; today's "
        "defaults: the probe times training steps start to start) on an AMX-bf16 CPU",
    ),
    "qs-data50-amx": (
        "qs-data50-amx",
        "make run (fresh clone of 0d30461: install + specdraft-quickstart, budget_minutes=45; today's "
        "defaults: half of the data + training budget to data, regeneration at 64 rows with packed "
        "weights) on an AMX-bf16 CPU",
    ),
    "qs-v8k-data75": (
        "qs-v8k-data75",
        "specdraft-quickstart name=qs-v8k-data75 budget.data_share=0.75 "
        "'overrides.train=[\"loss.draft_vocab_size=8192\"]' (the defaults of 87380d8) on an AMX-bf16 CPU",
    ),
    "quickstart-budget-amx": (
        "quickstart-budget-amx",
        "make run (fresh clone: install + specdraft-quickstart, budget_minutes=45) on an AMX-bf16 CPU",
    ),
    "quickstart-fused-avx2": (
        "quickstart-fused-avx2",
        "make run (fresh clone: install + specdraft-quickstart, budget_minutes=45) on an AVX2 CPU, "
        "with the cheaper training steps of c4ebf0e",
    ),
    "quickstart-budget-avx2": (
        "quickstart-budget-avx2",
        "make run (fresh clone: install + specdraft-quickstart, budget_minutes=45) on an AVX2 CPU",
    ),
    "quickstart": ("quickstart", "make run (fresh clone: install + specdraft-quickstart)"),
    "quickstart-512": (
        "quickstart-512",
        "specdraft-quickstart name=quickstart-512 conversations=512 "
        f"'overrides.train=[\"trainer.max_steps=400\"]' ({OLD_DEFAULTS})",
    ),
    "quickstart-256": (
        "quickstart-256",
        f"specdraft-quickstart ({OLD_DEFAULTS}, 256 conversations, 200 steps)",
    ),
    "quickstart-sharegpt": (
        "quickstart-256",
        "specdraft-quickstart self_distill=false aux_layers=false "
        f"({OLD_DEFAULTS}, 256 conversations, 200 steps)",
    ),
}
# The equal-token ablation: name -> specdraft-train overrides (on top of ablation_overrides()),
# in the order they are trained (the comparison the issue is about first).
ABLATION = {
    "eagle": ["experiment=eagle"],  # EAGLE-1 training, benched as an EAGLE-2 dynamic tree
    "hass": ["experiment=hass"],  # Top-K + 3-step alignment, β = 0.5 (conf/loss/hass.yaml)
    "hass_topk": ["experiment=hass", "loss.rollout.steps=1"],
    "hass_align": ["experiment=hass", "loss.weights.topk=0"],
    "hass_beta1": ["experiment=hass", "loss.rollout.step_weight_base=1.0"],
    # HASS as its reference code trains it: the second stage (Top-K added), see FIRST_STAGE_RECIPE.
    "hass_2stage": ["experiment=hass"],
    "eagle3": ["experiment=eagle3"],
    "hass_eagle3": ["experiment=hass_eagle3"],
}
# HASS's reference training script trains in two stages: the alignment alone (Top-K weight 0) for 40
# epochs, then 10 more with Top-K distillation added (weight 1) at a third of the learning rate
# (1e-5 after 3e-5), from the first stage's weights. Here: head -> the ABLATION head whose recipe its
# first stage follows for all but the last TOPK_STAGE_FRACTION of the steps (rounded to whole
# checkpoint intervals); the second stage (init_from the first's final weights) takes the rest, so the
# head takes as many steps as the others. Like the reference's restart, the second stage starts the
# batch order anew: it re-reads the first batches rather than the last.
FIRST_STAGE_RECIPE = {"hass_2stage": "hass_align"}
TOPK_STAGE_FRACTION = 0.2  # 10 of 50 epochs
TOPK_STAGE_LR_SCALE = 1 / 3  # 1e-5 / 3e-5
FIRST_STAGE_SUFFIX = "_stage1"  # the first stage's run: RESULTS/train/<head><this>
# The HASS loss-weight sweep (stage sweep): the Top-K weight w and β on a grid narrowed to a CPU
# session (K = 10 and n = 3 as in conf/loss/hass.yaml); --sweep key=v1,v2 … replaces it.
SWEEP_NAME = "hass-weights"
# The sweep's yardstick: EAGLE trained with the same recipe, data and steps (RESULTS/train/<this>).
SWEEP_REFERENCE = "hass-weights-eagle"
SWEEP_DEPTH_JSON = "depth_acceptance.json"  # in the sweep report's directory
SWEEP_GRID = {"loss.weights.topk": "0.5,1.0,2.0", "loss.rollout.step_weight_base": "0.5,1.0"}
SWEEP_SNAPSHOT = "sweep.json"
# the heads of the first (equal wall-clock) ablation, in its table's order
WALLCLOCK_HEADS = ("medusa", "eagle", "hass_topk", "hass_align", "hass", "eagle3", "hass_eagle3")
ABLATION_REFERENCE = "eagle"  # every τ difference is paired against this head's
# Every head trains and drafts over the same 8,192 most frequent assistant tokens: the decoder's
# default shortlist for EAGLE-1/2 heads, and EAGLE-3's own draft vocabulary (32k by default) cut
# to the same size, so that no head sees a different vocabulary; it also makes a CPU step ~3×
# cheaper (docs/results.md, training speed).
ABLATION_VOCAB = 8192
ABLATION_BATCH_TOKENS = 4096  # the quickstart's batch: the same batches, in the same order, for all
ABLATION_WARMUP = 20
ABLATION_PRECISION = "32-true"
ABLATION_VAL_EVERY = 25  # steps between held-out validations: the acc_1 curve
ABLATION_CHECKPOINT_EVERY = 50  # last.ckpt: what a killed run resumes from, and the benched weights
EXPORT_DIR = "export"  # in a run dir: the export stage's native export, which the bench prefers
ABLATION_BENCH = "ablation-tokens"  # its bench run (RESULTS/bench/<this>)
ABLATION_MT_BENCH_PER_CATEGORY = 5  # × 8 categories = 40 MT-bench first turns
ABLATION_HUMANEVAL = 40
SUITES = {
    "MT-bench": lambda category: category != "humaneval",
    "HumanEval": lambda category: category == "humaneval",
}
DEPTH_STEPS = 4  # depths of the own- vs target-feature acceptance (specdraft-depth-acceptance)
DEPTH_JSON = "depth_acceptance.json"
ABLATION_SNAPSHOT = "ablation_tokens.json"
ABLATION_CURVE_PNG = "results_ablation_curve.png"
CURVE_COLUMN_EVERY = 50  # the training table's held-out acc_1 column: one value per this many steps
OVERALL_KEYS = ("turns", "tau", "acceptance_per_depth", "depth_attempts", "speedup", "tokens_per_s")
OWN_VOCAB = {"eagle3", "hass_eagle3"}  # EAGLE-3 heads draft over their own vocabulary: no shortlist
RUN_CONDITIONS = {
    "qs-mtbench-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 6157abe (the code of qs-prefill-epyc; "
        "the commit adds tests only) in a directory beside shared/, so the eval found the MT-bench "
        "file, alone on the machine: 43:24 wall in all, of which the quickstart 43:16 of its "
        "45-minute budget (a first start was stopped after its probe, which had run beside 20 s of "
        "tests, and this one started afresh). Its probe read the machine in a fast moment: 507 "
        "regeneration tokens/s at 128 rows and 7,608 training positions/s, so it planned 3,744 "
        "conversations, 1,854 steps and an 8-minute eval box. Regeneration then ran at half that "
        "pace: it answered 3,385 (359 dropped as too long) with their features in 24:08 against an "
        "ETA of 17:25 (371,110 answer tokens at 258.5 tokens/s, prefills included), so training was "
        "resized to 1,104 steps; its steps then ran at ~0.75 s against the probe's 0.54, and its "
        "deadline took it to 846 (10:30 of fit, 3.32M tokens, ~5 passes over 635,615 tokens of "
        "3,132 conversations). Held-out simulated τ 1.49 / 1.67 / 1.77 at steps 221 / 442 / 663 and "
        "1.79 for the final weights (exported), against 2.03-2.10 in the MT-bench runs of this "
        "machine's usual days (2,939-3,856 steps). The eval took 6:43 of its 8:00 box; plain "
        "decoding 24.2 tokens/s (53.5-54.7 on usual days). τ 2.30 / 2.10 / 1.88 on 16 MT-bench "
        "first turns, against 2.63 / 2.37 / 2.12 and 2.67 / 2.40 / 2.13 (qs-capture2-epyc, "
        "qs-capture-epyc): the budget's steps on a machine at half its pace buy a third of the "
        "training. Speedups 0.68× / 1.01× / 1.30×. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-prefill-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit df8510c (the code of qs-slowday-epyc "
        "but for a prefill's captured features sent to the host in one transfer), on the machine of "
        "qs-slowday-epyc a session later, still slow: 45:14 wall in all, of which the quickstart 43:54 "
        "of its 45-minute budget. Not quite alone: two niced (nice 19) pytest runs of another "
        "checkout, 84 s of CPU in all, ran during regeneration and training's first minutes. Its "
        "probe read 409 regeneration tokens/s at 128 rows and 7,438 training positions/s, so it "
        "planned 3,311 conversations, 1,863 steps and a 7.3-minute eval box. Regeneration answered "
        "2,999 (312 dropped as too long) with their features in 19:57 against an ETA of 17:49 "
        "(326,647 answer tokens at 275 tokens/s, prefills included), so training was resized to "
        "1,630 steps; its steps then ran at ~0.72 s against the probe's 0.55, and its deadline took "
        "it to 1,308 (15:36 of fit, 5.13M tokens, ~9 passes over 557,219 tokens of 2,760 "
        "conversations). Held-out simulated τ 1.58 / 1.78 / 1.84 / 1.90 at steps 326-1,304 (1,304 "
        "exported) and 1.87 for the final weights. The eval took 6:42 of its 7:16 box; plain "
        "decoding ran at 22.0 tokens/s (the probe's plain step: 29 tokens/s; 28.4 in "
        "qs-slowday-epyc, 53.5-54.7 on this machine's usual days). The clone sat in /tmp, where the "
        "default MT-bench path (../shared/bench/spec_bench.jsonl) finds no file, so the eval read "
        "its fallback, 16 held-out ShareGPT first turns, as the quickstart said at its start: the "
        "self-distilled head's own distribution, not comparable with the MT-bench runs. On those "
        "prompts τ 2.71 / 2.45 / 2.19, against qs-slowday-epyc's 2.76 / 2.42 / 2.16 on the same "
        "16 with about as many steps (1,346) and conversations (2,806): within the ±0.08 that tells "
        "two heads of one recipe apart on 16 turns. Speedups 0.79× / 1.16× / 1.40×. Outputs copied "
        "from that clone's run `quickstart` under this run name."
    ),
    "qs-slowday-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 337793e (the code of qs-capture2-epyc "
        "but for feature shards written by safetensors straight to their files), alone on the machine: "
        "41:37 wall in all, of which the quickstart 40:14 of its 45-minute budget. The machine ran at "
        "about half its earlier pace all session (plain decoding 28.4 tokens/s against 53.5-54.7; "
        "1,024 first turns regenerated at 296-333 tokens/s, where 384 took 58 s two days before): its "
        "probe read 454 regeneration tokens/s at 128 rows and 4,815 training positions/s (~10,000 "
        "before), so it planned 3,375 conversations, 1,127 steps and a 9-minute eval box. "
        "Regeneration answered 3,048 (327 dropped as too long) with their features in 18:13 against "
        "an ETA of 16:51 (332,072 answer tokens at 307 tokens/s, prefills included), so training was "
        "resized to 1,031 steps; its steps then ran at ~0.66 s against the probe's 0.85, and its "
        "deadline took it to 1,346 (15:10 of fit, 5.25M tokens, ~9 passes over 566,002 tokens of "
        "2,806 conversations). Held-out simulated τ 1.49 / 1.65 / 1.76 / 1.84 / 1.87 / 1.91 at steps "
        "206-1,241 (1,241 exported) and 1.89 for the final weights: below the 2.03-2.10 of the runs "
        "before (2,939-3,856 steps). The eval took 5:11 of its 9:10 box. Its clone sat where the "
        "default MT-bench path (../shared/bench/spec_bench.jsonl) finds no file, so the eval read "
        "its fallback, 16 held-out ShareGPT first turns (the report's prompts: no per_category, "
        "limit 16; the reader added to this snapshot from that, a session later): τ 2.76 / 2.42 / "
        "2.16 there is the self-distilled head on its own distribution, not comparable with the "
        "MT-bench runs' 2.63-2.67 (first reported as MT-bench's, wrongly). Speedups 0.78× / 1.13× / "
        "1.41×. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-capture2-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 0138e28, right after a CI run, alone on "
        "the machine apart from a niced 12-second test during its regeneration: 44:03 wall in all, of "
        "which the quickstart 43:16 of its 45-minute budget. Its probe read the machine in a fast "
        "moment: 772 regeneration tokens/s at 128 rows (qs-capture-epyc: 542) and prefills of 47 ms "
        "a prompt (89 there, with the capture's extra step), so it planned 7,094 conversations and "
        "3,820 steps; regeneration then ran at 538 tokens/s and answered 6,455 (639 dropped as too "
        "long) with their features in 22:05 against an ETA of 19:51 (709,186 answer tokens), so "
        "training was resized to 3,377 steps, then by its deadline to 2,939 (17:26 of fit, 11.6M "
        "tokens, 9 passes over 1,245,273 tokens of 6,051 conversations). Held-out simulated τ 1.72 / "
        "1.86 / 2.00 / 2.05 at steps 675 / 1,351 / 2,027 / 2,703 (exported) and 2.03 for the final "
        "weights, on its own held-out split of 404 conversations. The eval took 2:41 of its 3:39 box; "
        "plain decoding 54.7 tokens/s. τ 2.63 / 2.37 / 2.12 against qs-capture-epyc's 2.67 / 2.40 / "
        "2.13 on 1.6× its conversations and 0.76× its steps: within the ±0.08 that tells two heads "
        "of one recipe apart on 16 turns. Outputs copied from that clone's run `quickstart` under "
        "this run name."
    ),
    "qs-capture-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 62c44c2 (the first with the features "
        "captured during regeneration: stages probe, regen, train, export, eval), alone on the "
        "machine apart from ~2 minutes of a niced unit test during its regeneration: 42:51 wall in "
        "all, of which the quickstart 42:00 of its 45-minute budget. Its probe read 542 regeneration "
        "tokens/s at 128 rows (capturing) and prefills of 89 ms a prompt (44-57 ms in the three runs "
        "before: the probe then timed the capture's extra step at one row, fixed in aca40b8), so it "
        "planned 4,407 conversations (qs-gqa-epyc: 3,311) and 2,872 steps; regeneration answered "
        "3,994 (413 dropped as too long) and captured their features in 13:51 against an ETA of "
        "19:04 (438,475 answer tokens; qs-gqa-epyc: regeneration 11:58 + caching 6:23 for 2,999), "
        "so training was resized to 3,680 steps, then by its deadline to 3,856 (24:06 of fit, 15.2M "
        "tokens, 20 passes over 754,910 tokens of 3,702 conversations). Held-out simulated τ 1.74 / "
        "1.93 / 2.04 / 2.07 / 2.10 at steps 736 / 1,472 / 2,208 / 2,944 / 3,680 (exported) and 2.07 "
        "for the final weights, on its own held-out split of 292 conversations. The eval took 2:56 "
        "of its 5:04 box; plain decoding 53.5 tokens/s. τ 2.67 / 2.40 / 2.13 against 2.54 / 2.30 / "
        "2.05 (qs-gqa-epyc), 2.62 / 2.27 / 2.06 and 2.61 / 2.28 / 2.04 (qs-a128-epyc, "
        "qs-a128b-epyc): above all three, the 24-node tree by 0.10-0.13, the 12-node one by 0.07-0.09 "
        "and the 60-node one by 0.05-0.13, against the ±0.08 that tells two heads of one recipe apart "
        "on 16 turns (more conversations and steps at once: the two are not separated). Outputs "
        "copied from that clone's run `quickstart` under this run name."
    ),
    "qs-gqa-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit c25cd4d (the first `make run` with "
        "answers cut at 128 tokens by default, and plain decoding's one-token attention on stacked "
        "query rows since 110a26a), with ~1.5 minutes of this session's unit tests beside it during "
        "its regeneration (that stage's pace is not clean), otherwise alone on the machine: 43:53 wall "
        "in all, of which the quickstart 42:58 of its 45-minute budget. A slower hour of the machine: "
        "its probe read 635 regeneration tokens/s at 128 rows, 1,209 feature tokens/s and 9,891 "
        "training positions/s (715-769 and 1,327-1,425 feature tokens/s in qs-a128-epyc and "
        "qs-a128b-epyc), so it planned 3,311 conversations and 2,654 steps; regeneration answered "
        "2,999 (312 dropped as too long) at 461 tokens/s (326,781 answer tokens in 11:48, its stage "
        "11:58 against an ETA of 11:02), caching wrote 562,374 tokens of 2,760 conversations in 6:23 "
        "(ETA 7:54), and training was resized to 2,720 steps, then by its deadline to 3,030 (19:27 of "
        "fit, 11.8M tokens, 21 passes over the data). Held-out simulated τ 1.69 / 1.86 / 1.95 / 2.02 / "
        "2.06 at steps 543 / 1,087 / 1,631 / 2,175 / 2,719 (exported) and 2.03 for the final weights. "
        "Plain decoding 48.9 tokens/s on the faster one-token attention: the trees' speedups are not "
        "comparable with the runs before it (Reading these numbers, below). τ 2.54 / 2.30 / 2.05 "
        "against 2.62 / 2.27 / 2.06 and 2.61 / 2.28 / 2.04 (qs-a128-epyc, qs-a128b-epyc) on 10-14 % "
        "fewer conversations: within the ±0.08 that tells two heads of one recipe apart on 16 turns. "
        "Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-a128b-epyc": (
        "2026-11-27, `time (make install-assets && .venv/bin/specdraft-quickstart "
        "regen.max_new_tokens=128 budget.answer_tokens=109)` in a fresh clone of commit 8606097 (the "
        "code of qs-a128-epyc), right after that run, alone on the machine: 43:38 wall in all, of which "
        "the quickstart 42:48 of its 45-minute budget. Its probe read 769 regeneration tokens/s and "
        "1,327 feature tokens/s, so it planned 3,860 conversations and 3,478 steps; regeneration "
        "answered 3,498 (362 dropped as too long) at 638 tokens/s (383,248 answer tokens in 10:01), "
        "caching wrote 661,622 tokens of 3,243 conversations in 7:26, and training's deadline ended it "
        "at 3,384 steps (20:42 of fit, 13.2M tokens, 20 passes over the data). Held-out simulated τ "
        "1.74 / 1.92 / 2.00 / 2.05 at steps 747 / 1,495 / 2,243 / 2,991 (exported) and 2.04 for the "
        "final weights, on its own held-out split of answers cut at 128 tokens. Plain decoding 51.0 "
        "tokens/s. τ 2.61 / 2.28 / 2.04 against qs-a128-epyc's 2.62 / 2.27 / 2.06: both runs' 60-node "
        "tree above all three runs of the 256-token answers (2.50 / 2.54 / 2.53, mean +0.09), the "
        "smaller trees +0.03 on their means (within the noise). Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-a128-epyc": (
        "2026-11-27, `time (make install-assets && .venv/bin/specdraft-quickstart "
        "regen.max_new_tokens=128 budget.answer_tokens=109)` in a fresh clone of commit 896d82e (the "
        "features' top-k softmax 32 rows at a time), alone on the machine after a session of short "
        "benchmarks: 43:29 wall in all, of which the quickstart 42:41 of its 45-minute budget. The eval "
        "decodes 128 new tokens a turn; here the answers it trains on were cut at 128 tokens too (109 "
        "on average, against 195 at the default 256, 62 % of which reach 256), so the same regeneration "
        "time buys more conversations. Its probe read 715 regeneration tokens/s at 128 rows and 1,425 "
        "feature tokens/s, so it planned 3,721 conversations (qs-rows128-epyc: 2,502) and 3,440 steps; "
        "regeneration answered 3,365 (2,226 there; 356 dropped as too long) at 587 tokens/s (368,969 "
        "answer tokens in 10:29, its stage 10:35 against an ETA of 11:37), caching wrote 637,430 "
        "tokens of 3,113 conversations in 7:01 (1,513 tokens/s; 579,873 of 2,031 in 7:46 there), and "
        "training's deadline ended it at 3,365 steps (20:38 of fit, 13.2M tokens, 21 passes over the "
        "data). Held-out simulated τ 1.73 / 1.91 / 1.98 / 2.02 at steps 687 / 1,375 / 2,063 / 2,751 and "
        "2.04 for the final weights (exported), on its own held-out split, whose answers are cut at 128 "
        "tokens too: not comparable with the runs on 256. Plain decoding 49.1 tokens/s. τ 2.62 / 2.27 "
        "/ 2.06 against 2.50 / 2.25 / 1.98, 2.54 / 2.31 / 2.02 and 2.53 / 2.20 / 2.06 for the defaults "
        "(qs-rows128-epyc, qs-slots-epyc, qs-slots2-epyc): the 60-node tree 0.08-0.12 above them, at "
        "the edge of the ±0.08 that tells two heads of one recipe apart on 16 turns. Outputs copied "
        "from that clone's run `quickstart` under this run name."
    ),
    "qs-rows128-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 8f157b8 (the code of 6474729, "
        "regeneration's rows on a CPU 64 -> 128), alone on the machine after a session of "
        "regeneration benchmarks: 44:18 wall in all, of which the quickstart 43:14 of its 45-minute "
        "budget. Its probe read 779 regeneration tokens/s at 128 rows and 1,309 feature tokens/s, so "
        "it planned 2,502 conversations (qs-slots-epyc / qs-slots2-epyc at 64 rows: 2,466 / 2,419) "
        "and 3,173 steps; regeneration answered 2,226 (2,194 / 2,149) at 641 tokens/s (607 / 586: "
        "433,875 answer tokens in 11:17, its stage 11:23 against an ETA of 10:59), caching wrote "
        "579,873 tokens in 7:46, and training's deadline resized it to 2,658 steps (18:03 of fit, "
        "10.3M tokens, 18 passes over the data; 2,933 / 2,911 steps there). Held-out simulated τ "
        "1.91 / 2.17 / 2.31 / 2.36 at steps 635 / 1,270 / 1,905 / 2,540 (exported) and 2.34 for the "
        "final weights, on its own held-out split of 195 conversations; plain decoding 46.6 tokens/s. "
        "τ 2.50 / 2.25 / 1.98 against 2.54 / 2.31 / 2.02 and 2.53 / 2.20 / 2.06: within the ±0.08 "
        "that tells two heads of one recipe apart on 16 turns. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-slots2-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit cc41a23 (the code of 990da36 on a "
        "CPU), right after run qs-slots-epyc and a CI run, alone on the machine: 44:03 wall in all, "
        "of which the quickstart 43:16 of its 45-minute budget. Its probe read 738 regeneration "
        "tokens/s (the stage then ran at 586) and 1,078 feature tokens/s, so it planned 2,419 "
        "conversations (2,149 answered) and 3,410 steps; regeneration overran its ETA by 1:40 "
        "(11:58), caching came in 1:35 early (7:09), and training's deadline resized it to 2,911 "
        "steps (19:03 of fit, 11.3M tokens, 20 passes over the data). Held-out simulated τ 1.92 / "
        "2.15 / 2.29 / 2.33 at steps 673 / 1,346 / 2,019 / 2,692 (exported) and 2.33 for the final "
        "weights, on its own held-out split of 178 conversations; plain decoding 47.2 tokens/s. "
        "Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-slots-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit 990da36, alone on the machine (before "
        "it that session ran only short benchmarks): 44:02 wall in all, of which the quickstart "
        "43:19 of its 45-minute budget. Its probe read 660 regeneration tokens/s and 1,254 feature "
        "tokens/s, so the plan gave data 2,466 conversations (2,194 answered, 272 dropped as too "
        "long; qs-answered-epyc: 1,945 and 1,705) and training 2,942 steps; regeneration took 11:50 "
        "(qs-answered-epyc: 11:47; 427,511 answer tokens at 607 tokens/s), caching 7:11 against its "
        "ETA of 7:39 (574,249 tokens). It trained 2,933 steps (19:19 of fit, 11.3M tokens: 20 "
        "passes over the data against 27). Held-out simulated τ 1.85 / 2.12 / 2.22 / 2.26 at steps "
        "589 / 1,178 / 1,767 / 2,356 and 2.30 for the final weights (exported), on its own held-out "
        "split of 184 conversations; plain decoding 49.7 tokens/s. τ 2.54 / 2.31 / 2.02 against "
        "qs-answered-epyc's 2.48 / 2.22 / 1.98: within the ±0.08 that tells two heads of one recipe "
        "apart on 16 turns. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-answered-epyc": (
        "2026-11-27, `time make run` in a fresh clone of commit d6e6022, alone on the machine after "
        "runs qs-padprobe-epyc and qs-share60-epyc: 43:44 wall in all, of which the quickstart 42:49 "
        "of its 45-minute budget. The plan: 1,945 conversations (1,705 answered), 2,745 steps "
        "probed at 9,954 positions/s (0.41 s a step, the pace the stages before had trained at), "
        "features at 1,175 tokens/s; caching took 5:53 against its ETA of 6:28 (1.10×), the stages "
        "before training finished 1:13 ahead (2,923 steps), and it trained at ~0.385 s a step, so "
        "its deadline lengthened it to 3,178 (20:25 of fit). Held-out simulated τ 1.87 / 2.17 / "
        "2.30 / 2.36 / 2.39 at steps 584 / 1,169 / 1,754 / 2,339 / 2,924 (exported) and 2.33 for "
        "the final weights; plain decoding 52.8 tokens/s. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-share60-epyc": (
        "2026-11-26, `time (make install-assets && .venv/bin/specdraft-quickstart "
        "budget.data_share=0.6)` in a fresh clone of commit ba16eed, right after run "
        "qs-padprobe-epyc, alone on the machine: 43:34 wall in all, of which the quickstart 42:38 of "
        "its 45-minute budget. Meant to give data 0.6 of the time, it probed the machine in a slow "
        "spell (regeneration 423 tokens/s, features 881, training 10,990 positions/s, against 482, "
        "1,033 and 13,154 an hour earlier), so it planned 1,941 conversations (1,701 answered; "
        "qs-padprobe-epyc: 1,921) and 2,371 steps. The stages then ran at the earlier pace "
        "(regeneration 12:09 against 13:53, caching 6:23 against 8:35), finished 3:52 ahead, and "
        "training was resized to 2,993 steps, then by its deadline to 2,726 at ~0.42 s (18:56 of "
        "fit). So the data is qs-padprobe-epyc's (448,017 tokens against 447,816) and the split "
        "about 0.5: a replicate of that run with 10 % fewer steps. Held-out simulated τ 1.92 / 2.19 / "
        "2.29 / 2.37 at steps 598 / 1,197 / 1,796 / 2,395 and 2.338 for the final weights (the step-"
        "2,395 checkpoint exported); τ 2.45 / 2.19 / 1.95 against qs-padprobe-epyc's 2.53 / 2.26 / "
        "2.02 (16 MT-bench first turns: ±0.08 between two heads of one recipe), plain decoding "
        "49.3 tokens/s (44.8 there), so 0.74× / 1.06× / 1.26×. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-padprobe-epyc": (
        "2026-11-26, `time make run` in a fresh clone of commit ba16eed, the first job of a session, "
        "alone on the machine (the same class of CPU as run qs-epyc-bf16, a day later): 43:50 wall in "
        "all, of which the quickstart 43:05 of its 45-minute budget. The plan: 1,921 conversations "
        "(1,681 answered, 240 dropped as too long; qs-epyc-bf16's probe planned 1,483), 3,638 "
        "training steps probed at 0.311 s (13,154 positions/s), a 4.3-minute eval box. Caching now "
        "ran 1.13× faster than its probe (6:25 against an ETA of 7:14; qs-epyc-bf16: 1.75×), so the "
        "stages before training finished 1:31 ahead and training was resized to 3,930 steps (ETA "
        "20:49). It trained at ~0.41 s a step, so its deadline resized it to 3,048 steps: 20:40 of "
        "fit; its final weights were the best. Regeneration ran at 506 tokens/s, plain decoding in "
        "the eval at 44.8 tokens/s; the eval took 3:17 of its box. Against qs-epyc-bf16 (fewer "
        "steps, 1.3× the answers): held-out simulated τ 2.336 against 2.197 (each on its own "
        "held-out split), 1.95 / 2.19 / 2.33 at steps 785 / 1,571 / 2,357 against 1.84 / 2.06 / 2.17 "
        "at 782 / 1,565 / 2,348, while its training batches' acc_1 ended lower (0.80 against 0.82): "
        "at 26 passes over the data (qs-epyc-bf16: 36) a conversation bought more than a step. "
        "Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-epyc-bf16": (
        "2026-11-26, `time make run` in a fresh clone of commit 12c8e88, the first job of a "
        "session (beside it only the main checkout's install in its first minutes and a 10 Hz py-spy "
        "sampler for 60 s of its caching): 43:21 wall "
        "in all, of which the quickstart 42:25 of its 45-minute budget. The plan: 1,483 "
        "conversations (1,287 answered, 196 dropped as too long), 3,095 training steps probed at "
        "0.347 s (11,804 positions/s), a 4.0-minute eval box. Caching ran 1.75× faster than its "
        "probe (5:21 against an ETA of 9:23), so the stages before training finished 4:43 ahead "
        "and training was resized to 3,911 steps (ETA 23:29). It trained at ~0.41 s a step, so its "
        "deadline resized it to 3,363 steps: 23:03 of fit, the stage 23:13 against 23:29; its final "
        "weights were the best. Regeneration ran at 482 tokens/s (the probe: 497), plain decoding "
        "in the eval at 47.4 tokens/s (2.2× the AMX Xeon's 21.4): a 60-node tree's verification "
        "costs more than its τ buys here (0.82×) where the 12-node one pays (1.38×); the eval took "
        "3:07 of its box. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-workers-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit 041203b, alone on the machine (after "
        "run qs-topk-amx and a default-tier test run): 43:52 wall in all, of which the quickstart 42:44 of "
        "its 45-minute budget. The plan: 1,484 conversations (1,288 answered, 196 dropped as too "
        "long), 2,421 training steps probed at 0.434 s (9,442 positions/s), a 7.1-minute eval box; "
        "the stages before training finished 2:31 ahead of their ETAs, so training was resized to "
        "2,769 steps with a deadline of 20:18 for its steps and validations. It trained at ~0.51 s "
        "a step, so its deadline resized it to 2,388 steps: 20:19 spent, the stage 20:33 against an "
        "ETA of 20:26; its final weights were exported. Regeneration ran at 386 tokens/s (the probe: "
        "376), plain decoding in the eval at 21.4 tokens/s; the eval took 5:43 of its box. Outputs "
        "copied from that clone's run `quickstart` under this run name."
    ),
    "qs-topk-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit d2746bd, alone on the machine: 46:11 "
        "wall in all, of which the quickstart 45:01 of its 45-minute budget. The plan: 1,254 "
        "conversations (1,082 answered, 172 dropped as too long), 2,056 training steps probed at "
        "0.477 s (8,589 positions/s), an 8.4-minute eval box; the stages before training finished "
        "2:38 ahead of their ETAs, so training was resized to 2,387 steps with a deadline of 19:38 "
        "for its steps and validations. The machine slowed as the run went on: training steps took "
        "0.40 s at first and 0.75–0.86 s in its last 300, so its deadline resized it to 1,950 steps "
        "(19:41 spent; the stage 20:07 against an ETA of 19:49), and plain decoding in the eval ran "
        "at 14.0 tokens/s (17.3–21.5 in the runs before), the eval taking 9:02 of its 8.4-minute box "
        "(a question started inside the box ran past it). The same training-step benchmark on fixed "
        "batches read 12,722 training tokens/s before the run and 8,552 right after it. "
        "Regeneration ran at 338 tokens/s (the probe: 331). Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-softce-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit 9f0c805, alone on the machine: 43:50 "
        "wall in all, of which the quickstart 42:33 of its 45-minute budget. A slow hour of this "
        "machine class: the probe read 250 tokens/s of regeneration (385–404 in the runs before), "
        "844 feature tokens/s (~1,530) and 7,378 training positions/s (~9,000), and plain decoding "
        "in the eval ran at 17.3 tokens/s (20.1). The plan: 998 conversations (869 answered, 129 "
        "dropped as too long), 1,708 training steps, a 9-minute eval box (its 20 % cap); the stages "
        "before training finished 3:24 ahead of their ETAs, so training was resized to 2,079 steps "
        "with a deadline of 19:59 for its steps and validations. It trained at ~0.72 s a step, so "
        "its deadline resized it to 1,665 steps: 20:02 spent of the 19:59, the stage 20:23 against "
        "an ETA of 20:12. Regeneration ran at 305 tokens/s. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-deadline2-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit b713b1a, alone on the machine (after "
        "this session's CI run on it): 43:10 wall in all, of which the quickstart 41:57 of its "
        "45-minute budget. The plan: 1,424 conversations, 2,158 training steps probed at 0.456 s "
        "(8,980 positions/s), a 7.1-minute eval box; the stages before training finished 2:39 "
        "ahead of their ETAs, so training was resized to 2,505 steps with a deadline of 19:38 for "
        "its steps and validations. It trained at ~0.59 s a step, so its deadline resized it to "
        "2,004 steps: 19:43 spent of the 19:38, the stage 20:00 against an ETA of 19:50. "
        "Regeneration ran at 385 tokens/s (the probe: 394), plain decoding in the eval at 20.1 "
        "tokens/s. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "qs-deadline-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit 698ee4f: 42:57 wall in all, of which "
        "the quickstart 41:58 of its 45-minute budget. The plan: 1,542 conversations, 2,236 training "
        "steps probed at 0.449 s (9,125 positions/s), a 6.7-minute eval box; regeneration overran "
        "its ETA by 1:19 and the features saved 1:25, so training was resized to 2,249 steps with "
        "a deadline of 17:21 for its steps and validations. It trained at ~0.56 s a step (the "
        "machine's own pace: a niced pytest run of 3 minutes shared the CPU during the features "
        "stage, not during training), so its deadline resized it to 1,850 steps: 17:24 spent of "
        "the 17:21, the stage 17:42 against an ETA of 17:32. Regeneration ran at 346 tokens/s "
        "where the probe read 404, and plain decoding in the eval at 21.5 tokens/s (30.8 in "
        "qs-fast-amx). Otherwise alone on the machine. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-evalbox-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit 9670f69, alone on the machine: 48:08 "
        "wall in all, of which the quickstart 47:15 of its 45-minute budget (+5 %). The plan: 1,667 "
        "conversations, 2,650 training steps (probed at 10,751 positions/s), a 6.6-minute eval box "
        "(the probe: a plain step 38.8 ms, verifying 12 / 24 / 60 nodes 45.4 / 50.8 / 67.5 ms); the "
        "stages before training finished 3:12 ahead of their ETAs, so training was resized to 3,154 "
        "steps (ETA 20:51) and took 25:57, 1.24× its ETA (the probe's steps ran faster than the "
        "real ones, ~8,000 positions/s), just inside its 1.25× guard; the eval took 6:00 of its "
        "6:44 (plain decoding ran at 20.7 tokens/s here against 30.8 in qs-fast-amx: the machine "
        "was slower during this eval). Outputs copied from that clone's run `quickstart` under this "
        "run name."
    ),
    "qs-fast-amx": (
        "2026-11-26, `time make run` in a fresh clone of commit a783fe9, alone on the machine: 37:49 "
        "wall in all, of which the quickstart 36:52 of its 45-minute budget. The plan: 1,543 "
        "conversations, 1,818 training steps of 4,096 positions (probed at 7,986 positions/s), a "
        "9-minute eval box; the stages before training finished 25 s ahead of their ETAs "
        "(regeneration 38 s behind, the features 63 s ahead), so training was resized to 1,866 "
        "steps and took 15:51 of its 16:42 ETA. The eval took 4:06 of its 9:06 box. Against "
        "de39b7d's fresh clone of the day before on this machine class (1,565 conversations, 1,642 "
        "steps, 6.30M training tokens, held-out simulated τ 2.003, τ 2.36 / 2.15 / 1.96) it "
        "measures the cheaper steps. Outputs copied from that clone's run `quickstart` under this "
        "run name."
    ),
    "qs-probe-amx": (
        "2026-11-25, `time make run` in a fresh clone of commit 08419f4, alone on the machine: 40:07 "
        "wall in all, of which the quickstart 39:02 of its 45-minute budget. The plan: 1,317 "
        "conversations, 1,329 training steps of 4,096 positions (probed at 0.61 s each, start to "
        "start), a 9-minute eval box; training took 1.10× its ETA (qs-data50-amx, probed start to "
        "end: 1.28×, cut by its time guard) and ran all its steps. This machine ran slower than on "
        "the day of qs-data50-amx (plain decoding 18.7 against 21.9 tokens/s, regeneration 388 against "
        "406), so its plan bought fewer conversations and steps. Outputs copied from that clone's run "
        "`quickstart` under this run name."
    ),
    "qs-data50-amx": (
        "2026-11-25, `time make run` in a fresh clone of commit 0d30461, alone on the machine: 44:02 "
        "wall in all, of which the quickstart 43:06 of its 45-minute budget. The plan: 1,553 "
        "conversations, 1,620 training steps of 4,096 positions, a 9-minute eval box; training ran "
        "slower than probed (0.8 against 0.6 s per step with its validations) and its time guard "
        "(1.25× the ETA) stopped it at step 1,501. Outputs copied from that clone's run `quickstart` "
        "under this run name. Against qs-v8k-data75 (the same machine class, 0.75 of the data "
        "budget, slower regeneration: 1,624 conversations and 830 steps) it measures the new split."
    ),
    "qs-v8k-data75": (
        "2026-11-25, in the working checkout at commit 23dd101 (the install and the GGUF's dequantized "
        "cache warm, no regenerated answers), alone on the machine: the quickstart 33:49 of its "
        "45-minute budget. The plan: 1,624 conversations, 830 training steps of 4,096 positions "
        "(bf16-mixed, the loss's vocabulary terms over 8,192 tokens), a 9-minute eval box. Its τ "
        "against quickstart-budget-amx (the same machine class, 0.5 of the data budget, "
        "full-vocabulary steps) measures the two changes together; that run's speedups predate the "
        "decoder's grouped attention, so compare τ."
    ),
    "quickstart-budget-amx": (
        "2026-11-25, `time make run` in a fresh clone of commit 2a9282e, alone on the machine: 35:30 "
        "wall in all, of which the quickstart 34:34 of its 45-minute budget (regeneration and the eval "
        "came in under their ETAs). The plan: 1,069 conversations, 439 training steps of 4,096 "
        "positions (bf16-mixed), a 9-minute eval box. Outputs copied from that clone's run `quickstart` "
        "under this run name."
    ),
    "quickstart-fused-avx2": (
        "2026-11-24, `time make run` in a fresh clone of commit c4ebf0e (vocabulary-major fused losses, "
        "aligned rollout attention), alone on the machine: 42:34 wall in all, of which the quickstart "
        "41:01 of its 45-minute budget. The plan: 378 conversations, 219 training steps (188 at 180e2b3), "
        "a 9-minute eval box. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "quickstart-budget-avx2": (
        "2026-11-24, `time make run` in a fresh clone of commit 180e2b3, alone on the machine (the "
        "GGUF's dequantized cache warm, no outputs): 42:03 wall in all, of which the quickstart "
        "40:46 of its 45-minute budget. The plan: 362 conversations, 188 training steps, a 9-minute "
        "eval box. Outputs copied from that clone's run `quickstart` under this run name."
    ),
    "quickstart": (
        "2026-11-22, `time make run` in a fresh clone of commit 6206b5f with an empty "
        "SPECDRAFT_CACHE_DIR and no outputs (pip's download cache warm), alone on the machine: "
        "46:28 wall in all, of which the quickstart's stages 44:50."
    ),
    "quickstart-512": (
        "2026-11-22, every stage alone on the machine; the regen stage found its 454 answered "
        "conversations already written (the session before: HF generate, batch 16, ~88 tokens/s)."
    ),
    "quickstart-256": (
        "2026-11-22. The regen stage found its answers already written (8 s): they are byte for byte "
        "the first 4 chunks of the 512-conversation regeneration (greedy, same chunking), whose "
        "second 256 conversations took 9:03 (88 tokens/s) alone on the machine. Training shared the "
        "CPU with the test suite: the same 200 steps alone took 417 s of fit, 7:13 wall (identical "
        "validation "
        "metrics). Eval ran alone."
    ),
    "quickstart-sharegpt": "2026-11-22, every stage alone on the machine.",
}
TREE = "{kind: dynamic, depth: 5, top_k: 6, total_tokens: 24}"  # the quickstart's head_tree
# τ vs training time and data: quickstart runs (specdraft-quickstart name=…) whose checkpoints/curve
# (every 50 steps) are benched together, every CURVE_EVERY steps; labels become method names.
CURVE_RUNS = {"quickstart-256": "c256", "quickstart-512": "c512", "quickstart": "c768"}
CURVE_EVERY = 100


@dataclass(frozen=True)
class Placement:
    """Where the stages run: the target's ``device`` (on ``cuda`` training takes ``trainer=gpu``)
    and the ablation's (and sweep's) ``precision`` and batch size — one for every head, so a GPU
    run can train in bf16-mixed over larger batches while staying equal across heads."""

    device: str = "cpu"
    precision: str = ABLATION_PRECISION
    batch_tokens: int = ABLATION_BATCH_TOKENS

    def target(self) -> list[str]:
        """Overrides of every command that loads the target."""
        return [] if self.device == "cpu" else [f"target.device={self.device}"]

    def training(self) -> list[str]:
        return self.target() + ([] if self.device == "cpu" else ["trainer=gpu"])


def command(name: str, *overrides: str, log: Path | None = None) -> None:
    """Run a specdraft console script of this venv (else of PATH); stop on failure. With ``log``
    its output goes to that file (commands run side by side), else to this terminal."""
    script = Path(sys.executable).parent / name
    argv = [str(script) if script.is_file() else shutil.which(name) or name, *overrides]
    print("$ " + " ".join(argv) + (f"  > {log}" if log else ""), flush=True)
    if log is None:
        subprocess.run(argv, check=True)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        if subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{name} failed: see {log}")


def final_checkpoint(run_dir: Path) -> Path:
    """A finished run's final weights: its export (the ``export`` stage: how a head trained on
    another machine travels) where there is one, else its last.ckpt (written at its last step)."""
    if not (run_dir / "summary.json").is_file():
        raise SystemExit(f"{run_dir} has not finished training: run the ablation stage first")
    export = run_dir / EXPORT_DIR
    return export if (export / "config.json").is_file() else run_dir / "checkpoints" / "last.ckpt"


def head_method(name: str, checkpoint: Path, shape: str, shortlist: bool = True) -> str:
    return (
        f"+methods.{name}={{type: head, checkpoint: '{checkpoint}', shape: {shape}, "
        f"shortlist: {str(shortlist).lower()}}}"
    )


def ablation_overrides(
    name: str,
    steps: int,
    features: Path,
    placement: Placement = Placement(),
    recipe_of: str | None = None,
    lr_scale: float = 1.0,
    warmup: int = ABLATION_WARMUP,
) -> list[str]:
    """What every ablation head shares: the features, the batches, the schedule, the vocabulary.

    Equal TOKENS, not time: every head takes ``steps`` optimiser steps over the same batches (same
    cache, batch size and seed), with the cosine decay ending at ``steps``, and its final weights
    are benched. The stages of a two-stage head set apart ``recipe_of`` (the ABLATION head whose
    overrides and vocabulary the run ``name`` takes; default ``name``), ``lr_scale`` and ``warmup``."""
    recipe_of = recipe_of or name
    if lr_scale != 1.0 and any(o.startswith("optim.lr=") for o in ABLATION[recipe_of]):
        raise SystemExit(f"{recipe_of}: a scaled stage scales the default lr, not its recipe's")
    vocab = (
        f"head.config.draft_vocab_size={ABLATION_VOCAB}"
        if recipe_of in OWN_VOCAB
        else f"loss.draft_vocab_size={ABLATION_VOCAB}"
    )
    lr = [] if lr_scale == 1.0 else [f"optim.lr={default_lr() * lr_scale:.6g}"]
    return [
        *ABLATION[recipe_of],
        vocab,
        *lr,
        f"run_name={name}",
        f"paths.log_dir={RESULTS}",
        "datamodule=cached",
        f"datamodule.train_cache={features / 'train'}",
        f"datamodule.val_cache={features / 'heldout'}",
        f"datamodule.max_batch_tokens={placement.batch_tokens}",
        f"trainer.max_steps={steps}",
        "trainer.max_time=null",
        # One precision for every head on every machine (`auto` would pick bf16-mixed on an AMX
        # CPU or a GPU, so an ablation resumed elsewhere would mix precisions).
        f"trainer.precision={placement.precision}",
        f"trainer.val_check_interval={ABLATION_VAL_EVERY}",
        "trainer.limit_val_batches=1.0",
        f"scheduler.warmup_steps={warmup}",
        f"scheduler.total_steps={steps}",
        f"callbacks.last_checkpoint.every_n_train_steps={ABLATION_CHECKPOINT_EVERY}",
        "validate_at_end=true",
        "callbacks.progress.refresh_rate=0",
        *placement.training(),
    ]


def default_lr() -> float:
    """The optimiser's default learning rate (conf/optim/adamw.yaml), which every head trains at."""
    return float(yaml.safe_load((ROOT / "conf" / "optim" / "adamw.yaml").read_text())["lr"])


def ablation(
    steps: int,
    features: Path | None,
    placement: Placement,
    heads: list[str] | None = None,
    parallel: int = 1,
) -> None:
    """Train every ABLATION head (or ``heads`` of them) for ``steps`` steps on the same features (a
    finished run is kept; a killed one resumes from its last checkpoint). ``parallel`` heads train
    side by side, each logging to RESULTS/train/<head>.log: on a GPU one small head's step is
    bound by the host's kernel launches and leaves the device mostly idle."""
    if steps % ABLATION_CHECKPOINT_EVERY:
        # last.ckpt must hold the final step's weights (what the bench reads), and every head's
        # curve and resume points fall on the same steps (a two-stage head's stages too).
        raise SystemExit(f"--steps must be a multiple of {ABLATION_CHECKPOINT_EVERY}, got {steps}")
    features = features or quickstart_features()
    todo = [name for name in heads or ABLATION if not (RESULTS / "train" / name / "summary.json").is_file()]

    def train(name: str) -> None:
        log = RESULTS / "train" / f"{name}.log" if parallel > 1 else None
        if name in FIRST_STAGE_RECIPE:
            train_two_stage(name, steps, features, placement, log)
        else:
            command("specdraft-train", *ablation_overrides(name, steps, features, placement), log=log)

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        list(pool.map(train, todo))  # list(): a failed head's error is raised here


def export_heads(dtype: str, parallel: int = 1) -> None:
    """Export every trained ablation head's final weights (native format, ``dtype``) into its run
    dir's EXPORT_DIR, which the bench then reads: the few MB that carry a head trained on another
    machine (a GPU) to the one that benches it, without its optimiser state."""
    todo = [
        name
        for name in ABLATION
        if (RESULTS / "train" / name / "summary.json").is_file()
        and not (RESULTS / "train" / name / EXPORT_DIR / "config.json").is_file()
    ]

    def export(name: str) -> None:
        run_dir = RESULTS / "train" / name
        command(
            "specdraft-export",
            f"checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}",
            "format=native",
            f"out={run_dir / EXPORT_DIR}",
            f"dtype={dtype}",
            log=run_dir / "export.log" if parallel > 1 else None,
        )

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        list(pool.map(export, todo))


def train_two_stage(
    name: str, steps: int, features: Path, placement: Placement, log: Path | None = None
) -> None:
    """A two-stage head: FIRST_STAGE_RECIPE[name]'s recipe for the first steps, then its own from
    those weights at TOPK_STAGE_LR_SCALE × the learning rate for the last TOPK_STAGE_FRACTION."""
    interval = ABLATION_CHECKPOINT_EVERY
    second = max(1, round(steps * TOPK_STAGE_FRACTION / interval)) * interval
    if second >= steps:
        raise SystemExit(f"{name}: {steps} steps leave no first stage (at least {2 * interval})")
    first_run = f"{name}{FIRST_STAGE_SUFFIX}"
    if not (RESULTS / "train" / first_run / "summary.json").is_file():
        recipe_of = FIRST_STAGE_RECIPE[name]
        command(
            "specdraft-train",
            *ablation_overrides(first_run, steps - second, features, placement, recipe_of),
            log=log,
        )
    command(
        "specdraft-train",
        *ablation_overrides(
            name,
            second,
            features,
            placement,
            lr_scale=TOPK_STAGE_LR_SCALE,
            warmup=round(ABLATION_WARMUP * second / steps),
        ),
        f"init_from={RESULTS / 'train' / first_run / 'checkpoints' / 'last.ckpt'}",
        log=log,
    )


def bench(max_minutes: float | None, placement: Placement, heads: list[str] | None = None) -> None:
    """ONE interleaved specdraft-bench run over every ablation head's final weights as the same
    EAGLE-2 dynamic tree (no early stopping by validation: equal tokens), on MT-bench first turns
    (balanced per category) alternating with HumanEval, at T=0 and T=1. It resumes where it was
    killed or time-boxed (``--max-minutes``)."""
    methods = [
        head_method(
            f"{name}_tree", final_checkpoint(RESULTS / "train" / name), TREE, shortlist=name not in OWN_VOCAB
        )
        for name in heads or ABLATION
    ]
    command(
        "specdraft-bench",
        "methods=none",
        *methods,
        *training_vocab_shortlist(train_cache(RESULTS / "train" / ABLATION_REFERENCE)),
        "checkpoint=null",
        f"run_name={ABLATION_BENCH}",
        f"paths.log_dir={RESULTS}",
        "prompts=mt_bench_humaneval",
        f"prompts.sources.0.path={MT_BENCH}",
        f"prompts.sources.0.per_category={ABLATION_MT_BENCH_PER_CATEGORY}",
        f"prompts.sources.1.limit={ABLATION_HUMANEVAL}",
        "temperatures=[0.0,1.0]",
        "progress=false",
        *([f"max_minutes={max_minutes}"] if max_minutes else []),
        *placement.target(),
    )


def training_vocab_shortlist(cache: Path) -> list[str]:
    """specdraft-bench overrides that make the decoder's shortlist the EAGLE-1/2 heads' training
    vocabulary: the ABLATION_VOCAB most frequent assistant tokens of the same split of the same
    conversations the train cache was computed from (its plan.json). The bench's default shortlist
    counts ShareGPT's original answers instead: for the quickstart's self-distilled cache only
    4,753 of its 8,192 tokens are in the training vocabulary (measured 2026-11-24)."""
    plan_source = json.loads((cache / "plan.json").read_text())["source"]
    if "captured_by" in plan_source:
        # Features captured during regeneration: its answers, split as the capture split them
        # (counted from their text tokenized again, where the cache holds the ids generated).
        data = {**plan_source["conversations"]["data"], **plan_source["split"]}
        data["source"] = {"_target_": "specdraft.data.conversations.read_jsonl", "path": plan_source["regen"]}
        plan_source = {"limit": None}
    else:
        data = plan_source["data"]
    source = dict(data["source"])
    if source.get("path") and not Path(source["path"]).is_absolute():
        source["path"] = str(ROOT / source["path"])  # the cache's paths are relative to the repo

    def value(item: object) -> str:
        return "null" if item is None else f"'{item}'" if isinstance(item, str) else str(item)

    return [
        f"shortlist.size={ABLATION_VOCAB}",
        "~shortlist.source",  # replaced whole: the default reader takes other arguments
        "+shortlist.source={" + ", ".join(f"{key}: {value(item)}" for key, item in source.items()) + "}",
        f"shortlist.heldout_fraction={data['heldout_fraction']}",
        f"shortlist.split_seed={data['split_seed']}",
        f"shortlist.max_length={data['max_length']}",
        f"shortlist.split_limit={value(plan_source.get('limit'))}",
    ]


def depth(device: str = "cpu", depth_steps: int = DEPTH_STEPS) -> None:
    """Chain acceptance per depth, own features vs the target's, of every trained ablation head
    on the held-out cache (specdraft-depth-acceptance), merged into RESULTS/DEPTH_JSON: a head
    measured already (with the per-conversation counts its interval needs) is not measured again."""
    path = RESULTS / DEPTH_JSON
    measured = read_json(path) or {"runs": {}}
    runs = [
        name
        for name in ABLATION
        if (RESULTS / "train" / name / "summary.json").is_file()
        and "conversations" not in measured["runs"].get(name, {})
    ]
    if not runs:
        print("depth: every trained ablation head is measured already")
        return
    partial = RESULTS / f"{DEPTH_JSON}.partial"
    for name in runs:  # one at a time: each reads its benched weights (an export, if it has one)
        command(
            "specdraft-depth-acceptance",
            str(RESULTS / "train" / name),
            f"--checkpoint={final_checkpoint(RESULTS / 'train' / name)}",
            f"--device={device}",
            f"--depth={depth_steps}",
            f"--out={partial}",
        )
        new = json.loads(partial.read_text())
        measured = {**new, "runs": {**measured["runs"], **new["runs"]}}
        write_json_atomic(path, measured)
        partial.unlink()


def sweep(steps: int, features: Path | None, grid: dict[str, str], placement: Placement) -> None:
    """The HASS loss-weight sweep as users run one offline: ONE Hydra multirun of HASS heads on the
    ablation's data, batches, vocabulary and step count (``grid``: key -> comma-separated values;
    the other weights stay at conf/loss/hass.yaml's), logged to W&B offline and CSV; then
    ``specdraft-sweep-report`` over its run dirs. Finished points are skipped, killed ones resume."""
    features = features or quickstart_features()
    shared = [
        o for o in ablation_overrides("hass", steps, features, placement) if not o.startswith("run_name=")
    ]
    # The run dirs are named after the swept values only.
    excluded = ["experiment", "logger", "logger.wandb.mode", "sweep_name", "paths.log_dir"]
    excluded += [o.split("=")[0] for o in shared]
    command(
        "specdraft-train",
        "-m",
        *shared,
        *(f"{key}={values}" for key, values in grid.items()),
        "logger=wandb",
        "logger.wandb.mode=offline",
        f"sweep_name={SWEEP_NAME}",
        f"hydra.job.config.override_dirname.exclude_keys=[{','.join(sorted(set(excluded)))}]",
    )
    sweep_dir = RESULTS / "sweeps" / SWEEP_NAME
    command("specdraft-sweep-report", str(sweep_dir), f"--out={sweep_dir / 'report'}")
    write_json_atomic(sweep_dir / "report" / "machine.json", machine_info())
    # Whether any weighting beats plain EAGLE training on the same tokens, and why (the depth gap).
    reference = RESULTS / "train" / SWEEP_REFERENCE
    if not (reference / "summary.json").is_file():
        command(
            "specdraft-train",
            *ablation_overrides(SWEEP_REFERENCE, steps, features, placement, recipe_of="eagle"),
        )
    points = [
        Path(row["run"]) for row in json.loads((sweep_dir / "report" / "runs.json").read_text())["runs"]
    ]
    depth_path = sweep_dir / "report" / SWEEP_DEPTH_JSON
    measured = (read_json(depth_path) or {"runs": {}})["runs"]
    if any(run.name not in measured for run in [reference, *points]):
        command(
            "specdraft-depth-acceptance",
            str(reference),  # first: every point's chain τ is compared with it
            *map(str, points),
            f"--depth={DEPTH_STEPS}",
            f"--out={depth_path}",
        )


def decoder(checkpoint: str | None, per_category: int, placement: Placement) -> None:
    if checkpoint is None:
        raise SystemExit("the decoder stage needs --decoder-checkpoint (a trained EAGLE head)")
    first_turns_bench("decoder", "decoder", checkpoint, per_category, placement)


def batch(checkpoint: str, per_category: int, placement: Placement) -> None:
    first_turns_bench("batch", BATCH_RUN, checkpoint, per_category, placement, f"batch_sizes={BATCH_SIZES}")


def first_turns_bench(
    methods: str, run_name: str, checkpoint: str, per_category: int, placement: Placement, *overrides: str
) -> None:
    """ONE specdraft-bench run of the ``methods`` preset on MT-bench first turns, 128 new tokens, T=0."""
    command(
        "specdraft-bench",
        f"methods={methods}",
        f"checkpoint={checkpoint}",
        f"run_name={run_name}",
        f"paths.log_dir={RESULTS}",
        f"prompts.path={MT_BENCH}",
        f"prompts.per_category={per_category}",
        "prompts.max_turns=1",
        "max_new_tokens=128",
        "temperatures=[0.0]",
        "progress=false",
        *overrides,
        *placement.target(),
    )


def mixture(checkpoint: str | None, per_category: int, placement: Placement) -> None:
    """ONE interleaved bench of a fine-tuned head (``checkpoint``) against the head it started
    from (the committed quickstart head), on MT-bench BOTH turns (the second turns ask to rewrite
    or continue the first answer: prompt lookup's best case), 128 new tokens, T=0, the same
    12-node tree."""
    if checkpoint is None:
        raise SystemExit("the mixture stage needs --mixture-checkpoint (the fine-tuned head)")
    tree = "shape: {kind: dynamic, depth: 3, top_k: 4, total_tokens: 12}, shortlist: true"
    command(
        "specdraft-bench",
        "methods=none",
        f"checkpoint={QUICKSTART_HEAD}",
        f"run_name={MIXTURE_RUN}",
        f"paths.log_dir={RESULTS}",
        f"prompts.path={MT_BENCH}",
        f"prompts.per_category={per_category}",
        "temperatures=[0.0]",
        "progress=false",
        "+methods.hf_generate={type: hf}",
        "+methods.hf_prompt_lookup={type: hf, prompt_lookup_tokens: 10}",
        f"+methods.{MIXTURE_BASE}={{type: head, checkpoint: {QUICKSTART_HEAD}, {tree}}}",
        f"+methods.{MIXTURE_TUNED}={{type: head, checkpoint: {checkpoint}, {tree}}}",
        *placement.target(),
    )


def lookahead(checkpoint: str, per_category: int, humaneval: int, placement: Placement) -> None:
    command(
        "specdraft-bench",
        "methods=lookahead",
        f"checkpoint={checkpoint}",
        f"run_name={LOOKAHEAD_RUN}",
        f"paths.log_dir={RESULTS}",
        "prompts=mt_bench_humaneval",
        f"prompts.sources.0.path={MT_BENCH}",
        f"prompts.sources.0.per_category={per_category}",
        f"prompts.sources.1.limit={humaneval}",
        "max_new_tokens=128",
        "temperatures=[0.0]",
        "progress=false",
        *placement.target(),
    )


def curve(per_category: int) -> None:
    """Every curve checkpoint of the quickstart runs in CURVE_RUNS, benched together at T=0."""
    methods = []
    for run, label in CURVE_RUNS.items():
        for path in sorted((LOG_DIR / "train" / run / "checkpoints" / "curve").glob("step=*.ckpt")):
            step = int(path.stem.split("=")[1])
            if step % CURVE_EVERY == 0:
                methods.append(head_method(f"{label}_step{step}", path, TREE))
    command(
        "specdraft-bench",
        "methods=none",
        *methods,
        "checkpoint=null",
        "run_name=curve",
        f"paths.log_dir={RESULTS}",
        f"prompts.path={MT_BENCH}",
        f"prompts.per_category={per_category}",
        "prompts.max_turns=1",
        "temperatures=[0.0]",
    )


def doc(
    decoder_provenance: str | None = None,
    mixture_provenance: str | None = None,
    ablation_provenance: str | None = None,
) -> None:
    """Snapshot the runs found under LOG_DIR into docs/results/, then render docs/results.md (and
    its plots) from the snapshots.

    The snapshots are the measured numbers, committed with the doc, so the doc can be re-rendered on
    any clone. A section whose snapshot is missing keeps the text it had (its runs' outputs may be
    gone with the machine that made them); one never measured says how to measure it.
    """
    snapshot_runs(decoder_provenance, mixture_provenance, ablation_provenance)
    previous = sections(DOCS / "results.md")
    lines = [
        "# Results",
        "",
        "Generated by `python scripts/results.py` from the runs it names; every number below is read",
        "from their JSON outputs, snapshotted in `docs/results/`. Do not edit by hand.",
        "",
    ]
    for title, render, how in (
        (QUICKSTART_TITLE, lambda: quickstart_section(previous.get(QUICKSTART_TITLE, [])), "make quickstart"),
        (ABLATION_TITLE, ablation_section, "python scripts/results.py --stages ablation depth bench doc"),
        (SWEEP_TITLE, sweep_section, "python scripts/results.py --stages sweep doc"),
        (WALLCLOCK_ABLATION_TITLE, wallclock_ablation_section, "(superseded: not re-run)"),
        (CURVE_TITLE, curve_section, "python scripts/results.py --stages curve doc"),
        (
            DECODER_TITLE,
            decoder_section,
            "python scripts/results.py --stages decoder doc --decoder-checkpoint <head>",
        ),
        (
            DECODER_BF16_TITLE,
            lambda: decoder_section(DECODER_BF16_SNAPSHOT),
            "python scripts/results.py --stages decoder doc --decoder-checkpoint <head>, on a CPU with AMX",
        ),
        (
            DECODER_AVX512BF16_TITLE,
            lambda: decoder_section(DECODER_AVX512BF16_SNAPSHOT),
            "python scripts/results.py --stages decoder doc --decoder-checkpoint <head>, on a CPU with"
            " AVX-512-bf16 but no AMX",
        ),
        (
            MIXTURE_TITLE,
            mixture_section,
            "python scripts/results.py --stages mixture doc --mixture-checkpoint <head>",
        ),
        (
            LOOKAHEAD_TITLE,
            lookahead_section,
            "python scripts/results.py --stages lookahead doc",
        ),
        (BATCH_TITLE, batch_section, "python scripts/results.py --stages batch doc"),
        (GPU_TITLE, gpu_section, "a GPU session: see docs/results/gpu_h100.json"),
        (DECODER_GPU_TITLE, decoder_gpu_section, "a GPU session: see docs/results/decoder_gpu.json"),
        (
            DECODER_ROUNDS_TITLE,
            decoder_rounds_section,
            "a GPU session: see docs/results/decoder_gpu_rounds.json",
        ),
        (
            RECIPE_TITLE,
            recipe_section,
            "a GPU session: python scripts/results.py --stages recipe doc (RECIPE_RUNS)",
        ),
        (
            GPU_REGEN_TITLE,
            gpu_regen_section,
            "a GPU session: python scripts/results.py --stages gpu_regen doc --gpu-regen LABEL:COMMIT:LOG …",
        ),
        (
            GPU_TESTS_TITLE,
            gpu_tests_section,
            "a GPU session: python scripts/results.py --stages gpu_tests doc --gpu-log LOG …",
        ),
        (
            TRAIN_SPEED_TITLE,
            train_speed_section,
            "python scripts/results.py --stages train_speed doc --train-speed OLDEST … NEWEST",
        ),
        (
            TRAIN_SPEED_BF16_TITLE,
            lambda: train_speed_section(TRAIN_SPEED_BF16_SNAPSHOT),
            "the train_speed stage, on a CPU with AMX",
        ),
        (
            TRAIN_SPEED_AVX512BF16_TITLE,
            lambda: train_speed_section(TRAIN_SPEED_AVX512BF16_SNAPSHOT),
            "the train_speed stage, on a CPU with AVX-512-bf16 but no AMX",
        ),
    ):
        body = render()
        if body is None:
            body = previous.get(title) or [f"_Not run yet: `{how}`._", ""]
        lines += [title, "", *body]
    lines += READING
    write_bytes_atomic(DOCS / "results.md", ("\n".join(lines) + "\n").encode())
    print(f"wrote {DOCS / 'results.md'}")


def sections(path: Path) -> dict[str, list[str]]:
    """A markdown file's ``## `` sections: title line -> the lines after it, less the blank line
    right after the title."""
    found: dict[str, list[str]] = {}
    title = None
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.startswith("## "):
            title = line
            found[title] = []
        elif title is not None:
            found[title].append(line)
    return {title: body[1:] if body[:1] == [""] else body for title, body in found.items()}


# --- snapshots: the few numbers the doc needs, copied out of the runs' outputs -------------------
TRAINING_KEYS = ("global_step", "tokens_seen", "fit_seconds", "best_sim_tau")


def snapshot_runs(
    decoder_provenance: str | None = None,
    mixture_provenance: str | None = None,
    ablation_provenance: str | None = None,
) -> None:
    """docs/results/<section>.json for every run whose outputs are under LOG_DIR."""
    for run, (directory, _) in QUICKSTART_RUNS.items():
        report = read_json(LOG_DIR / "bench" / run / "report.json")
        if report is not None:
            write_json_atomic(
                SNAPSHOTS / f"quickstart-{run}.json",
                {
                    "report": compact(report),
                    "training": training_summary(LOG_DIR / "train" / run),
                    "data": run_data(run),
                    "timings": read_json(LOG_DIR / directory / f"timings-{run}.json") or {},
                },
            )
    snapshot = ablation_snapshot()
    if snapshot is not None:
        write_json_atomic(
            SNAPSHOTS / ABLATION_SNAPSHOT, with_provenance(snapshot, ABLATION_SNAPSHOT, ablation_provenance)
        )
    snapshot = sweep_snapshot()
    if snapshot is not None:
        write_json_atomic(SNAPSHOTS / SWEEP_SNAPSHOT, snapshot)
    report = read_json(RESULTS / "bench" / "curve" / "report.json")
    if report is not None:
        runs = {
            run: {"data": run_data(run), "training": training_summary(LOG_DIR / "train" / run)}
            for run in CURVE_RUNS
        }
        write_json_atomic(SNAPSHOTS / "curve.json", {"report": compact(report), "runs": runs})
    snapshot = lookahead_snapshot()
    if snapshot is not None:
        write_json_atomic(SNAPSHOTS / LOOKAHEAD_SNAPSHOT, snapshot)
    report = read_json(RESULTS / "bench" / BATCH_RUN / "report.json")
    if report is not None:
        configs = report["config"]["methods"]
        write_json_atomic(
            SNAPSHOTS / BATCH_SNAPSHOT,
            {
                "machine": report["machine"],
                "head": Path(report["config"]["checkpoint"]).name,
                "methods": {  # how each was set up (its config: the shape) and what it is (type, lossless)
                    name: {
                        **{k: v for k, v in (configs.get(name) or {}).items() if k != "checkpoint"},
                        **details,
                    }
                    for name, details in report["methods"].items()
                },
                "config": {
                    "prompts": {k: report["config"]["prompts"].get(k) for k in ("per_category", "max_turns")},
                    "max_new_tokens": report["config"]["max_new_tokens"],
                    "batch_sizes": report["config"]["batch_sizes"],
                },
                "batch": report["batch"],
            },
        )
    mixture_dir = RESULTS / "bench" / MIXTURE_RUN
    report = read_json(mixture_dir / "report.json")
    if report is not None:
        name = machine_snapshot(MIXTURE_SNAPSHOT, report["machine"].get("hardware") or {})
        settings = read_json(mixture_dir / "run_config.json") or {}
        snapshot = mixture_snapshot(report, settings, read_records(mixture_dir))
        write_json_atomic(SNAPSHOTS / name, with_provenance(snapshot, name, mixture_provenance))
    report = read_json(RESULTS / "bench" / "decoder" / "report.json")
    if report is not None:
        name = machine_snapshot("decoder", report["machine"].get("hardware") or {})
        previous = read_json(SNAPSHOTS / name) or {}
        snapshot = {
            **compact(report),
            "methods": report["methods"],  # shape: auto's choice, predictions and latency probe
            "head": {
                "checkpoint": Path(report["config"]["checkpoint"]).name,
                "provenance": decoder_provenance or previous.get("head", {}).get("provenance"),
            },
        }
        write_json_atomic(SNAPSHOTS / name, snapshot)


def with_provenance(snapshot: dict, name: str, provenance: str | None) -> dict:
    """``snapshot`` with how its runs were made: ``provenance`` if given, else what the committed
    snapshot ``name`` says (a re-render without the flag keeps it)."""
    previous = read_json(SNAPSHOTS / name) or {}
    return {**snapshot, "provenance": provenance or previous.get("provenance")}


def mixture_snapshot(report: dict, settings: dict, records: list[dict]) -> dict:
    """The mixture bench per turn: tokens/s and τ of every method over that turn's answers, and
    the fine-tuned head's τ against its base with a paired bootstrap CI (by question). The heads'
    names come from the run's settings (its run_config.json)."""
    methods = settings.get("methods", {})
    per_turn = {}
    for turn, label in MIXTURE_TURNS.items():
        answers = [r for r in records if r["turn"] == turn]
        if not answers:
            continue
        by_method: dict[str, list[dict]] = {}
        for r in answers:
            by_method.setdefault(r["method"], []).append(r)
        measured = {method: metrics(rows, None) for method, rows in by_method.items()}
        per_turn[label] = {
            "turns": len({r["question_id"] for r in answers}),
            "methods": {
                method: {key: m[key] for key in ("tokens_per_s", "tau") if key in m}
                for method, m in measured.items()
            },
            "tuned_vs_base": paired_bootstrap(answers, MIXTURE_TUNED, MIXTURE_BASE),
        }
    return {
        "machine": report["machine"],
        "config": {
            "prompts": report["config"]["prompts"],
            "max_new_tokens": report["config"]["max_new_tokens"],
        },
        "heads": {
            name: Path(methods.get(name, {}).get("checkpoint") or "?").name
            for name in (MIXTURE_BASE, MIXTURE_TUNED)
        },
        "per_turn": per_turn,
    }


def machine_snapshot(stem: str, hardware: dict) -> str:
    """Where a measurement of ``hardware`` (a ``detect_hardware().record()``) is snapshotted: one
    snapshot per class of machine, because the issues' goals differ by class (with AMX a tree
    verification is nearly free and training runs bf16-mixed; on an AVX2-only CPU a verify costs a
    step per few nodes and training runs fp32; an AMD EPYC with AVX-512-bf16 but no AMX trains
    bf16-mixed, decodes one token 2× faster than the AMX Xeon but verifies a 60-node tree in 2.3
    of its plain steps)
    and one machine's run must not replace another's. ``<stem>.json`` on an AVX2-only CPU,
    ``<stem>_bf16.json`` on a CPU with AMX-bf16, ``<stem>_avx512bf16.json`` on one with native
    bf16 but no AMX, ``<stem>_<device>.json`` on an accelerator (the lent-GPU sessions' snapshots
    are kept by hand)."""
    device_type = hardware.get("device_type", "cpu")
    if device_type != "cpu":
        return f"{stem}_{device_type}.json"
    if not hardware.get("fast_bf16"):
        return f"{stem}.json"
    return f"{stem}_bf16.json" if "amx_bf16" in hardware.get("cpu_flags", ()) else f"{stem}_avx512bf16.json"


def ablation_snapshot() -> dict | None:
    """The equal-token ablation as far as it has run: each trained head's training and held-out
    curve; the own- vs target-feature acceptance per depth; and from the bench's records (a
    time-boxed run counts the prompts it did), per temperature and suite, each head's τ, α per
    depth and speedup, and its τ against EAGLE-2's with paired-bootstrap intervals."""
    eagle_run = RESULTS / "train" / ABLATION_REFERENCE
    if not (eagle_run / "summary.json").is_file():
        return None
    out_dir = RESULTS / "bench" / ABLATION_BENCH
    report = read_json(out_dir / "report.json") or {}
    records = read_records(out_dir) if report else []
    depth = depth_snapshot(read_json(RESULTS / DEPTH_JSON))
    reference = f"{ABLATION_REFERENCE}_tree"
    results: dict = {}
    for temperature in sorted({r["temperature"] for r in records}):
        key = f"T={temperature:g}"
        for suite, member in SUITES.items():
            rows = [r for r in records if r["temperature"] == temperature and member(r["category"])]
            if not rows:
                continue
            results.setdefault(key, {})[suite] = {
                method: {
                    "overall": {k: entry["overall"].get(k) for k in OVERALL_KEYS},
                    **({"lossless": entry["lossless"]} if "lossless" in entry else {}),
                    **(
                        {"against_reference": paired_bootstrap(rows, method, reference)}
                        if method not in ("plain", reference)
                        else {}
                    ),
                }
                for method, entry in summarize(rows)[key].items()
            }
    return {
        "machine": report.get("machine") or (depth or {}).get("machine"),
        **({"time_box": report["time_box"]} if "time_box" in report else {}),
        "setup": {
            "steps": (read_json(eagle_run / "summary.json") or {}).get("global_step"),
            "vocab": ABLATION_VOCAB,
            # --batch-tokens may differ from the default (a GPU run)
            "batch_tokens": yaml.safe_load((eagle_run / "run_config.yaml").read_text())["datamodule"].get(
                "max_batch_tokens", ABLATION_BATCH_TOKENS
            ),
            "tree": TREE,
            "max_new_tokens": report["config"]["max_new_tokens"] if report else None,
            "trained_on": training_device(eagle_run),
            "features": cache_source(train_cache(eagle_run)),
        },
        "prompts": {
            suite: len({r["question_id"] for r in records if member(r["category"])})
            for suite, member in SUITES.items()
        },
        "data": run_data(eagle_run),
        "training": {
            name: ablation_training(name)
            for name in ABLATION
            if (RESULTS / "train" / name / "summary.json").is_file()
        },
        "results": results,
        "depth": depth,
    }


def depth_snapshot(depth: dict | None, reference_name: str = ABLATION_REFERENCE) -> dict | None:
    """The depth measurement as committed: each head's chain τ (own features) against the
    reference's (EAGLE's) with an interval paired by held-out conversation, in place of the
    per-conversation counts it rests on; no local paths."""
    if depth is None:
        return None
    reference = depth["runs"].get(reference_name)
    for name, run in depth["runs"].items():
        for key in ("checkpoint", "val_cache"):
            if run.get(key):
                run[key] = Path(run[key]).name
        if name != reference_name and reference and "conversations" in run and "conversations" in reference:
            run["against_reference"] = paired_chain_bootstrap(run, reference)
    for run in depth["runs"].values():
        run.pop("conversations", None)
        for source in ("own_features", "target_features"):
            for key in ("attempts_per_conversation", "accepted_per_conversation"):
                run[source].pop(key, None)
    return depth


def ablation_training(name: str) -> dict:
    """A trained ablation head's summary and held-out curve; a two-stage head's count both stages
    (steps, tokens and seconds added, the second stage's curve after the first's)."""
    run = RESULTS / "train" / name
    summary, curve = training_summary(run) or {}, val_curve(run)
    first = RESULTS / "train" / f"{name}{FIRST_STAGE_SUFFIX}"
    if name in FIRST_STAGE_RECIPE and (first / "summary.json").is_file():
        before = training_summary(first) or {}
        summary["stages"] = [before["global_step"], summary["global_step"]]
        for key in ("global_step", "tokens_seen", "fit_seconds"):
            summary[key] = before[key] + summary[key]
        curve = val_curve(first) + [[step + before["global_step"], *rest] for step, *rest in curve]
    return {**summary, "curve": curve}


def lookahead_snapshot() -> dict | None:
    """The lookahead stage's bench per suite (T=0): each method's speed, tokens per step, nodes
    and agreement with plain decoding, and the methods' settings (no local paths)."""
    out_dir = RESULTS / "bench" / LOOKAHEAD_RUN
    report = read_json(out_dir / "report.json")
    if report is None:
        return None
    records = read_records(out_dir)
    results = {}
    for suite, member in SUITES.items():
        rows = [r for r in records if member(r["category"])]
        if rows:
            results[suite] = {
                method: {
                    "overall": {k: entry["overall"].get(k) for k in (*OVERALL_KEYS, "mean_nodes")},
                    **({"lossless": entry["lossless"]} if "lossless" in entry else {}),
                }
                for method, entry in summarize(rows)["T=0"].items()
            }
    methods = report["methods"]
    return {
        "machine": report["machine"],
        "head": Path(report["config"].get("checkpoint") or "").name,
        "methods": {m: {k: v for k, v in d.items() if k != "checkpoint"} for m, d in methods.items()},
        "max_new_tokens": report["config"]["max_new_tokens"],
        "results": results,
    }


def sweep_snapshot() -> dict | None:
    """The sweep report's table, each point's final held-out numbers, and how the points were trained."""
    report_dir = RESULTS / "sweeps" / SWEEP_NAME / "report"
    report = read_json(report_dir / "runs.json")
    if report is None:
        return None
    points, run_dir, config = [], None, None
    for row in report["runs"]:
        run_dir = Path(row["run"])
        summary = read_json(run_dir / "summary.json") or {}
        config = yaml.safe_load((run_dir / "run_config.yaml").read_text())
        points.append(
            {
                "run": run_dir.name,
                "values": {key: row[key] for key in report["swept"]},
                "best_sim_tau": row[report["metric"]],
                "final_val": summary.get("final_val") or {},
                "tokens_seen": summary.get("tokens_seen"),
                "loss": {"weights": config["loss"]["weights"], "rollout": config["loss"]["rollout"]},
            }
        )
    reference = read_json(RESULTS / "train" / SWEEP_REFERENCE / "summary.json")
    # Steps, data, precision and batch size are the same for every point: the last one's.
    return {
        "machine": read_json(report_dir / "machine.json"),
        "swept": report["swept"],
        "steps": config["trainer"]["max_steps"] if config else None,
        "training": None
        if config is None
        else {
            "data": run_data(run_dir),
            "precision": config["trainer"]["precision"],
            "batch_tokens": config["datamodule"]["max_batch_tokens"],
        },
        "points": points,
        "reference": None
        if reference is None
        else {"best_sim_tau": reference["best_sim_tau"], "final_val": reference.get("final_val") or {}},
        "depth": depth_snapshot(read_json(report_dir / SWEEP_DEPTH_JSON), SWEEP_REFERENCE),
    }


def val_curve(run_dir: Path) -> list[list[float]]:
    """[step, held-out acc_1, simulated τ] at every validation of a run, across its CSV logs (a
    resumed run starts a new one; a later row wins its step). The end-of-training validation of the
    same weights, logged one step after the last in-loop one with the same numbers, is dropped."""
    logs = sorted(
        (run_dir / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])
    )
    by_step: dict[int, list[float]] = {}
    for log in logs:
        with log.open() as handle:
            for row in csv.DictReader(handle):
                if row.get("val/acc_1"):
                    by_step[int(row["step"])] = [float(row["val/acc_1"]), float(row["val/sim_tau"])]
    curve = [[step, *by_step[step]] for step in sorted(by_step)]
    if len(curve) > 1 and curve[-1][0] == curve[-2][0] + 1 and curve[-1][1:] == curve[-2][1:]:
        curve.pop()
    return curve


def compact(report: dict) -> dict:
    """A bench report without per-category numbers or local paths (the report.json schema, less
    those)."""
    prompts, config = report["config"]["prompts"], report["config"]
    return {
        "machine": report["machine"],
        **({"time_box": report["time_box"]} if "time_box" in report else {}),
        "config": {
            "prompts": {key: prompts.get(key) for key in ("per_category", "max_turns", "limit")}
            | {"reader": prompts.get("_target_", "").rsplit(".", 1)[-1] or None},
            "max_new_tokens": config["max_new_tokens"],
        },
        "results": {
            temperature: {
                method: {key: entry[key] for key in ("overall", "lossless") if key in entry}
                for method, entry in methods.items()
            }
            for temperature, methods in report["results"].items()
        },
    }


def training_summary(run_dir: Path) -> dict | None:
    summary = read_json(run_dir / "summary.json")
    if not summary:
        return None
    return {key: summary[key] for key in TRAINING_KEYS} | {
        "precision": summary.get("precision"),  # older runs' summaries lack it
        "final_val": summary.get("final_val") or {},
    }


def manifest_counts(cache_dir: Path) -> dict | None:
    manifest = read_json(cache_dir / "manifest.json")
    return {key: manifest[key] for key in ("num_samples", "num_tokens")} if manifest else None


def quickstart_features() -> Path:
    """The feature caches of the default quickstart run (their directory names the planned
    number of conversations): the parent of the train cache its training read."""
    config = LOG_DIR / "train" / "quickstart" / "run_config.yaml"
    if not config.is_file():
        raise SystemExit(f"{config} is missing: run the quickstart first (make run)")
    cache = Path(yaml.safe_load(config.read_text())["datamodule"]["train_cache"])
    return (cache if cache.is_absolute() else ROOT / cache).parent


def train_cache(run_dir: Path) -> Path:
    """The train cache a training run read (from its resolved config)."""
    cache = Path(yaml.safe_load((run_dir / "run_config.yaml").read_text())["datamodule"]["train_cache"])
    return cache if cache.is_absolute() else ROOT / cache


def training_device(run_dir: Path) -> str | None:
    """What a training run ran on, as its log's first line names it ("NVIDIA H200 (bf16
    supported)", a CPU model and its flags)."""
    log = run_dir / "cli.log"
    found = re.search(r"specdraft-train on (.+?);", log.read_text()) if log.is_file() else None
    return found.group(1) if found else None


def cache_source(cache: Path) -> dict | None:
    """Where a feature cache's conversations came from (its plan.json): the reader, the file's
    name, the split and the limit on it; no local paths."""
    plan = read_json(cache / "plan.json")
    if plan is None:
        return None
    described = plan["source"]
    if "captured_by" in described:  # features captured during regeneration
        return {
            "reader": described["captured_by"],
            "file": Path(described["regen"]).name,
            "split": described["cache_split"],
            "limit": described["conversations"].get("limit"),
        }
    source = described.get("data", {}).get("source", {})
    return {
        "reader": source.get("_target_", "").rsplit(".", 1)[-1],
        "file": Path(source["path"]).name if source.get("path") else None,
        "split": described.get("split"),
        "limit": described.get("limit"),
    }


def features_text(features: dict | None) -> str:
    """The ablation's data, in words: its cache's source (older snapshots: the quickstart's)."""
    if not features:
        return "the quickstart's self-distilled features"
    where = f"`{features['file']}`" if features["file"] else f"`{features['reader']}`"
    first = f"the first {features['limit']:,} conversations of " if features["limit"] else ""
    return f"the target's features over {first}the {features['split']} split of {where}"


def run_data(run: str | Path) -> dict | None:
    """The manifest counts of the train cache a training run (its name under LOG_DIR/train, or its
    dir) read."""
    run_dir = run if isinstance(run, Path) else LOG_DIR / "train" / run
    return manifest_counts(train_cache(run_dir)) if (run_dir / "run_config.yaml").is_file() else None


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# --- rendering: from the snapshots only ------------------------------------------------------
def data_text(counts: dict | None) -> str:
    return f"{counts['num_samples']} conversations, {counts['num_tokens']:,} tokens" if counts else "–"


def machine_line(report: dict) -> str:
    machine = report["machine"]
    hardware = machine.get("hardware")  # the CPU model and flags; older reports lack them
    processor = machine["processor"]
    if hardware:
        processor = f"{hardware['name']} ({', '.join(hardware['cpu_flags'])})"
    accelerator = machine.get("accelerator")  # GPU runs record the GPU beside its host
    on = f"{accelerator['name']} on a host of " if accelerator else ""
    return (
        f"{machine['time'][:10]}, {on}{processor} × {machine['cpu_count']} cores "
        f"({machine['threads']} torch threads), torch {machine['torch']}, {machine['platform']}"
    )


def head_rows(results: dict, methods: list[str], reference: str | None = None) -> list[str]:
    """One table row per method: τ, α per depth, tokens/s, speedups, T=0 agreement."""
    rows = []
    for method in methods:
        cells = [method]
        for temperature in ("T=0", "T=1"):
            entry = results.get(temperature, {}).get(method)
            if entry is None:
                cells += ["–"] * (4 if temperature == "T=0" else 2)
                continue
            overall = entry["overall"]
            cells.append(f"{overall['tau']:.2f}" if "tau" in overall else "–")  # HF methods: not observable
            if temperature == "T=0":
                alphas = overall.get("acceptance_per_depth") or []
                cells.append(" / ".join(f"{a:.2f}" for a in alphas if a is not None) or "–")
            cells.append(f"{overall['speedup']:.2f}×")
            if temperature == "T=0":
                lossless = entry.get("lossless") or {}
                cells.append(
                    f"{lossless.get('exact_turns', '–')}/{lossless.get('turns_compared', '–')}"
                    if lossless
                    else "–"
                )
        if reference and reference in results.get("T=0", {}):
            ours = results["T=0"].get(method, {}).get("overall", {}).get("speedup")
            theirs = results["T=0"][reference]["overall"]["speedup"]
            cells.append(f"{ours / theirs:.2f}×" if ours else "–")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


READING = [
    "## Reading these numbers",
    "",
    "- τ = tokens committed per target forward (accepted drafts + 1); α per depth = the share of",
    "  verify steps that reached depth d and accepted a token there. Speedup = tokens/s over plain",
    "  decoding on the same turns in the same run (interleaved per question), prefill included.",
    "- On the AMX machine of the quickstart and ablation runs (bf16) one plain decoding step cost",
    "  ~50–60 ms and verifying a 12 / 24-node tree ~1.2 / ~1.5 plain steps, plus ~10 / ~20 ms of",
    "  drafting: a head needs τ above ~1.6 (12 nodes) or ~2.0 (24 nodes) before speculation pays",
    "  (the reports' draft_ms / verify_ms). The decoder section's AVX2 machine (fp32) verifies 12",
    "  nodes in ~1.5 plain steps.",
    "- Plain decoding before 110a26a ran its one-token step's attention through SDPA's enable_gqa",
    "  kernel, which a bf16 CPU runs ~5× slower than the query heads stacked as rows of their",
    "  key/value head (eval/kernels.py): the head of run qs-a128b-epyc benched again at 64f1780 and",
    "  110a26a, alternately, twice each (16 MT-bench first turns, 2-core AVX-512-bf16 EPYC): plain",
    "  decoding 48.7 / 46.7 → 52.7 / 50.5 tokens/s, the trees' tokens/s unchanged (they never run a",
    "  one-token target step), their speedups 1.35 / 1.43× → 1.27 / 1.25× (12 nodes), 1.15 / 1.22×",
    "  → 1.06 / 1.06× (24), 0.82 / 0.90× → 0.78 / 0.76× (60). So the bf16 runs above from before",
    "  that commit read their speedups high (~8 % there; not re-measured on the AMX Xeon); fp32",
    "  runs (the AVX2 EPYC's) kept enable_gqa, the faster kernel in fp32; τ is unaffected.",
    '- "identical to plain" counts turns whose speculative output equals plain greedy decoding',
    "  token for token. In bf16 a tree forward rounds differently from a one-token forward, so near",
    "  ties flip and the outputs drift apart after a while; in fp32 they are equal (tested).",
    "",
]

HEADER = "| method | τ T=0 | α per depth T=0 | speedup T=0 | identical to plain T=0 | τ T=1 | speedup T=1 |"
SEPARATOR = "|---|---|---|---|---|---|---|"
QUICKSTART_TITLE = "## Quickstart (`make quickstart`)"
ABLATION_TITLE = "## Ablation: the same data, the same number of training tokens"
SWEEP_TITLE = "## HASS loss-weight sweep (Hydra multirun, W&B offline)"
WALLCLOCK_ABLATION_TITLE = "## Earlier ablation: the same data, the same wall-clock training time"
CURVE_TITLE = "## τ vs training time and data"
DECODER_TITLE = "## The decoder's own speed (`specdraft-bench methods=decoder`)"
DECODER_SNAPSHOT = "decoder.json"  # an AVX2-only CPU's (machine_snapshot)
TRAIN_SPEED_TITLE = "## Training speed per head kind (`scripts/bench_train_step.py`)"
TRAIN_SPEED_SNAPSHOT = "train_speed.json"  # an AVX2-only CPU's, fp32 (machine_snapshot)
TRAIN_SPEED_BF16_TITLE = "## Training speed per head kind on a CPU with native bf16 (AMX-bf16, bf16-mixed)"
TRAIN_SPEED_BF16_SNAPSHOT = "train_speed_bf16.json"
TRAIN_SPEED_AVX512BF16_TITLE = (
    "## Training speed per head kind on a CPU with AVX-512-bf16 but no AMX (AMD EPYC, bf16-mixed)"
)
TRAIN_SPEED_AVX512BF16_SNAPSHOT = "train_speed_avx512bf16.json"
BATCH_TITLE = "## Throughput against batch size (`methods=batch batch_sizes=[1,2,4,8,16]`)"
BATCH_RUN = "batch"
BATCH_SNAPSHOT = "batch.json"
BATCH_SIZES = "[1,2,4,8,16]"
MIXTURE_TITLE = "## A head fine-tuned on a data mixture (`--stages mixture`)"
MIXTURE_RUN = "mixture"
MIXTURE_SNAPSHOT = "mixture"  # + the machine class (machine_snapshot)
MIXTURE_BASE, MIXTURE_TUNED = "head_dynamic", "head_dynamic_ft"
MIXTURE_TURNS = {0: "first turns", 1: "second turns"}
LOOKAHEAD_TITLE = "## Lookahead decoding, HF prompt lookup and a trained head (`methods=lookahead`)"
LOOKAHEAD_RUN = "lookahead"
LOOKAHEAD_SNAPSHOT = "lookahead.json"
GPU_TITLE = "## On one GPU: the quickstart, regeneration and the plain step (a lent H100)"
# the same bench on a CPU with native bf16 (AMX / AVX-512-bf16): its own snapshot and section
DECODER_BF16_TITLE = "## The decoder on a CPU with native bf16 (AMX-bf16)"
DECODER_BF16_SNAPSHOT = "decoder_bf16.json"
DECODER_AVX512BF16_TITLE = "## The decoder on a CPU with AVX-512-bf16 but no AMX (AMD EPYC)"
DECODER_AVX512BF16_SNAPSHOT = "decoder_avx512bf16.json"
DECODER_GPU_TITLE = "## The decoder on one GPU: CUDA graphs (a lent H100, second session)"
DECODER_GPU_SNAPSHOT = "decoder_gpu.json"
DECODER_ROUNDS_TITLE = "## The decoder on one GPU: greedy rounds on the device (a lent H100, third session)"
DECODER_ROUNDS_SNAPSHOT = "decoder_gpu_rounds.json"
GPU_TESTS_TITLE = "## `pytest -m gpu` on a lent GPU"
GPU_REGEN_TITLE = "## Regeneration on one GPU, plain and capturing the features (a lent H100)"
GPU_REGEN_SNAPSHOT = "regen_gpu.json"
RECIPE_TITLE = "## Recipe variants of the quickstart's head, side by side on a lent GPU"
RECIPE_SNAPSHOT = "recipe_gpu.json"
# The quickstart's EAGLE head (experiment=quickstart: 4,096-token batches, bf16-mixed) trained on the
# features of one quickstart run's data (run qs-deadline2-amx: SmolLM2's answers to 1,181 ShareGPT
# first turns, 340,993 tokens; its 54 held-out conversations for validation), recomputed on an H100.
# Run name under outputs/recipe-gpu -> (what differs from the quickstart as that run trained it, steps).
RECIPE_RUNS = {
    "base": ("– (soft_ce 0.1, lr 1e-3, noise 0.1, min lr ratio 0.1)", 2004),
    "seed1": ("datamodule.seed=1 (another batch order and noise)", 2004),
    "seed2": ("datamodule.seed=2", 2004),
    "steps2400": ("trainer.max_steps=2400", 2400),
    "steps2800": ("trainer.max_steps=2800", 2800),
    "softce0.2": ("loss.weights.soft_ce=0.2", 2004),
    "softce0.05": ("loss.weights.soft_ce=0.05", 2004),
    "softce0.02": ("loss.weights.soft_ce=0.02", 2004),
    "lr2e3": ("optim.lr=2e-3", 2004),
    "lr7e4": ("optim.lr=7e-4", 2004),
    "minlr0": ("scheduler.min_lr_ratio=0.0", 2004),
    "wd0.01": ("optim.weight_decay=0.01", 2004),
    "noise0": ("datamodule.noise.amplitude=0.0", 2004),
    "noise0.2": ("datamodule.noise.amplitude=0.2", 2004),
    "v4k": ("loss.draft_vocab_size=4096 (steps × 1.12, its measured speed-up on the AMX Xeon)", 2250),
    "mix": ("+ ShareGPT's original answers of 400 other conversations (574,998 tokens); steps less the "
            "~3 min their features would take on the AMX Xeon", 1670),
    "mix_lr2e3": ("mix + optim.lr=2e-3", 1670),
}  # fmt: skip
RECIPE_PROVENANCE = (
    "2026-11-26, NVIDIA H100 80GB HBM3 on a host of Intel(R) Xeon(R) Processor × 16 cores; torch "
    "2.11.0+cu130, lightning 2.6.6, transformers 5.23.0; at commit 97b9a51. Features: specdraft-cache "
    "over run qs-deadline2-amx's regenerated conversations (quickstart-train-1424.jsonl) split as the "
    "quickstart splits them (5 % held out, split seed 1), top_k 10, on the GPU; each run "
    "`specdraft-train experiment=quickstart trainer=gpu target.device=cuda "
    "trainer.max_steps=N trainer.val_check_interval=N/4 callbacks.curve_checkpoint=null <override>`, "
    "five or six side by side, 2 CPU threads each"
)
GPU_TESTS_SNAPSHOT = "gpu_tests.json"
# the dynamic tree the decoder issue measures drafting overhead on (conf/methods/decoder.yaml)
DECODER_TREE = "head_dynamic"


# the prompt readers (conf/prompts) a report's prompts came from, as the doc names them. Snapshots
# from before the reader was kept are all MT-bench's (their per_category says so: the quickstart
# sets it only when it finds the MT-bench file)
MT_BENCH_READER = "read_spec_bench"
PROMPT_SETS = {MT_BENCH_READER: "MT-bench", "sharegpt_heldout": "held-out ShareGPT (no MT-bench file)"}


def prompts_line(report: dict) -> str:
    prompts, config = report["config"]["prompts"], report["config"]
    turns = "first turns" if prompts.get("max_turns") == 1 else f"max_turns {prompts.get('max_turns')}"
    reader = prompts.get("reader") or MT_BENCH_READER
    name = PROMPT_SETS.get(reader, reader)
    if reader == MT_BENCH_READER:
        selection = f"{name}, {prompts.get('per_category')} per category"
    else:
        limit = prompts.get("limit")
        selection = f"{name}, the first {limit} prompts" if limit else name
    return f"{selection}, {turns}, {config['max_new_tokens']} new tokens per turn"


def training_line(summary: dict | None) -> str:
    if summary is None:
        return "–"
    return (
        f"{summary['global_step']} steps, {summary['tokens_seen']:,} tokens seen, "
        f"{summary['fit_seconds'] / 60:.1f} min, best simulated τ {summary['best_sim_tau']:.3f}"
    )


def quickstart_section(previous: list[str]) -> list[str] | None:
    """A subsection per quickstart run with a snapshot, then the ``previous`` text of runs that
    have none (measured before snapshots existed, on machines that are gone)."""
    runs = [(run, read_json(SNAPSHOTS / f"quickstart-{run}.json")) for run in QUICKSTART_RUNS]
    runs = [(run, snapshot) for run, snapshot in runs if snapshot is not None]
    if not runs:
        return None
    lines = []
    for run, snapshot in runs:
        report = snapshot["report"]
        box = report.get("time_box")
        lines += [
            f"### `{QUICKSTART_RUNS[run][1]}` (run `{run}`)",
            "",
            f"- machine: {machine_line(report)}",
            f"- data: {data_text(snapshot['data'])} (train cache)",
            f"- training: {training_line(snapshot['training'])}",
            "- stage wall times (s): " + stage_times(snapshot["timings"]),
            *([f"- conditions: {RUN_CONDITIONS[run]}"] if run in RUN_CONDITIONS else []),
            f"- prompts: {prompts_line(report)}"
            + (
                f"; a {box['max_seconds'] / 60:.1f}-min time box left {box['units_left']} undone"
                if box
                else ""
            ),
            "",
            HEADER,
            SEPARATOR,
            *head_rows(report["results"], [m for m in report["results"]["T=0"] if m != "plain"]),
            "",
        ]
    return lines + kept_runs(previous, {run for run, _ in runs})


def kept_runs(previous: list[str], snapshotted: set[str]) -> list[str]:
    """The ``### … (run `X`)`` subsections of ``previous`` whose run has no snapshot, each with
    its machine (older docs gave it once, as a ``Machine:`` line before the subsections)."""
    machine = next(
        (line.removeprefix("Machine: ").rstrip(".") for line in previous if line.startswith("Machine: ")),
        None,
    )
    blocks: list[list[str]] = []
    for line in previous:
        if line.startswith("### "):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    kept = []
    for block in blocks:
        run = re.search(r"\(run `([^`]+)`\)", block[0])
        if run is None or run.group(1) in snapshotted:
            continue
        if machine and not any(line.startswith("- machine: ") for line in block):
            block = [block[0], "", f"- machine: {machine}", *block[2:]]
        kept += block
    return kept


def stage_times(timings: dict) -> str:
    """``regen 612 (ETA 608), …``: a budgeted quickstart's timings carry its plan's ETAs."""
    eta = timings.get("eta", {})
    return ", ".join(
        f"{k} {v:.0f}" + (f" (ETA {eta[k]:.0f})" if k in eta else "")
        for k, v in timings.items()
        if isinstance(v, int | float) and k != "budget_minutes"
    ) + (f"; budget {timings['budget_minutes']:g} min" if "budget_minutes" in timings else "")


def ablation_section() -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / ABLATION_SNAPSHOT)
    if snapshot is None:
        return None
    setup, prompts = snapshot["setup"], snapshot["prompts"]
    box = snapshot.get("time_box") or {}
    trained = [name for name in ABLATION if name in snapshot["training"]]
    if snapshot["results"]:
        benched = (
            f"its FINAL weights benched as the EAGLE-2 dynamic tree `{setup['tree']}`, "
            f"{setup['max_new_tokens']} new tokens. Prompts, interleaved in one run: "
            f"{prompts.get('MT-bench', 0)} MT-bench first turns (balanced per category) and "
            f"{prompts.get('HumanEval', 0)} HumanEval problems"
            + (
                f"; the run was time-boxed with {box['units_left']} prompt × temperature units left"
                if box.get("units_left")
                else ""
            )
            + f". Intervals: {CONFIDENCE:.0%} percentile bootstrap over prompts, paired with EAGLE-2 "
            f"(`{ABLATION_REFERENCE}`) on the same prompts; each interval stands alone (with this many "
            "of them, one in twenty may miss by chance)."
        )
    else:
        benched = "not benched yet (`--stages bench`): the held-out measurements only."
    missing = [name for name in ABLATION if name not in trained]
    plot_training_curves(snapshot["training"])
    machine = (
        machine_line(snapshot) if snapshot.get("machine") else "not recorded (no bench, no depth run yet)"
    )
    trained_on = setup.get("trained_on")
    lines = [
        f"Machine: {machine}"
        + (f"; the heads trained on {trained_on}" if trained_on else "")
        + f". Data: {features_text(setup.get('features'))} "
        f"({data_text(snapshot['data'])}; held-out acc / τ on its held-out split). Every head: "
        f"{setup['steps']} optimiser steps over the same batches (≤ {setup['batch_tokens']:,} tokens each, "
        f"same order), cosine decay to that step, one {setup['vocab']:,}-token vocabulary (EAGLE-1/2's "
        f"training vocabulary and the decoder's shortlist, EAGLE-3's own); {benched}"
        + (f" Not trained yet: {', '.join(missing)}." if missing else "")
        + (f" How: {snapshot['provenance']}" if snapshot.get("provenance") else "")
        + "".join(
            f" `{name}` trains as HASS's reference does: `{FIRST_STAGE_RECIPE[name]}`'s recipe for "
            f"{run['stages'][0]} steps, then Top-K added from those weights for {run['stages'][1]} steps "
            f"at {TOPK_STAGE_LR_SCALE:.2g}× the learning rate; like the reference's restart, its second "
            "stage starts the batch order anew (it re-reads the first batches, not the last)."
            for name, run in snapshot["training"].items()
            if run.get("stages")
        ),
        "",
        f"![held-out acc_1 and simulated τ during training]({ABLATION_CURVE_PNG})",
        "",
        "| head | steps | tokens seen | precision | held-out acc_1..4 (final) | simulated τ (final) "
        f"| held-out acc_1 every {CURVE_COLUMN_EVERY} steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (name for name in ABLATION if name in snapshot["training"]):
        run = snapshot["training"][name]
        final = run.get("final_val", {})
        accs = " / ".join(f"{final[key]:.3f}" for key in sorted(final) if key.startswith("val/acc_"))
        curve = " ".join(
            f"{acc:.2f}" for step, acc, _ in run["curve"] if (step + 1) % CURVE_COLUMN_EVERY == 0
        )
        lines.append(
            f"| {name} | {run['global_step']} | {run['tokens_seen']:,} | {run.get('precision') or '–'} "
            f"| {accs} | {final.get('val/sim_tau', float('nan')):.3f} | {curve} |"
        )
    for temperature, suites in snapshot["results"].items():
        for suite in (name for name in SUITES if name in suites):
            methods = suites[suite]
            lines += [
                "",
                f"{suite}, {temperature} ({suite_prompts(methods)} prompts):",
                "",
                f"| head | τ | α per depth | τ ÷ EAGLE-2 [{CONFIDENCE:.0%} CI] | Δτ [{CONFIDENCE:.0%} CI] "
                "| speedup "
                "| identical to plain |",
                "|---|---|---|---|---|---|---|",
            ]
            for method in (f"{name}_tree" for name in ABLATION if f"{name}_tree" in methods):
                entry = methods[method]
                overall, versus = entry["overall"], entry.get("against_reference")
                alphas = " / ".join(
                    f"{a:.2f}" for a in overall.get("acceptance_per_depth") or [] if a is not None
                )
                ratio = (
                    "{estimate:.3f} [{low:.3f}, {high:.3f}]".format(**versus["ratio"])
                    if versus
                    else "1 (reference)"
                )
                difference = (
                    "{estimate:+.3f} [{low:+.3f}, {high:+.3f}]".format(**versus["difference"])
                    if versus
                    else "–"
                )
                lossless = entry.get("lossless")
                same = f"{lossless['exact_turns']}/{lossless['turns_compared']}" if lossless else "–"
                lines.append(
                    f"| {method.removesuffix('_tree')} | {overall['tau']:.3f} | {alphas} | {ratio} "
                    f"| {difference} | "
                    f"{overall['speedup']:.2f}× | {same} |"
                )
    depth = snapshot.get("depth")
    if depth:
        lines += ["", *depth_table(depth, list(ABLATION), ABLATION_REFERENCE, "EAGLE-2")]
    return [*lines, ""]


def depth_table(depth: dict, names: list[str], reference: str, reference_label: str) -> list[str]:
    """The depth measurement's table (``names`` in order, the runs measured), with each head's own
    chain τ against ``reference``'s and the intervals' note."""
    lines = [
        "The mechanism (`specdraft-depth-acceptance`): greedy chain acceptance per depth on the "
        "held-out split, the head reading its OWN features at depth ≥ 2 (as when decoding) against "
        "the target's (as plain EAGLE training assumes); gap = target − own.",
        "",
        f"| head | α own features d1..d{depth['depth']} | α target features d1..d{depth['depth']} "
        f"| gap d2..d{depth['depth']} | chain τ own / target | own chain τ ÷ {reference_label} "
        f"[{CONFIDENCE:.0%} CI] |",
        "|---|---|---|---|---|---|",
    ]
    for name in (name for name in names if name in depth["runs"]):
        run = depth["runs"][name]
        own, target = run["own_features"], run["target_features"]
        versus = run.get("against_reference")
        ratio = (
            "{estimate:.3f} [{low:.3f}, {high:.3f}]".format(**versus["ratio"])
            if versus
            else "1 (reference)"
            if name == reference
            else "–"
        )
        lines.append(
            f"| {name} | {rates(own['acceptance_per_depth'])} "
            f"| {rates(target['acceptance_per_depth'])} | "
            f"{rates(run['gap_per_depth'][1:])} | {own['chain_tau']:.3f} / {target['chain_tau']:.3f} "
            f"| {ratio} |"
        )
    conversations = next(
        (
            run["against_reference"]["conversations"]
            for run in depth["runs"].values()
            if "against_reference" in run
        ),
        None,
    )
    if conversations:
        lines += [
            "",
            f"Intervals: {CONFIDENCE:.0%} percentile bootstrap over the {conversations} held-out "
            f"conversations, paired with {reference_label} (each resample sums both heads' chain counts "
            "over the drawn conversations and recomputes α per depth and chain τ from the sums).",
        ]
    return lines


def suite_prompts(methods: dict[str, dict]) -> int:
    """The prompts the suite's intervals rest on (those every head answered)."""
    return min(
        (m["against_reference"]["prompts"] for m in methods.values() if "against_reference" in m), default=0
    )


def rates(values: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v:.3f}" for v in values)


def sweep_section() -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / SWEEP_SNAPSHOT)
    if snapshot is None:
        return None
    swept, points = snapshot["swept"], snapshot["points"]
    reference = snapshot.get("reference")  # older snapshots lack it
    machine = machine_line(snapshot) if snapshot.get("machine") else "not recorded"
    training = snapshot.get("training")  # older snapshots did not record it
    how = (
        f"{snapshot['steps']} steps of ≤ {training['batch_tokens']:,} positions in {training['precision']} "
        f"over the features of {data_text(training['data'])} (its held-out split for validation)"
        if training
        else f"{snapshot['steps']} steps"
    )
    lines = [
        f"Machine: {machine}. ONE Hydra multirun (`python scripts/results.py --stages sweep`), W&B "
        "logging offline (no network here: W&B's own sweep controller cannot run, see the README), "
        f"then `specdraft-sweep-report`. Every point: a HASS head trained with the ablation's recipe "
        f"(its schedule, batch order and {ABLATION_VOCAB:,}-token vocabulary): {how}; the weights not "
        "swept as in conf/loss/hass.yaml. Best and final held-out simulated τ; held-out acc_1..4 of "
        "the final weights."
        + (
            " The last row: an EAGLE head trained with the same recipe, data and steps, the yardstick "
            "each setting has to beat."
            if reference
            else ""
        ),
        "",
        "| " + " | ".join(swept) + " | best simulated τ | final simulated τ | final acc_1..4 |",
        "|" + "---|" * (len(swept) + 3),
    ]
    rows = [([str(point["values"][key]) for key in swept], point) for point in points]
    if reference is not None:
        rows.append((["EAGLE (no Top-K, no alignment)", *["–"] * (len(swept) - 1)], reference))
    for cells, run in rows:
        final = run["final_val"]
        accs = " / ".join(f"{final[key]:.3f}" for key in sorted(final) if key.startswith("val/acc_"))
        lines.append(
            "| "
            + " | ".join(cells)
            + f" | {run['best_sim_tau']:.3f} | {final.get('val/sim_tau', float('nan')):.3f} | {accs} |"
        )
    lines.append("")
    runs = [{"config": point["values"], "metric": point["best_sim_tau"]} for point in points]
    for parameter in swept:
        name = f"results_sweep_{parameter.replace('.', '_')}.png"
        plot_sweep(runs, parameter, "best held-out simulated τ", DOCS / name)
        lines += [f"![best held-out simulated τ against {parameter}]({name})", ""]
    depth = snapshot.get("depth")
    if depth:
        names = [SWEEP_REFERENCE, *(point["run"] for point in points if "run" in point)]
        lines += [*depth_table(depth, names, SWEEP_REFERENCE, "EAGLE"), ""]
    return lines


def wallclock_ablation_section() -> list[str] | None:
    """The first ablation (equal wall-clock, 8 questions), kept as it was measured."""
    snapshot = read_json(SNAPSHOTS / "ablation.json")
    if snapshot is None:
        return None
    report = snapshot["report"]
    lines = [
        f"Machine: {machine_line(report)}. Data: the quickstart's features "
        f"({data_text(snapshot['data'])}). Each head trained alone on the machine for the same "
        f"wall-clock time. Prompts: {prompts_line(report)}.",
        "",
        "| run | training |",
        "|---|---|",
    ]
    for name in (name for name in WALLCLOCK_HEADS if name in snapshot["training"]):
        lines.append(f"| {name} | {training_line(snapshot['training'][name])} |")
    order = [
        "medusa_tree",
        "eagle_chain",
        *(f"{name}_tree" for name in WALLCLOCK_HEADS[1:]),
        "hf_prompt_lookup",
    ]
    methods = [m for m in order if m in report["results"]["T=0"]]
    lines += [
        "",
        HEADER + " speedup vs HF prompt lookup T=0 |",
        SEPARATOR + "---|",
        *head_rows(report["results"], methods, reference="hf_prompt_lookup"),
        "",
    ]
    return lines


def curve_section() -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / "curve.json")
    if snapshot is None:
        return None
    report = snapshot["report"]
    results = report["results"]["T=0"]
    lines = [
        f"The checkpoints every {CURVE_EVERY} steps of the quickstart runs in `CURVE_RUNS` "
        "(scripts/results.py), "
        f"benched together at T=0 ({prompts_line(report)}; {machine_line(report)}), with the 24-node "
        "tree. Training time = step × the run's mean seconds per step as it ran (validation included; "
        "see each run's conditions).",
        "",
        "| run | data (train cache) | step | training time | τ T=0 | α per depth | speedup T=0 |",
        "|---|---|---|---|---|---|---|",
    ]
    curves = {}
    for run, label in CURVE_RUNS.items():
        summary, data = snapshot["runs"][run]["training"], data_text(snapshot["runs"][run]["data"])
        points = sorted((int(m.split("_step")[1]), m) for m in results if m.startswith(label + "_step"))
        if summary is None or not points:
            continue
        seconds_per_step = summary["fit_seconds"] / summary["global_step"]
        curves[run] = [(step * seconds_per_step / 60, results[m]["overall"]["tau"]) for step, m in points]
        for step, method in points:
            overall = results[method]["overall"]
            alphas = " / ".join(
                f"{a:.2f}" for a in overall.get("acceptance_per_depth") or [] if a is not None
            )
            lines.append(
                f"| {run} | {data} | {step} | {step * seconds_per_step / 60:.1f} min | {overall['tau']:.2f} "
                f"| {alphas} | {overall['speedup']:.2f}× |"
            )
    for run in curves:
        if run in RUN_CONDITIONS:
            lines.append(f"\n- {run}: {RUN_CONDITIONS[run]}")
    plot_curve(
        {f"{run} ({data_text(snapshot['runs'][run]['data'])})": points for run, points in curves.items()}
    )
    lines += ["", "![τ vs training time](results_curve.png)", ""]
    return lines


def shape_text(shape: dict) -> str:
    """A tree shape as it is written in a method's config, kind first: ``{kind: chain, depth: 1}``
    (snapshots store keys sorted)."""
    fields = {"kind": shape.get("kind"), **{k: v for k, v in shape.items() if k != "kind"}}
    return "{" + ", ".join(f"{key}: {value}" for key, value in fields.items()) + "}"


def mixture_section() -> list[str] | None:
    """The fine-tuned head against its base, with plain decoding and HF's baselines, per turn; one
    table per class of machine measured."""
    paths = sorted(SNAPSHOTS.glob(f"{MIXTURE_SNAPSHOT}*.json"))
    if not paths:
        return None
    return [line for path in paths for line in mixture_table(read_json(path))]


def mixture_table(snapshot: dict) -> list[str]:
    provenance = snapshot.get("provenance") or "provenance not recorded"
    heads = snapshot["heads"]
    lines = [
        f"Machine: {machine_line(snapshot)}. One interleaved `specdraft-bench` run: MT-bench,"
        f" {snapshot['config']['prompts']['per_category']} questions per category, both turns,"
        f" {snapshot['config']['max_new_tokens']} new tokens per turn, T=0, the 12-node dynamic tree"
        f" (depth 3, top-4). `{MIXTURE_BASE}`: `{heads[MIXTURE_BASE]}`, the committed quickstart head;"
        f" `{MIXTURE_TUNED}`: `{heads[MIXTURE_TUNED]}` — {provenance}.",
        "",
        "| turns | method | tok/s | × plain | × HF prompt lookup | τ |",
        "|---|---|---|---|---|---|",
    ]
    for label, turn in snapshot["per_turn"].items():
        results = turn["methods"]
        plain, lookup = results["plain"]["tokens_per_s"], results["hf_prompt_lookup"]["tokens_per_s"]
        for method, entry in sorted(results.items(), key=lambda item: item[0] != "plain"):
            speed = entry["tokens_per_s"]
            tau = f"{entry['tau']:.3f}" if "tau" in entry and method != "plain" else "–"
            lines.append(
                f"| {label} ({turn['turns']}) | {method} | {speed:.2f} | {speed / plain:.3f}× |"
                f" {speed / lookup:.3f}× | {tau} |"
            )
    lines.append("")
    for label, turn in snapshot["per_turn"].items():
        ratio = turn["tuned_vs_base"]["ratio"]
        lines.append(
            f"- {label}: τ of `{MIXTURE_TUNED}` ÷ `{MIXTURE_BASE}` = {ratio['estimate']:.3f}"
            f" ({CONFIDENCE:.0%} paired bootstrap CI by question [{ratio['low']:.3f}, {ratio['high']:.3f}])."
        )
    return [*lines, ""]


def lookahead_section() -> list[str] | None:
    """Lookahead decoding next to HF prompt lookup and a head, per suite, from one run."""
    snapshot = read_json(SNAPSHOTS / LOOKAHEAD_SNAPSHOT)
    if snapshot is None:
        return None
    settings = {name: d["lookahead"] for name, d in snapshot["methods"].items() if "lookahead" in d}
    lines = [
        f"Machine: {machine_line(snapshot)}. One interleaved run, T=0, "
        f"{snapshot['max_new_tokens']} new tokens per prompt; the head: `{snapshot['head']}` "
        "(the committed quickstart head). Tokens per step = τ (accepted drafts + 1 per target "
        "forward after the prefill); HF prompt lookup does not expose its steps.",
        "",
    ]
    for suite in (name for name in SUITES if name in snapshot["results"]):
        methods = snapshot["results"][suite]
        prompts = methods["plain"]["overall"]["turns"]
        lines += [
            f"{suite} ({prompts} prompts):",
            "",
            "| method | tok/s | × plain | tokens per step | nodes per step | identical to plain |",
            "|---|---|---|---|---|---|",
        ]
        for method, entry in sorted(methods.items(), key=lambda item: item[0] != "plain"):
            o, lossless = entry["overall"], entry.get("lossless") or {}
            stepped = method != "plain" and o.get("tau") is not None  # HF methods expose no steps
            cells = [
                method,
                f"{o['tokens_per_s']:.2f}",
                f"{o.get('speedup') or 1:.3f}×",
                f"{o['tau']:.2f}" if stepped else "–",
                f"{o['mean_nodes']:.1f}" if stepped and o.get("mean_nodes") else "–",
                f"{lossless['exact_turns']}/{lossless['turns_compared']}" if lossless else "–",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Lookahead settings: "
        + "; ".join(
            f"`{name}` W {d['window']}, N {d['ngram']}, G {d['guesses']}" for name, d in settings.items()
        )
        + "".join(
            f"; `{name}` (`shape: auto`) chose `{shape_text(d['auto_shape']['chosen'])}`"
            for name, d in snapshot["methods"].items()
            if "auto_shape" in d
        )
        + ". Lookahead verifies W × (N − 1) window nodes plus up to G × (N − 1) n-gram nodes a step, "
        "accepted or not: on a CPU, where a verify's cost grows with its nodes, it trades speed for "
        "steps; LADE's setting for 7B models on an A100 is W 15, N 5 (G = W).",
        "",
    ]
    return lines


def gpu_section() -> list[str] | None:
    """The one GPU session's numbers (docs/results/gpu_h100.json, assembled from that session's
    outputs: the GPU machine is lent, and gone after it)."""
    snapshot = read_json(SNAPSHOTS / "gpu_h100.json")
    if snapshot is None:
        return None
    quickstart, regen, profile = snapshot["quickstart"], snapshot["regen"], snapshot["plain_step_profile"]
    plan, timings, training = quickstart["plan"], quickstart["timings"], quickstart["training"]
    held_out = quickstart["held_out"]
    lines = [
        f"Machine: {machine_line(snapshot)}; {snapshot['software']}; at commit {snapshot['commit']}.",
        "",
        f"**The quickstart** (`{quickstart['command']}`), which made the head in "
        "`assets/heads/smollm2-135m-eagle/` (its `provenance.json`):",
        "",
        "| stage | ETA (plan) | took |",
        "|---|---|---|",
        *(
            f"| {stage} | {clock(plan['eta_s'][stage])} | {clock(timings[stage])} |"
            for stage in ("probe", "regen", "cache train", "cache heldout", "train", "export", "eval")
            if stage in timings and stage in plan["eta_s"]
        ),
        f"| total | {clock(sum(plan['eta_s'].values()))} | {clock(timings['total'])} "
        f"(budget {plan['budget_minutes']} min) |",
        "",
        f"Training: {training['global_step']} steps, {training['tokens_seen']:,} tokens, "
        f"{training['train_tokens_per_s']:,.0f} tokens/s ({training['precision']}, "
        f"{training['fit_seconds']:.0f} s, peak {training['peak_memory_gb']:.1f} GB); held out: simulated τ "
        f"{held_out['val/sim_tau']:.2f}, acc_1..4 "
        + " / ".join(f"{held_out[f'val/acc_{j}']:.3f}" for j in range(1, 5))
        + ".",
        "",
        f"Its eval ({quickstart['eval']['prompts']}, {quickstart['eval']['max_new_tokens']} new tokens, "
        "T=0):",
        "",
        "| method | shape | tok/s | × plain | τ | draft ms | verify ms | bookkeeping ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, o in sorted(quickstart["eval"]["methods"].items(), key=lambda item: item[0] != "plain"):
        head = method != "plain"
        lines.append(
            f"| {method} | {shape_text(o['shape']) if o['shape'] else '–'} | {o['tokens_per_s']:.1f} | "
            f"{o['speedup']:.2f}× | {o['tau']:.2f} | {o['draft_ms']:.0f} | {o['verify_ms']:.0f} | "
            f"{o['bookkeeping_ms']:.0f} |"
            if head
            else f"| plain | – | {o['tokens_per_s']:.1f} | 1× | 1 | – | {o['verify_ms']:.0f} | – |"
        )
    launches = profile["torch_profiler_8_forwards"]
    lines += [
        "",
        f"**Regeneration** ({regen['rows']} rows): {regen['chunk_64_tokens_per_s']:,} tokens/s with chunks "
        f"of 64 conversations — {regen['chunk_64_note']}; {regen['chunk_1024_tokens_per_s']:,.0f} "
        f"tokens/s with chunks of 1,024 — {regen['chunk_1024_note']}. Rows are refilled within a "
        "chunk only, hence `chunk_size: auto` (4 batches) and `batch_size: auto` (by free GPU memory).",
        "",
        f"**The plain step is launch-bound**: {launches['cuda_kernel_launches']:,} kernel launches in 8 "
        f"forwards; {launches['self_cpu_ms']:.0f} ms of host time against {launches['self_cuda_ms']:.0f} ms "
        f"on the GPU — {profile['note']}. Ours {profile['ours_ms_per_token']['64 tokens']:.0f} ms per "
        f"token, HF's forward with its DynamicCache {profile['hf_forward_dynamic_cache_ms_per_token']:.0f} "
        "ms: the GPU idles ~95 % of each step, so only fewer launches (CUDA graphs) make speculation "
        "pay here.",
        "",
        f"**`pytest -m gpu`**: passed {', '.join(f'`{t}`' for t in snapshot['gpu_tests']['passed'])}; failed "
        + "; ".join(f"`{t}`: {why}" for t, why in snapshot["gpu_tests"]["failed"].items())
        + ".",
        "",
        f"Compile: {snapshot['compile_bench']}.",
        "",
    ]
    return lines


def batch_section() -> list[str] | None:
    """Throughput (tokens/s over all rows) and per-row latency per batch size, plain decoding vs
    each method, and the crossover batch size."""
    snapshot = read_json(SNAPSHOTS / BATCH_SNAPSHOT)
    if snapshot is None:
        return None
    lines = [
        f"Machine: {machine_line(snapshot)}. Prompts: {prompts_line(snapshot)}, T=0; the prompts are",
        "decoded B at a time, every method on the same batch in turn (plain decoding first), each row",
        f"with its own tree and accepted length (eval/batch.py). Head: `{snapshot['head']}` (the committed",
        "quickstart head). Throughput counts every row's tokens over the batches' wall time (prefill",
        "included; a batch lasts as long as its slowest row); per-row latency is the median over rows of",
        "ms per token from the batch's start to the row's own end.",
        "",
        "| B | method | tok/s (all rows) | × plain | ms per token per row | τ | identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for section in snapshot["batch"].values():
        sizes = sorted(section["sizes"], key=int)  # JSON keys: "16" sorts before "2"
        for size in sizes:
            methods = section["sizes"][size]
            for name, entry in sorted(methods.items(), key=lambda item: item[0] != "plain"):
                cells = [
                    str(size),
                    name,
                    f"{entry['tokens_per_s']:.2f}",
                    f"{entry['speedup']:.3f}×",
                    f"{entry['row_ms_per_token']:.1f}",
                    f"{entry['tau']:.2f}" if name != "plain" else "–",
                    entry.get("identical_to_plain", "–"),
                ]
                lines.append("| " + " | ".join(cells) + " |")
        plain_rates = [section["sizes"][size]["plain"]["tokens_per_s"] for size in sizes]
        best = max(
            (entry["tokens_per_s"], name, size)
            for size in sizes
            for name, entry in section["sizes"][size].items()
            if name != "plain"
        )
        lines += [
            "",
            f"Plain decoding's throughput grows {plain_rates[-1] / plain_rates[0]:.1f}× from batch size "
            f"{sizes[0]} to {sizes[-1]}: the target's weights are read once for every row. Speculation "
            f"multiplies each row's tokens per forward by its tree's nodes, so where a forward's cost grows "
            f"with its tokens (a CPU) it saturates sooner: its best here is {best[0]:.2f} tok/s "
            f"(`{best[1]}`, B = {best[2]}).",
            "",
        ]
        for name, size in section["crossover"].items():
            shape = shape_text(snapshot["methods"][name]["shape"])
            lines.append(
                f"- `{name}` (`{shape}`): "
                + (
                    f"no faster than plain decoding at batch size {size} (the crossover on this machine)."
                    if size is not None
                    else "faster than plain decoding at every batch size measured."
                )
            )
    plot_batch(snapshot, DOCS / "results" / "batch_throughput.png")
    return [*lines, "", "![throughput against batch size](results/batch_throughput.png)", ""]


def plot_batch(snapshot: dict, path: Path) -> None:
    """Tokens/s over all rows against batch size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4))
    for section in snapshot["batch"].values():
        sizes = sorted(section["sizes"], key=int)
        methods = sorted(
            dict.fromkeys(m for size in sizes for m in section["sizes"][size]), key=lambda m: m != "plain"
        )
        for method in methods:
            points = [
                (int(size), section["sizes"][size][method]["tokens_per_s"])
                for size in sizes
                if method in section["sizes"][size]
            ]
            axes.plot(*zip(*points, strict=True), marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set(xlabel="batch size B", ylabel="tokens/s over all rows", title="Throughput against batch size")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def decoder_section(name: str = DECODER_SNAPSHOT) -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / name)
    if snapshot is None:
        return None
    results = snapshot["results"]["T=0"]
    plain = results["plain"]["overall"]
    plain_step = plain.get("verify_ms")  # a plain decoding step is a one-token verify
    head = snapshot["head"]
    lines = [
        f"Machine: {machine_line(snapshot)}. Prompts: {prompts_line(snapshot)}, T=0, every method",
        "interleaved per question in one run. Head: "
        f"`{head['checkpoint']}` — {head.get('provenance') or 'provenance not recorded'}.",
        "",
        "| method | tok/s | × plain | τ | nodes | draft ms | verify ms | bookkeeping ms | "
        "(draft + bookkeeping) / plain step | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, entry in sorted(results.items(), key=lambda item: item[0] != "plain"):  # plain first
        o, lossless = entry["overall"], entry.get("lossless") or {}
        steps = "draft_ms" in o and method != "plain"
        cells = [
            method,
            f"{o['tokens_per_s']:.2f}",
            f"{o['speedup']:.3f}×" if "speedup" in o else "1×",
            f"{o['tau']:.2f}" if steps else "–",
            f"{o['mean_nodes']:.1f}" if steps else "–",
            f"{o['draft_ms']:.1f}" if steps else "–",
            f"{o['verify_ms']:.1f}" if "verify_ms" in o else "–",
            f"{o['bookkeeping_ms']:.1f}" if steps else "–",
            f"{(o['draft_ms'] + o['bookkeeping_ms']) / plain_step:.2f}" if steps and plain_step else "–",
            f"{lossless['exact_turns']}/{lossless['turns_compared']}" if lossless else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Plain decoding: {plain['tokens_per_s']:.2f} tok/s; its step (verify ms) {plain_step or 0:.1f} ms.",
    ]
    for method, details in snapshot.get("methods", {}).items():
        choice = details.get("auto_shape")
        if not choice:
            continue
        chosen = choice["chosen"]
        measured = choice.get("measured_tokens_per_s")
        identical = (  # auto chose plain decoding: two identical methods in one run
            " (plain decoding on its own runner: its speedup over `plain` is this run's noise "
            "between two identical methods)"
            if chosen.get("kind") == "plain"
            else ""
        )
        lines += [
            "",
            f"`{method}` (`shape: auto`) chose `{shape_text(chosen)}`: "
            f"predicted {choice['predicted_tokens_per_s']:.2f} tok/s"
            + (f", {measured:.2f} tok/s decoding the calibration prompts" if measured else "")
            + f", {results[method]['overall']['tokens_per_s']:.2f} tok/s in this benchmark{identical}. "
            f"Verify latency probe: plain step {choice['latency']['plain_ms']:.1f} ms, "
            + ", ".join(
                f"{n} nodes {ms:.1f}"
                for n, ms in sorted(choice["latency"]["verify_ms"].items(), key=lambda x: int(x[0]))
            )
            + " ms. Candidates (predicted / measured tok/s, τ on held-out ShareGPT):",
            "",
        ]
        for prediction in choice["predictions"]:
            measured = prediction.get("measured_tokens_per_s")
            lines.append(
                f"- `{shape_text(prediction['shape'])}`: {prediction['predicted_tokens_per_s']:.2f}"
                + (f" / {measured:.2f}" if measured else "")
                + f", τ {prediction['tokens_per_step']:.2f}"
            )
    lines.append("")
    return lines


def decoder_gpu_section() -> list[str] | None:
    """The decoder bench of the second GPU session (docs/results/decoder_gpu.json): CUDA graphs
    against the eager steps, and what else that session measured."""
    snapshot = read_json(SNAPSHOTS / DECODER_GPU_SNAPSHOT)
    table = decoder_section(DECODER_GPU_SNAPSHOT)
    if snapshot is None or table is None:
        return None
    session, results = snapshot["session"], snapshot["results"]["T=0"]
    graphed, eager = results["plain"]["overall"], results["plain_eager"]["overall"]
    regen = session["regen_auto"]
    return [
        f"At commit {session['commit']}; {session['software']}. Command: `{session['command']}`.",
        "`plain` and the head methods replay CUDA graphs (`graphs: auto`, eval/graphs.py); "
        "`plain_eager` is the same plain decoding without them. In bf16 a tree verification's "
        "numerics differ from a one-token step's, so greedy outputs may part (the exactness "
        "invariant is tested in fp32, on CUDA too).",
        "",
        *table,
        f"**CUDA graphs**: the plain step {eager['verify_ms']:.1f} → {graphed['verify_ms']:.1f} ms "
        f"({eager['tokens_per_s']:.1f} → {graphed['tokens_per_s']:.1f} tok/s). At that commit "
        "speculation did not pay on this GPU: the drafting and bookkeeping between the graphed steps "
        "(eager tensor ops, host syncs, tree buffers) cost more than the target steps they saved "
        "(the next section moves them onto the device).",
        "",
        f"**`pytest -m gpu`**: {session['gpu_tests']}.",
        "",
        f"**Regeneration** with `batch_size: auto` / `chunk_size: auto` (`{regen['command']}`): "
        f"{regen['batch_size_auto']} rows per batch, {regen['chunk_size_auto']} conversations per chunk; "
        f"{regen['result']}.",
        "",
        "On the way: " + "; ".join(session["first_attempts"]) + ".",
        "",
    ]


def decoder_rounds_section() -> list[str] | None:
    """The decoder bench of the third GPU session (docs/results/decoder_gpu_rounds.json): greedy
    rounds on the device, against the second session's graphed steps (decoder_gpu.json)."""
    snapshot = read_json(SNAPSHOTS / DECODER_ROUNDS_SNAPSHOT)
    table = decoder_section(DECODER_ROUNDS_SNAPSHOT)
    if snapshot is None or table is None:
        return None
    session, results = snapshot["session"], snapshot["results"]["T=0"]
    before = (read_json(SNAPSHOTS / DECODER_GPU_SNAPSHOT) or {}).get("results", {}).get("T=0", {})
    lines = [
        f"At commit {session['commit']}; {session['software']}. Command: `{session['command']}`.",
        "At T=0 a feature head's chain or dynamic tree now runs as greedy rounds on the device "
        "(eval/decode.py): the drafter's round (commit of the accepted path + the next tree) and the "
        "target's greedy verification (tree forward, acceptance on the ancestor matrix, KV move) are "
        "one CUDA graph each, and a step syncs with the host once. Drafting now includes the head's "
        "commit, verification the acceptance; bookkeeping is the host's share.",
        "",
        *table,
        f"**Before / after** (× plain decoding of the same run; before: {session['before']}):",
        "",
        "| method | before | after | step ms before (draft + verify + bookkeeping) | after |",
        "|---|---|---|---|---|",
    ]
    for method in sorted(set(before) & set(results)):
        if method in ("plain", "hf_generate", "hf_prompt_lookup", "plain_eager"):
            continue
        old, new = before[method]["overall"], results[method]["overall"]

        def step(o: dict) -> str:
            return f"{o['draft_ms']:.1f} + {o['verify_ms']:.1f} + {o['bookkeeping_ms']:.1f}"

        lines.append(
            f"| {method} | {old['speedup']:.2f}× | {new['speedup']:.2f}× | {step(old)} | {step(new)} |"
        )
    dynamic, plain = results["head_dynamic"]["overall"], results["plain"]["overall"]
    step_ms = dynamic["draft_ms"] + dynamic["verify_ms"] + dynamic["bookkeeping_ms"]
    ceiling = dynamic["tau"] * plain["verify_ms"] / dynamic["verify_ms"]
    lines += [
        "",
        f"The 12-node tree's step is {step_ms:.2f} ms against a plain step of {plain['verify_ms']:.2f} ms, "
        f"with τ {dynamic['tau']:.2f}: even free drafting would stop at about τ × plain step / verify "
        f"= {ceiling:.2f}×. "
        "The issue's ≥ 2× on a GPU now waits on the head (a higher τ), not on the decoder. In bf16 a "
        "tree's numerics differ from a one-token step's, so greedy outputs part from plain decoding on "
        "some turns (the exactness invariant is tested in fp32, on CUDA too).",
        "",
        f"**`pytest -m gpu`** (graph tests): {session['gpu_tests']}.",
        "",
        "On the way: " + "; ".join(session["first_attempts"]) + ".",
        "",
    ]
    return lines


REGEN_RATE = re.compile(r"(\d+) tokens in (\d+) s = ([\d.]+) tokens/s")
REGEN_ROWS = re.compile(r"regen: (\d+) rows per batch")


def regen_log_numbers(log: Path, stage: str) -> dict:
    """tokens, seconds and tokens/s of a ``specdraft-regen`` log's last summary line, and its rows
    per batch where the log says them."""
    text = log.read_text()
    found = REGEN_RATE.findall(text)
    if not found:
        raise SystemExit(f"{stage}: {log} has no specdraft-regen throughput line")
    tokens, seconds, rate = found[-1]
    numbers: dict = {"tokens": int(tokens), "seconds": int(seconds), "tokens_per_s": float(rate)}
    if rows := REGEN_ROWS.findall(text):
        numbers["rows"] = int(rows[-1])
    return numbers


def regen_measurement(logs: list[Path], commits: list[str], command: str) -> dict:
    """Regeneration tokens/s before and after, from two ``specdraft-regen`` logs."""
    measurement: dict = {"command": command, "commits": commits}
    for label, log in zip(("before", "after"), logs, strict=True):
        measurement[label] = regen_log_numbers(log, "regen")
    return measurement


PYTEST_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
PYTEST_DURATION = re.compile(r"^([\d.]+)s call\s+(tests/\S+::\S+)$")
PYTEST_SUMMARY = re.compile(r"^=+ (.+ in [\d.]+s.*?) =+$")


def recipe() -> None:
    """docs/results/recipe_gpu.json from the summaries of the RECIPE_RUNS under outputs/recipe-gpu."""
    runs = []  # a list: the table keeps RECIPE_RUNS' order
    for name, (override, steps) in RECIPE_RUNS.items():
        summary = read_json(LOG_DIR / "recipe-gpu" / name / "summary.json")
        if summary is None:
            raise SystemExit(f"recipe: no {LOG_DIR / 'recipe-gpu' / name / 'summary.json'}")
        if summary["global_step"] != steps:
            raise SystemExit(f"recipe: run {name} trained {summary['global_step']} steps, not {steps}")
        kept = {key: summary[key] for key in (*TRAINING_KEYS, "final_val")}
        runs.append({"run": name, "override": override, **kept})
    write_json_atomic(SNAPSHOTS / RECIPE_SNAPSHOT, {"provenance": RECIPE_PROVENANCE, "runs": runs})


def recipe_section() -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / RECIPE_SNAPSHOT)
    if snapshot is None:
        return None
    runs = snapshot["runs"]
    seeds = [run["final_val"]["val/sim_tau"] for run in runs if run["run"] in ("base", "seed1", "seed2")]
    lines = [
        f"{snapshot['provenance']}. One change at a time against the quickstart's recipe as run "
        "qs-deadline2-amx trained it (its 2,004 steps reached a held-out simulated τ of 2.062 on the AMX "
        "Xeon). Held-out simulated τ and acc_1..4 of the final weights (the whole held-out split).",
        "",
        "| run | differs by | steps | tokens | simulated τ | acc_1..4 |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        final = run["final_val"]
        accs = " / ".join(f"{final[key]:.3f}" for key in sorted(final) if key.startswith("val/acc_"))
        lines.append(
            f"| {run['run']} | {run['override']} | {run['global_step']:,} | {run['tokens_seen']:,} "
            f"| {final['val/sim_tau']:.3f} | {accs} |"
        )
    lines += [
        "",
        f"Three batch orders of the same recipe: {min(seeds):.3f}–{max(seeds):.3f}. Beyond that spread: "
        "more steps (the lever a faster step buys) and a smaller soft-CE weight; the quickstart now "
        "weighs its vocabulary term 0.02, read from the target's cached top-10 (`loss.weights.topk`, "
        "which trained as the soft CE did at 1,000 steps on CPU and spares the target's vocabulary "
        "projection; conf/experiment/quickstart.yaml). ShareGPT's original answers, paid for with "
        "steps, lowered it on the target's own held-out answers.",
        "",
    ]
    return lines


def gpu_tests(log: Path, commit: str, machine: str) -> None:
    """docs/results/gpu_tests.json gains (or replaces) the run of ``commit``: each test's outcome
    and call time, read from the ``pytest -m gpu -v --durations=N`` output in ``log``."""
    outcomes: dict[str, dict] = {}
    summary = None
    for line in log.read_text().splitlines():
        if found := PYTEST_OUTCOME.match(line):
            outcomes[found[1]] = {"outcome": found[2]}
        elif (found := PYTEST_DURATION.match(line)) and found[2] in outcomes:
            outcomes[found[2]]["call_s"] = float(found[1])
        elif found := PYTEST_SUMMARY.match(line):
            summary = found[1]
    if not outcomes or summary is None:
        raise SystemExit(f"gpu_tests: {log} holds no `pytest -v` outcomes and summary line")
    earlier = (read_json(SNAPSHOTS / GPU_TESTS_SNAPSHOT) or {}).get("runs", [])
    runs = [run for run in earlier if run["commit"] != commit]
    run = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": machine, "summary": summary}
    write_json_atomic(SNAPSHOTS / GPU_TESTS_SNAPSHOT, {"runs": [*runs, {**run, "tests": outcomes}]})


def gpu_tests_section() -> list[str] | None:
    """Every recorded ``pytest -m gpu`` run (docs/results/gpu_tests.json), newest last."""
    snapshot = read_json(SNAPSHOTS / GPU_TESTS_SNAPSHOT)
    if snapshot is None:
        return None
    lines = [
        "The tests a CPU machine skips (CUDA graphs, the training strategies, the fused losses on "
        "cuBLAS), run on a lent GPU: `pytest -m gpu -v --durations=20 tests`, the project's wheels and "
        "DeepSpeed carried to the machine. Earlier sessions' runs are in the sections above.",
        "",
    ]
    for run in snapshot["runs"]:
        lines += [
            f"**{run['date']}, commit {run['commit']}**, {run['machine']}: {run['summary']}.",
            "",
            "| test | outcome | call s |",
            "|---|---|---|",
            *(
                f"| `{name.removeprefix('tests/')}` | {test['outcome']} | {test.get('call_s', '–')} |"
                for name, test in run["tests"].items()
            ),
            "",
        ]
    return lines


def gpu_regen(runs: list[str], compare: Path | None, machine: str, command: str) -> None:
    """docs/results/regen_gpu.json: ``specdraft-regen`` runs of one GPU session on the same
    conversations, each ``LABEL:COMMIT:LOG`` (tokens/s from the log's summary line, the rows
    from its batch line where it has one), and ``compare`` (the captured features against a
    forward over the same ids: JSON of samples, answer_positions, dtype, hidden_rel_err_median,
    hidden_rel_err_p99 and top1_agree)."""
    measured = []
    for run in runs:
        label, commit, log = run.split(":", 2)
        numbers = regen_log_numbers(Path(log), "gpu_regen")
        measured.append({"label": label, "commit": commit, "rows": None, **numbers})
    snapshot = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "command": command,
        "runs": measured,
        "features_vs_forward": read_json(compare) if compare else None,
    }
    write_json_atomic(SNAPSHOTS / GPU_REGEN_SNAPSHOT, snapshot)


def gpu_regen_section() -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / GPU_REGEN_SNAPSHOT)
    if snapshot is None:
        return None
    runs = snapshot["runs"]
    base = runs[-1]["tokens_per_s"]  # the oldest code, listed last
    lines = [
        f"**{snapshot['date']}**, {snapshot['machine']}. {snapshot['command']}",
        "",
        f"| run | commit | rows | answer tokens | s | tokens/s | × {runs[-1]['commit']} |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['label']} | {r['commit']} | {r['rows'] or '–'} | {r['tokens']:,} | {r['seconds']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}× |"
            for r in runs
        ),
        "",
    ]
    if found := snapshot.get("features_vs_forward"):
        lines += [
            f"The captured features against a forward over the same ids on the GPU ({found['samples']} "
            f"conversations, {found['answer_positions']:,} answer positions, {found['dtype']}): hidden "
            f"states' relative error median {found['hidden_rel_err_median']:.2%}, p99 "
            f"{found['hidden_rel_err_p99']:.2%}; the same top-1 at {found['top1_agree']:.1%} of positions.",
            "",
        ]
    return lines


def regen_speed(logs: list[Path], commits: list[str], command: str) -> None:
    """A regeneration measurement alone, added to this machine's training-speed snapshot (whose
    training and earlier regeneration measurements it keeps): ``logs`` of ``specdraft-regen`` at
    ``commits`` (before, after) on the same conversations."""
    name = machine_snapshot("train_speed", detect_hardware().record())
    snapshot = read_json(SNAPSHOTS / name)
    if snapshot is None:
        raise SystemExit(f"regen_speed: no {SNAPSHOTS / name} to add the measurement to (stage train_speed)")
    earlier = snapshot.get("regen") or []
    snapshot["regen"] = [
        *([earlier] if isinstance(earlier, dict) else earlier),
        regen_measurement(logs, commits, command),
    ]
    write_json_atomic(SNAPSHOTS / name, snapshot)


def train_speed(
    checkouts: list[Path],
    regen_logs: list[Path] | None,
    vocab: list[Path] | None,
    command: str,
    repeats: list[Path] | None = None,
) -> None:
    """docs/results/train_speed.json from the outputs of the training-speed measurements:
    ``checkouts`` are bench_train_step.py outputs of successive commits, oldest first. A
    regeneration or vocabulary-acceptance measurement not given again is kept from the snapshot
    (with the command it was made by)."""
    runs = [read_json(path) for path in checkouts]
    if len(runs) < 2 or any(run is None for run in runs):
        raise SystemExit(f"train_speed: {checkouts} must be two or more bench_train_step.py outputs")
    name = machine_snapshot("train_speed", runs[-1]["machine"])
    previous = read_json(SNAPSHOTS / name) or {}
    snapshot: dict = {"command": command, "checkouts": runs}
    if regen_logs:
        snapshot["regen"] = regen_measurement(regen_logs, [runs[0]["commit"], runs[-1]["commit"]], command)
    elif "regen" in previous:
        snapshot["regen"] = previous["regen"]
    if vocab:
        snapshot["vocab_acceptance"] = [read_json(path) for path in vocab]
    elif "vocab_acceptance" in previous:
        snapshot["vocab_acceptance"] = previous["vocab_acceptance"]
    if repeats:  # more bench_train_step.py outputs of the same checkouts
        snapshot["repeats"] = [read_json(path) for path in repeats]
    write_json_atomic(SNAPSHOTS / name, snapshot)


def train_speed_section(name: str = TRAIN_SPEED_SNAPSHOT) -> list[str] | None:
    snapshot = read_json(SNAPSHOTS / name)
    if snapshot is None:
        return None
    runs = snapshot["checkouts"]
    first, last = runs[0], runs[-1]
    machine = last["machine"]
    commits = [run["commit"][:7] for run in runs]
    lines = [
        f"Machine: {machine['name']} ({', '.join(machine['cpu_flags']) or 'no AVX-512 / AMX'}), "
        f"{machine['threads']} torch threads, torch {machine['torch']}, precision {last['precision']}. "
        f"Commits {', '.join(commits)} (oldest first), each timed in one process, its variants "
        f"interleaved batch by batch on the same cached SmolLM2 features ({last['batch_tokens']}-token "
        f"batches). `{snapshot['command']}`",
        "",
        "Median tokens/s of whole optimiser steps (objective, backward, AdamW) and of validation",
        "steps (the objective at `train=False`, 4 rollout steps, under `no_grad`). `_v8k`: a reduced",
        "training vocabulary of 8,192 tokens (`loss.draft_vocab_size=8192`; EAGLE-3:",
        *(
            [
                "`head.config.draft_vocab_size=8192`); `_r8k`: rollout steps j >= 2 over those 8,192 tokens,",
                "step 1 over the head's own vocabulary (`loss.rollout_vocab_size=8192`); × compares",
                f"{commits[-1]} with {commits[0]}, a `_v8k` or `_r8k` variant with the full-vocabulary",
                f"one of {commits[0]}.",
            ]
            if any(name.endswith("_r8k") for name in last["variants"])
            else [
                f"`head.config.draft_vocab_size=8192`); × compares {commits[-1]} with {commits[0]}, a `_v8k`",
                f"variant with the full-vocabulary one of {commits[0]}.",
            ]
        ),
        "",
        "| variant | " + " | ".join(f"train {c}" for c in commits) + " | × "
        f"| validation {commits[0]} | validation {commits[-1]} | × |",
        "|---|" + "---|" * (len(runs) + 4),
    ]
    for name, entry in last["variants"].items():
        reference = first["variants"].get(name.removesuffix("_v8k").removesuffix("_r8k"))
        cells = [f"`{name}`"]
        for run in runs:
            rate = run["variants"].get(name, {}).get("train_tokens_per_s")
            cells.append("–" if rate is None else f"{rate:.0f}")
        train, val = entry["train_tokens_per_s"], entry["val_tokens_per_s"]
        if reference is None:
            cells += ["–", "–", f"{val:.0f}", "–"]
        else:
            old_train, old_val = reference["train_tokens_per_s"], reference["val_tokens_per_s"]
            cells += [f"{train / old_train:.2f}×", f"{old_val:.0f}", f"{val:.0f}", f"{val / old_val:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")

    def ratios(run: dict) -> str:
        rates = {name: entry["train_tokens_per_s"] for name, entry in run["variants"].items()}
        found = []
        for kind in ("hass", "eagle3", "hass_eagle3", "medusa"):
            # An _r8k variant's step 1 runs over the whole vocabulary, as EAGLE's one step does.
            for suffix, eagle in (("", "eagle"), ("_v8k", "eagle_v8k"), ("_r8k", "eagle")):
                if f"{kind}{suffix}" in rates and eagle in rates:
                    found.append(f"{kind}{suffix} {rates[kind + suffix] / rates[eagle]:.2f}×")
        return ", ".join(found)

    lines += ["", "Training tokens/s relative to EAGLE's (same vocabulary for step 1):"]
    lines += [f"- {run['commit'][:7]}: {ratios(run)}" for run in runs]
    repeats = snapshot.get("repeats")
    if repeats:
        lines += [
            "",
            "The newest checkout timed again in another process, to show this machine's run-to-run",
            "spread (training tokens/s):",
        ]
        for run in repeats:
            rates = ", ".join(f"{n} {v['train_tokens_per_s']:.0f}" for n, v in run["variants"].items())
            lines.append(f"- {run['commit'][:7]}: {rates}")
    regens = snapshot.get("regen") or []
    for regen in [regens] if isinstance(regens, dict) else regens:  # oldest first
        old_rate, new_rate = regen["before"]["tokens_per_s"], regen["after"]["tokens_per_s"]
        rows = [regen[label].get("rows") for label in ("before", "after")]
        at_rows = f" at {rows[0]} → {rows[1]} rows" if all(rows) else ""
        lines += [
            "",
            f"Regeneration (`specdraft-regen`, greedy{at_rows}): {old_rate:.1f} tokens/s before, "
            f"{new_rate:.1f} after ({new_rate / old_rate:.2f}×; {regen['before']['tokens']} and "
            f"{regen['after']['tokens']} tokens; commits "
            f"{' → '.join(c[:7] for c in regen.get('commits', []))}; `{regen.get('command', '')}`).",
        ]
    measurements = snapshot.get("vocab_acceptance") or []
    for vocab in [measurements] if isinstance(measurements, dict) else measurements:
        lines += [
            "",
            f"What a reduced training vocabulary costs in acceptance ({vocab['description']}): held-out",
            "top-1 agreement per draft step and simulated τ, each head evaluated drafting over the",
            "full vocabulary and over the 8,192-token one (the decoder's default shortlist).",
            "",
            "| trained with | steps | training s | drafting over | acc_1..4 | simulated τ |",
            "|---|---|---|---|---|---|",
        ]
        for head, entry in vocab["heads"].items():
            fit = f"{entry['fit_seconds']:.0f}" if "fit_seconds" in entry else "–"
            for objective, result in entry["evaluations"].items():
                accuracy = ", ".join(f"{a:.3f}" for a in result["acc"])
                lines.append(
                    f"| {head} | {entry['steps']} | {fit} | {objective} | {accuracy} "
                    f"| {result['sim_tau']:.3f} |"
                )
    lines.append("")
    return lines


def plot_training_curves(training: dict[str, dict]) -> None:
    """ABLATION_CURVE_PNG: held-out acc_1 and simulated τ against the step, one line per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top1, tau) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name in (name for name in ABLATION if name in training):
        curve = training[name]["curve"]
        steps = [step + 1 for step, _, _ in curve]
        top1.plot(steps, [acc for _, acc, _ in curve], marker=".", label=name)
        tau.plot(steps, [t for _, _, t in curve], marker=".", label=name)
    top1.set(xlabel="training step", ylabel="held-out acc_1", title="Held-out top-1 (step 1)")
    tau.set(xlabel="training step", ylabel="simulated τ", title="Held-out simulated τ")
    for axes in (top1, tau):
        axes.grid(alpha=0.3)
    tau.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(DOCS / ABLATION_CURVE_PNG, dpi=120)
    plt.close(figure)


def plot_curve(curves: dict[str, list[tuple[float, float]]]) -> None:
    """One line per legend label: (training minutes, τ) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5.5, 3.4))
    for label, points in curves.items():
        axes.plot([m for m, _ in points], [t for _, t in points], marker="o", label=label)
    axes.set(
        xlabel="training time (min, 2 CPU cores)", ylabel="τ (MT-bench, T=0)", title="τ vs training time"
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(DOCS / "results_curve.png", dpi=120)
    plt.close(figure)


def sweep_grid(parser: argparse.ArgumentParser, given: list[str] | None) -> dict[str, str]:
    if not given:
        return SWEEP_GRID
    grid = dict(item.split("=", 1) for item in given if "=" in item)
    if len(grid) != len(given) or not all(grid.values()):
        parser.error(f"--sweep takes KEY=V1,V2 … items, got {given}")
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", nargs="+", default=["ablation", "depth", "bench", "doc"])
    parser.add_argument("--steps", type=int, default=300, help="training steps of every ablation head")
    parser.add_argument(
        "--heads",
        nargs="+",
        choices=list(ABLATION),
        help="train (and bench) only these ablation heads",
    )
    parser.add_argument(
        "--features", type=Path, help="the ablation's feature caches (default: the quickstart's)"
    )
    parser.add_argument("--per-category", type=int, default=2, help="MT-bench questions per category")
    parser.add_argument(
        "--device", default="cpu", help="the target's device in every stage (cuda: trainer=gpu)"
    )
    parser.add_argument(
        "--precision", default=ABLATION_PRECISION, help="training precision of every ablation / sweep head"
    )
    parser.add_argument(
        "--batch-tokens", type=int, default=ABLATION_BATCH_TOKENS, help="positions per ablation / sweep batch"
    )
    parser.add_argument(
        "--parallel", type=int, default=1, help="ablation heads trained (and exported) side by side"
    )
    parser.add_argument("--export-dtype", default="bfloat16", help="weights dtype of the export stage")
    parser.add_argument("--max-minutes", type=float, help="a time box for the ablation's bench (it resumes)")
    parser.add_argument(
        "--sweep", nargs="+", metavar="KEY=V1,V2", help="the sweep's grid (default: SWEEP_GRID)"
    )
    parser.add_argument("--sweep-steps", type=int, help="training steps per sweep point (default: --steps)")
    parser.add_argument("--decoder-checkpoint", help="the head the decoder stage benches")
    parser.add_argument(
        "--lookahead-checkpoint", default=str(QUICKSTART_HEAD), help="the head the lookahead stage benches"
    )
    parser.add_argument(
        "--batch-checkpoint", default=str(QUICKSTART_HEAD), help="the head the batch stage benches"
    )
    parser.add_argument("--humaneval", type=int, default=16, help="HumanEval problems of the lookahead stage")
    parser.add_argument("--mixture-checkpoint", help="the fine-tuned head the mixture stage benches")
    parser.add_argument("--mixture-provenance", help="how that head was made (kept in the snapshot)")
    parser.add_argument("--decoder-provenance", help="how that head was trained (kept in the snapshot)")
    parser.add_argument(
        "--ablation-provenance", help="how the ablation's data and heads were made (kept in the snapshot)"
    )
    parser.add_argument("--train-speed", nargs="+", type=Path, help="bench_train_step.py JSON, oldest first")
    parser.add_argument("--regen-logs", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--regen-commits", nargs=2, metavar=("OLD", "NEW"), help="stage regen_speed")
    parser.add_argument(
        "--vocab-acceptance",
        nargs="+",
        type=Path,
        help="reduced-vocabulary acceptance JSON (vocab_acceptance.py)",
    )
    parser.add_argument("--train-speed-command", default="", help="how the measurements were made")
    parser.add_argument("--train-speed-repeats", nargs="*", type=Path, help="more runs, either checkout")
    parser.add_argument("--gpu-log", type=Path, help="stage gpu_tests: a `pytest -m gpu -v` log")
    parser.add_argument("--gpu-commit", help="stage gpu_tests: the commit the log's tests ran at")
    parser.add_argument("--gpu-machine", help="stages gpu_tests, gpu_regen: the GPU, its host, the software")
    parser.add_argument(
        "--gpu-regen", nargs="+", metavar="LABEL:COMMIT:LOG", help="stage gpu_regen: regen logs, oldest last"
    )
    parser.add_argument("--gpu-regen-compare", type=Path, help="stage gpu_regen: captured vs forward JSON")
    parser.add_argument("--gpu-regen-command", default="", help="stage gpu_regen: how the runs were made")
    args = parser.parse_args()
    placement = Placement(args.device, args.precision, args.batch_tokens)
    started = time.perf_counter()
    for stage in args.stages:
        if stage == "ablation":
            ablation(args.steps, args.features, placement, args.heads, args.parallel)
        elif stage == "export":
            export_heads(args.export_dtype, args.parallel)
        elif stage == "bench":
            bench(args.max_minutes, placement, args.heads)
        elif stage == "depth":
            depth(placement.device)
        elif stage == "sweep":
            sweep(args.sweep_steps or args.steps, args.features, sweep_grid(parser, args.sweep), placement)
        elif stage == "curve":
            curve(args.per_category)
        elif stage == "decoder":
            decoder(args.decoder_checkpoint, args.per_category, placement)
        elif stage == "mixture":
            mixture(args.mixture_checkpoint, args.per_category, placement)
        elif stage == "batch":
            batch(args.batch_checkpoint, args.per_category, placement)
        elif stage == "lookahead":
            lookahead(args.lookahead_checkpoint, args.per_category, args.humaneval, placement)
        elif stage == "train_speed":
            if not args.train_speed:
                parser.error("stage train_speed needs --train-speed OLDEST … NEWEST")
            train_speed(
                args.train_speed,
                args.regen_logs,
                args.vocab_acceptance,
                args.train_speed_command,
                args.train_speed_repeats,
            )
        elif stage == "regen_speed":
            if not (args.regen_logs and args.regen_commits):
                parser.error("stage regen_speed needs --regen-logs BEFORE AFTER and --regen-commits OLD NEW")
            regen_speed(args.regen_logs, args.regen_commits, args.train_speed_command)
        elif stage == "recipe":
            recipe()
        elif stage == "gpu_tests":
            if not (args.gpu_log and args.gpu_commit and args.gpu_machine):
                parser.error("stage gpu_tests needs --gpu-log, --gpu-commit and --gpu-machine")
            gpu_tests(args.gpu_log, args.gpu_commit, args.gpu_machine)
        elif stage == "gpu_regen":
            if not (args.gpu_regen and args.gpu_machine):
                parser.error("stage gpu_regen needs --gpu-regen LABEL:COMMIT:LOG … and --gpu-machine")
            gpu_regen(args.gpu_regen, args.gpu_regen_compare, args.gpu_machine, args.gpu_regen_command)
        elif stage == "doc":
            doc(args.decoder_provenance, args.mixture_provenance, args.ablation_provenance)
        else:
            parser.error(f"unknown stage {stage!r}")
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min on {platform.node() or 'this machine'}")


if __name__ == "__main__":
    main()
