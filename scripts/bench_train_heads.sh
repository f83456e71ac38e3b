#!/usr/bin/env bash
# Training throughput and peak memory of every head, with and without multi-step alignment, on
# the same cached features; runs one after the other. Writes $OUT (JSON list of summaries).
#   TRAIN_CACHE=… VAL_CACHE=… STEPS=20 OUT=bench_train.json scripts/bench_train_heads.sh [overrides]
set -euo pipefail
: "${TRAIN_CACHE:?set TRAIN_CACHE to a specdraft-cache dir with aux layers and top_k >= 10}"
: "${VAL_CACHE:?set VAL_CACHE}"
STEPS=${STEPS:-20}
OUT=${OUT:-bench_train.json}
LOG_DIR=${LOG_DIR:-outputs/bench_train}
variants=(
  "medusa|experiment=medusa"
  "eagle|experiment=eagle"
  "hass-3steps|experiment=hass"
  "hass-1step|experiment=hass loss.rollout.steps=1"
  "eagle3-1step|experiment=eagle3 loss.rollout.steps=1"
  "eagle3-ttt3|experiment=eagle3"
  "hass_eagle3-3steps|experiment=hass_eagle3"
)
for variant in "${variants[@]}"; do
  name=${variant%%|*}
  # shellcheck disable=SC2086
  specdraft-train ${variant#*|} run_name="bench-$name" resume=false \
    datamodule=cached datamodule.train_cache="$TRAIN_CACHE" datamodule.val_cache="$VAL_CACHE" \
    datamodule.max_batch_tokens=4096 trainer.max_steps="$STEPS" trainer.limit_val_batches=0 \
    logger=none callbacks.progress.refresh_rate=0 paths.log_dir="$LOG_DIR" "$@"
done
python - "$LOG_DIR" "$OUT" <<'PY'
import json, os, sys
from pathlib import Path
log_dir, out = Path(sys.argv[1]), sys.argv[2]
rows = []
for path in sorted(log_dir.glob("train/bench-*/summary.json")):
    s = json.loads(path.read_text())
    rows.append({"variant": path.parent.name.removeprefix("bench-"), **{k: s[k] for k in (
        "kind", "global_step", "train_tokens_per_s", "peak_memory_gb", "trainable_parameters", "tokens_seen")}})
meta = {"threads": os.cpu_count(), "load_average": os.getloadavg()}
Path(out).write_text(json.dumps({"machine": meta, "runs": rows}, indent=2))
for r in rows:
    print(f"{r['variant']:>20}  {r['train_tokens_per_s']:8.1f} tok/s  {r['peak_memory_gb']:.2f} GB  {r['trainable_parameters']:,} params")
PY
