#!/usr/bin/env bash
# EAGLE vs HASS on the same cached SmolLM2 features, the same wall-clock budget each (run one
# after the other, never concurrently), then the final weights validated on the whole held-out
# cache. Writes <log_dir>/train/compare-{eagle,hass}/summary.json.
#   TRAIN_CACHE=… VAL_CACHE=… BUDGET=00:00:15:00 scripts/compare_eagle_hass.sh [extra overrides]
set -euo pipefail
: "${TRAIN_CACHE:?set TRAIN_CACHE to a specdraft-cache dir with top_k >= 10}"
: "${VAL_CACHE:?set VAL_CACHE to the held-out cache dir}"
BUDGET=${BUDGET:-00:00:15:00}
for experiment in eagle hass; do
  specdraft-train experiment="$experiment" run_name="compare-$experiment" \
    datamodule=cached datamodule.train_cache="$TRAIN_CACHE" datamodule.val_cache="$VAL_CACHE" \
    datamodule.top_k=10 datamodule.max_batch_tokens=4096 \
    trainer.max_time="$BUDGET" trainer.max_steps=1000000 trainer.val_check_interval=50 \
    trainer.limit_val_batches=8 scheduler.warmup_steps=20 scheduler.total_steps=-1 \
    validate_at_end=true callbacks.progress.refresh_rate=0 "$@"
done
