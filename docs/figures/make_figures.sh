#!/usr/bin/env bash
# Regenerates the README's compare, view and heatmap figures from memsim runs (build memsim
# first: tools/dev.sh build). Takes about half a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# compare: the default example against a re-timed stand-in for a real trace
# (docs/figures/stand_in_trace.py says why and how), aligned by phases.
build/memsim simulate --out "$work/sim" >/dev/null
/usr/bin/python3 docs/figures/stand_in_trace.py "$work/sim/memory_trace_rank0.json" \
    "$work/real/memory_trace_rank0.json"
build/memsim compare -r "$work/real" -s "$work/sim" -o "$work/compare" --align phases >/dev/null
cp "$work/compare/memory_comparison_rank_0.png" docs/figures/compare_rank0.png

# view: the default example's page in headless Chromium.
build/memsim view "$work/sim" -o "$work/view.html" >/dev/null
chromium --headless --no-sandbox --disable-gpu --user-data-dir="$work/chromium" \
    --window-size=1200,1100 --screenshot="$PWD/docs/figures/view.png" \
    "file://$work/view.html" 2>/dev/null

# heatmap: the seeds' sweep, the 485B GPT on 8,192 GPUs.
build/memsim sweep --model gpt-485b --world-size 8192 --precision fp16 --seq-length 2048 \
    --tp 1,2,4,8 --pp 2,4,8,16,32,64 --microbatches-per-pp 6 \
    --data-parallel distributed-optimizer --jobs 2 --out "$work/sweep" >/dev/null
build/memsim heatmap --memory-dir "$work/sweep" --log-dir "$work/sweep" \
    --output "$work/heatmap" --dpi 100 >/dev/null
cp "$work/heatmap.png" docs/figures/heatmap_485b.png
echo "wrote docs/figures/compare_rank0.png, view.png and heatmap_485b.png"
