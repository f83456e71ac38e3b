#!/usr/bin/env bash
# Target load time and forward throughput (bf16 vs fp32, interleaved) on SmolLM2; writes JSON.
# Usage: scripts/bench_target.sh [--out FILE] [--batch-size 8] [--seq-len 512] [--repeats 7]
set -euo pipefail
cd "$(dirname "$0")/.."
make -s install-assets
exec .venv/bin/python scripts/bench_target.py "$@"
