#!/usr/bin/env bash
# sympow L2 / launch-order / variant check on one H100 (from the repository root; logs under
# $OUT). (1) the sympow tests, (2) old vs new wgmma variants side by side at the bench shapes,
# (3) vitrail bench sympow. About 4 minutes of GPU time.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
echo "== (1) tests" | tee "$OUT/tests.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sympow.py -v 2>&1 \
  | tee -a "$OUT/tests.txt" | tail -40
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/tests.txt"
echo "== (2) side by side" | tee "$OUT/compare.txt"
timeout 150 python3 scratch/sympow_l2_compare.py 2>&1 | tee -a "$OUT/compare.txt"
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/compare.txt"
echo "== (3) vitrail bench sympow" | tee "$OUT/bench.txt"
timeout 90 python3 -m vitrail.cli bench sympow --out /tmp/bsy 2>&1 | tee -a "$OUT/bench.txt"
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench.txt"
cp -r /tmp/bsy "$OUT/bench_sympow" 2>/dev/null || true
