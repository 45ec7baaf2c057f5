#!/usr/bin/env bash
# Regenerates the README's compare, view and heatmap figures from memsim runs (build memsim
# first: tools/dev.sh build). Takes about half a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# compare: a real run of Megatron-LM (one H200, the measured rank alone through its fake
# process group; validation/fake_pg/README.md) against memsim's run of the same validation
# case, aligned by phases.
mkdir -p "$work/real"
gunzip -c validation/fake_pg/memory_traces/memory_trace_rank7_llama_1b_local_pp4_qk_layernorm_ce_fusion.json.gz \
    > "$work/real/memory_trace_rank7.json"
build/memsim validate --filter 'llama_1b_local_pp4_qk_layernorm_ce_fusion@fake_pg' \
    --out "$work/cases" >/dev/null
build/memsim compare -r "$work/real" -s "$work/cases/llama_1b_local_pp4_qk_layernorm_ce_fusion@fake_pg_h200" \
    -o "$work/compare" --align phases >/dev/null
cp "$work/compare/memory_comparison_rank_7.png" docs/figures/compare_fake_pg_rank7.png

# view: the default example's page in headless Chromium.
build/memsim simulate --out "$work/sim" >/dev/null
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
echo "wrote docs/figures/compare_fake_pg_rank7.png, view.png and heatmap_485b.png"
